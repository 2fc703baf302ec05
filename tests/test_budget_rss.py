"""A run's resident memory stays within its --dram-budget: the peak RSS of `flashllm run` (the
kernel's own count of the child process, anonymous and file-backed pages) against the budget, on
the real 1.5B native conversion, whose resident attention is repacked on load (AVX-512 VNNI): the
read copies the packed ones replace once stayed on the heap, 80 MiB that no plan counted (1220 MiB
at --dram-budget 1200MiB, where the plan keeps the whole model)."""
import resource
import subprocess
import sys

import pytest

from conftest import _converted

MiB = 1 << 20
PEAK = """
import resource, subprocess, sys
subprocess.run(sys.argv[1:], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
"""


@pytest.mark.realmodel
@pytest.mark.parametrize("budget", [560, 1200])
def test_peak_rss_within_the_budget(budget):
    model = _converted("qwen2.5-coder-1.5b", "native", log=lambda m: print(m, file=sys.stderr))
    cli = [sys.executable, "-c", "from flashllm.cli.app import main; main()"]
    run = cli + ["run", str(model), "-p", "def fib(n):", "-n", "8", "--temp", "0",
                 "--dram-budget", f"{budget}MiB"]
    out = subprocess.run([sys.executable, "-c", PEAK, *run], capture_output=True, text=True,
                         check=True)
    peak_kib = int(out.stdout.split()[-1])                               # ru_maxrss: KiB on Linux
    assert peak_kib * 1024 <= budget * MiB, f"peak {peak_kib >> 10} MiB over {budget} MiB"
