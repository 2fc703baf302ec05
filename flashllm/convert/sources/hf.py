"""A Hugging Face checkpoint folder: config.json + *.safetensors [+ model.safetensors.index.json].

Tensors are read one at a time through `safetensors.safe_open` (memory-mapped, framework numpy);
bf16 is understood through ml_dtypes, which registers the dtype numpy lacks.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy, so safetensors can hand it out)
import numpy as np
from safetensors import SafetensorError, safe_open

from flashllm.model.archs import Arch, arch_for_hf
from flashllm.model.archs.hf import eos_ids
from flashllm.model.archs.tensors import SHARED_GATE, check_tensor_set
from flashllm.model.config import ModelConfig
from flashllm.format.layout import MAX_TOKENIZER_BYTES
from flashllm.limits import loads_json, read_capped
from flashllm.errors import FlashError, SourceError
from flashllm.convert.sources.base import Source

INDEX_NAME = "model.safetensors.index.json"
MAX_JSON_BYTES = 64 << 20          # config.json, the index, tokenizer_config.json: KiBs to MiBs
MAX_TEMPLATE_BYTES = 1 << 20       # chat_template.jinja (the largest known: tens of KiB)
FLOAT_DTYPES = ("float32", "float16", "bfloat16", "float64")


def read_text(path: Path, limit: int = MAX_JSON_BYTES) -> str:
    """A checkpoint's text file, at most limit bytes (SourceError past it, or not UTF-8)."""
    try:
        raw = read_capped(path, limit)
        if raw is None:
            raise SourceError(f"{path}: more than {limit >> 20} MiB, more than a checkpoint's "
                              "file of its kind holds")
        return raw.decode("utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise SourceError(f"{path}: cannot read it ({e})") from None


def read_json(path: Path) -> dict:
    try:
        data = loads_json(read_text(path))
    except ValueError as e:
        raise SourceError(f"{path}: cannot read JSON ({e})") from None
    if not isinstance(data, dict):
        raise SourceError(f"{path}: expected a JSON object")
    return data


def _shard_files(folder: Path) -> list[Path]:
    """The safetensors files to read: those the index names, else every *.safetensors."""
    index = folder / INDEX_NAME
    if not index.exists():
        return sorted(folder.glob("*.safetensors"))
    weight_map = read_json(index).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise SourceError(f"{index}: no weight_map")
    files = sorted(set(weight_map.values()))
    for name in files:
        if not (folder / name).is_file():
            raise SourceError(f"{index}: names shard {name!r}, which is missing")
    return [folder / name for name in files]


def read_chat_template(folder: Path) -> str | None:
    """chat_template.jinja, else tokenizer_config.json's chat_template (a string or named list)."""
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return read_text(jinja, MAX_TEMPLATE_BYTES)
    tok_cfg = folder / "tokenizer_config.json"
    if not tok_cfg.is_file():
        return None
    template = read_json(tok_cfg).get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    return template if isinstance(template, str) else None


def _config(folder: Path) -> tuple[Arch, ModelConfig]:
    cfg_json = read_json(folder / "config.json")
    arch = arch_for_hf(cfg_json)
    try:
        cfg = arch.hf_config(cfg_json)
    except (TypeError, ValueError, ArithmeticError, KeyError, IndexError, AttributeError) as e:
        raise SourceError(f"{folder / 'config.json'}: bad value ({type(e).__name__}: {e})") from None
    except FlashError as e:
        raise SourceError(f"{folder / 'config.json'}: {e}") from None
    gen = folder / "generation_config.json"
    if gen.is_file():
        extra = eos_ids(read_json(gen).get("eos_token_id"))
        merged = cfg.eos_token_ids + tuple(i for i in extra if i not in cfg.eos_token_ids)
        cfg = dataclasses.replace(cfg, eos_token_ids=merged)
    return arch, cfg


class HFSource(Source):
    def __init__(self, folder: Path):
        self.path = Path(folder)
        self.arch, self.config = _config(self.path)
        self._handles: dict[Path, object] = {}
        self._where: dict[str, tuple[Path, str, int, int]] = {}  # canonical -> (file, HF name,
                                                                # its rows first .. end)
        self._experts: dict[str, dict[int, tuple[Path, str]]] = {}   # 3-D canonical -> e -> file, name
        try:
            self._index_tensors()
        except BaseException:
            self.close()
            raise
        tok = self.path / "tokenizer.json"
        self.tokenizer_json = read_text(tok, MAX_TOKENIZER_BYTES) if tok.is_file() else None
        self.chat_template = read_chat_template(self.path)

    def _index_tensors(self) -> None:
        for file in _shard_files(self.path):
            try:
                handle = safe_open(str(file), framework="numpy")
            except (SafetensorError, OSError) as e:
                raise SourceError(f"{file}: corrupt or truncated safetensors file ({e})") from None
            self._handles[file] = handle
            for hf_name in handle.keys():
                found = self.arch.locate(hf_name)
                if found is None:
                    continue
                canonical, expert = found
                if expert is not None:                 # one expert of a 3-D MoE tensor
                    if expert in self._experts.setdefault(canonical, {}):
                        raise SourceError(f"{file}: tensor {hf_name!r} appears twice in the checkpoint")
                    self._experts[canonical][expert] = (file, hf_name)
                    continue
                rows = int((handle.get_slice(hf_name).get_shape() or [1])[0])
                for part, r0, r1 in self.arch.split(self.config, canonical, rows):  # fused: parts
                    if part in self._where:
                        raise SourceError(f"{file}: tensor {hf_name!r} appears twice in the checkpoint")
                    self._where[part] = (file, hf_name, r0, r1)
        self._check_experts()
        if self.config.tied_embeddings:
            self._where.pop("output.weight", None)     # a tied head duplicates token_embd
        check_tensor_set(self.config, self._where, str(self.path))

    def _check_experts(self) -> None:
        """Every 3-D tensor holds experts 0 .. n_experts-1, each of one shape; its name is listed
        with expert 0's place (whose shape, with the count in front, is the tensor's)."""
        for canonical, experts in self._experts.items():
            if sorted(experts) != list(range(self.config.n_experts)):
                raise SourceError(f"{self.path}: {canonical} has experts {sorted(experts)[:8]}, the "
                                  f"config {self.config.n_experts}")
            shapes = {tuple(self._handles[f].get_slice(n).get_shape()) for f, n in experts.values()}
            if len(shapes) != 1:
                raise SourceError(f"{self.path}: the experts of {canonical} differ in shape")
            file, hf_name = experts[0]
            self._where[canonical] = (file, hf_name, 0, shapes.pop()[0])

    def tensor_names(self) -> list[str]:
        return list(self._where)

    def _slice(self, name: str, expert: int | None = None):
        if name not in self._where:
            raise self._unknown(name)
        file, hf_name, r0, r1 = self._where[name]
        if expert is not None:
            file, hf_name = self._experts[name][expert]
        return file, hf_name, self._handles[file].get_slice(hf_name), (r0, r1)

    def tensor_shape(self, name: str) -> tuple[int, ...]:
        _, _, sl, (r0, r1) = self._slice(name)
        shape = tuple(int(n) for n in sl.get_shape())
        if name in self._experts:
            return (len(self._experts[name]), *shape)
        if name.endswith(SHARED_GATE) and shape[:1] == (1,):
            return shape[1:]                             # (1, d_model) -> (d_model,)
        return (r1 - r0, *shape[1:]) if shape else shape

    def tensor_nbytes(self, name: str) -> int:
        sl = self._slice(name)[2]
        size = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2}.get(sl.get_dtype(), 4)
        return size * int(np.prod(self.tensor_shape(name)))

    def load(self, name: str) -> np.ndarray:
        if name in self._experts:
            return np.stack([self.load_expert(name, e) for e in range(len(self._experts[name]))])
        return self._load(name, None).reshape(self.tensor_shape(name))

    def load_expert(self, name: str, expert: int) -> np.ndarray:
        if name not in self._experts or expert not in self._experts[name]:
            raise self._unknown(f"{name}[{expert}]")
        return self._load(name, expert)

    def load_rows(self, name: str, r0: int, r1: int) -> np.ndarray:
        if name in self._experts or len(self.tensor_shape(name)) != 2:
            return super().load_rows(name, r0, r1)
        return self._load(name, None, (r0, r1))

    def load_cols(self, name: str, c0: int, c1: int) -> np.ndarray:
        if name in self._experts or len(self.tensor_shape(name)) != 2:
            return super().load_cols(name, c0, c1)
        return self._load(name, None, None, (c0, c1))

    def _load(self, name: str, expert: int | None, rows: tuple | None = None,
              cols: tuple | None = None) -> np.ndarray:
        """The tensor (an expert of it) as f32; rows / cols (a, b): only those of a 2-D one, read
        alone from the file."""
        file, hf_name, sl, (r0, r1) = self._slice(name, expert)
        try:
            if rows is None and cols is None:
                raw = self._handles[file].get_tensor(hf_name)       # storage dtype, any shape
            else:
                a, b = (r0 + rows[0], r0 + rows[1]) if rows else (r0, r1)
                raw = sl[a:b] if cols is None else sl[a:b, cols[0]:cols[1]]
        except (SafetensorError, TypeError, OSError) as e:
            raise SourceError(f"{file}: cannot read tensor {hf_name!r} ({e})") from None
        if raw.dtype.name not in FLOAT_DTYPES:
            raise SourceError(f"{file}: tensor {hf_name!r} has dtype {raw.dtype.name}, "
                              f"supported: {', '.join(FLOAT_DTYPES)}")
        if raw.ndim and rows is None and cols is None:
            raw = raw[r0:r1]                                        # all, or a fused tensor's part
        if self.arch.norm_shift and name.endswith("norm.weight"):  # Gemma's (1 + w), in f32
            return raw.astype(np.float32) + np.float32(self.arch.norm_shift)
        return raw.astype(np.float32, copy=False)                   # get_tensor already copied

    def close(self) -> None:
        self._handles.clear()
