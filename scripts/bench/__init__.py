"""Benchmarks: `make bench` (bench.py, writes BENCHMARKS.md) and its parts, the I/O and kernel
benchmarks."""
