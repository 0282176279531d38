"""The service and systemd: every stored descriptor it does not adopt is
closed and removed from the fd store (FDSTOREREMOVE=1 + FDNAME), a name
passed twice keeps one descriptor in the store and one in the service, a
LISTEN_FDS larger than what was passed is survived, and a notify socket
that is gone, or whose queue is full, costs a log line, never a table."""

import array
import os
import socket
import subprocess
import sys
import threading
import time

import pytest

from numa_engram import EngramSpec, SharedEngramTable, shard_heads, write_synthetic_model
from numa_engram.runtime.modeldir import ModelDirectory
from numa_engram.service import systemd
from numa_engram.service.tableservice import TableService

SPEC = EngramSpec.small(rows_per_head=300, n_head_per_ngram=2, head_dim=64, max_ngram_size=3)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return ModelDirectory.open(str(write_synthetic_model(tmp_path_factory.mktemp("m"), SPEC)))


@pytest.fixture
def manager(tmp_path, monkeypatch):
    """A fake service manager: the NOTIFY_SOCKET datagrams, with their fds."""
    path = str(tmp_path / "notify")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    listener.bind(path)
    listener.setblocking(False)
    monkeypatch.setenv("NOTIFY_SOCKET", path)
    yield listener
    listener.close()


def _drain(listener):
    out = []
    while True:
        fds = array.array("i")
        try:
            data, anc, _, _ = listener.recvmsg(4096, socket.CMSG_SPACE(16 * fds.itemsize))
        except BlockingIOError:
            return out
        for level, kind, payload in anc:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
        out.append((dict(line.split("=", 1) for line in data.decode().splitlines()),
                    list(fds)))


def _inode(fd):
    st = os.fstat(fd)
    return st.st_dev, st.st_ino


def _open_of(inode):
    """How many of this process's descriptors are of that file."""
    count = 0
    for name in os.listdir("/proc/self/fd"):
        try:
            count += _inode(int(name)) == inode
        except OSError:
            pass
    return count


def _stored_by_a_first_service(model, tmp_path, listener):
    first = TableService(model, str(tmp_path / "first.sock"))
    first.load_all()
    first.stop()
    return [(m["FDNAME"], fds[0]) for m, fds in _drain(listener) if m.get("FDSTORE") == "1"]


def test_rejected_and_duplicate_stored_descriptors_are_removed_from_the_store(
        model, tmp_path, manager):
    stored = _stored_by_a_first_service(model, tmp_path, manager)
    assert len(stored) == len(SPEC.layer_ids)
    (name0, fd0), (name1, fd1) = stored
    twin = os.dup(fd0)  # the same FDNAME passed twice
    other = SharedEngramTable.create(EngramSpec.small(rows_per_head=300, seed=7), 1,
                                     shard_heads(EngramSpec.small(rows_per_head=300, seed=7)
                                                 .bucket_sizes(1), 1, 0), directory=None)
    foreign = other.dup_descriptor()  # a table of another model, under a name of ours
    other.close()
    passed = [(name0, fd0), (name0, twin), ("engram-old-model-l1", foreign), (name1, fd1)]
    kept, dropped = _inode(fd0), _inode(foreign)
    second = TableService(model, str(tmp_path / "second.sock"))
    assert second.adopt(passed) == 2
    assert _open_of(kept) == 2  # the adopted descriptor and its read-only reopen: no twin
    assert _open_of(dropped) == 0
    assert all(t.state == "ready" and t.adopted for t in second.tables)
    said = _drain(manager)
    removed = [m["FDNAME"] for m, _ in said if m.get("FDSTOREREMOVE") == "1"]
    assert "engram-old-model-l1" in removed and name0 in removed
    restored = [(m["FDNAME"], fds) for m, fds in said if m.get("FDSTORE") == "1"]
    assert [n for n, _ in restored] == [name0] and len(restored[0][1]) == 1
    second.load_all()  # nothing to load: READY=1 only
    after = _drain(manager)
    assert [m.get("READY") for m, _ in after] == ["1"] and not any(f for _, f in after)
    second.stop()
    for _, fds in said:
        for fd in fds:
            os.close(fd)


def test_a_notify_socket_that_is_gone_costs_a_log_line_not_the_tables(
        model, tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "gone"))
    service = TableService(model, str(tmp_path / "run" / "engram.sock"))
    service.start()
    try:
        service.load_all()
        assert all(t.state == "ready" for t in service.tables)
        layer = SPEC.layer_ids[0]
        with SharedEngramTable.attach(SPEC, layer, shard_heads(SPEC.bucket_sizes(layer), 1, 0),
                                      service=service.socket_path) as t:
            assert t.mode == "service"
    finally:
        service.stop()
    assert "sd_notify" in caplog.text and "serving on" in caplog.text


