"""The table lifecycle (``tables.familytable.FamilyTable``) as one contract
over every table family: a private table made, then attached by its path,
a descriptor, the table service and a group's holders, each attach
reading the rows the table holds; stats with the lookups' latency; the
mode report's keys; close racing lookups in real threads (full rows or
"closed", never a crash) and racing itself (once, whatever the
interleaving)."""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from numa_engram import EngramSpec, SharedEngramTable, shard_heads
from numa_engram.checkpoints.synthetic import write_ple_checkpoint, write_synthetic_checkpoint
from numa_engram.errors import StorageError
from numa_engram.model.ple import PLESpec
from numa_engram.store import fdhandover
from numa_engram.tables.pletable import SharedPLETable

from .support import ple_scenarios
from .support.threadworld import run_threads

torch = pytest.importorskip("torch")

ENGRAM = EngramSpec.small(rows_per_head=300, n_head_per_ngram=2, head_dim=64, max_ngram_size=3)
PLE = PLESpec(layer_ids=[2, 5], ple_embed_dim=160, vocab_size=5000, eos_token_id=7,
              ngram_vocab_size_base=3000, split_ngram_parts=7)

COMMON_KEYS = {"family", "tier", "mode", "requested_mode", "fallback_reason", "layer_id",
               "row_start", "row_end", "num_rows", "sharing_group", "member_pids", "leader",
               "backing_path", "backing_bytes", "placement", "registered_device",
               "lookup_threads", "lookup_cpus", "identity", "startup_s", "startup_gib_per_s"}


@dataclass(frozen=True)
class Family:
    """How the contract makes, attaches and reads one family's table."""

    name: str
    cls: Any
    spec: Any
    layer: int
    own_keys: frozenset[str]  # the mode report's keys of the family

    def shard_args(self) -> dict[str, Any]:
        if self.name == "engram":
            return {"shard": shard_heads(self.spec.bucket_sizes(self.layer), 1, 0)}
        return {"etp_rank": 0, "etp_size": 1}

    def create(self, **kw: Any) -> Any:
        return self.cls.create(self.spec, self.layer, **self.shard_args(), **kw)

    def attach(self, **kw: Any) -> Any:
        return self.cls.attach(self.spec, self.layer, **self.shard_args(), **kw)

    def ids(self, n: int, seed: int = 0) -> np.ndarray:
        rng = np.random.default_rng(seed)
        if self.name == "engram":
            smallest = min(self.spec.bucket_sizes(self.layer))
            return rng.integers(0, smallest, (n, self.spec.n_hash_cols))
        return rng.integers(0, self.spec.rows(self.layer), (n, self.spec.n_heads))

    def checkpoint(self, root: Path) -> str:
        if self.name == "engram":
            return str(write_synthetic_checkpoint(root / "engram.safetensors", self.spec, seed=3))
        return str(write_ple_checkpoint(root / "ple.safetensors", self.spec, seed=3))

    def model(self, root: Path) -> Any:
        """A model directory of the family, opened (what ``serve`` reads)."""
        if self.name == "engram":
            pytest.importorskip("tokenizers", reason="the 'tokenizers' extra is not installed")
            from numa_engram import ModelDirectory, write_synthetic_model

            return ModelDirectory.open(str(write_synthetic_model(root / "m", self.spec)))
        from numa_engram.runtime.plemodeldir import PLEModelDirectory

        return PLEModelDirectory.open(str(ple_scenarios.write_ple_model(root / "m", self.spec)))


FAMILIES = {
    "engram": Family("engram", SharedEngramTable, ENGRAM, 1,
                     frozenset({"embedding_dp_size", "head_start", "head_end"})),
    "ple": Family("ple", SharedPLETable, PLE, 2, frozenset({"etp_rank", "etp_size"})),
}


@pytest.fixture(params=sorted(FAMILIES))
def family(request) -> Family:
    return FAMILIES[request.param]


@pytest.fixture
def runtime_dir(monkeypatch):
    """A short hand-over root of this test's own (a socket path is at most
    107 bytes): what is left in it is this test's."""
    root = tempfile.mkdtemp(prefix="ne-life-", dir="/tmp")
    monkeypatch.setenv(fdhandover.ROOT_ENV, root)
    yield root
    shutil.rmtree(root, ignore_errors=True)


def bits(rows: Any) -> torch.Tensor:
    """A lookup's BF16 rows as their bits (FP8 bytes at random hold NaNs)."""
    return rows.view(torch.int16)


