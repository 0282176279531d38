"""Whom an engine believes: a table service of another uid is refused unless
the operator names that uid; a descriptor not sealed against writes, growth
and shrinking is refused unless the operator allows it; a service never
hands out a table it could not seal; a client that reopens what it got
read-write can neither write, map writable, punch nor shrink it."""

import ctypes
import errno
import fcntl
import gc
import mmap
import os
import shutil
import socket
import tempfile
import threading
import time

import numpy as np
import pytest
import torch

from numa_engram import EngramSpec, SharedEngramTable, shard_heads, write_synthetic_model
from numa_engram.errors import StorageError
from numa_engram.runtime.modeldir import ModelDirectory
from numa_engram.service import tableservice
from numa_engram.service.tableservice import TableService
from numa_engram.store import serviceclient
from numa_engram.store.serviceclient import ServiceRefusal, ServiceTrust

SPEC = EngramSpec.small(rows_per_head=500, n_head_per_ngram=2, head_dim=64, max_ngram_size=3)
LAYER = SPEC.layer_ids[0]
SHARD = shard_heads(SPEC.bucket_sizes(LAYER), 1, 0)
NOBODY = 65534
FALLOC_FL_KEEP_SIZE, FALLOC_FL_PUNCH_HOLE = 0x1, 0x2
_libc = ctypes.CDLL(None, use_errno=True)


@pytest.fixture(scope="module")
def world_readable_model():
    """A model directory (and a socket directory) that uid 65534 can use."""
    top = tempfile.mkdtemp(prefix="engram-trust-", dir="/tmp")
    os.chmod(top, 0o777)
    model = write_synthetic_model(os.path.join(top, "model"), SPEC)
    for root, dirs, files in os.walk(model):
        for name in dirs + files:
            os.chmod(os.path.join(root, name), 0o755)
    os.chmod(model, 0o755)
    yield top, str(model)
    shutil.rmtree(top, ignore_errors=True)


def _reference(model, ids):
    with SharedEngramTable.create(SPEC, LAYER, SHARD, checkpoint=model, directory=None) as t:
        return t.lookup(ids).clone()


def _ids():
    return np.random.default_rng(0).integers(-1, 500, (64, SPEC.n_hash_cols))


def _wait_ready(sock, pid, timeout_s=120):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if os.waitpid(pid, os.WNOHANG)[0]:
            raise AssertionError("the service exited")
        try:
            if serviceclient.status(sock)["ready"]:
                return
        except (StorageError, OSError):
            pass
        time.sleep(0.05)
    raise AssertionError("the service did not get ready")


