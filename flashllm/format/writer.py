"""FlashWriter: writes one flash model folder (docs/FORMAT.md), atomically and in bounded memory.

Order is enforced by a state enum: OPEN → DENSE (add_tensor) → FFN (add_ffn_layer, layer 0 first)
→ FINISHED (finish). Everything goes to a temporary sibling folder `.OUT.tmp-<pid>`, each file is
fsync'd, and the folder is renamed into place only when complete; any exception (KeyboardInterrupt
included) inside `with FlashWriter(...)` removes the temporary folder.
"""
from __future__ import annotations

import enum
import json
import os
import shutil
import zlib
from pathlib import Path

import numpy as np

from flashllm import __version__
from flashllm.format.expert_rows import check_downs, expert_slots
from flashllm.format.files import check_target, fsync_dir, install, sweep_leftovers, sync_close, why
from flashllm.format.side_files import TokenizerFile, write_file, write_order
from flashllm.format.layout import (NATIVE, DENSE_ALIGN, DENSE_FILE, DENSE_HEADER, DENSE_MAGIC,
                                    DTYPE_CODES, DOWN_ALIGN, DOWN_FILE, FFN_ALIGN, FFN_FILE,
                                    FFN_HEADER, FFN_MAGIC, EXPERT_ROWS, MAGIC, MANIFEST_FILE,
                                    align_up, crc32_array, expert_rows_version, ffn_part_bytes,
                                    ffn_part_dtypes, ffn_parts, ffn_stride, ffn_weight, fits,
                                    required_tensors, tensor_dtype)
from flashllm.model.config import ModelConfig
from flashllm.errors import FormatError
from flashllm.ffi.quant import quantize_rows
from flashllm.model.tensor import (BLOCK_SIZE, QUANTIZABLE, QTensor, companion,
                                   row_bytes)


class WriterState(enum.Enum):
    OPEN = "open"            # folder created, nothing written yet
    DENSE = "dense"          # dense tensors being written
    FFN = "ffn"              # FFN layers being written
    FINISHED = "finished"    # renamed into place
    ABORTED = "aborted"      # temporary folder removed


