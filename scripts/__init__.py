"""Scripts around flashllm: benchmarks, fixture makers and studies (README.md). Run them as
modules from the repository root: `python -m scripts.bench.bench`."""
