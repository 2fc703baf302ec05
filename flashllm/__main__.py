"""`python -m flashllm` is the `flashllm` command."""
from .cli import main

main()