def _fill(path):
    """Send to the datagram socket at ``path`` until its queue is full."""
    sender = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sender.setblocking(False)
    try:
        while True:
            sender.sendto(b"X=1", path)
    except BlockingIOError:
        pass
    finally:
        sender.close()


@pytest.mark.slow
def test_a_manager_that_does_not_read_holds_no_load_up(model, tmp_path, manager, caplog):
    """A full notify queue (a service manager that does not read): every
    notify waits NOTIFY_TIMEOUT_S at most, so every table still loads, each
    dropped notify a warning."""
    _fill(str(tmp_path / "notify"))
    service = TableService(model, str(tmp_path / "full.sock"))
    loading = threading.Thread(target=service.load_all, daemon=True)
    started = time.monotonic()
    loading.start()
    try:
        loading.join(timeout=10 * systemd.NOTIFY_TIMEOUT_S * (len(service.tables) + 1))
        assert not loading.is_alive(), "load_all is blocked behind the full notify queue"
        took = time.monotonic() - started
    finally:
        _drain(manager)  # a blocked notify (before the fix) finishes, and the test with it
        loading.join(timeout=60)
        service.stop()
    assert all(t.state == "ready" for t in service.tables)
    assert took < 5 * systemd.NOTIFY_TIMEOUT_S * (len(service.tables) + 1)
    assert caplog.text.count("no room in its queue") == len(service.tables) + 1


LISTEN = r"""
import json, logging, os
logging.basicConfig()
os.environ["LISTEN_PID"] = str(os.getpid())
from numa_engram.service import systemd
print(json.dumps(systemd.listen_fds()))
"""


def test_listen_fds_larger_than_what_was_passed_is_survived(tmp_path):
    read, write = os.pipe()

    def at_three():
        os.dup2(read, 3, inheritable=True)
    try:
        run = subprocess.run([sys.executable, "-c", LISTEN], capture_output=True, text=True,
                             env=dict(os.environ, LISTEN_FDS="6", LISTEN_FDNAMES="a:b:c"),
                             preexec_fn=at_three, pass_fds=(3,), timeout=120, check=False)
    finally:
        os.close(read)
        os.close(write)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip() == '[["a", 3]]'
    assert "LISTEN_FDS=6 names fd 4, which is not open" in run.stderr


def _family_model(family, root, seed):
    from .support.checkpoint_scenarios import PLE_SPEC
    from .support.ple_scenarios import write_ple_model

    if family == "engram":
        return write_synthetic_model(root, SPEC, seed=seed)
    return write_ple_model(root, PLE_SPEC, seed=seed)


def _open_model(family, root):
    from numa_engram.runtime.plemodeldir import PLEModelDirectory

    return ModelDirectory.open(str(root)) if family == "engram" else \
        PLEModelDirectory.open(str(root))


@pytest.mark.parametrize("damage", ["truncate", "replace"])
@pytest.mark.parametrize("family", ["engram", "ple"])
def test_a_checkpoint_damaged_while_the_service_loads_fails_its_tables_naming_the_file(
        tmp_path, monkeypatch, family, damage):
    """The checkpoint truncated, or replaced with another version, as the
    service starts its first load: every table not loaded is failed with a
    CheckpointError naming the file (never rows of two versions), the
    service answers, and no table is left anywhere."""
    import numa_engram.groups.steps as steps

    from .conftest import shm_files

    root = _family_model(family, tmp_path / "model", seed=0)
    other = _family_model(family, tmp_path / "v2", seed=1)
    files = sorted(p.name for p in root.glob("*.safetensors"))

    def hook(step):
        if step == "before-load" and not damaged:
            for name in files:
                if damage == "truncate":
                    os.truncate(root / name, os.path.getsize(root / name) // 2)
                else:
                    os.replace(other / name, root / name)
            damaged.append(step)
    damaged: list[str] = []
    monkeypatch.setattr(steps, "STEP_HOOK", hook)
    before = shm_files()
    service = TableService(_open_model(family, root), str(tmp_path / "run" / "s.sock"))
    service.start()
    try:
        service.load_all()
        assert damaged and service.tables
        for table in service.tables:
            assert table.state == "failed" and table.error.startswith("CheckpointError"), \
                (table.state, table.error)
            assert str(root) in table.error, table.error
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            probe.connect(service.socket_path)  # still answering
    finally:
        service.stop()
    assert shm_files() == before
