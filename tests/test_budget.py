"""--dram-budget: parsing, the resident-byte plan, and the one-line refusals through the CLI."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from flashllm.runtime import budget, tokenizer_budget as tb
from flashllm.format.manifest import read_manifest
from flashllm.runtime.budget import BudgetError, PROCESS_STEP, parse_budget, plan_budget
from flashllm.format.reader import open_flash
from flashllm.format.layout import SKETCH_NAMES
from flashllm.cli import app
from flashllm.ffi import kernel
from flashllm.generation.tokenizer import Tokenizer
from flashllm.units import format_size
from test_chat import tiny  # noqa: F401  (the tiny converted model fixture)

MiB = 1 << 20


@pytest.mark.parametrize("text, want", [("1.5GiB", 3 << 29), ("560MiB", 560 * MiB),
                                        ("4096", 4096), ("50%", 500), ("12.5%", 125)])
def test_sizes_and_percentages_of_the_model(text, want):
    assert parse_budget(text).bytes_of(1000) == want


@pytest.mark.parametrize("text, message", [
    ("lots", "--dram-budget 'lots' is not a size (e.g. 1.5GiB, 560MiB) or a percentage of the "
             "model (e.g. 50%)"),
    ("150%", "--dram-budget '150%': a percentage must be in (0, 100]"),
    ("0%", "--dram-budget '0%': a percentage must be in (0, 100]"),
    ("nan%", "--dram-budget 'nan%': a percentage must be in (0, 100]"),
    *[(t, f"--dram-budget {t!r} is not a size (e.g. 1.5GiB, 560MiB) or a percentage of the "
          "model (e.g. 50%)") for t in ("", "  ", "nan", "NaNMiB", "-5MiB", "0", "inf")],
])
def test_unreadable_budgets_are_named(text, message):
    with pytest.raises(BudgetError) as e:
        parse_budget(text)
    assert str(e.value) == message


def dense_bytes(man: dict) -> dict:
    """Bytes of the dense tensors a plan weighs (the head's sketch only when it streams sparsely)."""
    return {t["name"]: t["nbytes"] for t in man["dense"]["tensors"]
            if t["name"] not in SKETCH_NAMES}


def test_dense_weights_then_caches_then_embeddings(tiny):  # noqa: F811
    man = read_manifest(tiny[0].path)
    f, c = man["ffn"], man["config"]
    nb = dense_bytes(man)
    kv = 2 * c["n_layers"] * 64 * c["n_kv_heads"] * c["head_dim"] * 2
    row = f["n_layers"] * (f["stride"] + 12)
    others = (kv + tb.TOKENIZER_KEPT * man["tokenizer"]["nbytes"] + tb.TOKENIZER_KEPT_FIXED
              + 3 * MiB + budget.WORK_FIXED
              + 16 * c["vocab_size"] + budget.RING_BUFFERS * f["n_ff"] * f["stride"]
              + 4 * f["n_ff"] * f["n_layers"])
    everything = others + sum(nb.values()) + f["n_ff"] * row
    plan = plan_budget(man, parse_budget(str(everything)), 64, 3 * MiB)
    assert (plan.streamed, plan.capacity) == ((), f["n_ff"])
    # one byte short: streaming the embeddings needs a 64-row buffer as large as this tiny table
    # (it buys nothing), so everything stays and the caches lose a row — and hold whole blocks
    # of the FFN kernel's sums (the text must not depend on the caches' size)
    plan = plan_budget(man, parse_budget(str(everything - 1)), 64, 3 * MiB)
    block = kernel.ffn_block()
    assert (plan.streamed, plan.capacity) == ((), (f["n_ff"] - 1) // block * block)
    assert plan.total <= plan.budget
    with pytest.raises(BudgetError, match="is below the"):
        plan_budget(man, parse_budget(str(others)), 64, 3 * MiB)


Q15 = Path(__file__).parent / "fixtures" / "qwen2.5-coder-1.5b-q4_0.manifest.json"


@pytest.mark.parametrize("cap, streams, kept", [
    ("560MiB", {"token_embd.weight", "output.weight"}, {"blk.27.attn_q.weight"}),
    ("280MiB", {"token_embd.weight", "output.weight"}, {"blk.27.attn_q.weight"}),
])
def test_qwen15_under_the_issue_caps(cap, streams, kept):
    """The 1.5B (q4_0: 125 MiB embeddings, 125 MiB head, 83 MiB attention) at ctx 512."""
    man = json.loads(Q15.read_text())
    plan = plan_budget(man, parse_budget(cap), 512, 40 * MiB, reader_stage=4 * MiB)
    assert streams <= set(plan.streamed) and not kept & set(plan.streamed)
    assert plan.total <= plan.budget and plan.capacity > 0
    nb = dense_bytes(man)
    assert plan.streamed_bytes == sum(nb[n] for n in plan.streamed if n != "token_embd.weight")


def test_an_uncalibrated_plan_says_what_calibrate_would_change():
    """Without calibrate's hot-first order the caches hold the first neurons, and where the head
    streams each token reads all of it (the sparse head needs calibrate's measurement): the
    plan's note says both; a calibrated folder gets none."""
    man = json.loads(Q15.read_text())
    man["ffn"].pop("neuron_order", None)
    plan = plan_budget(man, parse_budget("560MiB"), 512, 40 * MiB, reader_stage=4 * MiB)
    assert "output.weight" in plan.streamed and not plan.sparse_head
    assert plan.notes == ("not calibrated (run `flashllm calibrate` once): the caches hold the "
                          "first neurons, not the most active; each token reads the whole "
                          "output head, calibrate may let it read a sketch of it",)
    man["ffn"]["neuron_order"] = {"file": "order.bin"}
    assert plan_budget(man, parse_budget("560MiB"), 512, 40 * MiB, reader_stage=4 * MiB).notes == ()


def test_the_process_is_counted_in_whole_steps_so_a_plan_repeats():
    """The process's resident bytes move by a few hundred KiB from run to run; counted in whole
    PROCESS_STEPs they plan the same caches, so a run's --stats repeat too."""
    step = budget.PROCESS_STEP
    rss = budget.process_rss()
    assert rss % step == 0 and rss >= budget.process_rss(step=1) - step // 4 > 0
    man = json.loads(Q15.read_text())
    raw = [40 * MiB + 100 * 1024, 40 * MiB + 400 * 1024]                 # two runs' measures
    plans = [plan_budget(man, parse_budget("560MiB"), 512, -(-r // step) * step, reader_stage=4 * MiB)
             for r in raw]
    assert plans[0].capacity == plans[1].capacity


def test_a_head_that_fits_streams_when_the_caches_take_its_dram():
    """Tied 1.5B: with DRAM for every dense matrix and a few MiB over, the head (125 MiB a token)
    streams and the caches grow by what it frees less its two chunk buffers: a token reads the
    same bytes but for those buffers, and the head's compute overlaps its reads. Where the
    caches would then hold more than the whole FFN, it stays."""
    man = json.loads(Q15.read_text())
    man["dense"]["tensors"] = [t for t in man["dense"]["tensors"] if t["name"] != "output.weight"]
    head = dense_bytes(man)["token_embd.weight"]
    full = plan_budget(man, parse_budget("1TiB"), 512, 40 * MiB, reader_stage=4 * MiB)
    resident = full.total - full.cache_bytes
    plan = plan_budget(man, parse_budget(str(resident + 8 * MiB)), 512, 40 * MiB, reader_stage=4 * MiB)
    assert plan.streamed == ("token_embd.weight",) and plan.streamed_bytes == head
    chunks = plan.resident["stream buffers"]
    block_bytes = kernel.ffn_block() * plan.cache_bytes // plan.capacity   # caches: whole blocks
    assert plan.cache_bytes >= 8 * MiB + head - chunks - 2 * MiB - block_bytes
    assert plan.total <= plan.budget
    near = plan_budget(man, parse_budget(str(resident + full.cache_bytes - head // 2)), 512, 40 * MiB,
                       reader_stage=4 * MiB)
    assert near.streamed == () and near.capacity < full.capacity



OLMOE = Path(__file__).parent / "fixtures" / "olmoe-shape-q4_0.manifest.json"


@pytest.mark.parametrize("cap", ["1858MiB", "930MiB"])
def test_a_mixture_of_experts_keeps_its_head_over_expert_caches(cap):
    """OLMoE-1B-7B's shape (q4_0: 55 MiB head, 55 MiB embeddings, 144 MiB attention; 64 experts
    of 3.4 MiB a layer, top-8) under the MoE bench's caps (1/2, 1/4 of its GGUF). A cached
    expert byte saves 8/64 of a byte a token, the resident head a whole one: the head stays,
    only the embeddings (a row a token) stream, and the caches hold whole experts with less
    than one expert per layer of the budget idle."""
    man = json.loads(OLMOE.read_text())
    plan = plan_budget(man, parse_budget(cap), 128, 80 * MiB, reader_stage=4 * MiB)
    assert plan.streamed == ("token_embd.weight",) and plan.streamed_bytes == 0
    expert = man["config"]["n_ff"]
    assert plan.capacity > 0 and plan.capacity % expert == 0 and plan.total <= plan.budget
    assert plan.budget - plan.total < plan.n_layers * expert * (plan.stride + 12)
    full = plan.n_layers * plan.n_ff * (plan.stride + 12)
    reads = budget.ffn_reads(man, full, plan.cache_bytes)
    assert reads == pytest.approx((full - plan.cache_bytes) / 8, rel=1e-3)
    assert "experts per layer" not in plan.summary() and "expert caches" in plan.summary()


def test_ffn_reads_count_the_routed_share_and_the_shared_expert_in_full():
    """Dense: every missing byte. MoE (4 experts of 100 rows, top-1, a shared expert of 200
    rows, cached first): an expert byte missing costs 1/4, a shared one a whole byte."""
    dense = {"config": {}, "ffn": {"n_ff": 600}}
    assert [budget.ffn_reads(dense, 600, c) for c in (0, 250, 600, 700)] == [600, 350, 0, 0]
    moe = {"config": {"n_experts": 4, "n_experts_used": 1, "n_ff_shared": 200, "n_ff": 100},
           "ffn": {"n_ff": 600}}
    assert [budget.ffn_reads(moe, 600, c) for c in (600, 400, 200, 0)] == [0, 50, 100, 300]
    assert [budget._cache_rows(moe, r) for r in (150, 250, 399, 600)] == [150, 200, 300, 600]

def run(model, *args, rss=100 * MiB, monkeypatch=None):
    monkeypatch.setattr(budget, "process_rss", lambda: rss)
    return CliRunner().invoke(app, ["run", str(model), "-p", "hello there", "-n", "3", "--temp", "0",
                                    *args])


def test_refusals_through_the_cli(tiny, monkeypatch):  # noqa: F811
    model = tiny[0].path
    r = run(model, "--dram-budget", "50MiB", monkeypatch=monkeypatch)
    assert r.exit_code == 1
    assert r.output.strip() == (
        "error: --dram-budget 50MiB (50 MiB) cannot load the tokenizer: the process and the "
        "tokenizer peak at 101 MiB while the prompt is encoded (the least --dram-budget that works "
        "for this model and context: 119 MiB)")
    r = run(model, "--dram-budget", "110MiB", monkeypatch=monkeypatch)
    assert r.exit_code == 1
    assert r.output.strip() == (
        "error: --dram-budget 110MiB (110 MiB) is below the 119 MiB that must stay resident (KV "
        "cache 1 MiB, tokenizer 5 MiB, process 100 MiB, buffers 15 MiB, dense vectors 1 MiB, "
        "stream buffers 1 MiB); give at least 119 MiB, or a shorter context (--ctx-size, or the "
        "prompt + --n-predict) (the least --dram-budget that works for this model and context: "
        "119 MiB)")
    ok = run(model, "--dram-budget", "119MiB", monkeypatch=monkeypatch)
    assert ok.exit_code == 0, ok.output                                     # the least one works
    assert run(model, "--dram-budget", "118MiB", monkeypatch=monkeypatch).exit_code == 1
    r = run(model, "--dense", "--naive", monkeypatch=monkeypatch)
    assert r.exit_code == 1 and r.output.strip() == "error: give --dense or --naive, not both"
    n_ctx = len(Tokenizer.from_flash(open_flash(model)).encode("hello there")) + 3  # prompt + -n
    full = plan_budget(read_manifest(model), parse_budget("1GiB"), n_ctx, 100 * MiB, reader_stage=16 * 256 * 1024,
                       keep_tokenizer=True)          # a word-level vocabulary: no byte table
    short = str(full.total - 1)          # one byte short of every FFN bundle in DRAM
    r = run(model, "--dense", "--dram-budget", short, monkeypatch=monkeypatch)
    assert r.exit_code == 1 and r.output.strip() == (
        f"error: --dense needs {format_size(full.total, 'MiB', up=True)} (every FFN bundle in DRAM), --dram-budget "
        f"{short} gives {format_size(full.total - 1, 'MiB', up=False)}: drop --dense to stream the FFN "
        f"from flash")


@pytest.mark.parametrize("args", [["--dram-budget", "120MiB"], ["--naive"]])
def test_flash_runs_give_the_dense_tokens_and_a_stats_table(tiny, monkeypatch, args):  # noqa: F811
    model = tiny[0].path
    dense = run(model, "--no-timings", monkeypatch=monkeypatch)
    flash = run(model, "--no-timings", "--stats", *args, monkeypatch=monkeypatch)
    assert dense.exit_code == 0 and flash.exit_code == 0, flash.output
    assert flash.stdout.splitlines()[0] == dense.stdout.splitlines()[0]
    assert "tok    kind  MB read" in flash.output and " prefill " in flash.output


def test_stats_with_json_joins_the_timings_object(tiny, monkeypatch):  # noqa: F811
    import json
    r = run(tiny[0].path, "--dram-budget", "120MiB", "--stats", "--json", monkeypatch=monkeypatch)
    assert r.exit_code == 0, r.output
    data = json.loads(r.stderr.strip().splitlines()[-1])
    assert data["n_decode"] == len(data["flash"]["tokens"]) - 1       # + the prefill record
    summary = data["flash"]["summary"]
    assert summary["decode_tokens"] == data["n_decode"] and 0 <= summary["hit_rate"] <= 1
    assert "tok    kind" not in r.stderr                                # no text table with --json


def q15_with_predictor(tmp_path, nbytes: int, load: float) -> Path:
    """A model folder holding the 1.5B's manifest with a predictor section of nbytes and load."""
    man = json.loads(Q15.read_text())
    man["predictor"] = {"kind": "gate_up", "file": "predictor.bin", "nbytes": nbytes,
                        "bytes": nbytes, "load": [load] * 28}
    (tmp_path / "manifest.json").write_text(json.dumps(man))
    return tmp_path


@pytest.mark.parametrize("cap", ["560MiB", "2GiB", "8GiB"])
def test_auto_skips_a_predictor_that_cannot_pay(tmp_path, cap):
    """gate_up at q4_0 costs 2/3 of the FFN in DRAM: in a tight budget it displaces more cache
    than it saves reads; in a large one it touches more DRAM than the FFN it prunes."""
    from flashllm.runtime.plan import FlashOptions
    from conftest import plan_run
    path = q15_with_predictor(tmp_path, 434 * MiB, 0.5)
    plan = plan_run(path, FlashOptions(parse_budget(cap)), 512, 40 * MiB)
    assert not plan.predictor and any("not used" in n for n in plan.notes)
    if cap != "560MiB":       # forced, where it fits
        assert plan_run(path, FlashOptions(parse_budget(cap), predictor="on"), 512, 40 * MiB).predictor


@pytest.mark.parametrize("cap", ["560MiB", "1GiB", "1500MiB", "3GiB"])
def test_auto_skips_the_predictor_runs_measured_slower(tmp_path, cap):
    """The 0.5B's calibrated gate_up (1/3 of its q8_0 FFN, load 0.515) was slower than no
    predictor at every budget measured (1.2-2.3x: docs/history/2026-11-28-predictor-studies.md,
    "When a predictor pays"), though the read+touch rule without read-ahead, gather cost and
    margin took it; here at the same share of the 1.5B's FFN, from a budget that streams most of
    it to one that holds everything."""
    from flashllm.runtime.plan import FlashOptions
    from conftest import plan_run
    path = q15_with_predictor(tmp_path, 220 * MiB, 0.515)
    assert not plan_run(path, FlashOptions(parse_budget(cap)), 512, 40 * MiB).predictor


def test_auto_takes_a_cheap_predictor_and_on_off_are_obeyed(tmp_path):
    from flashllm.runtime.plan import FlashOptions
    from conftest import plan_run
    path = q15_with_predictor(tmp_path, 20 * MiB, 0.3)
    assert plan_run(path, FlashOptions(parse_budget("560MiB")), 512, 40 * MiB).predictor
    assert not plan_run(path, FlashOptions(parse_budget("560MiB"), predictor="off"), 512, 40 * MiB).predictor
    big = q15_with_predictor(tmp_path, 434 * MiB, 0.5)     # forced, it needs 542 MiB
    with pytest.raises(BudgetError, match="below"):
        plan_run(big, FlashOptions(parse_budget("500MiB"), predictor="on"), 512, 40 * MiB)
    with pytest.raises(BudgetError, match="expected one of auto, on, off"):
        plan_run(big, FlashOptions(parse_budget("560MiB"), predictor="maybe"), 512, 40 * MiB)


def test_run_refuses_an_unknown_predictor_mode_at_parse_time(tiny):  # noqa: F811
    r = CliRunner().invoke(app, ["run", str(tiny[0].path), "-p", "x", "--predictor", "maybe"])
    said = " ".join(r.output.replace("│", " ").split())                  # unwrap Rich's box
    assert r.exit_code == 2 and "'maybe' is not one of 'auto', 'on', 'off'" in said


def test_a_converted_folder_imports_no_converter(tiny):  # noqa: F811
    """A run under a budget measures its own size to plan: resolving a converted folder must not
    import the converters (gguf-py and the sources: ~12 MiB the plan would count as process and
    take from the neuron caches)."""
    import subprocess
    import sys
    heavy = ("gguf", "flashllm.convert.convert", "flashllm.convert.native")
    code = ("import sys; from flashllm.cli.app import model_path; model_path(sys.argv[1]); "
            f"print([m for m in {heavy!r} if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code, str(tiny[0].path)], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "[]", (out.stdout, out.stderr)


def _peak_of_run(path, budget: str) -> tuple[int, int, str]:
    """(exit code, peak resident KiB, stderr) of `flashllm run` under --dram-budget, the peak
    from the process's own getrusage, taken by a parent that runs nothing else."""
    import subprocess
    import sys
    code = ("import resource, subprocess, sys; r = subprocess.run(sys.argv[1:], capture_output=True,"
            " text=True); print(r.returncode, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss);"
            " print(r.stderr)")
    run_argv = [sys.executable, "-m", "flashllm", "run", str(path), "-p", "The sky is", "-n", "16",
                "--temp", "0", "--dram-budget", budget]
    out = subprocess.run([sys.executable, "-c", code, *run_argv], capture_output=True, text=True,
                         timeout=300).stdout
    head, _, stderr = out.partition("\n")
    rc, peak_kib = head.split()
    return int(rc), int(peak_kib), stderr


@pytest.mark.realmodel
@pytest.mark.parametrize("extra_mib", [2, 30, 100])   # 2: the process size varies by ~1 MiB
def test_a_run_stays_within_its_budget_smollm2(extra_mib):
    """The budget is a promise: just above the least budget a refusal names (it depends on this
    machine's process size) and further up, the run's peak resident memory stays below it."""
    import re
    from conftest import _converted
    path = _converted("smollm2-135m", "q8_0", log=lambda m: None)
    rc, _, stderr = _peak_of_run(path, "1MiB")
    least = re.search(r"least --dram-budget that works for this model and context: (\d+) MiB", stderr)
    assert rc == 1 and least, stderr
    mib = int(least.group(1)) + extra_mib
    assert mib - extra_mib < 160, stderr          # the process and the tokenizer: ~100 MiB
    rc, peak_kib, stderr = _peak_of_run(path, f"{mib}MiB")
    again = re.search(r"least --dram-budget that works for this model and context: (\d+) MiB", stderr)
    if rc == 1 and again:       # the process is counted in whole steps (budget.process_rss): it
        step = int(again.group(1)) - int(least.group(1))   # may measure one step more this time
        assert 0 < step * MiB <= PROCESS_STEP, stderr
        mib += step
        rc, peak_kib, stderr = _peak_of_run(path, f"{mib}MiB")
    assert rc == 0 and peak_kib <= mib * 1024, (rc, peak_kib / 1024, stderr)


@pytest.mark.realmodel
def test_a_first_run_under_a_budget_converts_apart(tmp_path):
    """`run NAME --dram-budget` on a fresh cache converts in a child process: the conversion
    (dequantized embeddings: several times the budget) never counts in the run's own peak."""
    import os
    import subprocess
    import sys
    from conftest import gguf_path
    (tmp_path / "models").mkdir()
    gguf = gguf_path("smollm2-135m")
    for f in (gguf, gguf.with_name(gguf.name + ".verified")):
        (tmp_path / "models" / f.name).symlink_to(f)
    # VmHWM, not getrusage: ru_maxrss keeps the peak of the image before exec (here pytest's)
    code = ("import atexit, re, runpy, sys; atexit.register(lambda: print('peak', re.search("
            "r'VmHWM:\\s+(\\d+)', open('/proc/self/status').read()).group(1), file=sys.stderr));"
            " sys.argv[0] = 'flashllm'; runpy.run_module('flashllm', run_name='__main__')")
    r = subprocess.run([sys.executable, "-c", code, "run", "smollm2-135m", "-p", "The sky is",
                        "-n", "8", "--temp", "0", "--dram-budget", "200MiB"], capture_output=True,
                       text=True, timeout=600, env={**os.environ, "FLASHLLM_CACHE": str(tmp_path)})
    peak_kib = int(r.stderr.split("peak ")[-1])
    assert r.returncode == 0 and "in a child process" in r.stderr, r.stderr
    assert len(list((tmp_path / "converted").glob("smollm2-135m-*/manifest.json"))) == 1
    assert peak_kib <= 200 * 1024, (peak_kib / 1024, r.stderr)
