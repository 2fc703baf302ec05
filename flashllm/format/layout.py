"""The flash layout's constants, byte headers and size rules (docs/FORMAT.md).

Shared by the writer (format/writer.py) and the reader (format/reader.py) so both agree byte for byte.
"""
from __future__ import annotations

import re
import struct
import zlib

import numpy as np

from flashllm.errors import FormatError
from flashllm.model.archs.tensors import ROUTER, required_tensors  # noqa: F401 (the format's)
from flashllm.model.tensor import BLOCK_SIZE, DTYPE_CODES, companion, row_bytes
from flashllm.units import PAGE

MAGIC = "flashllm"
# the manifest dtype of a native conversion: every tensor in its own type (per tensor, and the
# FFN's in ffn.dtype / ffn.down_dtype)
NATIVE = "native"
FORMAT_VERSION = 1
# a folder whose mixture-of-experts layers hold each expert as its source's rows (EXPERT_ROWS,
# below): an older reader must refuse it rather than read its experts as bundles
EXPERT_ROWS_VERSION = 2
READ_VERSIONS = (FORMAT_VERSION, EXPERT_ROWS_VERSION)
# ffn.experts of a native MoE conversion: an expert's n_ff slots hold its gate rows, its up rows,
# then its down rows (d_model rows of n_ff values), each as the GGUF stores them
EXPERT_ROWS = "rows"
MANIFEST_FILE = "manifest.json"
DENSE_FILE = "dense.bin"
FFN_FILE = "ffn.bin"
TOKENIZER_FILE = "tokenizer.json"
MAX_TOKENIZER_BYTES = 128 << 20    # a tokenizer.json (Gemma 3's 262k tokens: 12 MiB; in HF 33)
# the manifest tokenizer entry's "merges": how tokenizer.json writes a BPE model's merges
# ("left right" strings, or [left, right] pairs), "none" for a model without them; absent: a
# conversion older than the field (or a JSON it could not read)
MERGES_FORMS = ("strings", "pairs", "none")
ORDER_FILE = "order.bin"
# a native conversion's FFN down matrices as the GGUF stores them (rows of n_ff values), for runs
# that hold the whole FFN in DRAM (runtime/ffn.py RowFfn); absent from older folders
DOWN_FILE = "down.bin"
DOWN_ALIGN = PAGE                # every layer's down matrix starts on a page

QUANTIZED = tuple(d for d in DTYPE_CODES if BLOCK_SIZE[d] > 1)   # block-quantized dtypes
QBLOCK = 32                      # values per quantization block

DENSE_MAGIC = b"FLDENSE\0"
DENSE_ALIGN = 64                 # every dense tensor starts on a 64-byte boundary
# magic, version, header_bytes, n_tensors, file_bytes; zero-padded to DENSE_ALIGN
DENSE_HEADER = struct.Struct("<8sIIQQ")

FFN_MAGIC = b"FLFFN\0\0\0"
FFN_ALIGN = PAGE                 # the header and every layer region: direct-I/O alignment
STRIDE_ALIGN = 32                # a bundle's stride is a multiple of this
# magic, version, header_bytes, dtype code, glu, n_layers, d_model, n_ff, part_bytes, stride,
# layer_bytes (one layer's region, padded), file_bytes; zero-padded to FFN_ALIGN
FFN_HEADER = struct.Struct("<8sIIIIQQQQQQQ")

CRC_CHUNK = 16 << 20             # bytes hashed per zlib.crc32 call when streaming a file

_FFN_WEIGHT = re.compile(r"blk\.(\d+)\.ffn_(gate|up|down)(?:_(exps|shexp))?\.weight")
SKETCH = "output_sketch.weight"   # the output head's Q2_K sketch (vocab, d_pad): convert/head_sketch.py
SKETCH_VAR = "output_sketch.var"  # its mean squared error per superblock (vocab, d_pad / 256) f32
SKETCH_NAMES = (SKETCH, SKETCH_VAR)


