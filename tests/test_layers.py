"""The package's folders are layers: the torch-free ones import without
torch, and no module imports a folder above its own."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "numa_engram"
# lowest first; a module may import its own folder and the ones before it
LAYERS = ["", "bindings", "model", "host", "store", "lookup", "sharing", "runtime", "service",
          "cli"]
TOP_ALLOWED_UP = {"__init__", "__main__", "metrics"}  # the package's front door
TORCH_FREE = ["bindings", "model", "host", "store"]


def _modules(folder: str) -> list[str]:
    base = PACKAGE / folder if folder else PACKAGE
    names = sorted(p.stem for p in base.glob("*.py"))
    prefix = "numa_engram" + (f".{folder}" if folder else "")
    return [prefix if n == "__init__" else f"{prefix}.{n}" for n in names]


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


def _imports(path: Path, module: str) -> list[str]:
    """Every numa_engram module this file imports (relative ones resolved)."""
    package = module.rsplit(".", 1)[0] if path.name != "__init__.py" else module
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.startswith("numa_engram"):
                found.append(target)
                found += [f"{target}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.startswith("numa_engram")]
    return found


def test_no_module_imports_a_folder_above_its_own():
    wrong = []
    for mine, folder in enumerate(LAYERS):
        for path in sorted((PACKAGE / folder).glob("*.py")):
            if not folder and path.stem in TOP_ALLOWED_UP:
                continue
            module = ".".join(["numa_engram"] + ([folder] if folder else [])
                              + ([] if path.stem == "__init__" else [path.stem]))
            above = [t for t in _imports(path, module) if t.split(".")[1:2]
                     and t.split(".")[1] in LAYERS[mine + 1:]]
            wrong += [f"{module} imports {t}" for t in above]
    assert not wrong, "\n".join(wrong)


def test_the_layer_check_sees_an_upward_import(tmp_path):
    """The check above can fail: a store module importing the table is found."""
    f = tmp_path / "x.py"
    f.write_text("from ..sharing.table import SharedEngramTable\n")
    assert "numa_engram.sharing.table" in _imports(f, "numa_engram.store.x")


def test_only_the_layered_paths_import():
    code = ("import importlib\n"
            "for old in ('numa_engram.group', 'numa_engram.table', 'numa_engram.native'):\n"
            "    try:\n"
            "        importlib.import_module(old)\n"
            "    except ModuleNotFoundError:\n"
            "        continue\n"
            "    raise AssertionError(old + ' still imports')\n"
            "import numa_engram.sharing.group\n"
            "from numa_engram.lookup import aligned_empty\n"
            "from numa_engram.cli import main\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
