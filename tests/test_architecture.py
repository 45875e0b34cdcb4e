"""The package's shape, checked: one installed package `linrec`, modules that import each other in one
direction (no cycles; each layer only below itself), and imports at the top of modules.

The layers, bottom up (docs/backends.md, "Package layout"):
    dsl        the language: grammar, parser, syntax tree, errors
    compiler   names, shapes, IR, transitions, decomposition, analyses both backends need
    support    what backends and driver share: interface (what a backend is), arrays (call checks),
               templating (jinja, user text in comments), version
    numpy      the NumPy backend
    c          the C backend (its scans and attention kernels run behind NumPy glue: it may use linrec.numpy)
    driver     the API, the command line, verify, bench, decode, the choice of form, the backend registry
    torch      linrec.torch, the optional PyTorch layer (tensors, a module, a custom op) on top of the driver:
               the only modules that import torch, which nothing below imports
"""
from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

import linrec

SUPPORT = {"linrec.interface", "linrec.arrays", "linrec.templating", "linrec.version"}
ALLOWED = {  # layer → the layers its modules may import
    "dsl": {"dsl"},
    "compiler": {"compiler", "dsl"},
    "support": {"support", "compiler", "dsl"},
    "numpy": {"numpy", "support", "compiler", "dsl"},
    "c": {"c", "numpy", "support", "compiler", "dsl"},
    "driver": {"driver", "c", "numpy", "support", "compiler", "dsl"},
    "torch": {"torch", "driver", "c", "numpy", "support", "compiler", "dsl"},
}


def layer(module: str) -> str:
    parts = module.split(".")
    if len(parts) > 1 and parts[1] in ("dsl", "compiler", "numpy", "c", "torch"):
        return parts[1]
    return "support" if module in SUPPORT else "driver"


def package_modules() -> dict[str, Path]:
    """Every module of the installed package, by dotted name → its file."""
    out = {}
    for package in ("linrec", "linrec.dsl", "linrec.compiler"):
        spec = importlib.util.find_spec(package)
        root = Path(spec.origin).parent
        for path in root.rglob("*.py"):
            parts = [p for p in path.relative_to(root).with_suffix("").parts if p != "__init__"]
            if package == "linrec" and parts and parts[0] in ("dsl", "compiler"):
                continue  # (installed inside linrec/: listed under their own package)
            out[".".join([package, *parts])] = path
    return out


def imports(module: str, path: Path, modules: dict[str, Path]) -> list[tuple[str, int, bool]]:
    """(imported linrec module, line, at the module's top level) for every import statement of the file."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    top = {id(node) for node in tree.body}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            names = [f"{target}.{a.name}" for a in node.names]
            targets = [n if n in modules else target for n in names]
        elif isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        else:
            continue
        for t in targets:
            if t.split(".")[0] == "linrec" and t in modules and t != module:
                found.append((t, node.lineno, id(node) in top))
    return found


def graph() -> dict[str, set[str]]:
    modules = package_modules()
    return {m: {t for t, _, _ in imports(m, p, modules)} for m, p in modules.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), or a module importing itself."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in edges.get(v, ()):
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_the_cycle_finder_finds_cycles():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"a"}}) == [["a"]]
    assert cycles({"a": {"b"}, "b": set(), "c": {"a", "b"}}) == []


def test_no_import_cycles():
    edges = graph()
    assert len(edges) > 40  # (the whole package was read)
    assert cycles(edges) == []


def test_each_layer_imports_only_itself_and_below():
    edges = graph()
    wrong = sorted(f"{m} ({layer(m)}) imports {t} ({layer(t)})" for m, ts in edges.items() for t in ts
                   if layer(t) not in ALLOWED[layer(m)])
    assert wrong == []


# the one deferred linrec import: the command's entry point imports the command line inside a try, so that a
# Ctrl-C while NumPy, lark, jinja2 and the compiler import is caught (tests/test_cli.py checks it)
DEFERRED = {("linrec.command", "linrec.cli")}


def test_linrec_modules_are_imported_at_the_top():
    """Imports inside functions hide dependencies (and cycles); optional dependencies (matplotlib,
    threadpoolctl) may still be deferred, which this test does not look at."""
    modules = package_modules()
    late = sorted(f"{m}:{line} imports {t}" for m, p in modules.items() for t, line, top in imports(m, p, modules)
                  if not top and (m, t) not in DEFERRED)
    assert late == []
    assert all(t in graph()[m] for m, t in DEFERRED)  # (each exception is still there)


def test_one_installed_package():
    """The distribution installs `linrec` and none of the source folders' generic names (read from the
    environment's own site-packages: a source tree on sys.path may hold an egg-info of its own)."""
    site = Path(sysconfig.get_paths()["purelib"])
    assert not [name for name in ("dsl", "compiler", "backends") if (site / name).exists()]
    installed = list(importlib.metadata.distributions(name="linrec", path=[str(site)]))
    assert len(installed) == 1
    top = {f.parts[0] for f in installed[0].files or []}
    assert not top & {"dsl", "compiler", "backends"}
    assert linrec.__version__ == installed[0].version


