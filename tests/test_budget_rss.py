"""A run's resident memory stays within its --dram-budget, and a budget that holds the whole FFN
computes as a run with no budget.

The peak RSS of `flashllm run` (the kernel's own count of the child process, anonymous and
file-backed pages) against the budget, on the real 1.5B native conversion, whose resident
attention is repacked on load (AVX-512 VNNI): the read copies the packed ones replace once stayed
on the heap, 80 MiB that no plan counted (1220 MiB at --dram-budget 1200MiB). At 1200 MiB the
plan caches every neuron, and the FFN runs as llama.cpp's row products over the GGUF's own rows
(runtime/assemble.py holds_ffn_rows): the text of a run without a budget, token for token."""
import subprocess
import sys

import pytest

from conftest import _converted

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
