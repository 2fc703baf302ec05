"""Model management commands: convert, pull, models, inspect, profile."""
from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from flashllm.cli.app import (finite, MODEL_HELP, cache_dir, choice, command, err, fail, model_path,
                              registry_path, stdout_console)
from flashllm.session.options import DTYPES

Dtype = choice("Dtype", DTYPES)


@command
def convert(
    src: List[Path] = typer.Argument(..., help="HF checkpoint folder(s) or GGUF file(s)."),
    out: Path = typer.Option(..., "-o", "--out",
                             help="Output model folder (one source) or parent folder (several)."),
    dtype: Optional[Dtype] = typer.Option(
        None, "--dtype", help="Storage dtype; native (the default for a GGUF: each tensor in its "
        "own type, FFN down columns re-quantized) or one dtype for all (the default for a "
        "Hugging Face folder: q8_0)."),
    force: bool = typer.Option(False, "--force", help="Replace an existing output."),
    jobs: int = typer.Option(1, "-j", "--jobs", min=1, help="Sources converted at once (worker processes)."),
) -> None:
    """Repack checkpoints into the row-column-bundled flash layout."""
    from flashllm.session.models import convert as convert_many
    failures = convert_many(src, out, dtype and dtype.value, force, console=err, jobs=jobs)
    if failures:
        raise typer.Exit(1)


@command
def pull(name: str = typer.Argument(..., help="A model name from models.toml.")) -> None:
    """Fetch a model listed in models.toml into the user cache and verify its checksum."""
    from flashllm.session.models import pull as pull_model
    path = pull_model(name, cache_dir(), registry_path(), log=lambda m: err.print(m, markup=False))
    print(path)  # on stdout, so scripts can use $(flashllm pull NAME)


@command
def models(as_json: bool = typer.Option(False, "--json", help="Print the list as JSON.")) -> None:
    """List models.toml entries and the user cache: sizes, what is fetched and converted."""
    import json
    from flashllm.cli.views import models_table
    from flashllm.session.models import models as catalog
    rows = catalog(cache_dir(), registry_path())
    if as_json:
        print(json.dumps(rows, indent=1))
    else:
        stdout_console().print(models_table(rows, cache_dir()))


@command
def inspect(
    model: str = typer.Argument(..., help=MODEL_HELP),
    verify: bool = typer.Option(False, "--verify", help="Also check every checksum."),
    as_json: bool = typer.Option(False, "--json", help="Print the summary as JSON."),
    tensors: bool = typer.Option(False, "--tensors", help="Also list every tensor: its dtype and "
                                 "whether it was copied from the source or re-quantized."),
) -> None:
    """Summarize a converted model: config, dtypes, sizes, calibration state; --verify checksums."""
    import json
    from flashllm.cli.views import summary_table, tensors_table
    from flashllm.session.models import inspect as summarize
    summary = summarize(model_path(model), verify=verify)
    if as_json:
        print(json.dumps(summary, indent=1))
        return
    out = stdout_console()
    out.print(summary_table(summary))
    if tensors:
        out.print(tensors_table(summary))


@command
def profile(
    path: Path = typer.Argument(Path("."), help="A folder on the device to measure (a scratch "
                                "file is written there), or an existing file to read."),
    size: str = typer.Option("2GiB", "--size", help="Scratch file size."),
    seconds: float = typer.Option(30.0, "--seconds", min=1.0, callback=finite, help="Total measuring time."),
    as_json: bool = typer.Option(False, "--json", help="Print the profile as JSON."),
) -> None:
    """Measure the device's direct-I/O read throughput and save it for `run` to plan reads."""
    import json
    from flashllm.units import parse_size
    from flashllm.cli.views import model_table, profile_table, run_profile, sequential_table, throughput_chart
    if not path.exists():
        fail(f"{path} does not exist")
    if not (path.is_dir() or path.is_file()):
        fail(f"{path} is neither a folder (to write a scratch file in) nor a regular file to read")
    result, cost, saved = run_profile(err, path, parse_size(size), seconds, cache_dir())
    if as_json:
        print(json.dumps(result.to_dict(), indent=1))
    else:
        out = stdout_console()
        for view in (profile_table(result), sequential_table(result), throughput_chart(result),
                     model_table(cost)):
            out.print(view)
    err.print(f"profile saved to {saved}", markup=False)
