"""native/ is a stack of modules with no dependency circle.

A module is a name X with its files native/X.c and native/X.h (either may be missing: a
header-only module such as dtype.h, or a file such as ops.c whose whole offering is in the public
API). X.h is X's internal header: what X offers the modules above it. native/flashllm.h is the
public C API, not a module: any file may include it, and the functions it declares belong to the
modules whose .c defines them.

Module A depends on module B (A != B) when a file of A
  - includes "B.h", or
  - names a function that B.c defines with external linkage (a call, or a pointer in a table):
    a dependency even when the declaration came from flashllm.h.
The test fails on a circle in that graph and names it; and on an internal header that declares a
function its own .c does not define (a header offers its own module's functions only, so the
includes show the dependencies). The source is parsed, not compiled: function definitions are
those that start a line (this code base's style, checked here to find every header's functions).
"""
from __future__ import annotations

import re
from pathlib import Path

NATIVE = Path(__file__).resolve().parent.parent / "native"
API = "flashllm"
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)
DEF_START = re.compile(r"^(?!static\b|typedef\b|extern\b|#)(?:[A-Za-z_][\w \t*]*?[ \t*])?(\w+)\(",
                       re.M)
MACRO_DEF = re.compile(r"^FLI_\w+\((\w+)\)\s*[{;]", re.M)
IDENT = re.compile(r"\b[A-Za-z_]\w*\b")


def _code(text: str) -> str:
    """text without comments and string literals (identifiers in them are not uses)."""
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    text = re.sub(r"//[^\n]*", " ", text)
    return re.sub(r'"(?:\\.|[^"\\\n])*"', '""', text)


def _functions(code: str, body: bool) -> set[str]:
    """Names of the functions that start a line of code with external linkage: defined (body)
    or declared only (not body)."""
    names = set()
    for m in DEF_START.finditer(code):
        start = max(code.rfind(";", 0, m.start()), code.rfind("}", 0, m.start())) + 1
        specifiers = [ln for ln in code[start:m.start(1)].splitlines() if not ln.startswith("#")]
        if re.search(r"\bstatic\b", " ".join(specifiers)) or m.group(1).isupper():
            continue  # internal linkage (static on the line before), or a macro
        depth, i = 1, m.end()
        while depth and i < len(code):
            depth += {"(": 1, ")": -1}.get(code[i], 0)
            i += 1
        rest = code[i:].lstrip()
        if rest[:1] == ("{" if body else ";"):
            names.add(m.group(1))
    names |= {n for n, end in ((m.group(1), m.group(0)[-1]) for m in MACRO_DEF.finditer(code))
              if (end == "{") == body}
    return names


def module_graph(native: Path) -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """(edges, declared): module -> the modules it depends on; internal header's module -> the
    functions the header declares."""
    files = sorted(native.glob("*.c")) + sorted(native.glob("*.h"))
    code = {f: _code(f.read_text()) for f in files}
    defined = {}  # function -> module whose .c defines it
    for f in files:
        if f.suffix == ".c":
            for name in _functions(code[f], body=True):
                defined[name] = f.stem
    edges: dict[str, set[str]] = {f.stem: set() for f in files if f.stem != API}
    for f in files:
        if f.stem == API:
            continue
        for inc in INCLUDE.findall(f.read_text()):
            assert inc.endswith(".h") and (native / inc).exists(), f"{f.name} includes {inc}"
            if Path(inc).stem not in (API, f.stem):
                edges[f.stem].add(Path(inc).stem)
        for name in set(IDENT.findall(code[f])):
            if defined.get(name, f.stem) != f.stem:
                edges[f.stem].add(defined[name])
    declared = {f.stem: _functions(code[f], body=False) for f in files
                if f.suffix == ".h" and f.stem != API}
    return edges, declared


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One circle of the graph as [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(u: str) -> list[str] | None:
        state[u] = 1
        path.append(u)
        for v in sorted(edges.get(u, ())):
            if state.get(v) == 1:
                return path[path.index(v):] + [v]
            if v not in state and (c := visit(v)):
                return c
        state[u] = 2
        path.pop()
        return None

    for u in sorted(edges):
        if u not in state and (c := visit(u)):
            return c
    return None


def test_no_module_circle():
    edges, _ = module_graph(NATIVE)
    assert find_cycle(edges) is None, " -> ".join(find_cycle(edges))


def test_headers_offer_their_own_module():
    edges, declared = module_graph(NATIVE)
    for module, names in declared.items():
        c = NATIVE / f"{module}.c"
        own = _functions(_code(c.read_text()), body=True) if c.exists() else set()
        assert names <= own, f"{module}.h declares {sorted(names - own)}, not defined in {c.name}"


def test_finds_a_circle(tmp_path):
    """The graph sees both kinds of dependency: a.c calls b.c's function through flashllm.h,
    b.h includes a.h."""
    (tmp_path / "flashllm.h").write_text("int fl_b(void);\n")
    (tmp_path / "a.h").write_text("int fli_a(void);\n")
    (tmp_path / "a.c").write_text('#include "flashllm.h"\n#include "a.h"\n'
                                  "int fli_a(void) { return fl_b(); }\n")
    (tmp_path / "b.h").write_text('#include "a.h"\n')
    (tmp_path / "b.c").write_text('#include "flashllm.h"\nint\nfl_b(void) {\n    return 1;\n}\n')
    edges, declared = module_graph(tmp_path)
    assert edges == {"a": {"b"}, "b": {"a"}} and declared["a"] == {"fli_a"}
    assert find_cycle(edges) == ["a", "b", "a"]
