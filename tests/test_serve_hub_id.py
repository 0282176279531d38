"""``numa-engram serve ORG/NAME``: a hub id whose snapshot is in the local
Hugging Face cache (laid out as huggingface_hub lays it: refs/main names
the snapshot, its files links into blobs/) is served from there; one not in
the cache is refused saying that nothing is downloaded and how to get it."""

import os
import shutil
import subprocess
import sys

import pytest

from numa_engram import EngramSpec, write_synthetic_model
from numa_engram.runtime import hubcache

from .support.service import wait_ready

pytestmark = pytest.mark.multiproc

SPEC = EngramSpec.small(rows_per_head=200, n_head_per_ngram=2, head_dim=64)
REVISION = "0123456789abcdef0123456789abcdef01234567"


def fake_hub_cache(root, model_dir, org="acme", name="tiny-v41"):
    """``model_dir`` as the hub cache holds a downloaded snapshot."""
    repo = root / f"models--{org}--{name}"
    blobs, snapshot = repo / "blobs", repo / "snapshots" / REVISION
    blobs.mkdir(parents=True)
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(REVISION)
    for i, f in enumerate(sorted(os.listdir(model_dir))):
        shutil.copy(os.path.join(model_dir, f), blobs / f"blob{i}")
        os.symlink(f"../../blobs/blob{i}", snapshot / f)
    return f"{org}/{name}", str(snapshot)


def _serve(args, env):
    return subprocess.Popen([sys.executable, "-m", "numa_engram", "serve", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def test_serve_a_hub_id_from_the_local_cache(tmp_path, monkeypatch):
    model_dir = str(write_synthetic_model(tmp_path / "model", SPEC))
    hub_id, snapshot = fake_hub_cache(tmp_path / "hub", model_dir)
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "hub")}
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    assert hubcache.model_path(hub_id) == snapshot
    sock = str(tmp_path / "engram.sock")
    proc = _serve([hub_id, "--socket", sock], env)
    try:
        doc = wait_ready(sock, proc)
        assert doc["model_dir"] == snapshot
        assert len(doc["tables"]) == len(SPEC.layer_ids)
    finally:
        proc.terminate()
        proc.wait(60)


def test_a_hub_id_not_in_the_cache_is_refused_naming_the_download(tmp_path):
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "empty")}
    proc = _serve(["acme/never-downloaded", "--socket", str(tmp_path / "s.sock")], env)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode != 0
    assert "neither a local directory nor a model in the local Hugging Face cache" in err
    assert "huggingface-cli download acme/never-downloaded" in err
    assert str(tmp_path / "empty" / "models--acme--never-downloaded") in err


def test_hub_cache_order_and_what_reads_as_a_hub_id(tmp_path, monkeypatch):
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    assert hubcache.hub_caches() == [str(tmp_path / "hf" / "hub")]
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "c"))
    assert hubcache.hub_caches() == [str(tmp_path / "c")]
    assert hubcache.is_hub_id("deepseek-ai/DeepSeek-V4.1")
    for path in ("/models/x", "./x/y", "a/b/c", "x", "../a/b", "a/.."):
        assert not hubcache.is_hub_id(path), path
    repo = tmp_path / "c" / "models--a--b"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("not a hash\n")
    from numa_engram.errors import CheckpointError

    with pytest.raises(CheckpointError, match="not a commit hash"):
        hubcache.model_path("a/b")
