"""The flashllm command line: parse → call → print.

The app, its error handling and the model-management commands live here; `run` is in
cli_run.py, `perplexity` and `calibrate` in cli_quality.py. These CLI modules are the only ones
that read the environment; everything below them takes settings as arguments. A FlashError becomes one line on stderr and exit code 1; usage errors exit with 2.
Generated tokens go alone to stdout; everything else goes to stderr.
"""
from __future__ import annotations

import functools
import os
import sys
from pathlib import Path
from typing import List

import typer
from platformdirs import user_cache_dir
from rich.console import Console

from .errors import FlashError

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Run language models larger than DRAM: FFN neurons stream from flash.")
err = Console(stderr=True, highlight=False)

DTYPES = ("f32", "f16", "q8_0", "q4_0", "q4_1", "q4_k")
DEFAULT_THREADS = min(os.cpu_count() or 1, 8)


def cache_dir() -> Path:
    """The user cache folder (models fetched and converted by name)."""
    return Path(os.environ.get("FLASHLLM_CACHE") or user_cache_dir("flashllm"))


def registry_path() -> Path:
    """models.toml: FLASHLLM_MODELS, else the one shipped at the project root."""
    env = os.environ.get("FLASHLLM_MODELS")
    return Path(env) if env else Path(__file__).resolve().parent.parent / "models.toml"


def command(fn):
    """Register a CLI command: a FlashError becomes one line on stderr and exit code 1; a closed
    stdout (`| head`) ends quietly with exit code 0; Ctrl-C prints one line, exit code 130."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            result = fn(*args, **kwargs)
            sys.stdout.flush()
            return result
        except FlashError as e:
            err.print(f"error: {e}", markup=False, soft_wrap=True)
            raise typer.Exit(1) from None
        except BrokenPipeError:
            _silence_stdout()
            raise typer.Exit(0) from None
        except KeyboardInterrupt:
            err.print("interrupted", markup=False)
            raise typer.Exit(130) from None
        except ImportError as e:
            if "_native" not in str(e):
                raise
            err.print(f"error: the C extension flashllm._native cannot be loaded ({e}): build it with "
                      "`make setup`, or `make native` in a source tree", markup=False, soft_wrap=True)
            raise typer.Exit(1) from None
    return app.command()(wrapper)


def _silence_stdout() -> None:
    """Point stdout at /dev/null so the interpreter's final flush cannot fail again."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


def fail(message: str) -> None:
    err.print(f"error: {message}", markup=False, soft_wrap=True)
    raise typer.Exit(1)


def _resolve(model: str) -> Path:
    """MODEL as given on the command line: a converted folder, or a models.toml name."""
    from .registry import resolve_model
    return resolve_model(model, cache_dir(), registry_path(), log=lambda m: err.print(m, markup=False))


# `run` (cli_run.py), `perplexity` and `calibrate` (cli_quality.py) register themselves on `app`
# when imported: first, so `flashllm --help` lists run first
from . import cli_run, cli_quality  # noqa: E402,F401  (after the names they import from here)


@command
def convert(
    src: List[Path] = typer.Argument(..., help="HF checkpoint folder(s) or GGUF file(s)."),
    out: Path = typer.Option(..., "-o", "--out",
                             help="Output model folder (one source) or parent folder (several)."),
    dtype: str = typer.Option("q8_0", "--dtype", help=f"Storage dtype: {', '.join(DTYPES)}."),
    force: bool = typer.Option(False, "--force", help="Replace an existing output."),
    jobs: int = typer.Option(1, "-j", "--jobs", min=1, help="Sources converted at once (worker processes)."),
) -> None:
    """Repack checkpoints into the row-column-bundled flash layout."""
    from .convert import convert_many
    if dtype not in DTYPES:
        err.print(f"error: --dtype must be one of {', '.join(DTYPES)}, not {dtype!r}")
        raise typer.Exit(2)
    failures = convert_many(src, out, dtype, force, console=err, jobs=jobs)
    if failures:
        raise typer.Exit(1)


@command
def pull(name: str = typer.Argument(..., help="A model name from models.toml.")) -> None:
    """Fetch a model listed in models.toml into the user cache and verify its checksum."""
    from .registry import load_registry, pull as pull_model
    entry = load_registry(registry_path()).get(name)
    path = pull_model(entry, cache_dir(), log=lambda m: err.print(m, markup=False))
    print(path)  # on stdout, so scripts can use $(flashllm pull NAME)


@command
def models(as_json: bool = typer.Option(False, "--json", help="Print the list as JSON.")) -> None:
    """List models.toml entries and the user cache: sizes, what is fetched and converted."""
    import json
    from .info import catalog, models_table
    from .registry import load_registry
    rows = catalog(load_registry(registry_path()), cache_dir())
    if as_json:
        print(json.dumps(rows, indent=1))
    else:
        Console(highlight=False).print(models_table(rows))


@command
def inspect(
    path: Path = typer.Argument(..., help="A converted model folder."),
    verify: bool = typer.Option(False, "--verify", help="Also check every checksum."),
    as_json: bool = typer.Option(False, "--json", help="Print the summary as JSON."),
) -> None:
    """Summarize a converted model: config, dtypes, sizes, calibration state; --verify checksums."""
    import json
    from .bundle import open_flash
    from .info import flash_summary, summary_table
    summary = flash_summary(open_flash(path), verify=verify)
    if as_json:
        print(json.dumps(summary, indent=1))
    else:
        Console(highlight=False).print(summary_table(summary))


@command
def profile(
    path: Path = typer.Argument(Path("."), help="A folder on the device to measure (a scratch "
                                "file is written there), or an existing file to read."),
    size: str = typer.Option("2GiB", "--size", help="Scratch file size."),
    seconds: float = typer.Option(30.0, "--seconds", help="Total measuring time."),
    as_json: bool = typer.Option(False, "--json", help="Print the profile as JSON."),
) -> None:
    """Measure the device's direct-I/O read throughput and save it for `run` to plan reads."""
    import json
    from rich.console import Console as StdoutConsole
    from .costmodel import CostModel
    from .profile import parse_size, save_profile
    from .profile_view import model_table, profile_table, run_profile, sequential_table, throughput_chart
    if not path.exists():
        fail(f"{path} does not exist")
    result = run_profile(err, path, parse_size(size), seconds)
    saved = save_profile(result, cache_dir())
    if as_json:
        print(json.dumps(result.to_dict(), indent=1))
    else:
        out = StdoutConsole(highlight=False)
        for view in (profile_table(result), sequential_table(result), throughput_chart(result),
                     model_table(CostModel.from_profile(result))):
            out.print(view)
    err.print(f"profile saved to {saved}", markup=False)



def main() -> None:
    """Console entry point: domain errors become one line and exit code 1."""
    try:
        app()
    except FlashError as e:
        err.print(f"error: {e}", markup=False, soft_wrap=True)
        sys.exit(1)
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        sys.exit(0)
    except KeyboardInterrupt:
        err.print("interrupted", markup=False)
        sys.exit(130)


if __name__ == "__main__":  # `python -m flashllm.cli`: run the imported module, where the
    from flashllm.cli import main as imported_main  # commands of cli_run/cli_quality registered
    imported_main()
