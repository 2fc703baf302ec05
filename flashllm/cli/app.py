"""The Typer app and what every command shares: the error wrapper, the user cache, models.toml,
MODEL names resolved to folders.

The commands register themselves on `app` from run.py, quality.py and manage.py (imported by
the package's __init__, in the order `--help` lists them). The cli package is the only one that
reads the environment; everything below it takes settings as arguments. A FlashError becomes one
line on stderr and exit code 1; usage errors exit with 2. Generated tokens go alone to stdout;
everything else goes to stderr.
"""
from __future__ import annotations

import enum
import functools
import math
import os
import signal
import sys
from pathlib import Path
from typing import Optional

import typer
from platformdirs import user_cache_dir
from rich.console import Console

from flashllm import __version__
from flashllm.errors import FlashError

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  rich_markup_mode=None,
                  help="Run language models larger than DRAM: FFN neurons stream from flash.")
err = Console(stderr=True, highlight=False, soft_wrap=True)   # a message is one line, in a log file too
PIPE_WIDTH = 200   # columns of a table printed into a pipe or a file


def stdout_console() -> Console:
    """The console tables go to on stdout: a terminal's width; into a pipe or a file PIPE_WIDTH
    unless COLUMNS says otherwise (rich would assume 80 and cut the cells to "…")."""
    out = Console(highlight=False)
    if not out.is_terminal and not os.environ.get("COLUMNS"):
        out.width = PIPE_WIDTH
    return out


def _version(show: bool) -> None:
    if show:
        print(f"flashllm {__version__}")
        raise typer.Exit(0)


@app.callback()
def _options(version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                          help="Print the version and exit.")) -> None:
    """Run language models larger than DRAM: FFN neurons stream from flash."""

DEFAULT_THREADS = min(os.cpu_count() or 1, 8)
MAX_THREADS = 256          # the C reader's limit, and far past any useful compute thread count


def finite(value: Optional[float]) -> Optional[float]:
    """A float option's callback: NaN and infinities are refused at parse time, naming the
    option (typer's min / max let NaN through)."""
    if value is not None and not math.isfinite(value):
        raise typer.BadParameter(f"{value} is not a finite number")
    return value


def choice(name: str, values) -> type[enum.Enum]:
    """A str Enum of exactly `values`, for a Typer option that refuses anything else at parse
    time (a usage error, exit code 2, listing the choices)."""
    return enum.Enum(name, {v: v for v in values}, type=str)


MODEL_HELP = ("Converted model folder, a GGUF file (converted once into the user cache), or a "
              "models.toml name.")


def cache_dir() -> Path:
    """The user cache folder (models fetched and converted by name)."""
    return Path(os.environ.get("FLASHLLM_CACHE") or user_cache_dir("flashllm"))


def registry_path() -> Path:
    """models.toml: FLASHLLM_MODELS, else the one shipped at the project root."""
    env = os.environ.get("FLASHLLM_MODELS")
    return Path(env) if env else Path(__file__).resolve().parents[2] / "models.toml"


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
        except KeyboardInterrupt as e:
            raise typer.Exit(_interrupted(e)) from None
        except OSError as e:        # a file or folder the domain code did not name: say which
            where = f": {e.filename}" if e.filename else ""
            err.print(f"error: {e.strerror or e}{where}", markup=False, soft_wrap=True)
            raise typer.Exit(1) from None
    return app.command()(wrapper)


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the program is, so the same cleanup as Ctrl-C runs."""


def _terminate(signum, frame) -> None:
    raise Terminated()


def _interrupted(e: KeyboardInterrupt) -> int:
    """One line for Ctrl-C or SIGTERM; the shell's exit code for it (130, 143)."""
    term = isinstance(e, Terminated)
    lead = "\n" if err.is_terminal else ""      # after the ^C a terminal echoes mid-line
    err.print(lead + ("terminated" if term else "interrupted"), markup=False)
    return 128 + (signal.SIGTERM if term else signal.SIGINT)


def _silence_stdout() -> None:
    """Point stdout at /dev/null so the interpreter's final flush cannot fail again."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


def fail(message: str) -> None:
    err.print(f"error: {message}", markup=False, soft_wrap=True)
    raise typer.Exit(1)


def model_path(model: str, apart: bool = False) -> Path:
    """MODEL as given on the command line: a converted folder, a GGUF file or a models.toml name
    (both converted once; in a child process with `apart`, so the conversion's memory stays out
    of this one)."""
    from flashllm.session.models import resolve
    return resolve(model, cache_dir(), registry_path(), log=lambda m: err.print(m, markup=False),
                   apart=apart)


def main() -> None:
    """Console entry point: domain errors become one line and exit code 1; SIGTERM is handled
    as Ctrl-C is (temporary files removed), with exit code 143."""
    signal.signal(signal.SIGTERM, _terminate)
    try:
        app()
    except FlashError as e:
        err.print(f"error: {e}", markup=False, soft_wrap=True)
        sys.exit(1)
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        sys.exit(0)
    except KeyboardInterrupt as e:
        sys.exit(_interrupted(e))