def test_only_linrec_torch_imports_torch():
    """PyTorch is an optional extra: `import linrec` (and every module but linrec.torch's) must work without it,
    so none of them may import it, even late (read from the sources), and importing linrec loads no torch."""
    modules = package_modules()
    importing = sorted(m for m, p in modules.items() if layer(m) != "torch" and _imports_torch(p))
    assert importing == []
    assert any(layer(m) == "torch" and _imports_torch(p) for m, p in modules.items())  # (the reading works)
    run = subprocess.run([sys.executable, "-c", "import sys, linrec, linrec.cli, linrec.decode, linrec.verify; "
                          "print('torch' in sys.modules)"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "False"


HEAVY = ("numpy", "lark", "jinja2", "cffi", "linrec.api", "linrec.cli", "linrec.dsl", "linrec.compiler")


def test_importing_linrec_imports_nothing_heavy():
    """`import linrec` imports its names and submodules when first used (PEP 562), so that linrec.command, the
    command's entry point, runs before NumPy, lark, jinja2 and the compiler import, and catches a Ctrl-C while
    they do (it printed a KeyboardInterrupt traceback); importing the entry point imports nothing heavy either."""
    run = subprocess.run([sys.executable, "-c", "import sys, linrec, linrec.command; print(*sys.modules)"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    loaded = run.stdout.split()
    assert "linrec.command" in loaded  # (the listing works)
    assert sorted(m for m in loaded if m in HEAVY or m.split(".")[0] in HEAVY) == []


def test_linrec_names_and_submodules_resolve_on_first_use():
    run = subprocess.run([sys.executable, "-c", "import linrec; print(linrec.decode.__name__, linrec.api.__name__)"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["linrec.decode", "linrec.api"]
    import linrec.api
    import linrec.arrays
    import linrec.dsl.errors
    from linrec import machine  # (a submodule, through the package's __getattr__)
    assert machine is sys.modules["linrec.machine"] and linrec.bench is sys.modules["linrec.bench"]
    assert (linrec.load, linrec.compile, linrec.Recurrence, linrec.Result) == (
        linrec.api.load, linrec.api.compile, linrec.api.Recurrence, linrec.api.Result)
    assert (linrec.from_bfloat16, linrec.to_bfloat16) == (linrec.arrays.from_bfloat16, linrec.arrays.to_bfloat16)
    assert linrec.LinrecError is linrec.dsl.errors.LinrecError
    assert linrec.RuntimeInputError is linrec.dsl.errors.RuntimeInputError
    assert linrec.__version__ == linrec.version.VERSION
    namespace: dict = {}
    exec("from linrec import *", namespace)
    assert sorted(n for n in namespace if n != "__builtins__") == sorted(linrec.__all__)
    assert set(linrec.__all__) <= set(dir(linrec))
    assert not hasattr(linrec, "no_such_name")
    with pytest.raises(AttributeError, match="no attribute 'no_such_name'"):
        linrec.no_such_name  # noqa: B018


def _imports_torch(path: Path) -> bool:
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import) and any(a.name.split(".")[0] == "torch" for a in node.names):
            return True
        if isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] == "torch":
            return True
    return False


@pytest.mark.parametrize("argv", [["-m", "linrec", "--version"], ["-m", "linrec", "check", "--help"]])
def test_python_dash_m_linrec_is_the_command(argv, tmp_path):
    run = subprocess.run([sys.executable, *argv], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert (linrec.__version__ in run.stdout) if "--version" in argv else ("usage: linrec check" in run.stdout)
