"""A run's resident memory stays within its --dram-budget, and a budget that holds the whole FFN
computes as a run with no budget.

The peak RSS of `flashllm run` (the kernel's own count of the child process, anonymous and
file-backed pages) against the budget, on the real 1.5B native conversion, whose resident
attention is repacked on load (AVX-512 VNNI): the read copies the packed ones replace once stayed
on the heap, 80 MiB that no plan counted (1220 MiB at --dram-budget 1200MiB). At 1200 MiB the
plan caches every neuron, and the FFN runs as llama.cpp's row products over the GGUF's own rows
(runtime/assemble.py holds_ffn_rows): the text of a run without a budget, token for token. At
560 MiB (head streamed) a pass of several tokens gives each the logits of feeding it alone. And
the process the plan measures holds no module a run never uses."""
import subprocess
import sys

import pytest

from conftest import _converted
from test_chat import tiny  # noqa: F401  (the tiny converted model fixture)

MiB = 1 << 20
PEAK = """
import resource, subprocess, sys
r = subprocess.run(sys.argv[1:], check=True, capture_output=True, text=True)
print(r.stdout + "\\x00" + r.stderr + "\\x00" + str(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss))
"""


def run(*args) -> tuple[str, str, int]:
    """(stdout, stderr, peak RSS bytes) of `flashllm run` on the 1.5B native, greedy, 8 tokens."""
    model = _converted("qwen2.5-coder-1.5b", "native", log=lambda m: print(m, file=sys.stderr))
    cli = [sys.executable, "-c", "from flashllm.cli.app import main; main()", "run", str(model),
           "-p", "def fib(n):", "-n", "8", "--temp", "0", *args]
    out = subprocess.run([sys.executable, "-c", PEAK, *cli], capture_output=True, text=True,
                         check=True).stdout
    text, err, peak_kib = out.rsplit("\x00", 2)
    return text, err, int(peak_kib) * 1024                               # ru_maxrss: KiB on Linux


@pytest.mark.realmodel
@pytest.mark.parametrize("budget, ffn", [(560, "sparse"), (1200, "dense")])
def test_peak_rss_within_the_budget(budget, ffn):
    text, err, peak = run("--dram-budget", f"{budget}MiB", "--stats")
    assert peak <= budget * MiB, f"peak {peak >> 20} MiB over {budget} MiB"
    assert f"flash FFN ({ffn}): DRAM budget {budget} MiB" in err
    if ffn == "dense":
        assert "every neuron in DRAM: no FFN reads" in err
        assert text == run()[0]                                          # as with no budget


@pytest.mark.realmodel
def test_self_drafting_keeps_the_caches_when_the_budget_holds_the_whole_ffn():
    """--draft-kind self drafts from the neuron caches: with a budget that holds every neuron the
    run keeps the caches' path (a DenseFfn has none) and completes. (Its text is not compared
    with the rows path's: the bundles' re-quantized down columns sum differently.)"""
    text, err, _ = run("--dram-budget", "1200MiB", "--draft", "2", "--draft-kind", "self",
                       "--stats")
    assert "flash FFN (sparse): DRAM budget 1200 MiB" in err
    assert "draft =" in err and text.strip()


@pytest.mark.realmodel
def test_a_pass_gives_each_token_its_own_logits_under_a_budget():
    """At 560 MiB the 1.5B's FFN and output head stream and its attention stays resident, packed
    as without a budget (runtime/assemble.py make_weights): a pass over 6 tokens gives each the
    logits that feeding it alone gives, bit for bit, so a greedy text with self-drafting does not
    depend on how many guesses each pass checked (it did when the attention stayed unpacked: the
    q4_k products of a multi-token tile round otherwise); nor do the siblings of a pass."""
    import numpy as np
    from flashllm.cli.app import cache_dir
    from flashllm.format.reader import open_flash
    from conftest import plan_run
    from flashllm.runtime.assemble import make_parts
    from flashllm.runtime.budget import parse_budget
    from flashllm.runtime.plan import FlashOptions
    from flashllm.runtime.model import Model
    path = _converted("qwen2.5-coder-1.5b", "native", log=lambda m: print(m, file=sys.stderr))
    opts = FlashOptions(dram_budget=parse_budget("560MiB"), draft_rows=16384)
    plan = plan_run(path, opts, 32, 100 * MiB)
    assert "output.weight" in plan.streamed
    flash = open_flash(path)
    ffn, weights, _ = make_parts(flash, opts, plan, None, 2, cache_dir(), log=lambda m: None)
    net = Model(flash, n_threads=2, n_ctx=32, ffn=ffn, weights=weights, kv_dtype="f16")
    try:
        ids = np.array([785, 1156, 315, 279, 1565, 374, 264, 26618, 8500, 30, 576, 4226, 374,
                        429, 432, 1035], np.int32)                                # (16,)
        net.forward(ids[:10], 0)
        alone = np.stack([net.forward(ids[j:j + 1], j)[0] for j in range(10, 16)])  # (6, vocab)
        together = net.forward(ids[10:16], 10)                                  # (6, vocab)
        np.testing.assert_array_equal(together, alone)
        # siblings (the runner-up of guesses 1 and 3) get the logits of feeding them alone there
        sibs = {3: 1000, 1: 2000}                          # chain index: token, last first
        rows = net.forward(np.r_[ids[10:16], list(sibs.values())], 10, siblings=list(sibs))
        np.testing.assert_array_equal(rows[:6], together)
        for s, (j, token) in enumerate(sibs.items()):      # slot 10 + j only: j = 1 after 3
            np.testing.assert_array_equal(rows[6 + s], net.forward(np.array([token]), 10 + j)[0])
    finally:
        ffn.close()


NEVER_RUN = ("pydantic", "zipfile", "multiprocessing")   # ~11 MiB a plan would count (session 25)
BEFORE_PLAN = f"""
import sys
from flashllm.cli import main
sys.argv = ["flashllm", "run", sys.argv[1], "-p", "hi", "-n", "1", "--dram-budget", "1MiB"]
try:
    main()
except SystemExit as e:
    print(e.code, [m for m in {NEVER_RUN!r} if m in sys.modules])
"""


def test_the_process_a_plan_measures_holds_no_module_a_run_never_uses(tiny):  # noqa: F811
    """The plan subtracts the process's resident bytes from the budget, so whatever is imported
    before it comes out of the neuron caches: typer 0.29 imported pydantic (9 MiB) at every
    command, and a models.toml pull's zipfile and a conversion's multiprocessing came along with
    the registry. A budget the plan refuses stops the run right after the measure."""
    out = subprocess.run([sys.executable, "-c", BEFORE_PLAN, str(tiny[0].path)],
                         capture_output=True, text=True, check=True).stdout
    assert out.split("\n")[-2] == "1 []", out
