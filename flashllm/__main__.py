"""`python -m flashllm` is the `flashllm` command."""
from flashllm.cli import main

if __name__ == "__main__":     # a spawned child (a conversion apart from a run) imports this too
    main()