def align_up(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def ffn_weight(name: str) -> tuple[int, str, str] | None:
    """(layer, "gate"|"up"|"down", group) for an FFN weight that goes to ffn.bin, else None;
    group is "" for a dense FFN, "exps" for the routed experts, "shexp" for the shared one."""
    m = _FFN_WEIGHT.fullmatch(name)
    return (int(m.group(1)), m.group(2), m.group(3) or "") if m else None


def tensor_dtype(dtype: str, shape: tuple[int, ...], name: str = "") -> str:
    """The dtype a dense tensor is stored in: 1-D and MoE routers in f32; 2-D in `dtype` (q4_1
    for q4_k), or f16 when that is quantized and the row length is not a multiple of the block
    size."""
    if len(shape) == 1 or name.endswith(ROUTER):
        return "f32"
    dtype = companion(dtype)
    if dtype in QUANTIZED and shape[1] % QBLOCK:
        return "f16"
    return dtype


def fits(dtype: str, cols: int) -> bool:
    """Whether rows of `cols` values can be stored in dtype (quantized dtypes need whole blocks:
    32 values, 256 for q4_k)."""
    return dtype in DTYPE_CODES and cols > 0 and not cols % BLOCK_SIZE[dtype]


def tensor_nbytes(dtype: str, shape: tuple[int, ...]) -> int:
    """Bytes of a dense tensor: rows × row_bytes(dtype, cols), or 4 × n for a 1-D f32 tensor."""
    if len(shape) == 1:
        return 4 * shape[0]
    return shape[0] * row_bytes(dtype, shape[1])


def ffn_parts(glu: bool) -> tuple[str, ...]:
    return ("gate", "up", "down") if glu else ("up", "down")


def ffn_part_dtypes(dtype: str, glu: bool, down_dtype: str | None = None) -> tuple[str, ...]:
    """The dtype of each bundle part: gate / up in `dtype`, the down column in down_dtype
    (default companion(dtype): dtype, but q4_1 for a q4_k bundle, as folders before down_dtype)."""
    down = companion(dtype) if down_dtype is None else down_dtype
    return tuple(dtype if part != "down" else down for part in ffn_parts(glu))


def ffn_part_bytes(dtype: str, d_model: int, glu: bool,
                   down_dtype: str | None = None) -> tuple[int, ...]:
    """Bytes of each bundle part, in ffn_parts order."""
    return tuple(row_bytes(dt, d_model) for dt in ffn_part_dtypes(dtype, glu, down_dtype))


def ffn_stride(dtype: str, d_model: int, glu: bool, down_dtype: str | None = None) -> int:
    """Bytes of one bundle slot: the parts back to back, rounded up to STRIDE_ALIGN."""
    return align_up(sum(ffn_part_bytes(dtype, d_model, glu, down_dtype)), STRIDE_ALIGN)


def expert_rows_version(expert_rows: bool) -> int:
    """The format version of a folder with (or without) expert rows."""
    return EXPERT_ROWS_VERSION if expert_rows else FORMAT_VERSION


def expert_spans(dtype: str, down_dtype: str, d_model: int, n: int) -> tuple[int, int, int]:
    """(gate rows, up rows, down rows) bytes of an expert of n neurons stored as rows
    (EXPERT_ROWS): n rows of d_model values each for gate and up, d_model rows of n for down."""
    return n * row_bytes(dtype, d_model), n * row_bytes(dtype, d_model), \
        d_model * row_bytes(down_dtype, n)


def layer_strides(ffn: dict) -> list[int]:
    """Each layer's bundle stride from a manifest's ffn section: its own `stride`, else the
    section's (every folder before per-layer down dtypes)."""
    return [int(e.get("stride", ffn["stride"])) for e in ffn["layers"]]


def crc32_file(f, offset: int, nbytes: int) -> int:
    """zlib.crc32 of nbytes of the open binary file f from offset, read in CRC_CHUNK pieces."""
    crc, done = 0, 0
    f.seek(offset)
    while done < nbytes:
        chunk = f.read(min(CRC_CHUNK, nbytes - done))
        if not chunk:
            raise FormatError(f"{f.name}: unexpected end of file at byte {offset + done}")
        crc = zlib.crc32(chunk, crc)
        done += len(chunk)
    return crc


def crc32_array(a: np.ndarray, crc: int = 0) -> int:
    """zlib's crc32 of a's bytes, continuing crc (that of the bytes before them)."""
    return zlib.crc32(memoryview(np.ascontiguousarray(a)).cast("B"), crc)
