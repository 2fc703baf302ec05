"""Source checkpoint → flash model folder in bounded memory: one row block of a tensor and one
block of an FFN layer's neurons at a time, each written as it is made (several sources at once:
convert/batch.py)."""
from __future__ import annotations

from pathlib import Path
from typing import Callable

from flashllm.convert import head_sketch, native, native_moe
from flashllm.convert.merges import compact_merges
from flashllm.format.layout import (NATIVE, SKETCH_NAMES, ffn_parts, ffn_weight,
                                    required_tensors)
from flashllm.format.writer import FlashWriter
from flashllm.errors import FlashError, SourceError
from flashllm.convert.sources import open_source
from flashllm.model.tensor import QTensor

ProgressFn = Callable[[int, int], None]


def default_dtype(src: Path) -> str:
    """The conversion a source gets when none is asked for: native for a GGUF file (its own
    types), q8_0 for a Hugging Face folder."""
    return NATIVE if Path(src).is_file() else "q8_0"


def convert(src: Path, out: Path, dtype: str | None, force: bool = False,
            progress: ProgressFn | None = None) -> Path:
    """Convert the checkpoint at src (HF folder or GGUF file) into the flash model folder out, in
    dtype (None: default_dtype). progress(done, total) is called after every tensor, counting
    the bytes the source stores."""
    dtype = dtype or default_dtype(src)
    src, out = Path(src), Path(out)
    if out.exists() and (out.resolve() == src.resolve() or out.resolve() in src.resolve().parents):
        raise FlashError(f"{out} holds the source {src}: the output must be another folder")
    source = open_source(src)
    try:
        return convert_source(source, out, dtype, force=force, progress=progress,
                              description={"path": str(src.resolve()), "name": src.name})
    finally:
        source.close()


def convert_source(source, out: Path, dtype: str, *, force: bool = False,
                   progress: ProgressFn | None = None, description: dict | None = None,
                   kquants: dict = native.KQUANT_DOWN) -> Path:
    """Write an opened Source (sources.Source protocol) as a flash model folder at out
    (kquants: a native conversion's down columns' k-quant per stored type, native.plan)."""
    cfg = source.config
    dense, ffn = _plan(source)
    if dtype == "q4_k" and cfg.n_experts:
        raise SourceError("--dtype q4_k is not supported for a mixture of experts (use q4_1, "
                          "q4_0 or q8_0)")
    if dtype == "q4_k":
        _check_q4_k(source, ffn)
    plan = None
    if dtype == NATIVE:
        plan = native_moe.plan_experts(source, ffn) if cfg.n_experts else \
            native.plan(source, ffn, kquants)
    nbytes = {n: source.tensor_nbytes(n) for n in source.tensor_names()}   # as the source stores them
    total, done = sum(nbytes.values()), 0
    tick = progress or (lambda done, total: None)
    with FlashWriter(out, cfg, dtype, force=force, source=description,
                     ffn_dtypes=plan and (plan.ffn_dtype, list(plan.down_dtypes)),
                     expert_rows=bool(plan and cfg.n_experts)) as w:
        text, merges = compact_merges(source.tokenizer_json) \
            if source.tokenizer_json is not None else (None, None)
        w.set_tokenizer(text, source.chat_template, merges)
        for name in dense:
            native.write_dense(w, source, name) if plan else _write_dense(w, source, name)
            done += nbytes[name]
            tick(done, total)
        head = "output.weight" if "output.weight" in dense else "token_embd.weight"
        head_sketch.write(w, lambda r0, r1: source.load_rows(head, r0, r1),
                          *source.tensor_shape(head))
        for layer in range(cfg.n_layers):
            groups = ffn[layer]
            if cfg.n_experts and plan:
                native_moe.write_expert_layer(w, source, layer, groups, plan)
            elif cfg.n_experts:
                _write_experts(source, w, layer, groups)
            elif plan:
                native.write_ffn_layer(w, source, layer, groups[""], plan)
            else:
                _write_ffn_layer(source, w, layer, groups[""], dtype)
            done += sum(nbytes[n] for names in groups.values() for n in names.values())
            tick(done, total)
        return w.finish()


def _write_experts(source, w: FlashWriter, layer: int, groups: dict[str, dict[str, str]]) -> None:
    """An MoE layer's slots: each routed expert in turn (one expert's f32 weights in memory at a
    time), then the shared expert."""
    exps = groups["exps"]
    for e in range(source.config.n_experts):
        w.add_ffn_rows(layer, *(source.load_expert(exps[p], e) for p in ("gate", "up", "down")))
    if "shexp" in groups:
        w.add_ffn_rows(layer, *(source.load(groups["shexp"][p]) for p in ("gate", "up", "down")))


