"""The flashllm command line: parse → call → print.

Importing the package registers every command on the Typer app, in the order `--help` lists them.
"""
from flashllm.cli import run, serve, quality, manage  # noqa: F401  (each registers its commands)
from flashllm.cli.app import app, main  # noqa: F401  (the console entry point: flashllm.cli:main)
