"""The table service's wire protocol: table descriptors handed over a Unix
stream socket (``SCM_RIGHTS``), and the client side of it.

A request is one JSON object on one line (at most ``MAX_REQUEST`` bytes);
the answer is a 4-byte little-endian length and a JSON object, with the
table's descriptor attached to its first bytes when the answer is a table.
Operations: ``attach`` (fingerprint, layer, shard key, page size and the
client's NUMA node), ``status`` (what is held, loading or ready).  A refusal
names its reason: ``no_such_table``, ``not_ready`` (with the load's
progress), ``failed`` (its load failed), ``mismatch``, ``refused`` (the peer's uid may not attach),
``bad_request``.  No torch here.
"""

from __future__ import annotations

import json
import os
import socket
import struct
from dataclasses import dataclass
from typing import Any

from ..errors import ServiceRefusal, StorageError
from .fileformat import ShardKey

MAX_REQUEST = 64 << 10   # a request is a few hundred bytes; more is garbage
MAX_ANSWER = 16 << 20    # a status of thousands of tables still fits
LENGTH = struct.Struct("<I")
REASONS = ("no_such_table", "not_ready", "failed", "mismatch", "refused", "bad_request")
CLIENT_TIMEOUT_S = 10.0
__all__ = ["REASONS", "ServiceRefusal", "TableRequest", "ask", "fetch", "status"]


@dataclass(frozen=True)
class TableRequest:
    """What a client names: the table's spec fingerprint, layer, shard and
    page size, and the NUMA node it reads from (a service holding one copy
    per node hands out that node's)."""

    fingerprint: bytes
    key: ShardKey
    page_size: int
    node: int | None = None

    def to_dict(self) -> dict:
        return {"op": "attach", "fingerprint": self.fingerprint.hex(),
                "layer": self.key.layer_id,
                "key": [self.key.head_start, self.key.head_end, self.key.row_start,
                        self.key.row_end], "page_size": self.page_size, "node": self.node}

    @classmethod
    def from_dict(cls, doc: dict) -> TableRequest:
        """Parsed and type-checked: a ValueError names what is wrong."""
        key = doc.get("key")
        if not isinstance(key, list) or len(key) != 4 or not all(isinstance(k, int)
                                                                  for k in key):
            raise ValueError("key must be [head_start, head_end, row_start, row_end]")
        layer, page, node = doc.get("layer"), doc.get("page_size"), doc.get("node")
        if not isinstance(layer, int) or not isinstance(page, int) or \
                not (node is None or isinstance(node, int)):
            raise ValueError("layer and page_size must be integers, node an integer or null")
        fingerprint = bytes.fromhex(str(doc.get("fingerprint", "")))
        if len(fingerprint) != 32:
            raise ValueError("fingerprint must be 32 bytes in hex")
        return cls(fingerprint, ShardKey(layer, *key), page, node)


# ----------------------------------------------------------- framing --

def send_answer(sock: socket.socket, doc: dict, fd: int | None = None) -> None:
    data = json.dumps(doc, default=str).encode()
    frame = LENGTH.pack(len(data)) + data
    if fd is None:
        sock.sendall(frame)
        return
    sent = socket.send_fds(sock, [frame], [fd])
    if sent < len(frame):
        sock.sendall(frame[sent:])


def read_request(sock: socket.socket) -> dict:
    """One request line, bounded in size (the socket's timeout bounds its
    time): a ValueError for garbage, too much, or a peer that went away."""
    data = b""
    while not data.endswith(b"\n"):
        chunk = sock.recv(4096)
        if not chunk:
            raise ValueError("the client closed the connection before a whole request")
        data += chunk
        if len(data) > MAX_REQUEST:
            raise ValueError(f"a request longer than {MAX_REQUEST} bytes")
    doc = json.loads(data)
    if not isinstance(doc, dict):
        raise ValueError("a request is a JSON object")
    return doc


def _read_answer(sock: socket.socket) -> tuple[dict, list[int]]:
    data, fds, _, _ = socket.recv_fds(sock, 65536, 4)
    try:
        data = _recv_to(sock, data, LENGTH.size)
        (length,) = LENGTH.unpack_from(data)
        if length > MAX_ANSWER:
            raise StorageError(f"the table service sent a {length}-byte answer")
        data = _recv_to(sock, data, LENGTH.size + length)
        return json.loads(data[LENGTH.size:LENGTH.size + length]), fds
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise


def _recv_to(sock: socket.socket, data: bytes, size: int) -> bytes:
    """``data`` and what follows it on ``sock`` until it holds ``size`` bytes."""
    while len(data) < size:
        more = sock.recv(65536)
        if not more:
            raise StorageError("the table service closed the connection mid-answer")
        data += more
    return data


# ------------------------------------------------------------ client --

def peer_uid(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end (``SO_PEERCRED``)."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", creds)
    return pid, uid, gid


def ask(path: str, doc: dict, timeout_s: float = CLIENT_TIMEOUT_S
        ) -> tuple[dict, list[int], tuple[int, int, int]]:
    """Send one request to the service at ``path``; (answer, descriptors,
    the service's (pid, uid, gid))."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout_s)
        try:
            sock.connect(path)
        except PermissionError:
            raise StorageError(f"cannot reach the table service at {path}: permission denied "
                               "(its socket admits the service's uid and its --group)") from None
        except OSError as exc:
            raise StorageError(f"no table service at {path} ({exc.strerror}); start one with "
                               "`numa-engram serve MODEL_DIR --socket PATH`") from None
        server = peer_uid(sock)
        sock.sendall(json.dumps(doc).encode() + b"\n")
        try:
            answer, fds = _read_answer(sock)
        except (OSError, ValueError) as exc:
            raise StorageError(f"the table service at {path} did not answer: {exc}") from None
        return answer, fds, server
    finally:
        sock.close()


def fetch(path: str, request: TableRequest,
          timeout_s: float = CLIENT_TIMEOUT_S) -> tuple[int, dict, int]:
    """The table's descriptor from the service at ``path``: (fd, the
    service's description of it, the service's uid).  A refusal is a
    ServiceRefusal naming the reason."""
    answer, fds, server = ask(path, request.to_dict(), timeout_s)
    if not answer.get("ok"):
        for fd in fds:
            os.close(fd)
        raise ServiceRefusal(f"the table service at {path} refused layer "
                             f"{request.key.layer_id} heads [{request.key.head_start}, "
                             f"{request.key.head_end}): {answer.get('message')}",
                             str(answer.get("reason", "")), answer.get("detail"))
    if len(fds) != 1:
        for fd in fds:
            os.close(fd)
        raise StorageError(f"the table service at {path} answered without a descriptor")
    return fds[0], answer.get("table", {}), server[1]


def status(path: str, timeout_s: float = CLIENT_TIMEOUT_S) -> dict[str, Any]:
    """What the service holds (``numa-engram status``)."""
    answer, fds, server = ask(path, {"op": "status"}, timeout_s)
    for fd in fds:
        os.close(fd)
    answer["service_pid"] = server[0]
    return answer
