"""The table service in real processes: a `numa-engram serve` holder and
engines from separate launches attaching through its socket; restarts of
either side; refusals; the systemd notify protocol and fd-store adoption."""

import array
import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from numa_engram import (
    EngramRuntime,
    EngramSpec,
    ModelDirectory,
    SharedEngramTable,
    shard_heads,
    write_synthetic_model,
)
from numa_engram.errors import StorageError
from numa_engram.store import serviceclient
from numa_engram.store.serviceclient import ServiceRefusal

from .support.service import wait_ready
from .support.stranger import ask_as_nobody

pytest.importorskip("tokenizers", reason="the 'tokenizers' extra is not installed")
pytestmark = pytest.mark.multiproc

SPEC = EngramSpec.small(rows_per_head=4000, n_head_per_ngram=4, head_dim=128, max_ngram_size=3)
TP = 2

# an engine of its own launch: attaches TP shard 0 of every layer through
# the service, then answers "rows" (a digest of its lookups and its PSS)
# until stdin closes
ENGINE = r"""
import hashlib, json, sys
import numpy as np
from numa_engram import EngramSpec, SharedEngramTable, shard_heads
from numa_engram.bindings import native
from numa_engram.host.procfs import smaps
spec = EngramSpec.from_dict(json.loads(sys.argv[2]))
tables = {}
for layer in spec.layer_ids:
    shard = shard_heads(spec.bucket_sizes(layer), int(sys.argv[3]), 0)
    t = SharedEngramTable.attach(spec, layer, shard, service=sys.argv[1])
    native.madvise(t._backing.mapping, native.MADV_POPULATE_READ)  # map every page, for PSS
    tables[layer] = t
ids = np.random.default_rng(0).integers(-1, 3900, (512, spec.n_hash_cols))
print(json.dumps({"attached": {l: t.mode_report()["mode"] for l, t in tables.items()},
                  "startup": tables[spec.layer_ids[0]].startup_phases}), flush=True)
for line in sys.stdin:
    digest = hashlib.sha256()
    for layer, t in tables.items():
        digest.update(t.lookup(ids).view(dtype=__import__("torch").int16).numpy().tobytes())
    print(json.dumps({"digest": digest.hexdigest(), "pss": smaps("self", "numa-engram-").pss}),
          flush=True)
"""


def _python(*args, **kwargs):
    return subprocess.Popen([sys.executable, *args], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs)


def _stop(proc):
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(write_synthetic_model(tmp_path_factory.mktemp("model"), SPEC))


def _serve(model_dir, sock, *extra, env=None, launcher=None, tp=TP, **kwargs):
    serve = [model_dir, "--socket", sock, "--tp", str(tp), *extra]
    args = ["-c", launcher, *serve] if launcher else ["-m", "numa_engram.cli.app", "serve",
                                                      *serve]
    return _python(*args, env=env or os.environ.copy(), **kwargs)


@pytest.fixture
def service(model_dir, tmp_path):
    sock = str(tmp_path / "run" / "engram.sock")
    proc = _serve(model_dir, sock)
    try:
        wait_ready(sock, proc)
        yield proc, sock
    finally:
        _stop(proc)


def _engine(sock):
    proc = _python("-c", ENGINE, sock, json.dumps(SPEC.to_dict()), str(TP))
    line = proc.stdout.readline()
    assert line, proc.stderr.read()[-3000:]
    return proc, json.loads(line)


def _rows(engine):
    engine.stdin.write("rows\n")
    engine.stdin.flush()
    line = engine.stdout.readline()
    assert line, engine.stderr.read()[-3000:]
    return json.loads(line)


def _reference_digest(model_dir):
    ids = np.random.default_rng(0).integers(-1, 3900, (512, SPEC.n_hash_cols))
    digest = hashlib.sha256()
    import torch

    for layer in SPEC.layer_ids:
        t = SharedEngramTable.create(SPEC, layer, shard_heads(SPEC.bucket_sizes(layer), TP, 0),
                                     checkpoint=model_dir, directory=None)
        digest.update(t.lookup(ids).view(torch.int16).numpy().tobytes())
        t.close()
    return digest.hexdigest()