def copy_to(fd: int, path: Path) -> None:
    """The table file behind ``fd`` as a regular file at ``path`` (ours, 0600)."""
    out = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        size, done = os.fstat(fd).st_size, 0
        while done < size:
            done += os.sendfile(out, fd, done, size - done)
    finally:
        os.close(out)


# ------------------------------------------------------------- attach --

def test_a_private_table_is_attached_by_its_path_and_by_a_descriptor(family, tmp_path):
    """PLE tables attached only through a service or a group's holders:
    ``path=`` and ``fd=`` were Engram's alone."""
    ids = family.ids(64)
    with family.create(mode="independent", directory=None,
                       checkpoint=family.checkpoint(tmp_path)) as table:
        want = bits(table.lookup(ids))
        fd = table.dup_descriptor()
        try:
            with family.attach(fd=fd) as by_fd:
                assert (by_fd.mode, by_fd.requested_mode) == ("attached", "attach")
                assert not by_fd.backing.mapping.writable
                assert torch.equal(bits(by_fd.lookup(ids)), want)
            copy_to(fd, tmp_path / "table")
        finally:
            os.close(fd)
    with family.attach(path=str(tmp_path / "table")) as by_path:
        assert by_path.mode == "attached" and by_path.path == str(tmp_path / "table")
        assert torch.equal(bits(by_path.lookup(ids)), want)
    with pytest.raises(ValueError, match="exactly one of path=, fd=, service= or peers="):
        family.attach(path=str(tmp_path / "table"), fd=0)


def test_the_table_service_hands_a_table_over(family, tmp_path):
    from numa_engram.service.tableservice import TableService

    model = family.model(tmp_path)
    ids = family.ids(64, seed=1)
    run = tempfile.mkdtemp(prefix="ne-svc-", dir="/tmp")
    service = TableService(model, os.path.join(run, "s.sock"))
    service.start()
    try:
        service.load_all()
        with family.create(mode="independent", directory=None,
                           checkpoint=model.checkpoint) as private, \
                family.attach(service=service.socket_path) as served:
            assert (served.mode, served.requested_mode) == ("service", "service")
            assert torch.equal(bits(served.lookup(ids)), bits(private.lookup(ids)))
    finally:
        service.stop()
        shutil.rmtree(run, ignore_errors=True)


def test_a_late_process_attaches_from_the_groups_holders(family, runtime_dir, tmp_path):
    ckpt = family.checkpoint(tmp_path)
    ids = family.ids(64, seed=2)
    tables: dict[int, Any] = {}

    def member(rank, world):
        tables[rank] = family.create(mode="dp_shared", checkpoint=ckpt,
                                     group=world.group(rank, 10))
        return {}
    for r in run_threads(2, member):
        assert r["ok"], r
    want = bits(tables[0].lookup(ids))
    late = family.attach(peers=tables[0].handover)
    for t in tables.values():
        t.close()
    with late:
        assert late.mode == "dp_shared" and late.handover == tables[0].handover
        assert torch.equal(bits(late.lookup(ids)), want)
    assert not os.listdir(runtime_dir)


def test_a_table_that_cannot_be_made_of_what_was_built_keeps_nothing(family, monkeypatch):
    """A table whose rows cannot be made (the rows object refused) of what
    a create or an attach built raises that and keeps no descriptor."""
    with family.create(mode="independent", directory=None) as table:
        fd = table.dup_descriptor()
    before = sorted(os.listdir("/proc/self/fd"))

    def refused(*args, **kwargs):  # noqa: ARG001
        raise MemoryError("no room for the rows")
    # the family's rows object, as its table module names it
    monkeypatch.setattr(sys.modules[family.cls.__module__],
                        "ShardRows" if family.name == "engram" else "PLERows", refused)
    try:
        with pytest.raises(MemoryError, match="no room"):
            family.create(mode="independent", directory=None)
        with pytest.raises(MemoryError, match="no room"):
            family.attach(fd=fd)
        assert sorted(os.listdir("/proc/self/fd")) == before
    finally:
        os.close(fd)


# ------------------------------------------------------------ reports --

def test_stats_carry_the_lookups_latency(family):
    """PLE tables reported no latency (``latency=()``): their kernel
    counted it, the stats left it out."""
    with family.create(mode="independent", directory=None) as table:
        for n in (1, 8, 200):
            table.lookup(family.ids(n))
        s = table.stats()
        assert (s.lookups, s.layer_id) == (3, family.layer)
        buckets, total = s.latency
        assert buckets[-1] == ("+Inf", 3), buckets
        assert [c for _, c in buckets] == sorted(c for _, c in buckets)  # cumulative
        assert total == pytest.approx(s.lookup_seconds) and total > 0


