"""The package's shape (docs/ARCHITECTURE.md): imports flow one way between layers, no module
imports another in a cycle (lazy imports inside functions count), no private name crosses a
module boundary, and the top level stays small. Read from the source with ast, nothing imported."""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "flashllm"

# Lower layers first; a module may import its own package and any package of a lower layer.
LAYERS = [
    {"errors", "units", "limits"},
    {"model"},
    {"ffi"},
    {"format", "storage", "sparsity"},
    {"runtime", "convert"},
    {"generation"},
    {"session"},
    {"serve"},
    {"cli"},
]
# What cli/ may import: the session layer (and through it the types it returns), the errors it
# prints, the units it reads sizes with, the bounded reads of what users hand it, the package's
# version; nothing else below it. serve/: a front end over the session layer, as cli/ is.
CLI_MAY_IMPORT = ("flashllm.cli", "flashllm.session", "flashllm.serve", "flashllm.errors",
                  "flashllm.units", "flashllm.limits")


def modules() -> dict[str, Path]:
    """Dotted name -> file of every module of the package."""
    out = {}
    for f in sorted(PACKAGE.rglob("*.py")):
        parts = list(f.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = f
    return out


def imports(name: str, file: Path, known: dict) -> list[tuple[str, list[str]]]:
    """(imported module, names taken from it) for every import statement, lazy ones included."""
    out = []
    pkg = name if file.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(file.read_text())):
        if isinstance(node, ast.Import):
            out += [(a.name, []) for a in node.names if a.name.startswith("flashllm")]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(pkg.split(".")[:len(pkg.split(".")) - node.level + 1] + ([base] if base else []))
            if not base.startswith("flashllm"):
                continue
            names = [a.name for a in node.names]
            subs = [f"{base}.{n}" for n in names if f"{base}.{n}" in known]
            out += [(s, []) for s in subs]
            rest = [n for n in names if f"{base}.{n}" not in known]
            if rest or not subs:
                out.append((base, rest))
    return out


def graph() -> dict[str, set[str]]:
    known = modules()
    return {m: {i for i, _ in imports(m, f, known) if i in known and i != m} for m, f in known.items()}


def layer(module: str) -> int:
    top = module.split(".")[1] if module.count(".") else ""
    for i, names in enumerate(LAYERS):
        if top in names:
            return i
    return len(LAYERS)          # flashllm, flashllm.__main__: the entry points


def find_cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """The import cycles a depth-first walk of g meets (each as its modules, first = last)."""
    state, cycles = {}, []

    def visit(m, path):
        state[m] = "open"
        for n in sorted(g[m]):
            if state.get(n) == "open":
                cycles.append(path[path.index(n):] + [n])
            elif n not in state:
                visit(n, path + [n])
        state[m] = "done"

    for m in sorted(g):
        if m not in state:
            visit(m, [m])
    return cycles


def test_the_cycle_finder_finds_one():
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
    assert find_cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle():
    assert find_cycles(graph()) == []


def test_imports_flow_down_the_layers():
    bad = [f"{m} -> {n}" for m, deps in graph().items() for n in deps
           if n.count(".") and m.count(".") and layer(n) > layer(m)]
    assert bad == []


def cli_imports_below_the_session(known: dict) -> list[str]:
    """Every import of a cli/ module (lazy ones included) of a flashllm module that is not in
    CLI_MAY_IMPORT (nor `from flashllm import __version__`)."""
    bad = []
    for m, f in known.items():
        if not m.startswith("flashllm.cli"):
            continue
        for src, names in imports(m, f, known):
            allowed = src.startswith(CLI_MAY_IMPORT) or (src == "flashllm" and names == ["__version__"])
            if not allowed:
                bad.append(f"{m} -> {src}" + (f" ({', '.join(names)})" if names else ""))
    return bad


def test_cli_imports_only_the_session_layer():
    assert cli_imports_below_the_session(modules()) == []


def test_the_cli_check_finds_an_import_around_the_session(tmp_path):
    """The check sees a top-level import, a lazy one and a relative one past the session."""
    cli = tmp_path / "flashllm" / "cli"
    cli.mkdir(parents=True)
    (cli / "x.py").write_text("from flashllm.session.run import assemble\n"
                              "from flashllm import __version__\n"
                              "from flashllm.runtime.budget import plan_budget\n"
                              "def f():\n    import flashllm.format.reader\n"
                              "    from ..units import MiB\n    from ..model import arch\n")
    known = {"flashllm.cli.x": cli / "x.py", "flashllm.model.arch": cli / "x.py"}
    assert cli_imports_below_the_session(known) == [
        "flashllm.cli.x -> flashllm.runtime.budget (plan_budget)",
        "flashllm.cli.x -> flashllm.format.reader", "flashllm.cli.x -> flashllm.model.arch"]


def test_no_private_name_crosses_a_module():
    known = modules()
    bad = [f"{m}: {n} from {src}" for m, f in known.items() for src, names in imports(m, f, known)
           for n in names if n.startswith("_") and not n.endswith("__") and src != m]
    assert bad == []


def test_the_top_level_is_small():
    top = [p.name for p in PACKAGE.iterdir() if p.suffix == ".py" or (p / "__init__.py").is_file()]
    assert len([t for t in top if t.endswith(".py")]) <= 6, top


def test_no_cycle_between_packages():
    top = lambda m: ".".join(m.split(".")[:2])                          # noqa: E731
    pkgs: dict[str, set[str]] = {}
    for m, deps in graph().items():
        pkgs.setdefault(top(m), set()).update(top(n) for n in deps if top(n) != top(m))
    for deps in list(pkgs.values()):
        for n in deps:
            pkgs.setdefault(n, set())
    assert find_cycles(pkgs) == []


def test_only_ffi_lib_loads_the_c_library():
    known = modules()
    loaders = sorted(m for m, f in known.items() for src, _ in imports(m, f, known)
                     if src == "flashllm.ffi._native")
    assert loaders == ["flashllm.ffi.lib"]


CFFI = {"cffi", "_cffi_backend", "flashllm.ffi._native", "flashllm.ffi.lib"}   # lib: its ffi / lib


def test_only_ffi_touches_cffi():
    """cffi, the compiled module and flashllm.ffi.lib (which hands out its ffi and lib) are
    imported by flashllm/ffi/ alone: every other layer calls C through ffi's bindings."""
    bad = []
    for m, f in modules().items():
        if m == "flashllm.ffi" or m.startswith("flashllm.ffi."):
            continue
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]
            else:
                continue
            bad += [f"{m} -> {n}" for n in names if n.split(".")[0] in CFFI or n in CFFI]
    assert bad == []


def test_runtime_and_generation_declare_what_they_ask():
    """No capability probing in runtime/ and generation/: no hasattr(), no getattr() with a
    default; an optional capability is declared (runtime/interfaces.py, speculate.Draft,
    sparsity.predictor.NeuronPredictor) and called."""
    bad = []
    for m, f in modules().items():
        if m.split(".")[1:2] not in (["runtime"], ["generation"]):
            continue
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and (
                    node.func.id == "hasattr" or node.func.id == "getattr" and len(node.args) > 2):
                bad.append(f"{m}:{node.lineno} {node.func.id}")
    assert bad == []
