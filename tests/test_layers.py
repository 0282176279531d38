"""The torch-free folders import without torch, and no module imports itself
back (the layer order itself is import-linter's contract in pyproject.toml,
run by tools/test.sh)."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "numa_engram"
TORCH_FREE = ["bindings", "model", "host", "store", "groups", "checkpoints", "tables"]


def _modules(folder: str) -> list[str]:
    base = PACKAGE / folder if folder else PACKAGE
    names = sorted(p.stem for p in base.glob("*.py"))
    prefix = "numa_engram" + (f".{folder}" if folder else "")
    return [prefix if n == "__init__" else f"{prefix}.{n}" for n in names]


@pytest.mark.slow
@pytest.mark.parametrize("folder", TORCH_FREE + [""])
def test_the_torch_free_folders_import_without_torch(folder):
    modules = [m for m in _modules(folder) if not m.endswith("__main__")]
    code = ("import importlib, sys\n"
            f"for m in {modules!r}:\n"
            "    importlib.import_module(m)\n"
            "    assert 'torch' not in sys.modules, f'{m} imported torch'\n"
            "    assert 'triton' not in sys.modules, f'{m} imported triton'\n")
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", code], capture_output=True,
                         text=True)
    assert out.returncode == 0, out.stderr


def test_only_the_layered_paths_import():
    code = ("import importlib\n"
            "for old in ('numa_engram.group', 'numa_engram.table', 'numa_engram.native',\n"
            "            'numa_engram.sharing', 'numa_engram.sharing.table'):\n"
            "    try:\n"
            "        importlib.import_module(old)\n"
            "    except ModuleNotFoundError:\n"
            "        continue\n"
            "    raise AssertionError(old + ' still imports')\n"
            "import numa_engram.groups.group\n"
            "from numa_engram.lookup import aligned_empty\n"
            "from numa_engram.cli import main\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


def _import_graph() -> dict[str, set[str]]:
    """Every import of the package's modules, at module level or inside a
    function (a lazy import closes a circle as well), module -> modules."""
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges = graph.setdefault(name, set())
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = package.rsplit(".", node.level - 1)[0] if node.level else ""
                base = ".".join(p for p in (base, node.module or "") if p)
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                           for a in node.names]
            else:
                continue
            edges.update(t for t in targets if t in modules and t != name)
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_module_imports_itself_back():
    """No import circle, lazy imports included: the layer contract allows a
    circle inside one folder (lookup/prefetch picking its own subclasses,
    store/placement and store/deployment importing each other)."""
    graph = _import_graph()
    assert "numa_engram.lookup.cpuprefetch" in graph["numa_engram.lookup.prefetch"]
    assert _circles(graph) == []


def test_the_circle_check_finds_a_circle():
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
