"""The public API is typed: a type checker sees the real classes behind the
package's lazy names and refuses a misspelt mode or id format."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytest.importorskip("mypy", reason="mypy is not installed (pip install -e '.[test]')")


def _mypy(tmp_path, code: str) -> str:
    snippet = tmp_path / "caller.py"
    snippet.write_text(code)
    out = subprocess.run([sys.executable, "-m", "mypy", "--no-error-summary",
                          "--cache-dir", str(ROOT / ".mypy_cache"), str(snippet)],
                         capture_output=True, text=True, cwd=ROOT)
    return out.stdout + out.stderr


def test_a_misspelt_mode_or_id_format_fails_the_type_check(tmp_path):
    out = _mypy(tmp_path, (
        "from numa_engram import EngramSpec, SharedEngramTable, shard_heads\n"
        "spec = EngramSpec.small()\n"
        "shard = shard_heads(spec.bucket_sizes(1), 1, 0)\n"
        "t = SharedEngramTable.create(spec, 1, shard, mode='indepndent')\n"
        "rows = t.lookup([[0]], id_format='globl')\n"
        "where = t.mode_report()['backing_pth']\n"
        "from numa_engram import HashState\n"
        "state = HashState(spec, max_requests='many')\n"))
    assert "caller.py:4: error" in out and "indepndent" in out, out
    assert "caller.py:6: error" in out and "backing_pth" in out, out  # a TypedDict key
    assert "caller.py:8: error" in out and "max_requests" in out, out
    assert "caller.py:5: error" in out, out  # no lookup overload takes id_format="globl"


def test_the_lazy_names_are_the_real_classes_to_a_type_checker(tmp_path):
    out = _mypy(tmp_path, (
        "from numa_engram import EngramSpec, HashState, SharedEngramTable, shard_heads\n"
        "spec = EngramSpec(layer_ids=[1, 14], engram_vocab_sizes=[1000] * 3,\n"
        "                  max_ngram_size=4, n_head_per_ngram=8, head_dim=256,\n"
        "                  compressed_vocab_size=99092, pad_id=2)\n"
        "reveal_type(SharedEngramTable.create)\n"
        "reveal_type(HashState)\n"
        "t = SharedEngramTable.create(spec, 14, shard_heads(spec.bucket_sizes(14), 1, 0))\n"
        "reveal_type(t.lookup([[0]]))\n"
        "reveal_type(t.lookup([[0]], packed=True))\n"))
    assert "error" not in out, out  # README's own spec (lists where a list is natural) passes
    assert "numa_engram.sharing.table.SharedEngramTable" in out, out
    assert "numa_engram.model.hashstate.HashState" in out, out
    assert 'Revealed type is "torch._tensor.Tensor"' in out, out
    assert 'tuple[torch._tensor.Tensor, torch._tensor.Tensor]' in out, out