def _serve_as(uid, model, sock):
    """A real table service run by ``uid`` in a forked child (its
    interpreter is this one: uid 65534 may not reach the venv's); ends when
    the returned descriptor is closed.  (pid, that descriptor)."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.close(write)
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            service = TableService(ModelDirectory.open(model), sock, tp=1)
            service.start()
            service.load_all()
            os.read(read, 1)  # until the parent closes its end
            service.stop()
            code = 0
        finally:
            os._exit(code)
    os.close(read)
    return pid, write


@pytest.mark.multiproc
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a service as another uid")
def test_a_service_of_another_uid_is_refused_unless_the_operator_names_it(
        world_readable_model):
    top, model = world_readable_model
    sock_dir = os.path.join(top, "shared-emptydir")  # world-writable, as a planted socket's
    os.makedirs(sock_dir, mode=0o777, exist_ok=True)
    os.chmod(sock_dir, 0o777)
    sock = os.path.join(sock_dir, "engram.sock")
    pid, running = _serve_as(NOBODY, model, sock)
    try:
        _wait_ready(sock, pid)
        with pytest.raises(StorageError, match=f"runs as uid {NOBODY}, neither ours .* "
                                               f"service_uids=\\[{NOBODY}\\]"):
            SharedEngramTable.attach(SPEC, LAYER, SHARD, service=sock)
        ids = _ids()
        with SharedEngramTable.attach(SPEC, LAYER, SHARD, service=sock,
                                      service_uids=[NOBODY]) as t:
            assert torch.equal(t.lookup(ids).view(torch.int16),
                               _reference(model, ids).view(torch.int16))
        os.environ[serviceclient.UIDS_ENV] = str(NOBODY)  # the operator's allowance, by environment
        try:
            SharedEngramTable.attach(SPEC, LAYER, SHARD, service=sock).close()
        finally:
            del os.environ[serviceclient.UIDS_ENV]
    finally:
        os.close(running)
        _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


@pytest.fixture
def in_process_service(world_readable_model, tmp_path):
    _, model = world_readable_model
    service = TableService(ModelDirectory.open(model), str(tmp_path / "run" / "engram.sock"))
    service.start()
    service.load_all()
    yield service
    service.stop()


def test_a_sealed_descriptor_reopened_read_write_cannot_change_the_table(in_process_service):
    request = serviceclient.TableRequest(SPEC.fingerprint, in_process_service.tables[0].key, 4096)
    fd, _, _ = serviceclient.fetch(in_process_service.socket_path, request)
    try:
        rw = os.open(f"/proc/self/fd/{fd}", os.O_RDWR)  # the attack: a writable reopen
        try:
            size = os.fstat(rw).st_size
            with pytest.raises(OSError) as err:
                os.pwrite(rw, b"\xff" * 16, size // 2)
            assert err.value.errno == errno.EPERM
            with pytest.raises(OSError):
                mmap.mmap(rw, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            punch = _libc.fallocate(rw, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE,
                                    ctypes.c_long(0), ctypes.c_long(size))
            assert punch == -1 and ctypes.get_errno() == errno.EPERM
            with pytest.raises(OSError):
                os.truncate(rw, 0)
            with pytest.raises(OSError):
                os.truncate(rw, size * 2)
        finally:
            os.close(rw)
    finally:
        os.close(fd)


def test_a_service_never_hands_out_a_table_the_kernel_would_not_seal(
        world_readable_model, tmp_path, monkeypatch):
    _, model = world_readable_model
    # as a pre-4.16 hugetlb memfd
    monkeypatch.setattr(tableservice, "seal_contents", lambda fd: False)
    service = TableService(ModelDirectory.open(model), str(tmp_path / "engram.sock"))
    service.start()
    try:
        service.load_all()
        table = serviceclient.status(service.socket_path)["tables"][0]
        assert table["state"] == "ready" and not table["sealed"]
        assert table["handout"].startswith("refused")
        with pytest.raises(ServiceRefusal, match="would not seal") as err:
            SharedEngramTable.attach(SPEC, LAYER, SHARD, service=service.socket_path,
                                     allow_unsealed=True)
        assert err.value.reason == "unsealed"
    finally:
        service.stop()


def test_a_writable_mapping_left_in_a_reference_cycle_is_collected_before_the_seal():
    fd = os.memfd_create("numa-engram-seal-test", os.MFD_ALLOW_SEALING | os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, mmap.PAGESIZE)
        cycle: list = [mmap.mmap(fd, mmap.PAGESIZE)]
        cycle.append(cycle)  # only a collection frees the writable mapping
        del cycle
        gc_was = gc.isenabled()
        gc.disable()  # no collection of its own between the two seals
        try:
            assert not tableservice.seal_contents(fd)  # the kernel refuses: EBUSY
            assert tableservice._sealed(fd)
        finally:
            if gc_was:
                gc.enable()
        assert fcntl.fcntl(fd, fcntl.F_GET_SEALS) & fcntl.F_SEAL_WRITE
    finally:
        os.close(fd)


def _hand_out(sock_path, fd, stop):
    """A service that hands ``fd`` to whoever asks (an unsealed impostor)."""
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(sock_path)
    listener.listen()
    listener.settimeout(0.1)
    while not stop.is_set():
        try:
            conn, _ = listener.accept()
        except TimeoutError:
            continue
        with conn:
            serviceclient.read_request(conn, 5.0)
            serviceclient.send_answer(conn, {"ok": True, "table": {}}, fd)
    listener.close()


def test_an_unsealed_descriptor_is_refused_unless_the_operator_allows_it(tmp_path):
    ids = _ids()
    with SharedEngramTable.create(SPEC, LAYER, SHARD, directory=None) as made:
        made.weights[:] = np.random.default_rng(1).integers(0, 0x7F, made.weights.shape,
                                                            dtype=np.uint8)
        fd = made.dup_descriptor()
        want = made.lookup(ids).clone()
        sock, stop = str(tmp_path / "impostor.sock"), threading.Event()
        server = threading.Thread(target=_hand_out, args=(sock, fd, stop), daemon=True)
        server.start()
        try:
            for _ in range(100):
                if os.path.exists(sock):
                    break
                time.sleep(0.01)
            with pytest.raises(StorageError, match="not sealed against writes"):
                SharedEngramTable.attach(SPEC, LAYER, SHARD, service=sock)
            with SharedEngramTable.attach(SPEC, LAYER, SHARD, service=sock,
                                          allow_unsealed=True) as t:
                assert torch.equal(t.lookup(ids).view(torch.int16), want.view(torch.int16))
        finally:
            stop.set()
            server.join()
            os.close(fd)


def test_trust_settings_are_checked():
    with pytest.raises(ValueError, match="service_uids must be non-negative integers"):
        ServiceTrust.of([-1])
    os.environ[serviceclient.UIDS_ENV] = "12,x"
    try:
        with pytest.raises(ValueError, match="comma-separated numeric uids"):
            ServiceTrust.of()
    finally:
        del os.environ[serviceclient.UIDS_ENV]
    assert ServiceTrust.of([5], True) == ServiceTrust((5,), True)
