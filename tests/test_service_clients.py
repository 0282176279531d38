"""No client can starve, hang or crash the table service: a request is
bounded in time as a whole (not per recv), an idle flood past
RLIMIT_NOFILE leaves good clients answered within a second and the
service near idle, deeply nested JSON and unknown ops get a bad_request
answer (and no descriptor)."""

import json
import os
import resource
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from numa_engram import EngramSpec, SharedEngramTable, shard_heads, write_synthetic_model
from numa_engram.errors import StorageError
from numa_engram.service.tableservice import CLIENT_TIMEOUT_S
from numa_engram.store import serviceclient

pytestmark = pytest.mark.multiproc

SPEC = EngramSpec.small(rows_per_head=300, n_head_per_ngram=2, head_dim=64, max_ngram_size=3)
NOFILE = 64


def _limit_descriptors():
    resource.setrlimit(resource.RLIMIT_NOFILE, (NOFILE, NOFILE))


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    top = tmp_path_factory.mktemp("svc")
    model = write_synthetic_model(top / "model", SPEC)
    sock = str(top / "run" / "engram.sock")
    proc = subprocess.Popen([sys.executable, "-m", "numa_engram.cli.app", "serve", str(model),
                             "--socket", sock, "--tp", "1"], preexec_fn=_limit_descriptors,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.stderr.read()[-3000:]
            assert time.monotonic() < deadline, "the service did not get ready"
            try:
                if serviceclient.status(sock)["ready"]:
                    break
            except (StorageError, OSError):
                pass
            time.sleep(0.05)
        yield proc, sock
    finally:
        proc.terminate()
        proc.wait(30)


def _cpu_seconds(pid):
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_a_trickling_client_is_cut_at_the_per_request_bound(service):
    _, sock = service
    conn = socket.socket(socket.AF_UNIX)
    conn.connect(sock)
    conn.settimeout(0.3)
    started, cut = time.monotonic(), None
    request = json.dumps({"op": "status"}).encode()
    for byte in request * 10:  # a byte every 0.3 s: 12 s in all, never a whole line
        try:
            conn.sendall(bytes([byte]))
            data = conn.recv(65536)
        except TimeoutError:
            continue
        except OSError:
            data = b""
        cut = time.monotonic() - started
        break
    conn.close()
    assert cut is not None, "the trickling client was answered or kept for 12 s"
    assert CLIENT_TIMEOUT_S - 0.5 <= cut <= CLIENT_TIMEOUT_S + 1.5, cut
    assert data == b"" or b"not complete within" in data


def test_an_idle_flood_past_the_descriptor_limit_starves_nobody(service):
    proc, sock = service
    flood = []
    for _ in range(80):  # more than RLIMIT_NOFILE: each says nothing
        s = socket.socket(socket.AF_UNIX)
        s.connect(sock)
        flood.append(s)
    try:
        time.sleep(0.5)  # the service has seen them all
        cpu, wall = _cpu_seconds(proc.pid), time.monotonic()
        time.sleep(2.0)
        busy = (_cpu_seconds(proc.pid) - cpu) / (time.monotonic() - wall)
        assert busy < 0.15, f"the service spent {busy:.0%} of a CPU with idle clients"
        for _ in range(3):
            started = time.monotonic()
            assert serviceclient.status(sock, timeout_s=1.0)["ready"]
            assert time.monotonic() - started < 1.0
        layer = SPEC.layer_ids[0]
        with SharedEngramTable.attach(SPEC, layer, shard_heads(SPEC.bucket_sizes(layer), 1, 0),
                                      service=sock, timeout_s=1.0) as t:
            assert t.mode == "service"
        assert proc.poll() is None
    finally:
        for s in flood:
            s.close()


@pytest.mark.parametrize("request_line, says", [
    (b"[" * 30000 + b"]" * 30000 + b"\n", "nested too deeply"),
    (json.dumps({"op": "shutdown"}).encode() + b"\n", "unknown op 'shutdown'"),
    (json.dumps({"op": None, "layer": 1}).encode() + b"\n", "unknown op"),
])
def test_nested_json_and_unknown_ops_get_a_bad_request_and_no_descriptor(
        service, request_line, says):
    _, sock = service
    conn = socket.socket(socket.AF_UNIX)
    conn.connect(sock)
    conn.settimeout(10)
    conn.sendall(request_line)
    data, fds, _, _ = socket.recv_fds(conn, 65536, 4)
    conn.close()
    for fd in fds:
        os.close(fd)
    assert not fds
    answer = json.loads(data[4:])
    assert answer["reason"] == "bad_request" and says in answer["message"], answer
