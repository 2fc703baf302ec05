"""A GGUF in another llama.cpp quantization, made by llama.cpp itself (llama_model_quantize of the
installed llama-cpp-python) from one of the shipped GGUFs: how the benchmarks get Q2_K / Q3_K_M
models to test against llama.cpp when no such file can be downloaded here.

    python -m scripts.bench.requantize_gguf $FLASHLLM_CACHE/models/qwen2.5-coder-1.5b.gguf \\
        build/gguf/qwen2.5-coder-1.5b-q3_k_m.gguf --type Q3_K_M

The source's tensors are requantized (allow_requantize), as `llama-quantize --allow-requantize`
does; the output is written atomically (a temporary name, then renamed).
"""
from __future__ import annotations

import argparse
import ctypes
import os
import sys
from pathlib import Path

TYPES = ("Q2_K", "Q3_K_S", "Q3_K_M", "Q3_K_L", "Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("source", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--type", choices=TYPES, required=True)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    import llama_cpp
    if not a.source.is_file():
        sys.exit(f"requantize_gguf: no such file: {a.source}")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{a.type}")
    params.allow_requantize = True
    params.nthread = a.threads
    a.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = a.out.with_name(a.out.name + ".part")
    rc = llama_cpp.llama_model_quantize(str(a.source).encode(), str(tmp).encode(),
                                        ctypes.byref(params))
    if rc != 0:
        tmp.unlink(missing_ok=True)
        sys.exit(f"requantize_gguf: llama_model_quantize failed ({rc})")
    os.replace(tmp, a.out)
    print(f"{a.out}: {a.out.stat().st_size / 2**20:.1f} MiB ({a.type})")


if __name__ == "__main__":
    main()