def _write_dense(w: FlashWriter, source, name: str) -> None:
    """A dense tensor converted to the writer's dtype, a block of rows at a time."""
    shape = tuple(source.tensor_shape(name))
    if len(shape) == 1:
        return w.add_tensor(name, source.load(name))
    w.add_tensor_rows(name, shape, (source.load_rows(name, *b) for b in native.blocks(*shape)))


def _write_ffn_layer(source, w: FlashWriter, layer: int, names: dict[str, str], dtype: str) -> None:
    """One dense FFN layer in dtype, a block of neurons at a time (whole blocks of the down
    matrix's stored type, its columns): f32 rows and columns for the writer to quantize, or
    for q4_k gate / up the source's Q4_K rows as they are."""
    n_ff, d = source.tensor_shape(names["up"])
    for n0, n1 in native.blocks(n_ff, d, source.col_block(names["down"])):
        parts = {}
        for part, name in names.items():
            if part == "down":
                parts[part] = source.load_cols(name, n0, n1)                 # (d_model, n)
            elif dtype == "q4_k":
                parts[part] = QTensor(source.load_blocks(name)[n0:n1], "q4_k", n1 - n0, d)
            else:
                parts[part] = source.load_rows(name, n0, n1)                 # (n, d_model)
        w.add_ffn_rows(layer, parts.get("gate"), parts["up"], parts["down"])


def _check_q4_k(source, ffn: list[dict[str, dict[str, str]]]) -> None:
    """SourceError unless every FFN gate / up weight is stored as Q4_K rows (q4_k copies them)."""
    d = source.config.d_model
    if d % 256:
        raise SourceError(f"--dtype q4_k needs d_model a multiple of 256, this model has {d}")
    for groups in ffn:
        parts = groups[""]
        for part in ("gate", "up"):
            name = parts.get(part)
            if name and source.stored_type(name) != "Q4_K":
                raise SourceError(f"--dtype q4_k copies Q4_K gate / up blocks, but {name} is "
                                  f"{source.stored_type(name)} (use --dtype q4_1)")


def _plan(source) -> tuple[list[str], list[dict[str, dict[str, str]]]]:
    """Dense tensor names in source order, and per layer {group: {part: name}} of the FFN
    weights (group "" for a dense FFN, "exps" and "shexp" for an MoE layer's; layout.ffn_weight);
    SourceError when a tensor the architecture needs is missing or misshapen."""
    cfg = source.config
    names = list(source.tensor_names())
    dense = [n for n in names if not ffn_weight(n)]
    for name, shape in required_tensors(cfg).items():
        if name not in dense:
            raise SourceError(f"the checkpoint has no tensor {name}")
        if tuple(source.tensor_shape(name)) != shape:
            raise SourceError(f"tensor {name} has shape {tuple(source.tensor_shape(name))}, "
                              f"the config needs {shape}")
    ffn: list[dict[str, dict[str, str]]] = [{} for _ in range(cfg.n_layers)]
    for n in names:
        key = ffn_weight(n)
        if key and key[0] >= cfg.n_layers:
            raise SourceError(f"tensor {n} is beyond the config's {cfg.n_layers} layers")
        if key:
            ffn[key[0]].setdefault(key[2], {})[key[1]] = n
    want = (["exps"] + (["shexp"] if cfg.n_ff_shared else [])) if cfg.n_experts else [""]
    for layer, groups in enumerate(ffn):
        for group in set(want) | set(groups):
            parts = groups.get(group, {})
            if group not in want or set(parts) != set(ffn_parts(cfg.glu)):
                raise SourceError(f"layer {layer}: FFN weights {sorted(parts)} "
                                  f"{'of the ' + group + ' ' if group else ''}do not match a "
                                  f"{'GLU' if cfg.glu else 'non-GLU'} model (needs "
                                  f"{list(ffn_parts(cfg.glu))})")
        if cfg.n_experts:
            _check_expert_shapes(source, layer, groups)
    return dense, ffn


def _check_expert_shapes(source, layer: int, groups: dict[str, dict[str, str]]) -> None:
    """SourceError unless an MoE layer's FFN tensors have the config's shapes."""
    cfg, d = source.config, source.config.d_model
    want = {("exps", "gate"): (cfg.n_experts, cfg.n_ff, d), ("exps", "up"): (cfg.n_experts, cfg.n_ff, d),
            ("exps", "down"): (cfg.n_experts, d, cfg.n_ff), ("shexp", "gate"): (cfg.n_ff_shared, d),
            ("shexp", "up"): (cfg.n_ff_shared, d), ("shexp", "down"): (d, cfg.n_ff_shared)}
    for group, parts in groups.items():
        for part, name in parts.items():
            if tuple(source.tensor_shape(name)) != want[group, part]:
                raise SourceError(f"tensor {name} has shape {tuple(source.tensor_shape(name))}, "
                                  f"the config needs {want[group, part]}")
