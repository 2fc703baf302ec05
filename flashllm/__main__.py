"""`python -m flashllm` is the `flashllm` command."""
from flashllm.cli import main

main()
