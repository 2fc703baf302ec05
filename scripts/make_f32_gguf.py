"""Re-export a GGUF file with every tensor dequantized to F32 (gguf-py only, no flashllm code).

Run:  /work/venv/bin/python scripts/make_f32_gguf.py SRC.gguf -o OUT.gguf

Each tensor is dequantized by gguf.quants.dequantize and written as F32 under its own name and
shape, in the file's order. Every metadata key is copied as stored (architecture keys, tokenizer,
chat template, ...) except general.file_type, which becomes ALL_F32. Tensors are NOT
un-permuted: llama-arch GGUFs keep their Q/K rows in the order llama.cpp's interleaved RoPE
expects, so the output is the same model to llama.cpp, only without quantized weights (and so
without llama.cpp's 8-bit activation rounding inside quantized dot products).
The output is written to OUT.tmp and renamed when complete.
"""
from __future__ import annotations

import argparse
import os
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter, Keys, LlamaFileType
from gguf.quants import dequantize


def copy_metadata(reader: GGUFReader, writer: GGUFWriter) -> int:
    """Copy every key/value pair but the header fields, the architecture (the writer adds it)
    and the file type (set to ALL_F32). Returns the number of keys copied."""
    copied = 0
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name in (Keys.General.ARCHITECTURE,
                                                             Keys.General.FILE_TYPE):
            continue
        vtype = field.types[0]
        sub_type = field.types[-1] if vtype == GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), vtype, sub_type=sub_type)
        copied += 1
    writer.add_key_value(Keys.General.FILE_TYPE, int(LlamaFileType.ALL_F32), GGUFValueType.UINT32)
    return copied


def f32_tensor(tensor) -> np.ndarray:
    """The tensor dequantized to F32, numpy shape = reversed GGML ne (rows last-dim-first)."""
    shape = tuple(int(n) for n in reversed(tensor.shape))
    values = dequantize(tensor.data, tensor.tensor_type)
    return np.ascontiguousarray(values, dtype=np.float32).reshape(shape)  # (…, ne0)


def export(src: Path, out: Path, log=print) -> None:
    """Write OUT: SRC with all tensors in F32, metadata kept (file_type = ALL_F32)."""
    reader = GGUFReader(str(src))
    arch = reader.fields[Keys.General.ARCHITECTURE].contents()
    tmp = out.with_name(out.name + ".tmp")
    writer = GGUFWriter(str(tmp), arch=arch, endianess=reader.endianess)
    n_keys = copy_metadata(reader, writer)
    for t in reader.tensors:
        shape = tuple(int(n) for n in reversed(t.shape))
        writer.add_tensor_info(t.name, shape, np.dtype(np.float32), 4 * int(np.prod(shape)),
                               raw_dtype=GGMLQuantizationType.F32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    kinds = {}
    for t in reader.tensors:
        kinds[t.tensor_type.name] = kinds.get(t.tensor_type.name, 0) + 1
        writer.write_tensor_data(f32_tensor(t))
    writer.close()
    os.replace(tmp, out)
    log(f"{out}: {len(reader.tensors)} tensors to F32 (were {kinds}), {n_keys} metadata keys "
        f"copied, {out.stat().st_size / 2**20:.0f} MiB")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("src", type=Path, help="GGUF file to re-export")
    ap.add_argument("-o", "--out", type=Path, required=True, help="F32 GGUF file to write")
    args = ap.parse_args()
    if args.out.resolve() == args.src.resolve():
        raise SystemExit(f"{args.out}: output would overwrite the source")
    export(args.src, args.out)


if __name__ == "__main__":
    main()