def _table_bytes(doc):
    return sum(t["bytes"] for t in doc["tables"] if t["heads"][0] == 0)


def test_engines_of_separate_launches_share_one_sealed_copy_and_survive_restarts(
        service, model_dir):
    proc, sock = service
    doc = serviceclient.status(sock)
    assert all(t["sealed"] and t["state"] == "ready" for t in doc["tables"])
    assert len(doc["tables"]) == len(SPEC.layer_ids) * TP
    want = _reference_digest(model_dir)
    a, info = _engine(sock)
    b, _ = _engine(sock)
    try:
        assert set(info["attached"].values()) == {"service"} and "attach" in info["startup"]
        ra, rb = _rows(a), _rows(b)
        assert ra["digest"] == rb["digest"] == want
        one_copy = _table_bytes(doc)
        assert abs(ra["pss"] + rb["pss"] - one_copy) < 0.02 * one_copy, (ra, rb, one_copy)
        a.kill()  # an engine crashes; its restart re-attaches
        a.wait()
        a, _ = _engine(sock)
        assert _rows(a)["digest"] == want
        assert sum(t["attaches"] for t in serviceclient.status(sock)["tables"]) == 6
        proc.kill()  # the service dies: the engines keep reading their mappings
        proc.wait()
        assert _rows(a)["digest"] == _rows(b)["digest"] == want
    finally:
        for e in (a, b):
            e.kill()
            e.wait()


def test_refusals_name_their_reason(service):
    _, sock = service
    shard = shard_heads(SPEC.bucket_sizes(1), TP, 1)
    with pytest.raises(ServiceRefusal, match="no table holds") as exc:
        SharedEngramTable.attach(SPEC, 1, shard_heads(SPEC.bucket_sizes(1), 3, 0), service=sock)
    assert exc.value.reason == "no_such_table"
    other = EngramSpec.small(rows_per_head=4000, n_head_per_ngram=4, head_dim=128, seed=1)
    with pytest.raises(ServiceRefusal, match="holds spec") as exc:
        SharedEngramTable.attach(other, 1, shard, service=sock)
    assert exc.value.reason == "mismatch"
    with pytest.raises(ServiceRefusal, match="on 4K pages; asked for .* on 2M pages") as exc:
        SharedEngramTable.attach(SPEC, 1, shard, service=sock, page_size="2M")
    with pytest.raises(Exception, match="no table service at"):
        SharedEngramTable.attach(SPEC, 1, shard, service=sock + ".nothing")


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a client as another uid")
def test_another_uid_is_refused_even_where_the_socket_lets_it_connect(model_dir):
    import shutil
    import tempfile

    top = tempfile.mkdtemp(prefix="engram-uid-", dir="/tmp")  # a path uid 65534 can walk
    os.chmod(top, 0o755)
    sock = os.path.join(top, "run", "engram.sock")
    proc = _serve(model_dir, sock)
    try:
        wait_ready(sock, proc)
        assert oct(os.stat(sock).st_mode & 0o777) == "0o600"
        assert "permission denied" in ask_as_nobody(sock, {"op": "status"})  # the modes keep it out
        os.chmod(os.path.dirname(sock), 0o755)
        os.chmod(sock, 0o666)  # opened up: SO_PEERCRED still refuses it
        assert ask_as_nobody(sock, {"op": "status"}) == "refused fds=0"
    finally:
        _stop(proc)
        shutil.rmtree(top, ignore_errors=True)


