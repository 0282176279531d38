#!/usr/bin/env python3
"""What the vLLM plugin's manifest needs of a vLLM release, read from its
wheel without installing it: each patched module's file and sha256, the
symbols of ``manifest.SYMBOLS`` each file does not define (by its syntax
tree: a name defined, assigned or imported at module level, a method or
attribute of a class defined there; an inherited one is named as missing
and checked by hand), and the ``Release`` row to add.

    python tools/vllm_release.py 0.35.0            # pip download --no-deps
    python tools/vllm_release.py path/to/vllm-0.35.0-*.whl

Then add the row to numa_engram/integrations/vllm/manifest.py and the
release's files to tests/support/vllm_harness.py's RELEASES, and run
``pytest tests/test_vllm_plugin_releases.py``.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from numa_engram.integrations.vllm import manifest  # noqa: E402


def wheel_of(what: str, tmp: str) -> Path:
    if what.endswith(".whl"):
        return Path(what)
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                    f"vllm=={what}", "-d", tmp], check=True)
    return next(Path(tmp).glob("vllm-*.whl"))


def defined(source: str) -> set[str]:
    """Module-level names and Class.member names the source defines."""
    names: set[str] = set()
    for node in ast.parse(source).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(node.name)
        elif isinstance(node, ast.ClassDef):
            names.add(node.name)
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    names.add(f"{node.name}.{item.name}")
                elif isinstance(item, (ast.Assign, ast.AnnAssign)):
                    targets = item.targets if isinstance(item, ast.Assign) else [item.target]
                    names.update(f"{node.name}.{t.id}" for t in targets
                                 if isinstance(t, ast.Name))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
    return names


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("release", help="a vLLM version (downloaded) or a wheel's path")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        wheel = zipfile.ZipFile(wheel_of(args.release, tmp))
        present = set(wheel.namelist())
        version = wheel.filename.split("-")[1] if wheel.filename else args.release
        engram = manifest.ENGRAM_NV if "vllm/" + manifest.Release(
            "", "", {}).file_of(manifest.ENGRAM_NV) in present else manifest.ENGRAM_COMMON
        modules = [engram, manifest.ENGRAM_COMMON, manifest.VL, manifest.PLE_COMMON,
                   manifest.PLE_HELPERS, manifest.PLE_MODEL]
        files, missing = {}, 0
        for module in dict.fromkeys(modules):
            path = "vllm/" + module.removeprefix("vllm.").replace(".", "/") + ".py"
            if path not in present:
                print(f"MISSING FILE {path}")
                missing += 1
                continue
            data = wheel.read(path)
            files[module] = hashlib.sha256(data).hexdigest()
            role = "engram" if module == engram else module
            lacking = [s for r in {role, module} for s in manifest.SYMBOLS.get(r, ())
                       if s not in defined(data.decode())]
            missing += len(lacking)
            print(f"{path} {files[module]}" + (f"  lacks: {', '.join(lacking)}"
                                               if lacking else ""))
        print("\nRelease(" + repr(version) + ", " + ("ENGRAM_NV" if engram == manifest.ENGRAM_NV
                                                     else "ENGRAM_COMMON") + ", {")
        for module, digest in files.items():
            name = {v: k for k, v in vars(manifest).items() if isinstance(v, str)}[module]
            print(f"    {name}: \"{digest}\",")
        print("}),")
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