def test_the_mode_report_has_every_tables_keys_and_the_familys(family, tmp_path):
    """PLE tables had no ``mode_report()``."""
    with family.create(mode="independent", directory=None) as table:
        report = table.mode_report()
        assert set(report) == COMMON_KEYS | family.own_keys, set(report) ^ COMMON_KEYS
        assert (report["family"], report["tier"], report["mode"], report["requested_mode"]) \
            == (family.name, "resident", "independent", "independent")
        assert (report["layer_id"], report["num_rows"]) == (family.layer, table.shard.num_rows)
        assert report["member_pids"] == [os.getpid()] and report["backing_bytes"] > 0
        json.dumps(report)
        fd = table.dup_descriptor()
        try:
            with family.attach(fd=fd) as attached:
                doc = attached.mode_report()
                assert set(doc) == set(report)
                assert (doc["mode"], doc["requested_mode"]) == ("attached", "attach")
        finally:
            os.close(fd)


# -------------------------------------------------------------- close --

def test_close_under_lookups_gives_full_rows_or_closed(family):
    """Real threads look up while the table closes: each lookup returns
    the whole rows or raises StorageError saying closed, nothing else;
    close() again does nothing."""
    table = family.create(mode="independent", directory=None, lookup_threads=2)
    ids = family.ids(300)
    want = bits(table.lookup(ids))
    outcomes: list[str] = []
    started = threading.Barrier(4)

    def reader() -> None:
        started.wait()
        while True:
            try:
                got = table.lookup(ids)
            except StorageError as exc:
                outcomes.append("closed" if "closed" in str(exc) else f"other: {exc}")
                return
            except Exception as exc:  # (the assertion names it)
                outcomes.append(f"{type(exc).__name__}: {exc}")
                return
            outcomes.append("rows" if torch.equal(bits(got), want) else "wrong rows")
    readers = [threading.Thread(target=reader) for _ in range(3)]
    for th in readers:
        th.start()
    started.wait()
    while not outcomes:  # the readers are looking up
        threading.Event().wait(0.001)
    table.close()
    for th in readers:
        th.join(60)
    assert set(outcomes) == {"rows", "closed"}, sorted(set(outcomes))
    assert table.closed
    table.close()
    with pytest.raises(StorageError, match="closed"):
        table.lookup(ids)
    with pytest.raises(StorageError, match="closed"):
        table.dup_descriptor()


def _yield_at_every_line_of_close(frame, event, arg):  # noqa: ARG001
    """A trace function: the thread lets the others run before each line
    of a table's ``close`` (the worst interleaving of closers)."""
    if event == "call" and frame.f_code.co_name == "close" and \
            "numa_engram/tables/" in frame.f_code.co_filename:
        return _yield_line
    return None


def _yield_line(frame, event, arg):  # noqa: ARG001
    if event == "line":
        os.sched_yield()
        threading.Event().wait(0.0005)
    return _yield_line


def closed_at_once(table: Any, closers: int) -> list[BaseException]:
    """``table.close()`` in ``closers`` threads let go together, each
    yielding before every line of close; what they raised."""
    errors: list[BaseException] = []
    ready = threading.Barrier(closers)

    def closer() -> None:
        ready.wait()
        try:
            table.close()
        except BaseException as exc:  # (the assertion names it)
            errors.append(exc)
    before = threading.gettrace()  # (a coverage run's tracer: put back after)
    threading.settrace(_yield_at_every_line_of_close)
    try:
        threads = [threading.Thread(target=closer) for _ in range(closers)]
        for th in threads:
            th.start()
    finally:
        threading.settrace(before)  # type: ignore[arg-type]
    for th in threads:
        th.join(60)
    return errors


def test_close_from_many_threads_at_once_closes_once(family):
    """PLE's close took no lock: two closers interleaved line by line both
    passed its check, and the second closed no file (AttributeError)."""
    tracer = sys.gettrace()
    for _ in range(10):
        table = family.create(mode="independent", directory=None)
        assert closed_at_once(table, 3) == []
        assert table.closed
        with pytest.raises(StorageError, match="closed"):
            table.lookup(family.ids(2))
    assert sys.gettrace() is tracer
