"""Bindings of the C kernel (native/): the compute half (kernel), the direct-I/O reader (reader) and
its read-ahead thread (readahead), whole-matrix quantization on top of the kernel (quant). The
only package that touches cffi (tests/test_layout.py checks it)."""
