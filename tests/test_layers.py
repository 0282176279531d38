"""The torch-free folders import without torch (the layer order itself is
import-linter's contract in pyproject.toml, run by tools/test.sh)."""

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
