"""The table service (``numa-engram serve``): a long-lived holder that
creates every table a host needs once, seals it and hands out its
descriptor to any number of engines, from any number of launches.

Each table is a memfd (never a path in /dev/shm: nothing to size, nothing
to evict, nothing to leak), placed as ``--placement`` says, loaded from the
model directory's checkpoint, then sealed against writes, growth and
shrinking (``F_SEAL_*``).  A table the kernel will not seal (a hugetlb memfd
before Linux 4.16) is never handed out: any client could reopen a read-only
descriptor of it through ``/proc/self/fd`` read-write and rewrite, punch or
shrink every engine's rows; attaches are refused as ``unsealed`` and
``status`` says so.  Engines receive a read-only descriptor
(``SCM_RIGHTS``), check its header as a peer checks the leader's file,
and map it: an attach costs a header read and a mmap, whatever the
table's size.

Under systemd the service speaks the notify protocol: each loaded table's
descriptor goes to the file descriptor store (``FDSTORE=1``, ``FDNAME=`` its
key), ``READY=1`` once every table is loaded, and on the next start the
stored descriptors come back in ``LISTEN_FDS`` and are adopted (header
checked) instead of reloaded: a service restart keeps every table.  Every
stored descriptor not adopted is removed from the store as it is closed
(``FDSTOREREMOVE=1``), so PID 1 never keeps an old model's tables; a
notify that fails is logged, never fatal.
"""

from __future__ import annotations

import gc
import grp
import logging
import os
import socket
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ..errors import CheckpointError, NumaEngramError, StorageError
from ..host import hugepages, procfs
from ..host.topology import Topology
from ..model.families import ENGRAM, Family, family_of
from ..model.family import TableFamily
from ..model.sharding import ShardInfo
from ..runtime.modeldirs import FamilyModelDirectory
from ..store import serviceclient, unixsockets
from ..store.fileformat import STATE_READY, ShardKey
from ..store.storage import BackingFile, read_only_descriptor, seal_contents
from ..tables.familytable import FamilyTable
from ..tables.familytables import create_shard
from ..tables.request import TableOptions, shard_key, table_layout
from . import systemd
from .listener import Listener

log = logging.getLogger(__name__)

CLIENT_TIMEOUT_S = 5.0  # a whole request, from accept; a slower client loses its connection
REPLICATE = "replicate-per-node"
# engines of a whole node start at once: a backlog of 5 would turn the sixth
# concurrent connect into EAGAIN
LISTEN_BACKLOG = 512


@dataclass
class HeldTable:
    """One table the service holds (or is loading)."""

    layer_id: int
    shard: ShardInfo
    node: int | None           # the node of this copy (replicate-per-node), else None
    policy: str
    tp_rank: int = 0
    state: str = "planned"     # planned | loading | ready | failed
    fd: int = -1               # the sealed memfd (what the fd store keeps)
    read_only_fd: int = -1     # what clients get
    sealed: bool = False
    adopted: bool = False      # came back from the fd store, not reloaded
    file_bytes: int = 0        # the table file: header, rows, scales, page padding
    done: int = 0              # load progress in row bytes
    total: int = 0
    error: str = ""
    bytes_per_node: dict[int, int] = field(default_factory=dict)
    phases: dict[str, float] = field(default_factory=dict)
    attaches: int = 0
    family: Family = ENGRAM    # which rows a shard is, and the table's name

    @property
    def key(self) -> ShardKey:
        return shard_key(self.layer_id, self.shard)

    def name(self, fingerprint: bytes, page_size: int) -> str:
        """Its FDNAME: printable, no ':' (systemd's rule), at most 255 bytes."""
        node = "all" if self.node is None else str(self.node)
        return self.family.table_name(fingerprint, self.layer_id, self.shard, page_size, node)

    def describe(self) -> dict:
        return {"layer": self.layer_id, "heads": [self.shard.head_start, self.shard.head_end],
                "rows": [self.shard.row_start, self.shard.row_end], "node": self.node,
                "policy": self.policy, "state": self.state, "sealed": self.sealed,
                "adopted": self.adopted, "bytes": self.file_bytes,
                "progress": [self.done, self.total],
                "error": self.error, "bytes_per_node": self.bytes_per_node,
                "startup_s": {k: round(v, 6) for k, v in self.phases.items()},
                "attaches": self.attaches, "handout": self.handout}

    @property
    def handout(self) -> str:
        """How clients get this table: a sealed descriptor, or refused."""
        if self.state != "ready":
            return "none yet"
        return "sealed read-only descriptor" if self.sealed else \
            "refused: the kernel would not seal it (a client could reopen it writable)"


