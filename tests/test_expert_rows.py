"""format/expert_rows.py: an expert's slots are its gate, up and down bytes back to back, zero
padded (compared with numpy's concatenation of the parts), and a part of another shape or dtype,
an expert past the layer's slots or a down dtype a layout cannot hold is one FormatError naming
it."""
from __future__ import annotations

import numpy as np
import pytest

from flashllm.errors import FormatError
from flashllm.format.expert_rows import check_downs, expert_slots
from flashllm.model.tensor import QTensor, row_bytes
from tiny_sources import tiny_config

D, N = 64, 32                                      # d_model, an expert's neurons


def part(rows: int, cols: int, dtype: str, seed: int) -> QTensor:
    """Random bytes of a (rows, cols) matrix in dtype (the layout copies bytes, never reads them)."""
    data = np.random.default_rng(seed).integers(0, 256, (rows, row_bytes(dtype, cols)), np.uint8)
    return QTensor(data, dtype, rows, cols)


def test_an_expert_is_its_parts_back_to_back_then_zeros():
    gate, up, down = part(N, D, "q8_0", 1), part(N, D, "q8_0", 2), part(D, N, "q4_0", 3)
    stride = 3 * row_bytes("q8_0", D)                # a bundle's stride: more than the rows need
    slots = expert_slots(0, gate, up, down, D, ("q8_0", "q4_0"), stride, room=N)  # (N, stride)
    assert slots.shape == (N, stride) and slots.dtype == np.uint8
    want = np.concatenate([gate.data.ravel(), up.data.ravel(), down.data.ravel()])
    np.testing.assert_array_equal(slots.ravel()[:len(want)], want)
    assert not slots.ravel()[len(want):].any()


def test_a_wrong_part_or_too_many_slots_is_named():
    gate, up, down = part(N, D, "q8_0", 1), part(N, D, "q8_0", 2), part(D, N, "q4_0", 3)
    stride = 3 * row_bytes("q8_0", D)
    with pytest.raises(FormatError, match=r"layer 2: expert up rows are \(32, 64, 'f16'\)"):
        expert_slots(2, gate, part(N, D, "f16", 4), down, D, ("q8_0", "q4_0"), stride, N)
    with pytest.raises(FormatError, match="expert down rows are"):
        expert_slots(0, gate, up, part(N, D, "q4_0", 5), D, ("q8_0", "q4_0"), stride, N)
    with pytest.raises(FormatError, match="layer 1: 32 FFN slots given, 31 left to write"):
        expert_slots(1, gate, up, down, D, ("q8_0", "q4_0"), stride, room=N - 1)


def test_down_dtypes_each_layout_takes():
    dense = tiny_config()
    check_downs(dense, ["q8_0", "q6_k"], expert_rows=False)
    with pytest.raises(FormatError, match="a bundle's down column cannot be"):
        check_downs(dense, ["q2_k", "q8_0"], expert_rows=False)
    with pytest.raises(FormatError, match="expert rows need a mixture of experts"):
        check_downs(dense, ["q8_0", "q8_0"], expert_rows=True)
    moe = tiny_config(n_experts=4, n_experts_used=2, n_ff=96)
    check_downs(moe, ["q8_0", "f16"], expert_rows=True)               # 96 values: 3 blocks of 32
    with pytest.raises(FormatError, match=r"down rows of 96 values cannot be \['q4_k'\]"):
        check_downs(moe, ["q4_k", "q8_0"], expert_rows=True)          # 256-value superblocks
