"""A GGUF file (its header read lean, gguf_file.py): metadata, vocabulary and tensors, dequantized
by gguf-py one row block at a time.

GGUF tensor names are already the canonical names. Shapes are given to numpy reversed (ggml's ne
order), which is HF's (out, in). llama-arch files store attn_q/attn_k permuted for interleaved RoPE;
`load` undoes that so every architecture uses rotate-half RoPE.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES
from gguf.quants import dequantize

from flashllm.model.archs import arch_for_gguf
from flashllm.model.archs.gguf import gguf_config
from flashllm.model.archs.tensors import check_tensor_set
from flashllm.errors import FlashError, SourceError
from flashllm.convert.gguf_vocab import gguf_vocab
from flashllm.convert.sources.base import GGUF_MAGIC, Source
from flashllm.convert.sources.gguf_file import STRING, GGUFFile, HeaderTooLarge

# llama.cpp treats these as end-of-generation when present (llama_vocab::load, auto-detection).
EOG_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>",
             "<EOT>", "<|eom_id|>")
ROPE_FREQS = "rope_freqs.weight"   # per-frequency RoPE divisors (model/rope.py), read into the config
DEQUANT_ROWS = 8192          # rows dequantized at a time: gguf-py's temporaries stay small
_BIG_ARRAYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type",
               "tokenizer.ggml.scores")


@dataclass
class RowRange:
    """Rows r0 .. r1 of a stored GGUF tensor, read like gguf-py's ReaderTensor."""
    name: str
    shape: list                 # ggml order: (cols, rows)
    data: np.ndarray            # (rows, bytes per row) or (rows, cols)
    n_bytes: int
    tensor_type: object


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Invert llama.cpp's `w.reshape(n_head, 2, hd // 2, *rest).swapaxes(1, 2)` (HF -> GGUF)."""
    shape = w.shape                                                  # (n_head * hd, ...) or (n_head * hd,)
    hd = shape[0] // n_head
    return w.reshape(n_head, hd // 2, 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def _read(path: Path) -> GGUFFile:
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise SourceError(f"{path}: not a GGUF file (magic {magic!r})")
    try:
        reader = GGUFFile(path)
    except HeaderTooLarge as e:
        raise SourceError(f"{path}: refused: {e}") from None
    except Exception:                     # ValueError, struct.error, UnicodeDecodeError, ...
        raise SourceError(f"{path}: corrupt GGUF: {_diagnose(path)}") from None
    size = path.stat().st_size
    for t in reader.tensors:
        if len(t.shape) == 0 or any(int(n) <= 0 for n in t.shape):
            raise SourceError(f"{path}: tensor {t.name!r} has an empty shape {list(t.shape)}")
        if t.data_offset + t.n_bytes > size:
            raise SourceError(f"{path}: truncated GGUF: tensor {t.name!r} ends at byte "
                              f"{t.data_offset + t.n_bytes}, the file has {size}")
    return reader


def _diagnose(path: Path) -> str:
    """What is wrong with a GGUF file gguf-py could not read, from its fixed header: the
    version, the counts, or else the metadata / tensor table that follows them."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(24)                  # magic, version u32, n_tensors u64, n_kv u64
    if len(head) < 24:
        return f"the file ends inside its 24-byte header ({size} bytes)"
    version, n_tensors, n_kv = struct.unpack("<IQQ", head[4:])
    if version not in (2, 3):
        return f"unknown GGUF version {version} (flashllm reads versions 2 and 3)"
    if n_tensors > size // 24 or n_kv > size // 12:    # each entry takes at least that many bytes
        return (f"the header counts {n_tensors} tensors and {n_kv} metadata entries, more than "
                f"its {size} bytes can hold")
    return (f"after its header ({n_kv} metadata entries, {n_tensors} tensors) the metadata, the "
            f"tensor table or the tensor data is cut short or does not parse ({size} bytes)")


def _metadata(reader: GGUFFile) -> dict:
    """Scalar and small-array metadata as plain Python values."""
    return {k: v for k, v in reader.fields.items() if k not in _BIG_ARRAYS}


def _eos_ids(reader: GGUFFile, meta: dict) -> tuple[int, ...]:
    ids = [meta[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                             "tokenizer.ggml.eom_token_id") if meta.get(k) is not None]
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    if isinstance(tokens, list) and reader.types["tokenizer.ggml.tokens"] == STRING:
        wanted = set(EOG_TEXTS)
        for n, text in enumerate(tokens):
            if text in wanted and n not in ids:
                ids.append(n)
    return tuple(int(i) for i in ids)


class GGUFSource(Source):
    stores_blocks = True

    def __init__(self, path: Path):
        self.path = Path(path)
        reader = _read(self.path)
        try:
            self._parse(reader)
        except FlashError as e:
            raise SourceError(e if str(self.path) in str(e) else f"{self.path}: {e}") from None
        except (UnicodeDecodeError, ValueError, TypeError, KeyError, IndexError, AttributeError,
                ArithmeticError) as e:    # metadata of the wrong type or encoding in a hostile file
            raise SourceError(f"{self.path}: corrupt GGUF metadata ({type(e).__name__}: {e})") from None

    def _parse(self, reader: GGUFFile) -> None:
        meta = _metadata(reader)
        arch = arch_for_gguf(str(meta.get("general.architecture")))
        self._permuted = arch.gguf_permuted_qk
        self._tensors = {t.name: t for t in reader.tensors}
        if len(self._tensors) != len(reader.tensors):
            raise SourceError("a tensor name appears twice")
        tokens = reader.fields.get("tokenizer.ggml.tokens")
        vocab = len(tokens) if tokens is not None else self._shape_of("token_embd.weight")[0]
        freqs = self._tensors.pop(ROPE_FREQS, None)      # llama3 rope scaling: config, not weights
        rope_freqs = tuple(dequantize(freqs.data, freqs.tensor_type).reshape(-1)) if freqs else ()
        self.config = gguf_config(arch, meta, self._tensors, vocab, _eos_ids(reader, meta), rope_freqs)
        self._tensors = self._split(arch)
        self.tokenizer_json = gguf_vocab(reader.fields)      # streamed by the writer
        check_tensor_set(self.config, self._tensors, str(self.path))
        template = meta.get("tokenizer.chat_template")
        if template is not None and not isinstance(template, str):
            raise SourceError("tokenizer.chat_template is not a string")
        self.chat_template = template

    def _split(self, arch) -> dict:
        """The tensors with each fused one (Phi-3's attn_qkv, 2·n_ff-row ffn_up) replaced by its
        parts: row ranges of the same stored rows."""
        out = {}
        for name, t in self._tensors.items():
            rows = int(t.shape[-1]) if len(t.shape) == 2 else 1
            parts = arch.split(self.config, name, rows)
            for part, r0, r1 in parts:
                out[part] = t if len(parts) == 1 else RowRange(
                    part, [t.shape[0], r1 - r0], t.data[r0:r1], t.n_bytes // rows * (r1 - r0),
                    t.tensor_type)
        return out

    def _shape_of(self, name: str) -> tuple[int, ...]:
        if name not in self._tensors:
            raise self._unknown(name)
        return tuple(int(n) for n in reversed(self._tensors[name].shape))

    def tensor_names(self) -> list[str]:
        return list(self._tensors)

    def tensor_nbytes(self, name: str) -> int:
        if name not in self._tensors:
            raise self._unknown(name)
        return int(self._tensors[name].n_bytes)

    def tensor_shape(self, name: str) -> tuple[int, ...]:
        return self._shape_of(name)

    def stored_type(self, name: str) -> str:
        self._shape_of(name)
        return self._tensors[name].tensor_type.name

    def load_blocks(self, name: str) -> np.ndarray:
        shape = self._shape_of(name)
        t = self._tensors[name]
        if len(shape) != 2 or t.data.ndim != 2 or t.data.shape[0] != shape[0]:
            raise SourceError(f"{self.path}: tensor {name!r} is not stored as rows of blocks")
        rows = np.ascontiguousarray(t.data).view(np.uint8).reshape(shape[0], -1)  # (rows, bytes)
        return self._unpermuted(name, rows)

    def load(self, name: str) -> np.ndarray:
        shape = self._shape_of(name)
        rows = self._tensors[name].data.shape[0] if len(shape) == 2 else 1
        out = np.empty(shape, dtype=np.float32)                        # HF shape, e.g. (n_ff, d_model)
        flat = out.reshape(rows, -1)                                   # (stored rows, values per row)
        for r0 in range(0, rows, DEQUANT_ROWS):                        # bounded temporaries
            flat[r0:r0 + DEQUANT_ROWS] = self._dequant_rows(name, r0, r0 + DEQUANT_ROWS)
        return self._unpermuted(name, out)

    def load_rows(self, name: str, r0: int, r1: int) -> np.ndarray:
        shape = self._shape_of(name)
        if len(shape) != 2 or self._is_permuted(name):    # attention q / k: whole, then cut
            return np.ascontiguousarray(self.load(name)[r0:r1])
        return np.require(self._dequant_rows(name, r0, r1), np.float32, ["C", "W", "O"])

    def load_cols(self, name: str, c0: int, c1: int) -> np.ndarray:
        rows, cols = self._shape_of(name)
        t, block = self._tensors[name], self.col_block(name)
        if self._is_permuted(name) or c0 % block or (c1 % block and c1 != cols):
            return np.ascontiguousarray(self.load(name)[:, c0:c1])
        width = t.data.shape[1] // (cols // block)                     # bytes (or items) per block
        part = np.ascontiguousarray(t.data[:, c0 // block * width:-(-c1 // block) * width])
        cut = self._dequantized(name, part).reshape(rows, -1)         # (rows, c1 - c0)
        return np.require(cut, np.float32, ["C", "W", "O"])

    def col_block(self, name: str) -> int:
        return GGML_QUANT_SIZES[self._tensors[name].tensor_type][0]

    def _dequant_rows(self, name: str, r0: int, r1: int) -> np.ndarray:
        """Stored rows r0 .. r1 of a tensor (a 1-D one: its one row) as f32 (rows, values)."""
        data = self._tensors[name].data
        data = data if data.ndim == 2 else data.reshape(1, -1)         # (rows, bytes per row) storage
        part = self._dequantized(name, data[r0:r1])
        return part.reshape(part.shape[0], -1)

    def _dequantized(self, name: str, data: np.ndarray) -> np.ndarray:
        t = self._tensors[name]
        try:
            return dequantize(data, t.tensor_type)
        except NotImplementedError:
            raise SourceError(f"{self.path}: tensor {name!r} has type {t.tensor_type.name}, "
                              "which gguf-py cannot dequantize") from None

    def _is_permuted(self, name: str) -> bool:
        return self._permuted and name.split(".")[-2] in ("attn_q", "attn_k")

    def _unpermuted(self, name: str, rows: np.ndarray) -> np.ndarray:
        """rows (out, ...) — values or stored blocks — in HF order: llama-arch attn_q / attn_k
        rows back from llama.cpp's interleaved-RoPE permutation."""
        if not self._is_permuted(name):
            return rows
        heads = self.config.n_heads if ".attn_q." in name else self.config.n_kv_heads
        if rows.shape[0] % (2 * heads):
            raise SourceError(f"{self.path}: tensor {name!r} has {rows.shape[0]} rows, not whole "
                              f"RoPE pairs of {heads} heads")
        return np.ascontiguousarray(unpermute_qk(rows, heads))

    def load_expert(self, name: str, expert: int) -> np.ndarray:
        shape = self._shape_of(name)
        t = self._tensors[name]
        if len(shape) != 3 or not 0 <= expert < shape[0] or t.data.shape[0] != shape[0]:
            raise SourceError(f"{self.path}: tensor {name!r} {list(shape)} has no expert {expert}")
        part = self._dequantized(name, t.data[expert])                 # (rows, cols)
        return np.ascontiguousarray(part, dtype=np.float32).reshape(shape[1:])

    def load_expert_blocks(self, name: str, expert: int) -> np.ndarray:
        shape = self._shape_of(name)
        t = self._tensors[name]
        if len(shape) != 3 or not 0 <= expert < shape[0] or t.data.shape[0] != shape[0] \
                or t.data.ndim != 3:
            raise SourceError(f"{self.path}: tensor {name!r} {list(shape)} has no expert {expert}")
        return np.ascontiguousarray(t.data[expert]).view(np.uint8).reshape(shape[1], -1)  # (rows, bytes)

    def close(self) -> None:
        self._tensors = {}
