"""A third table family added as docs/design.md's "Adding a family" says
(tests/support/thirdfamily: four modules, no edit of the package),
installed by the ``numa_engram.families`` entry point group in processes
of their own: ``plan``, ``serve`` and an engine's attach find its spec,
reader, table class and model directory through the family alone, and its
rows are Engram's own, bit for bit."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from numa_engram import EngramSpec, SharedEngramTable, shard_heads
from numa_engram.runtime.modeldir import write_synthetic_model

from .support.service import wait_ready
from .support.thirdfamily import entry_point_dir
from .support.thirdfamily.mirrorspec import MARKER

pytest.importorskip("tokenizers", reason="the 'tokenizers' extra is not installed")
pytestmark = pytest.mark.multiproc

REPO = Path(__file__).resolve().parent.parent
SPEC = EngramSpec.small(rows_per_head=1000, n_head_per_ngram=4, head_dim=64, max_ngram_size=3)
TP = 2
IDS = np.random.default_rng(3).integers(-1, 900, (64, SPEC.n_hash_cols))

# an engine: the model directory opened by its family, each layer's TP
# shard 0 attached from the service through the family's table class
ENGINE = r"""
import hashlib, json, sys
import numpy as np
from numa_engram.model.families import family_of
from numa_engram.runtime.modeldirs import open_model_directory
from numa_engram.model.sharding import shard_heads
model = open_model_directory(sys.argv[1])
family = family_of(model.spec)
cls = family.part("table")
ids = np.array(json.loads(sys.argv[3]))
digest, kinds = hashlib.sha256(), set()
for layer in model.spec.layer_ids:
    t = cls.attach(model.spec, layer, shard_heads(model.spec.bucket_sizes(layer), 2, 0),
                   service=sys.argv[2])
    kinds.add((type(t).__name__, t.mode))
    digest.update(t.lookup(ids).view(dtype=__import__("torch").int16).numpy().tobytes())
    t.close()
print(json.dumps({"family": family.name, "directory": type(model).__name__,
                  "kinds": sorted(kinds), "digest": digest.hexdigest()}))
"""


@pytest.fixture(scope="module")
def mirror_dir(tmp_path_factory):
    root = write_synthetic_model(tmp_path_factory.mktemp("mirror"), SPEC)
    config = root / "config.json"
    doc = json.loads(config.read_text())
    config.write_text(json.dumps({**doc, MARKER: True}))
    return str(root)


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    installed = entry_point_dir(tmp_path_factory.mktemp("site"))
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(installed), str(REPO)])}


def _run(env, *args, timeout=180):
    proc = subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True,
                          timeout=timeout, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def _engram_digest(model_dir):
    import hashlib

    import torch

    digest = hashlib.sha256()
    for layer in SPEC.layer_ids:
        with SharedEngramTable.create(SPEC, layer, shard_heads(SPEC.bucket_sizes(layer), TP, 0),
                                      checkpoint=model_dir, directory=None) as t:
            digest.update(t.lookup(IDS).view(torch.int16).numpy().tobytes())
    return digest.hexdigest()


def test_plan_reads_the_third_family_from_its_entry_point(mirror_dir, env):
    out = _run(env, "-m", "numa_engram.cli.app", "plan", "--model", mirror_dir, "--tp", str(TP))
    assert "mirror rows: TP 2" in out  # the family's own sharding notes


def test_without_the_entry_point_the_directory_is_engrams(mirror_dir):
    from numa_engram.runtime.modeldirs import family_of_directory

    assert family_of_directory(mirror_dir).name == "engram"


def test_serve_and_attach_use_the_third_familys_directory_and_table_class(mirror_dir, env,
                                                                        tmp_path):
    sock = str(tmp_path / "run" / "mirror.sock")
    proc = subprocess.Popen([sys.executable, "-m", "numa_engram.cli.app", "serve", mirror_dir,
                             "--socket", sock, "--tp", str(TP)], env=env, cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        doc = wait_ready(sock, proc)
        assert len(doc["tables"]) == len(SPEC.layer_ids) * TP
        out = json.loads(_run(env, "-c", ENGINE, mirror_dir, sock, json.dumps(IDS.tolist())))
    finally:
        proc.terminate()
        proc.wait(60)
    assert out["family"] == "mirror" and out["directory"] == "MirrorModelDirectory"
    assert out["kinds"] == [["MirrorTable", "service"]]
    assert out["digest"] == _engram_digest(mirror_dir)


def test_the_create_protocol_loads_through_the_third_familys_reader(mirror_dir, env):
    script = r"""
import json, sys
from numa_engram.checkpoints.familyreaders import reader_of
from numa_engram.model.sharding import shard_heads
from numa_engram.runtime.modeldirs import open_model_directory
from numa_engram.tables.familytables import create_shard
from numa_engram.tables.request import TableOptions
from tests.support.thirdfamily import mirrorcheckpoint, mirrortable
model = open_model_directory(sys.argv[1])
layer = model.spec.layer_ids[0]
shard = shard_heads(model.spec.bucket_sizes(layer), 1, 0)
t = create_shard(model.spec, layer, shard, model.checkpoint, TableOptions(directory=None))
print(json.dumps({"reader": type(reader_of(model.spec)).__name__, "calls": mirrorcheckpoint.CALLS,
                  "made": len(mirrortable.MADE), "type": type(t).__name__}))
"""
    out = json.loads(_run(env, "-c", script, mirror_dir))
    assert out == {"reader": "MirrorReader", "calls": {"resolve": 1, "load": 1}, "made": 1,
                   "type": "MirrorTable"}