def test_garbage_and_stalled_clients_block_nobody(service):
    _, sock = service
    stalled = socket.socket(socket.AF_UNIX)
    stalled.connect(sock)  # connects and says nothing
    garbage = socket.socket(socket.AF_UNIX)
    garbage.connect(sock)
    garbage.sendall(b"\x00\xffnot json\n")
    answer = garbage.recv(4096)
    assert b"bad_request" in answer
    flood = socket.socket(socket.AF_UNIX)
    flood.connect(sock)
    flood.sendall(b"x" * (serviceclient.MAX_REQUEST + 10))
    assert b"longer than" in flood.recv(4096)
    shard = shard_heads(SPEC.bucket_sizes(14), TP, 1)
    results, started = [], time.monotonic()

    def attach():
        t = SharedEngramTable.attach(SPEC, 14, shard, service=sock)
        results.append(t.mode)
        t.close()
    threads = [threading.Thread(target=attach) for _ in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert results == ["service"] * 32
    assert time.monotonic() - started < 4.0  # well before the stalled client's timeout
    for s in (stalled, garbage, flood):
        s.close()


LAUNCH_HELD = r"""
import os, sys, time
from numa_engram.groups import steps
def hold(name):
    # the loads wait until the test creates the file (each one checks it)
    while name == "before-load" and not os.path.exists(os.environ["RELEASE_LOAD"]):
        time.sleep(0.02)
steps.STEP_HOOK = hold
from numa_engram.cli.app import main
sys.exit(main(["serve", *sys.argv[1:]]))
"""


def test_a_table_still_loading_answers_not_ready_with_progress(model_dir, tmp_path):
    sock, release = str(tmp_path / "s" / "engram.sock"), str(tmp_path / "release")
    proc = _serve(model_dir, sock, env=dict(os.environ, RELEASE_LOAD=release),
                  launcher=LAUNCH_HELD)
    try:
        deadline = time.monotonic() + 60
        while not os.path.exists(sock) and time.monotonic() < deadline:
            assert proc.poll() is None, proc.stderr.read()[-3000:]
            time.sleep(0.05)
        doc = serviceclient.status(sock)
        assert not doc["ready"] and doc["tables"][0]["state"] == "loading"
        with pytest.raises(ServiceRefusal, match="the table is loading") as exc:
            SharedEngramTable.attach(SPEC, 1, shard_heads(SPEC.bucket_sizes(1), TP, 0),
                                     service=sock)
        assert exc.value.reason == "not_ready"
        done, total = exc.value.detail["progress"]
        assert 0 <= done < total
        out = subprocess.run([sys.executable, "-m", "numa_engram.cli.app", "status",
                              "--socket", sock], capture_output=True, text=True)
        assert out.returncode == 1 and "NOT ready" in out.stdout and "loading" in out.stdout
        open(release, "w").close()
        wait_ready(sock, proc)
        out = subprocess.run([sys.executable, "-m", "numa_engram.cli.app", "status",
                              "--socket", sock], capture_output=True, text=True)
        assert out.returncode == 0 and "sealed" in out.stdout, out
    finally:
        _stop(proc)


LAUNCH_SECOND_HELD = r"""
import os, sys, time
from numa_engram.groups import steps
loads = []
def hold(name):
    # the first table loads at once; the second waits for the release file
    if name == "before-load":
        loads.append(name)
        while len(loads) > 1 and not os.path.exists(os.environ["RELEASE_LOAD"]):
            time.sleep(0.02)
steps.STEP_HOOK = hold
from numa_engram.cli.app import main
sys.exit(main(["serve", *sys.argv[1:]]))
"""


def test_auto_waits_for_a_service_still_loading_a_later_layer(model_dir, tmp_path,
                                                               monkeypatch):
    """The sidecar start-up case: the first layer ready, the second loading.
    "auto" waits (bounded) for every layer instead of refusing on the first;
    past its bound every rank fails naming the progress."""
    sock, release = str(tmp_path / "s" / "engram.sock"), str(tmp_path / "release")
    proc = _serve(model_dir, sock, env=dict(os.environ, RELEASE_LOAD=release),
                  launcher=LAUNCH_SECOND_HELD, tp=1)
    monkeypatch.setenv("NUMA_ENGRAM_SOCKET", sock)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            assert proc.poll() is None, proc.stderr.read()[-3000:]
            try:
                states = [t["state"] for t in serviceclient.status(sock)["tables"]]
            except Exception:
                states = []
            if states and states[0] == "ready":
                break
            time.sleep(0.05)
        assert states[0] == "ready" and states[1] == "loading", states
        with pytest.raises(StorageError, match="still loading this rank's tables after 0.5 s"):
            EngramRuntime.from_pretrained(model_dir, max_tokens=8, service="auto",
                                          timeout_s=0.5)
        threading.Timer(1.0, lambda: open(release, "w").close()).start()
        started = time.monotonic()
        with EngramRuntime.from_pretrained(model_dir, max_tokens=8, service="auto") as rt:
            assert rt.mode_report()["source"] == "service"
        assert time.monotonic() - started >= 0.9  # it waited for the second layer
    finally:
        _stop(proc)


# ------------------------------------------------------------- systemd --

def _receive_notifications(listener, until="READY=1", timeout_s=120):
    """What a service manager receives: messages and the descriptors with them."""
    listener.settimeout(timeout_s)
    messages = []
    while True:
        fds = array.array("i")
        data, ancillary, _, _ = listener.recvmsg(4096, socket.CMSG_SPACE(16 * fds.itemsize))
        for level, kind, payload in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
        messages.append((data.decode(), list(fds)))
        if until in data.decode():
            return messages


LAUNCH_WITH_FDS = r"""
import os, sys
os.environ["LISTEN_PID"] = str(os.getpid())  # what systemd sets in the child it starts
from numa_engram.cli.app import main
sys.exit(main(["serve", *sys.argv[1:]]))
"""


def test_the_fd_store_keeps_every_table_across_a_service_restart(model_dir, tmp_path):
    """FDSTORE=1 with each table's descriptor and FDNAME, READY=1 at the end;
    a service started with those descriptors (LISTEN_FDS, from 3 up)
    adopts them (no load) and engines read the same rows."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    listener.bind(str(tmp_path / "notify"))
    sock = str(tmp_path / "run" / "engram.sock")
    first = _serve(model_dir, sock, env=dict(os.environ, NOTIFY_SOCKET=str(tmp_path / "notify")))
    try:
        messages = _receive_notifications(listener)
    finally:
        _stop(first)
    stored = [(m.split("FDNAME=")[1].strip(), fds[0]) for m, fds in messages
              if "FDSTORE=1" in m]
    assert len(stored) == len(SPEC.layer_ids) * TP and all(f >= 0 for _, f in stored)
    assert messages[-1][0].startswith("READY=1") and not messages[-1][1]
    assert len({name for name, _ in stored}) == len(stored)

    def place_fds():  # in the child: the stored descriptors at 3, 4, ... (via high numbers,
        high = [os.dup2(fd, 200 + i) for i, (_, fd) in enumerate(stored)]  # no overlap)
        for i, fd in enumerate(high):
            os.dup2(fd, 3 + i, inheritable=True)
            os.close(fd)
    env = dict(os.environ, LISTEN_FDS=str(len(stored)),
               LISTEN_FDNAMES=":".join(name for name, _ in stored))
    started = time.monotonic()
    second = _serve(model_dir, sock, env=env, launcher=LAUNCH_WITH_FDS, preexec_fn=place_fds,
                    pass_fds=tuple(range(3, 3 + len(stored))))
    for _, fd in stored:
        os.close(fd)
    try:
        doc = wait_ready(sock, second)
        assert all(t["adopted"] and t["sealed"] for t in doc["tables"])
        assert time.monotonic() - started < 30
        engine, _ = _engine(sock)
        try:
            assert _rows(engine)["digest"] == _reference_digest(model_dir)
        finally:
            engine.kill()
            engine.wait()
    finally:
        _stop(second)
        listener.close()


# ------------------------------------------------------------- runtime --

def test_the_runtime_attaches_through_the_service(model_dir, tmp_path, monkeypatch):
    """A TP-1 runtime: its tables from a TP-1 service, the same rows as
    built ones; "auto" finds the service by $NUMA_ENGRAM_SOCKET, and builds
    where none answers (or it holds other shards)."""
    sock = str(tmp_path / "run" / "engram.sock")
    proc = _serve(model_dir, sock, tp=1)
    try:
        wait_ready(sock, proc)
        _runtimes_agree(model_dir, sock, monkeypatch)
    finally:
        _stop(proc)


def _runtimes_agree(model_dir, sock, monkeypatch):
    import torch

    built = EngramRuntime.from_pretrained(model_dir, max_tokens=32, max_requests=2,
                                          directory=None)
    attached = EngramRuntime.from_pretrained(model_dir, max_tokens=32, max_requests=2,
                                             service=sock)
    monkeypatch.setenv("NUMA_ENGRAM_SOCKET", sock)
    auto = EngramRuntime.from_pretrained(model_dir, max_tokens=32, max_requests=2,
                                         service="auto")
    with built, attached, auto:
        assert built.mode_report()["source"] == "built"
        assert attached.mode_report()["source"] == auto.mode_report()["source"] == "service"
        assert "attach" in attached.mode_report()["layers"][1]["startup_s"]
        for rt in (built, attached, auto):
            rt.begin_step([3, 4, 5], [0, 0, 1], [0, 1, 0])
        for layer in built.layer_ids:
            want = built.embed(layer)
            for rt in (attached, auto):
                assert rt.embed(layer).view(torch.int16).equal(want.view(torch.int16))
    monkeypatch.setenv("NUMA_ENGRAM_SOCKET", sock + ".none")
    with EngramRuntime.from_pretrained(model_dir, max_tokens=8, service="auto",
                                       directory=None) as rt:
        assert rt.mode_report()["source"] == "built"
    with pytest.raises(ServiceRefusal, match="no table holds"):  # TP 2 shards: not held
        SharedEngramTable.attach(SPEC, 1, shard_heads(SPEC.bucket_sizes(1), 2, 0), service=sock)


# ------------------------------------------------------ what we ship --

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"


def _unit_exec_start():
    text = (DEPLOY / "numa-engram.service").read_text()
    joined = text.replace("\\\n", " ")
    fields = dict(line.split("=", 1) for line in joined.splitlines()
                  if "=" in line and not line.startswith("#"))
    return fields


def test_the_shipped_unit_and_pod_run_commands_this_version_parses():
    """The unit file is Type=notify with an fd store, and its ExecStart and
    the Kubernetes sidecar's command are command lines our parser takes."""
    import shlex

    from numa_engram.cli.app import build_parser

    unit = _unit_exec_start()
    assert unit["Type"] == "notify" and int(unit["FileDescriptorStoreMax"]) >= 4
    args = build_parser().parse_args(shlex.split(unit["ExecStart"])[1:])
    assert args.command == "serve" and args.socket == "/run/numa-engram/engram.sock"
    pod = (DEPLOY / "kubernetes-sidecar.yaml").read_text()
    command = json.loads(pod.split("command: ", 1)[1].split("]", 1)[0].replace("\n", " ") + "]")
    args = build_parser().parse_args(command[1:])
    assert args.command == "serve" and args.page_size == 2 << 20
    probe = json.loads(pod.split("command: ", 2)[2].split("]", 1)[0] + "]")
    assert build_parser().parse_args(probe[1:]).command == "status"


def test_the_service_resolves_the_checkpoint_once_and_a_broken_layer_fails_alone(
        tmp_path, monkeypatch):
    """Every table of the model (layers x TP ranks) loads through one
    resolution of the checkpoint (its index and headers read once); a
    checkpoint that lacks a layer fails that layer's tables only, each
    naming it, and the others serve."""
    from numa_engram.checkpoints import checkpoint
    from numa_engram.service.tableservice import TableService

    resolutions = []
    real = checkpoint.checkpoint_files
    monkeypatch.setattr(checkpoint, "checkpoint_files",
                        lambda paths: resolutions.append(paths) or real(paths))
    whole = write_synthetic_model(tmp_path / "whole", SPEC)
    service = TableService(ModelDirectory.open(str(whole)), str(tmp_path / "a.sock"), tp=2)
    service.load_all()
    assert len(service.tables) == 2 * len(SPEC.layer_ids)
    assert all(t.state == "ready" for t in service.tables)
    assert len(resolutions) == 1, resolutions
    service.stop()

    first, last = SPEC.layer_ids[0], SPEC.layer_ids[-1]
    broken = write_synthetic_model(tmp_path / "broken", SPEC, layers=[first])
    service = TableService(ModelDirectory.open(str(broken)), str(tmp_path / "b.sock"), tp=2)
    service.load_all()
    states = {(t.layer_id, t.tp_rank): (t.state, t.error) for t in service.tables}
    assert all(states[(first, r)][0] == "ready" for r in range(2)), states
    for r in range(2):
        state, error = states[(last, r)]
        assert state == "failed" and "CheckpointError" in error and str(last) in error, error
    service.stop()
