"""flashllm: run language models larger than DRAM by streaming FFN neurons from flash."""

__version__ = "0.1.0"
