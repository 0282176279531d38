"""The table service's wire protocol: table descriptors handed over a Unix
stream socket (``SCM_RIGHTS``), and the client side of it.

A request is one JSON object on one line (at most ``MAX_REQUEST`` bytes);
the answer is a 4-byte little-endian length and a JSON object, with the
table's descriptor attached to its first bytes when the answer is a table.
Operations: ``attach`` (fingerprint, layer, shard key, page size and the
client's NUMA node), ``status`` (what is held, loading or ready).  A refusal
names its reason: ``no_such_table``, ``not_ready`` (with the load's
progress), ``failed`` (its load failed), ``mismatch``, ``refused`` (the peer's uid may not attach),
``unsealed`` (the kernel would not seal the table, so no client may map it),
``bad_request``.

A client trusts only a service run by its own uid or root (``SO_PEERCRED``)
and only a descriptor sealed against writes, growth and shrinking
(``F_GET_SEALS``); the operator widens that explicitly (``ServiceTrust``:
parameters, or ``NUMA_ENGRAM_SERVICE_UIDS`` and
``NUMA_ENGRAM_ALLOW_UNSEALED=1``).  No torch here.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import struct
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import ServiceRefusal, StorageError
from .fileformat import ShardKey
from .unixsockets import peer_uid

MAX_REQUEST = 64 << 10   # a request is a few hundred bytes; more is garbage
MAX_ANSWER = 16 << 20    # a status of thousands of tables still fits
LENGTH = struct.Struct("<I")
OPS = ("attach", "status")
REASONS = ("no_such_table", "not_ready", "failed", "mismatch", "refused", "unsealed",
           "bad_request")
CLIENT_TIMEOUT_S = 10.0
REQUIRED_SEALS = fcntl.F_SEAL_WRITE | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SHRINK
UIDS_ENV, UNSEALED_ENV = "NUMA_ENGRAM_SERVICE_UIDS", "NUMA_ENGRAM_ALLOW_UNSEALED"
__all__ = ["REASONS", "ServiceRefusal", "ServiceTrust", "TableRequest", "ask", "fetch",
           "status"]


@dataclass(frozen=True)
class ServiceTrust:
    """Whom a client believes: a service whose uid is ours, root, or one of
    ``uids``; a descriptor sealed against write, grow and shrink, or any
    with ``allow_unsealed`` (a service that could rewrite or shrink the rows
    under the engine: corrupt rows, or SIGBUS)."""

    uids: tuple[int, ...] = ()
    allow_unsealed: bool = False

    @classmethod
    def of(cls, uids: Sequence[int] | None = None,
           allow_unsealed: bool | None = None) -> ServiceTrust:
        """The given allowances, each defaulting to its environment variable
        (``NUMA_ENGRAM_SERVICE_UIDS``: comma-separated uids;
        ``NUMA_ENGRAM_ALLOW_UNSEALED=1``)."""
        if uids is None:
            uids = _env_uids()
        elif not all(isinstance(u, int) and not isinstance(u, bool) and u >= 0 for u in uids):
            raise ValueError(f"service_uids must be non-negative integers, got {list(uids)!r}")
        if allow_unsealed is None:
            allow_unsealed = os.environ.get(UNSEALED_ENV, "") in ("1", "true", "yes")
        return cls(tuple(uids), bool(allow_unsealed))

    def check_peer(self, path: str, uid: int) -> None:
        if uid not in (os.geteuid(), 0, *self.uids):
            raise StorageError(
                f"the table service at {path} runs as uid {uid}, neither ours ({os.geteuid()}) "
                f"nor root: refusing to attach (another user's service could rewrite or shrink "
                f"the rows under this engine); if uid {uid} is your service, allow it with "
                f"service_uids=[{uid}] or {UIDS_ENV}={uid}")

    def check_seals(self, path: str, fd: int) -> None:
        try:
            seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        except OSError:
            seals = 0  # a file that cannot be sealed at all
        if seals & REQUIRED_SEALS != REQUIRED_SEALS and not self.allow_unsealed:
            raise StorageError(
                f"the table service at {path} handed over a table not sealed against writes, "
                f"growth and shrinking (seals {seals:#x}): its rows could change or vanish "
                f"under this engine; refusing it (allow_unsealed=True or {UNSEALED_ENV}=1 "
                "accepts it where the service is trusted)")


def _env_uids() -> tuple[int, ...]:
    text = os.environ.get(UIDS_ENV, "").strip()
    if not text:
        return ()
    try:
        uids = tuple(int(u) for u in text.split(",") if u.strip())
    except ValueError:
        raise ValueError(f"{UIDS_ENV}={text!r}: give comma-separated numeric uids") from None
    if any(u < 0 for u in uids):
        raise ValueError(f"{UIDS_ENV}={text!r}: uids are non-negative")
    return uids


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


def read_request(sock: socket.socket, timeout_s: float) -> dict:
    """One request line, bounded in size and in time as a whole (a client
    that trickles bytes is cut at ``timeout_s``): a ValueError for garbage,
    too much, too slow, too deeply nested, or a peer that went away."""
    data = b""
    deadline = time.monotonic() + timeout_s
    while not data.endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0:
            raise ValueError(f"the request was not complete within {timeout_s:g} s")
        sock.settimeout(left)
        try:
            chunk = sock.recv(4096)
        except TimeoutError:
            raise ValueError(f"the request was not complete within {timeout_s:g} s") from None
        if not chunk:
            raise ValueError("the client closed the connection before a whole request")
        data += chunk
        if len(data) > MAX_REQUEST:
            raise ValueError(f"a request longer than {MAX_REQUEST} bytes")
    try:
        doc = json.loads(data)
    except RecursionError:
        raise ValueError("a request nested too deeply") from None
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

def ask(path: str, doc: dict, timeout_s: float = CLIENT_TIMEOUT_S,
        trust: ServiceTrust | None = None) -> tuple[dict, list[int], tuple[int, int, int]]:
    """Send one request to the service at ``path``; (answer, descriptors,
    the service's (pid, uid, gid)).  With ``trust``, a service of a uid it
    does not name is refused before anything is sent."""
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
        if trust is not None:
            trust.check_peer(path, server[1])
        try:
            sock.sendall(json.dumps(doc).encode() + b"\n")
        except (BrokenPipeError, ConnectionResetError):
            pass  # a service that refuses a peer answers at once and closes: read its answer
        try:
            answer, fds = _read_answer(sock)
        except (OSError, ValueError) as exc:
            raise StorageError(f"the table service at {path} did not answer: {exc}") from None
        return answer, fds, server
    finally:
        sock.close()


def fetch(path: str, request: TableRequest, timeout_s: float = CLIENT_TIMEOUT_S,
          trust: ServiceTrust | None = None) -> tuple[int, dict, int]:
    """The table's descriptor from the service at ``path``: (fd, the
    service's description of it, the service's uid), from a service and of
    a descriptor ``trust`` (default: ``ServiceTrust.of()``) believes.  A
    refusal is a ServiceRefusal naming the reason."""
    trust = trust or ServiceTrust.of()
    answer, fds, server = ask(path, request.to_dict(), timeout_s, trust)
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
    try:
        trust.check_seals(path, fds[0])
    except BaseException:
        os.close(fds[0])
        raise
    return fds[0], answer.get("table", {}), server[1]


def status(path: str, timeout_s: float = CLIENT_TIMEOUT_S,
           trust: ServiceTrust | None = None) -> dict[str, Any]:
    """What the service holds (``numa-engram status``); with ``trust``, only
    from a service it believes."""
    answer, fds, server = ask(path, {"op": "status"}, timeout_s, trust)
    for fd in fds:
        os.close(fd)
    answer["service_pid"] = server[0]
    return answer