class TableService:
    """Holds ``model``'s tables for TP ``tp`` and serves them on ``socket_path``."""

    def __init__(self, model: FamilyModelDirectory, socket_path: str, *,
                 tp: int = 1,
                 placement: str = "interleave", page_size: Any = "4K",
                 group: str | None = None, load_threads: int | None = None,
                 topology: Topology | None = None) -> None:
        self.model = model
        self.spec: TableFamily = model.spec  # of either family: asked through family_of
        self.socket_path = os.path.abspath(socket_path)
        self.page_size = hugepages.parse_page_size(page_size)
        self.placement, self.load_threads = placement, load_threads
        self.topology = topology or Topology.detect()
        self.gid = None if group is None else grp.getgrnam(group).gr_gid
        self.tp = tp
        self.tables = self._plan(tp)
        self._plans: dict[int, Any] | None = None  # the checkpoint's layers, resolved once
        self._lock = threading.Lock()
        self._listener: Listener | None = None
        self._stopped = threading.Event()
        self.started = time.time()

    # ------------------------------------------------------------ plan --
    def _plan(self, tp: int) -> list[HeldTable]:
        nodes: Sequence[int | None] = [None]
        if self.placement == REPLICATE:
            nodes = [n.id for n in self.topology.nodes if n.mem_total > 0] or [None]
        out = []
        family = family_of(self.spec)
        for layer in self.spec.layer_ids:
            for rank in range(tp):
                shard = family.shard(self.spec, layer, rank, tp)
                for node in nodes:
                    policy = self.placement if node is None else f"node:{node}"
                    out.append(HeldTable(
                        layer, shard, node, policy, rank,
                        total=shard.num_rows * self.spec.row_bytes, family=family,
                        file_bytes=table_layout(self.spec, shard, self.page_size).file_size))
        return out

    # ------------------------------------------------------------ load --
    def adopt(self, stored: Sequence[tuple[str, int]]) -> int:
        """Take back descriptors the fd store kept ((FDNAME, fd) pairs), each
        header checked; every other one is closed and removed from the store
        (a name passed twice keeps one descriptor).  How many were adopted."""
        wanted = {t.name(self.spec.fingerprint, self.page_size): t for t in self.tables}
        adopted, kept = 0, {}
        for name, fd in stored:
            table = wanted.get(name)
            if table is None or table.adopted or not self._adoptable(table, fd):
                why = "a second descriptor of that name" if table is not None and \
                    table.adopted else "not one of this model's tables"
                log.warning("stored descriptor %s (fd %d) is %s: closed and removed from the "
                            "fd store", name, fd, why)
                os.close(fd)
                if name not in kept:
                    systemd.notify(f"FDSTOREREMOVE=1\nFDNAME={name}")
                continue
            table.fd, table.read_only_fd = fd, read_only_descriptor(fd)
            table.sealed = seal_contents(fd)  # already sealed: the seals stay, this is a no-op
            table.state, table.adopted = "ready", True
            table.done = table.total
            kept[name] = fd
            adopted += 1
        for name, fd in kept.items():  # a removal above may have dropped it with a twin
            if sum(n == name for n, _ in stored) > 1:
                systemd.notify(f"FDSTOREREMOVE=1\nFDNAME={name}")
                systemd.notify(f"FDSTORE=1\nFDNAME={name}", [fd])
        return adopted

    def _adoptable(self, table: HeldTable, fd: int) -> bool:
        try:
            backing = BackingFile.attach(
                fd=fd, fingerprint=self.spec.fingerprint, key=table.key,
                layout_for=lambda page: table_layout(self.spec, table.shard, page))
        except NumaEngramError as exc:
            log.warning("stored descriptor refused: %s", exc)
            return False
        try:
            return backing.state == STATE_READY and backing.layout.page_size == self.page_size
        finally:
            backing.close()

    def load_all(self) -> None:
        """Create and load every table not adopted, one after the other;
        each goes to the fd store as soon as it is sealed; READY=1 at the
        end (a failed table is logged and answered as failed)."""
        for table in self.tables:
            if table.state == "ready" or self._stopped.is_set():
                continue
            try:
                self._load(table)
            except Exception as exc:  # one table's failure is answered, not fatal
                log.error("Engram layer %d heads [%d, %d): load failed: %s", table.layer_id,
                          table.shard.head_start, table.shard.head_end, exc)
                table.state, table.error = "failed", f"{type(exc).__name__}: {exc}"
                continue
            name = table.name(self.spec.fingerprint, self.page_size)
            systemd.notify(f"FDSTORE=1\nFDNAME={name}", [table.fd])
        ready = sum(t.state == "ready" for t in self.tables)
        systemd.notify(f"READY=1\nSTATUS={ready} of {len(self.tables)} Engram tables ready")
        log.info("table service: %d of %d tables ready", ready, len(self.tables))

    def _load(self, table: HeldTable) -> None:
        table.state = "loading"

        def progress(done: int, total: int) -> None:
            table.done, table.total = done, total
        created: FamilyTable
        options = TableOptions(directory=None, placement=table.policy, page_size=self.page_size,
                               load_threads=self.load_threads, progress=progress,
                               topology=self.topology)
        created = create_shard(self.spec, table.layer_id, table.shard,
                               self._checkpoint_of(table.layer_id), options)
        try:
            report = created.placement_report()
            table.bytes_per_node = {} if report is None else report.bytes_per_node()
            table.phases = dict(created.startup_phases)
            fd = created.dup_descriptor()
        finally:
            created.close()
        del created
        table.fd, table.sealed = fd, _sealed(fd)
        table.read_only_fd = read_only_descriptor(fd)
        table.done = table.total
        table.state = "ready"

    def _checkpoint_of(self, layer: int) -> Any:
        """What a table of ``layer`` loads from: its tensors as the whole
        model's checkpoint resolved once (the index and each file's header
        read once for every table, each file then checked unchanged by every
        load), or the checkpoint's path where the model's does not resolve
        whole: each table then resolves its own layer, and only a broken
        layer's tables fail, naming it."""
        if self._plans is None:
            try:
                self._plans = self.model.checkpoint_plans()
            except CheckpointError as exc:
                log.warning("table service: the checkpoint does not resolve for every layer "
                            "(%s); each table resolves its own", exc)
                self._plans = {}
        return self._plans.get(layer, self.model.checkpoint)

    # ----------------------------------------------------------- serve --
    def start(self) -> None:
        """Listen on the socket (a stale one of a dead service is replaced);
        answers begin at once, tables not loaded yet are "not_ready"."""
        _prepare_socket_path(self.socket_path, self.gid)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(self.socket_path)
            os.chmod(self.socket_path, 0o660 if self.gid is not None else 0o600)
            if self.gid is not None:
                os.chown(self.socket_path, -1, self.gid)
            sock.listen(LISTEN_BACKLOG)
        except BaseException:
            sock.close()
            raise
        self._listener = Listener(sock, self._answer)
        self._thread = threading.Thread(target=self._listener.serve_forever,
                                        name="engram-service", daemon=True)
        self._thread.start()
        log.info("table service on %s: %d tables of %s", self.socket_path, len(self.tables),
                 self.model.path)

    def wait(self, timeout_s: float | None = None) -> bool:
        """Until stop() (True), or ``timeout_s`` passed (False)."""
        return self._stopped.wait(timeout_s)

    def stop(self) -> None:
        """Stop answering, close every descriptor, remove the socket
        (idempotent).  Engines keep their mappings."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        if self._listener is not None:
            self._listener.stop()
            self._thread.join()
            self._listener.sock.close()
            try:
                os.unlink(self.socket_path)
            except FileNotFoundError:
                pass
        for table in self.tables:
            for fd in (table.fd, table.read_only_fd):
                if fd >= 0:
                    os.close(fd)
            table.fd = table.read_only_fd = -1

    # --------------------------------------------------------- answers --
    def _answer(self, sock: socket.socket) -> None:
        sock.settimeout(CLIENT_TIMEOUT_S)  # an answer the client does not read is dropped too
        pid, uid, gid = unixsockets.peer_uid(sock)
        try:
            if not self._allowed(pid, uid, gid):
                log.warning("table service: refused pid %d uid %d (not uid %d%s)", pid, uid,
                            os.geteuid(), "" if self.gid is None else f" or group {self.gid}")
                serviceclient.send_answer(sock, _refusal("refused", f"uid {uid} may not attach"))
                return
            try:
                doc = serviceclient.read_request(sock, CLIENT_TIMEOUT_S)
            except (ValueError, OSError) as exc:
                serviceclient.send_answer(sock, _refusal("bad_request", str(exc)[:200]))
                return
            sock.settimeout(CLIENT_TIMEOUT_S)
            if doc.get("op") not in serviceclient.OPS:
                serviceclient.send_answer(sock, _refusal(
                    "bad_request", f"unknown op {str(doc.get('op'))[:40]!r}; the ops are "
                    f"{', '.join(serviceclient.OPS)}"))
                return
            if doc.get("op") == "status":
                serviceclient.send_answer(sock, self.status())
                return
            answer, fd = self._attach_answer(doc)
            serviceclient.send_answer(sock, answer, fd)
        except OSError:
            pass  # the client went away: only its own connection ends

    def _allowed(self, pid: int, uid: int, gid: int) -> bool:
        if uid in (os.geteuid(), 0):
            return True
        if self.gid is None:
            return False
        return gid == self.gid or self.gid in procfs.supplementary_groups(pid)

    def _attach_answer(self, doc: dict) -> tuple[dict, int | None]:
        try:
            req = serviceclient.TableRequest.from_dict(doc)
        except (ValueError, TypeError) as exc:
            return _refusal("bad_request", str(exc)), None
        table, why = self._find(req)
        if table is None:
            return why, None
        if table.state == "ready" and not table.sealed:
            return _refusal("unsealed", "the kernel would not seal this table against writes, "
                            "so any client could reopen its descriptor writable; it is not "
                            "handed out (hugetlb memfds seal from Linux 4.16: upgrade, or "
                            "serve 4K pages)"), None
        if table.state != "ready":
            reason = "failed" if table.state == "failed" else "not_ready"
            return _refusal(reason, f"the table is {table.state}" + (
                f": {table.error}" if table.error else
                f" ({table.done} of {table.total} bytes)"),
                {"progress": [table.done, table.total]}), None
        with self._lock:
            table.attaches += 1
        return {"ok": True, "table": table.describe()}, table.read_only_fd

    def _find(self, req: serviceclient.TableRequest) -> tuple[HeldTable | None, dict]:
        same_key = [t for t in self.tables if t.key == req.key]
        if not same_key:
            return None, _refusal("no_such_table", f"no table holds {req.key}; this service "
                                  f"holds layers {list(self.spec.layer_ids)} for its TP shards")
        if req.fingerprint != self.spec.fingerprint or req.page_size != self.page_size:
            return None, _refusal("mismatch", f"the service holds spec "
                                  f"{self.spec.fingerprint.hex()[:16]} on "
                                  f"{hugepages.name_of(self.page_size)} pages; asked for spec "
                                  f"{req.fingerprint.hex()[:16]} on "
                                  f"{hugepages.name_of(req.page_size)} pages")
        mine = [t for t in same_key if t.node == req.node]
        return (mine or same_key)[0], {}

    def status(self) -> dict:
        return {"ok": True, "model_dir": self.model.path, "socket": self.socket_path,
                "page_size": self.page_size, "placement": self.placement,
                "spec_fingerprint": self.spec.fingerprint.hex(),
                "uptime_s": round(time.time() - self.started, 3),
                "ready": all(t.state == "ready" for t in self.tables),
                "tables": [t.describe() for t in self.tables]}


def _refusal(reason: str, message: str, detail: dict | None = None) -> dict:
    return {"ok": False, "reason": reason, "message": message, "detail": detail or {}}


def _prepare_socket_path(path: str, gid: int | None) -> None:
    """The socket's directory (made 0700, or 0750 for a group) and no
    stale socket: one a dead service left is removed, a live one refused."""
    directory = os.path.dirname(path)
    if not os.path.isdir(directory):
        os.makedirs(directory, mode=0o750 if gid is not None else 0o700)
        if gid is not None:
            os.chown(directory, -1, gid)
    state = unixsockets.free_socket_path(path)
    if state == "not a socket":
        raise StorageError(f"{path} exists and is not a socket; pass another --socket")
    if state == "in use":
        raise StorageError(f"a table service already listens on {path}; stop it first or "
                           "pass another --socket")


def _sealed(fd: int) -> bool:
    """Seal a loaded table; where a writable mapping of it is still alive
    in a reference cycle (the kernel refuses the write seal while one is),
    a collection frees it and the seal is tried once more.  The collection
    only on refusal: in a process holding torch it costs ~0.1 s a table."""
    if seal_contents(fd):
        return True
    gc.collect()
    return seal_contents(fd)