class FlashWriter:
    """Write tensors with add_tensor, then every FFN layer in order with add_ffn_layer, then finish()."""

    def __init__(self, out: Path, config: ModelConfig, dtype: str, *, force: bool = False,
                 source: dict | None = None,
                 ffn_dtypes: tuple[str, str | list[str]] | None = None,
                 expert_rows: bool = False) -> None:
        """dtype: the conversion's (a storage dtype, or NATIVE: every 2-D tensor comes as a
        QTensor); ffn_dtypes: (gate / up, down) of the bundles, by default (dtype,
        companion(dtype)); down may be a list, one dtype per layer (each layer then has its own
        stride). expert_rows: a mixture of experts' layers are written as each expert's rows
        (add_expert_rows; docs/FORMAT.md, EXPERT_ROWS), down in the layer's down dtype."""
        if dtype not in DTYPE_CODES and not (dtype == NATIVE and ffn_dtypes):
            raise FormatError(f"unknown storage dtype {dtype!r} (one of {', '.join(DTYPE_CODES)})")
        self.ffn_dtype, down = ffn_dtypes or (dtype, companion(dtype))
        self.downs = [down] * config.n_layers if isinstance(down, str) else list(down)
        if len(self.downs) != config.n_layers:
            raise FormatError(f"{len(self.downs)} down dtypes for {config.n_layers} layers")
        for dt in (self.ffn_dtype, *self.downs):
            if not fits(dt, config.d_model):
                raise FormatError(f"d_model={config.d_model} is not a multiple of "
                                  f"{BLOCK_SIZE.get(dt, '?')}: the FFN cannot be stored as {dt} "
                                  "(use f16 or f32)")
        self.expert_rows = expert_rows
        check_downs(config, self.downs, expert_rows)
        self.version = expert_rows_version(expert_rows)
        self.out, self.cfg, self.dtype, self.force = Path(out), config.validate(), dtype, force
        self.source = source or {}
        check_target(self.out, self.force)
        self.tmp = self.out.parent / f".{self.out.name}.tmp-{os.getpid()}"
        self.tensors: list[dict] = []
        self.layers: list[dict] = []
        self.orders: list[np.ndarray | None] = []
        self.tokenizer = TokenizerFile(self.tmp)
        self.strides = [ffn_stride(self.ffn_dtype, config.d_model, config.glu, dd)
                        for dd in self.downs]                        # per layer
        self.stride = max(self.strides)                              # the widest layer's
        self.down_dtype = self.downs[self.strides.index(self.stride)]
        self.layer_bytes = align_up(config.ffn_slots * self.stride, FFN_ALIGN)
        regions = [align_up(config.ffn_slots * s, FFN_ALIGN) for s in self.strides]
        self.offsets = [FFN_ALIGN + sum(regions[:i]) for i in range(config.n_layers)]
        self.ffn_bytes = FFN_ALIGN + sum(regions)
        self._ffn = None
        self._down = None              # down.bin, opened by the first add_ffn_layer with down_rows
        self.down_rows: list[dict] = []  # its per-layer entries
        self._rows = (0, 0)            # (slots written, crc32 so far) of the layer being written
        try:
            if not self.out.parent.exists():
                self.out.parent.mkdir(parents=True)              # like mkdir -p
            sweep_leftovers(self.out)
            if self.tmp.exists():
                shutil.rmtree(self.tmp)
            self.tmp.mkdir()
            self._dense = open(self.tmp / DENSE_FILE, "wb")
            self._dense.write(bytes(DENSE_ALIGN))          # header, patched when the section closes
        except OSError as e:
            self.abort()
            raise FormatError(f"cannot write the flash model to {self.out}: {why(e)}") from None
        self.state = WriterState.OPEN

    def __enter__(self) -> "FlashWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()
        elif self.state is not WriterState.FINISHED:
            self.abort()
            raise FormatError(f"{self.out}: writer closed before finish()")

    # ---- dense section --------------------------------------------------------------------

    def add_tensor(self, name: str, x: np.ndarray | QTensor, origin: dict | None = None) -> None:
        """Append a dense tensor: x (n,) or (rows, cols) f32, stored per layout.tensor_dtype, or
        a QTensor stored as it is; origin (how the source stored it) goes into the manifest."""
        if isinstance(x, QTensor):
            self.add_tensor_rows(name, (x.rows, x.cols), [x.data], x.dtype, origin)
        else:
            if x.ndim not in (1, 2) or 0 in x.shape:
                raise FormatError(f"tensor {name} has shape {x.shape}: only 1-D and 2-D tensors "
                                  "are stored")
            self.add_tensor_rows(name, x.shape, [x], None, origin)

    def add_tensor_rows(self, name: str, shape: tuple, blocks, dtype: str | None = None,
                        origin: dict | None = None) -> None:
        """Append a dense tensor of shape (n,) or (rows, cols) given as consecutive row blocks,
        each written as it comes: a block is f32 values ((rows, cols), quantized to dtype; a 1-D
        tensor is one block) or uint8 bytes already in dtype ((rows, row_bytes)). dtype None:
        layout.tensor_dtype of the conversion's."""
        self._require(WriterState.OPEN, WriterState.DENSE, what=f"add_tensor({name!r})")
        if ffn_weight(name):
            raise FormatError(f"{name} is an FFN weight: write it with add_ffn_layer")
        if any(t["name"] == name for t in self.tensors):
            raise FormatError(f"tensor {name} written twice")
        dt = dtype or tensor_dtype(self.dtype, tuple(shape), name)
        offset = align_up(self._dense.tell(), DENSE_ALIGN)
        self._io(self._dense, lambda f: f.write(bytes(offset - f.tell())))
        nbytes, crc = 0, 0
        for block in blocks:
            if block.dtype != np.uint8:
                block = np.ascontiguousarray(block, dtype=np.float32)    # (n,) or (rows, cols)
                block = block if dt == "f32" else quantize_rows(block, dt)   # (rows, row_bytes)
            self._io(self._dense, lambda f: f.write(block))
            nbytes, crc = nbytes + block.nbytes, crc32_array(block, crc)
        want = 4 * shape[0] if len(shape) == 1 else shape[0] * row_bytes(dt, shape[1])
        if nbytes != want:
            raise FormatError(f"tensor {name}: {nbytes} bytes given for {dt} {list(shape)} "
                              f"({want} bytes)")
        self.tensors.append({"name": name, "dtype": dt, "shape": [int(n) for n in shape],
                             "offset": offset, "nbytes": nbytes, "crc32": crc,
                             **({"origin": origin} if origin else {})})
        self.state = WriterState.DENSE

    def _close_dense(self) -> None:
        f = self._dense
        size = align_up(f.tell(), DENSE_ALIGN)
        header = DENSE_HEADER.pack(DENSE_MAGIC, self.version, DENSE_ALIGN, len(self.tensors), size)

        def finish(f) -> None:
            f.write(bytes(size - f.tell()))
            f.seek(0)
            f.write(header)
            sync_close(f)
        self._io(f, finish)
        self.dense_bytes = size

    # ---- FFN section ----------------------------------------------------------------------

    def add_ffn_layer(self, layer: int, gate: np.ndarray | None, up: np.ndarray, down: np.ndarray,
                      order: np.ndarray | None = None, origin: dict | None = None,
                      down_rows: QTensor | None = None) -> None:
        """Write layer `layer`'s bundles: gate, up (n_ff, d_model), down (d_model, n_ff) f32; gate is
        None for non-GLU models. Any part may instead be a QTensor already in its bundle dtype
        (its bytes are copied; down's rows are the columns, (n_ff, d_model)). order (n_ff) int, a
        permutation: bundle slot j holds neuron order[j] (None: slot j holds neuron j). origin
        (how each part was made) goes into the manifest. down_rows: the down matrix (d_model,
        n_ff) as the source stores it, written to down.bin as it is (every layer or none)."""
        if down_rows is None and self.down_rows:
            raise FormatError(f"FFN layer {layer}: down rows are given for every layer or none")
        self.add_ffn_rows(layer, gate, up, down, order, origin)
        if self._rows[0]:
            raise FormatError(f"FFN layer {layer}: {self._rows[0]} of {self.cfg.ffn_slots} slots "
                              f"given to add_ffn_layer (a mixture of experts: add_ffn_rows)")
        if down_rows is not None:
            self.add_down_rows(layer, down_rows)

    def add_down_rows(self, layer: int, w: QTensor) -> None:
        """Append layer `layer`'s down matrix w (d_model, n_ff) to down.bin as it is, page-aligned,
        once the layer's bundles are complete (every layer or none)."""
        if len(self.down_rows) != layer or len(self.layers) != layer + 1:
            raise FormatError(f"FFN layer {layer}: down rows are given for every layer or none, "
                              "each after its layer's bundles")
        if (w.rows, w.cols) != (self.cfg.d_model, self.cfg.n_ff):
            raise FormatError(f"blk.{layer}.ffn_down.weight rows have shape {(w.rows, w.cols)}, "
                              f"expected {(self.cfg.d_model, self.cfg.n_ff)}")
        if self._down is None:
            try:
                self._down = open(self.tmp / DOWN_FILE, "wb")
            except OSError as e:
                raise FormatError(f"cannot write {self.tmp / DOWN_FILE}: {why(e)}") from None
        offset = align_up(self._down.tell(), DOWN_ALIGN)
        self._io(self._down, lambda f: (f.write(bytes(offset - f.tell())), f.write(w.data)))
        self.down_rows.append({"offset": offset, "nbytes": w.data.nbytes, "dtype": w.dtype,
                               "shape": [w.rows, w.cols], "crc32": crc32_array(w.data)})

    def add_ffn_rows(self, layer: int, gate: np.ndarray | None, up: np.ndarray, down: np.ndarray,
                     order: np.ndarray | None = None, origin: dict | None = None) -> None:
        """Append the next slots of layer `layer`: gate, up (n, d_model), down (d_model, n) as
        add_ffn_layer takes them. A mixture of experts writes each expert (then the shared one)
        in turn; the layer is complete at cfg.ffn_slots slots, and the next layer starts."""
        self._require(WriterState.DENSE, WriterState.FFN, what=f"add_ffn_rows({layer})")
        if layer != len(self.layers):
            raise FormatError(f"FFN layer {layer} written out of order (expected layer {len(self.layers)})")
        if self.expert_rows:
            raise FormatError(f"FFN layer {layer}: this folder's experts are rows (add_expert_rows)")
        bundles = self._bundles(layer, gate, up, down, order,
                                self.cfg.ffn_slots - self._rows[0])            # (n, stride)
        self._append(layer, bundles, order, origin)

    def add_expert_rows(self, layer: int, gate: QTensor, up: QTensor, down: QTensor,
                        origin: dict | None = None) -> None:
        """Append the next expert of layer `layer` (each routed expert, then the shared one) as
        its rows (EXPERT_ROWS): gate, up (n, d_model) in the FFN dtype, down (d_model, n) in the
        layer's down dtype, their bytes back to back in n slots (zero padding at the end)."""
        self._require(WriterState.DENSE, WriterState.FFN, what=f"add_expert_rows({layer})")
        if not self.expert_rows:
            raise FormatError(f"FFN layer {layer}: this folder's experts are bundles (add_ffn_rows)")
        dd = self.downs[min(layer, len(self.downs) - 1)]
        slots = expert_slots(layer, gate, up, down, self.cfg.d_model, (self.ffn_dtype, dd),
                             self.strides[layer], self.cfg.ffn_slots - self._rows[0])  # (n, stride)
        self._append(layer, slots, None, origin)

    def _append(self, layer: int, bundles: np.ndarray, order, origin: dict | None) -> None:
        """Write the next slots (n, stride) of layer `layer`; complete at cfg.ffn_slots slots."""
        if layer != len(self.layers):
            raise FormatError(f"FFN layer {layer} written out of order (expected layer {len(self.layers)})")
        if self.state is WriterState.DENSE:
            self._close_dense()
            self._open_ffn()
        done, crc = self._rows
        offset, stride = self.offsets[layer], self.strides[layer]
        self._io(self._ffn, lambda f: (f.seek(offset + done * stride), f.write(bundles)))
        done, crc = done + len(bundles), zlib.crc32(memoryview(bundles).cast("B"), crc)
        self._rows = (done, crc)
        self.state = WriterState.FFN
        if done == self.cfg.ffn_slots:
            pad = align_up(done * stride, FFN_ALIGN) - done * stride
            self._io(self._ffn, lambda f: f.write(bytes(pad)))
            own = {} if self._uniform() else {"stride": stride, "down_dtype": self.downs[layer]}
            self.layers.append({"offset": offset, "nbytes": done * stride, "crc32": crc, **own,
                                **({"origin": origin} if origin else {})})
            self.orders.append(order)
            self._rows = (0, 0)

    def _bundles(self, layer: int, gate, up, down, order, room: int) -> np.ndarray:
        n_ff, d = up.rows if isinstance(up, QTensor) else len(up), self.cfg.d_model
        if n_ff > room or (order is not None and n_ff != self.cfg.ffn_slots):
            raise FormatError(f"layer {layer}: {n_ff} FFN slots given, {room} left to write"
                              + (" (a neuron order needs the whole layer)" if order is not None else ""))
        if (gate is not None) != self.cfg.glu:
            raise FormatError(f"layer {layer}: gate {'missing' if self.cfg.glu else 'given'} "
                              f"for a {'GLU' if self.cfg.glu else 'non-GLU'} model")
        for part, w, shape in (("gate", gate, (n_ff, d)), ("up", up, (n_ff, d)), ("down", down, (d, n_ff))):
            got = (w.cols, w.rows) if isinstance(w, QTensor) and part == "down" else \
                (w.rows, w.cols) if isinstance(w, QTensor) else None if w is None else w.shape
            if w is not None and got != shape:
                raise FormatError(f"blk.{layer}.ffn_{part}.weight has shape {got}, expected {shape}")
        if order is not None:
            order = np.asarray(order)                                  # (n_ff,)
            if order.shape != (n_ff,) or not np.array_equal(np.sort(order), np.arange(n_ff)):
                raise FormatError(f"layer {layer}: neuron order is not a permutation of 0..{n_ff - 1}")
        down_rows = down if isinstance(down, QTensor) else down.T       # (n_ff, d)
        rows = [gate, up, down_rows] if self.cfg.glu else [up, down_rows]
        bundles = np.zeros((n_ff, self.strides[layer]), dtype=np.uint8)  # (n_ff, stride)
        glu, at, dd = self.cfg.glu, 0, self.downs[layer]
        for w, dt, pb in zip(rows, ffn_part_dtypes(self.ffn_dtype, glu, dd),
                             ffn_part_bytes(self.ffn_dtype, d, glu, dd)):
            bundles[:, at:at + pb] = _part_rows(layer, w, dt, order)  # (n_ff, pb)
            at += pb
        return bundles

    def _open_ffn(self) -> None:
        n_layers = self.cfg.n_layers
        header = FFN_HEADER.pack(FFN_MAGIC, self.version, FFN_ALIGN, DTYPE_CODES[self.ffn_dtype],
                                 int(self.cfg.glu), n_layers, self.cfg.d_model, self.cfg.ffn_slots,
                                 row_bytes(self.ffn_dtype, self.cfg.d_model), self.stride,
                                 self.layer_bytes, self.ffn_bytes)
        try:
            self._ffn = open(self.tmp / FFN_FILE, "wb")
        except OSError as e:
            raise FormatError(f"cannot write {self.tmp / FFN_FILE}: {why(e)}") from None
        self._io(self._ffn, lambda f: f.write(header + bytes(FFN_ALIGN - len(header))))

    # ---- tokenizer, manifest, install -------------------------------------------------------

    def set_tokenizer(self, tokenizer_json: str | object | None, chat_template: str | None,
                      merges: str | None = None) -> None:
        """tokenizer_json: the text, or an object whose write(put) streams it to put(bytes), written
        now (gguf_vocab.GGUFVocab: never held as one text); merges: the form of the JSON's BPE
        merges (layout.MERGES_FORMS), or None."""
        self._require(WriterState.OPEN, WriterState.DENSE, WriterState.FFN, what="set_tokenizer")
        self.tokenizer.set(tokenizer_json, chat_template, merges)

    def finish(self) -> Path:
        """Write the remaining files and the manifest, then rename the folder into place."""
        self._require(WriterState.FFN, what="finish")
        if len(self.layers) != self.cfg.n_layers or self._rows[0]:
            raise FormatError(f"finish() after {len(self.layers)} of {self.cfg.n_layers} FFN layers")
        shapes = {t["name"]: tuple(t["shape"]) for t in self.tensors}
        for name, shape in required_tensors(self.cfg).items():
            if shapes.get(name) != shape:
                raise FormatError(f"finish() without tensor {name} of shape {shape} "
                                  f"(written: {shapes.get(name)})")
        if self.down_rows and len(self.down_rows) != self.cfg.n_layers:
            raise FormatError(f"finish() with down rows of {len(self.down_rows)} of "
                              f"{self.cfg.n_layers} layers")
        self._io(self._ffn, sync_close)
        files = {"tokenizer": self.tokenizer.entry(),
                 "order": write_order(self.tmp, self.orders, self.cfg.ffn_slots),
                 "down_rows": self._close_down()}
        write_file(self.tmp, MANIFEST_FILE,
                   (json.dumps(self._manifest(files), indent=1) + "\n").encode())
        self._install()
        self.state = WriterState.FINISHED
        return self.out

    def _close_down(self) -> dict | None:
        """down.bin padded to a page and closed; its manifest section (None: not written)."""
        if self._down is None:
            return None
        size = align_up(self._down.tell(), DOWN_ALIGN)
        self._io(self._down, lambda f: (f.write(bytes(size - f.tell())), sync_close(f)))
        return {"file": DOWN_FILE, "nbytes": size, "layers": self.down_rows}

    def _manifest(self, files: dict) -> dict:
        cfg, pb = self.cfg, row_bytes(self.ffn_dtype, self.cfg.d_model)
        ffn = {"file": FFN_FILE, "nbytes": self.ffn_bytes,
               "header_bytes": FFN_ALIGN, "alignment": FFN_ALIGN, "dtype": self.ffn_dtype,
               "down_dtype": self.down_dtype, "glu": cfg.glu,
               "parts": list(ffn_parts(cfg.glu)), "d_model": cfg.d_model, "n_ff": cfg.ffn_slots,
               "n_layers": cfg.n_layers, "part_bytes": pb, "stride": self.stride,
               "layer_bytes": self.layer_bytes, "layers": self.layers, "neuron_order": files["order"],
               **({"experts": EXPERT_ROWS} if self.expert_rows else {})}
        dense = {"file": DENSE_FILE, "nbytes": self.dense_bytes, "header_bytes": DENSE_ALIGN,
                 "alignment": DENSE_ALIGN, "compression": None, "tensors": self.tensors}
        down = {"down_rows": files["down_rows"]} if files["down_rows"] else {}
        return {"magic": MAGIC, "format_version": self.version, "created_by": f"flashllm {__version__}",
                "source": self.source, "config": cfg.to_dict(), "dtype": self.dtype, "dense": dense,
                "ffn": ffn, **down, "tokenizer": files["tokenizer"], "sparsity": {}, "predictor": {}}

    def _install(self) -> None:
        try:
            fsync_dir(self.tmp)
            install(self.tmp, self.out, self.force)
        except OSError as e:
            raise FormatError(f"cannot move the flash model into {self.out}: {why(e)}") from None

    # ---- helpers ----------------------------------------------------------------------------

    def _uniform(self) -> bool:
        """Every layer has one stride and down dtype: the manifest's, and no per-layer fields."""
        return len(set(self.downs)) == 1

    def abort(self) -> None:
        """Close the files and remove the temporary folder (safe to call more than once)."""
        for f in (getattr(self, "_dense", None), self._ffn, getattr(self, "_down", None)):
            if f is not None and not f.closed:
                f.close()
        shutil.rmtree(self.tmp, ignore_errors=True)
        self.state = WriterState.ABORTED

    def _require(self, *states: WriterState, what: str) -> None:
        if self.state not in states:
            raise FormatError(f"{what} in writer state {self.state.value} "
                              f"(allowed in: {', '.join(s.value for s in states)})")

    def _io(self, f, action) -> None:
        """Run action(f), turning an OSError into a FormatError that names the file."""
        try:
            action(f)
        except OSError as e:
            raise FormatError(f"cannot write {f.name}: {why(e)}") from None


def _part_rows(layer: int, w, dtype: str, order) -> np.ndarray:
    """One bundle part of every slot, (n_ff, row_bytes) uint8: a QTensor's rows as stored (its
    dtype must be the part's), anything else quantized to dtype."""
    if isinstance(w, QTensor):
        if w.dtype != dtype:
            raise FormatError(f"layer {layer}: a {w.dtype} FFN part cannot be stored as {dtype}")
        return w.data if order is None else w.data[order]
    if dtype not in QUANTIZABLE:
        raise FormatError(f"layer {layer}: {dtype} FFN rows are copied from a GGUF's blocks, "
                          "not quantized from floats")
    return quantize_rows(np.ascontiguousarray(w if order is None else w[order], np.float32), dtype)
