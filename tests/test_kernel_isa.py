"""native/qdot.c, qgemm.c, act.c and attend.c built for each instruction set it has a path for (AVX-512 VNNI, AVX2 + AVX-VNNI,
AVX2 alone, plain C) and run through tests/native/qdot_isa.c, which checks every tile variant
against a double reference on the same quantized activations (see there). The extension itself
is built for this CPU only, so without this the other paths would go untested here. A build the
CPU cannot run is skipped."""
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ["tests/native/qdot_isa.c", "native/qdot.c", "native/qgemm.c", "native/act.c",
           "native/quant.c", "native/vec.c", "native/q4k.c", "native/qk.c", "native/q3k.c",
           "native/act_quant.c", "native/kquant.c", "native/kaxpy.c", "native/gemm_f32.c",
           "native/traits.c", "native/q0pack.c", "native/q4kpack.c", "native/q6kpack.c",
           "native/q5kpack.c", "native/q23pack.c", "native/q2k.c"]
ISAS = {
    "avx512vnni": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mavx2", "-mfma",
                   "-mf16c"],
    "avxvnni": ["-mavx2", "-mfma", "-mf16c", "-mavxvnni"],
    "avx2": ["-mavx2", "-mfma", "-mf16c"],
    "plain": ["-march=x86-64"],
}
CPU_FLAGS = {"avx512vnni": "avx512_vnni", "avxvnni": "avx_vnni", "avx2": "avx2", "plain": ""}


def _cpu_has(flag: str) -> bool:
    if not flag:
        return True
    info = Path("/proc/cpuinfo")
    return info.exists() and f" {flag}" in info.read_text()


def isa_compiler(isa: str) -> str:
    """The C compiler for building isa's code; skips the test where there is none, or where this
    CPU cannot run that code."""
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        pytest.skip("no C compiler")
    if not _cpu_has(CPU_FLAGS[isa]):
        pytest.skip(f"this CPU cannot run {isa} code")
    return cc


@pytest.mark.parametrize("isa", list(ISAS))
def test_qdot_tiles_on_every_instruction_set(isa, tmp_path):
    cc = isa_compiler(isa)
    exe = tmp_path / f"qdot_{isa}"
    subprocess.run([cc, "-O2", "-std=c11", "-Wall", "-Wextra", "-Werror", "-Inative", *ISAS[isa],
                    *SOURCES, "-lm", "-o", str(exe)], cwd=ROOT, check=True)
    run = subprocess.run([str(exe)], capture_output=True, text=True)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stdout


@pytest.mark.parametrize("isa", ["avx512vnni", "avx2", "plain"])
def test_attention_on_every_instruction_set(isa, tmp_path):
    """native/attend.c's register path (AVX-512, AVX2) and its per-row kernels (plain C, and an
    odd head_dim everywhere) against tests/native/attend_isa.c's rule of f16 attention."""
    cc = isa_compiler(isa)
    exe = tmp_path / f"attend_{isa}"
    sources = ["tests/native/attend_isa.c", "native/attend.c", *SOURCES[1:]]
    subprocess.run([cc, "-O2", "-std=c11", "-Wall", "-Wextra", "-Werror", "-Inative", *ISAS[isa],
                    *sources, "-lm", "-o", str(exe)], cwd=ROOT, check=True)
    run = subprocess.run([str(exe)], capture_output=True, text=True)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stdout

