"""dp_shared on 4 KiB pages without /dev/shm: the table is a memfd its
holders hand over at Unix sockets in a 0700 directory (store/fdhandover.py),
so a container's 64 MiB /dev/shm shares a table of any size, a late process
gets it from any holder still alive, and it dies with its last holder."""

import json
import os
import re
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from numa_engram import SharedEngramTable, shard_heads
from numa_engram.checkpoints.synthetic import synthetic_layer, write_synthetic_checkpoint
from numa_engram.errors import ServiceRefusal, StorageError
from numa_engram.store import fdhandover, serviceclient
from numa_engram.tables import protocol

from .conftest import shm_files
from .support import memfd_scenarios as scenarios
from .support.dist_harness import run_world
from .support.dist_scenarios import LAYER, make_spec
from .support.stranger import ask_as_nobody
from .support.threadworld import run_threads

ROOT = os.geteuid() == 0
SHM_MIB = 64
# 8 heads x ~96k rows x 132 B: a ~97 MiB table, above a 64 MiB /dev/shm
BIG_ROWS_PER_HEAD = 96_000


@pytest.fixture
def runtime_dir(monkeypatch):
    """A hand-over root of this test's own (ranks take the environment):
    what is left in it is this test's.  Short: a socket's path is at most
    107 bytes, and pytest's tmp_path is long."""
    root = tempfile.mkdtemp(prefix="ne-run-", dir="/tmp")
    monkeypatch.setenv(fdhandover.ROOT_ENV, root)
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def small_shm(tmp_path):
    """A 64 MiB tmpfs, Docker's default /dev/shm, for the ranks to mount there."""
    if not ROOT:
        pytest.skip("needs root to mount a 64 MiB tmpfs and give each rank a mount namespace "
                    "with it at /dev/shm")
    mnt = tmp_path / "shm64"
    mnt.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={SHM_MIB}m,mode=1777", "tmpfs",
                           str(mnt)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    yield str(mnt)
    subprocess.run(["umount", str(mnt)], check=False)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt") / "engram.safetensors"
    return str(write_synthetic_checkpoint(path, make_spec(1000)))


def _ok(results):
    for r in results:
        assert r["ok"], f"rank {r['rank']}: {r.get('traceback') or r}"


@pytest.mark.multiproc
def test_a_table_above_a_64_mib_dev_shm_is_one_copy_by_pss(small_shm, runtime_dir):
    """Four processes, each with a 64 MiB tmpfs at /dev/shm (a container's
    default), share one ~97 MiB table: the sum of their PSS is one copy,
    every member reads the leader's rows, and /dev/shm holds nothing."""
    world = 4
    results = run_world(world, scenarios.one_copy, rows_per_head=BIG_ROWS_PER_HEAD,
                        hosts=[(small_shm, "container", "/dev/shm")] * world, timeout_s=240)
    _ok(results)
    one = results[0]["backing_bytes"]
    assert one > SHM_MIB << 20
    pss = sum(r["pss"] for r in results)
    print(f"\n{world} members, /dev/shm {SHM_MIB} MiB: one copy {one / 2**20:.1f} MiB, sum of "
          f"PSS {pss / 2**20:.1f} MiB ({pss / one:.3f} copies)")
    assert abs(pss - one) <= 0.05 * one, (pss, one)
    for r in results:
        assert r["mode"] == "dp_shared" and r["shm_total"] == SHM_MIB << 20, r
        assert not r["shm_names"], "nothing may be made in /dev/shm"
    assert len({r["digest"] for r in results}) == 1
    assert not os.listdir(runtime_dir), "the last holder removes the hand-over directory"


@pytest.mark.multiproc
def test_a_late_member_joins_and_the_killed_creator_leaves_nothing(small_shm, runtime_dir,
                                                                    checkpoint):
    """World ranks 1-3 share a table (rank 1 creates it) with a 64 MiB
    /dev/shm; rank 1 is SIGKILLed: ranks 2 and 3 go on serving exact rows,
    rank 0 joins late from the hand-over directory (past the dead creator's
    socket) and, the last holder, leaves no directory, socket or file."""
    before = shm_files()
    results = run_world(4, scenarios.late_member_and_killed_creator, checkpoint=checkpoint,
                        hosts=[(small_shm, "container", "/dev/shm")] * 4, timeout_s=120)
    assert results[1]["exitcode"] == -9, results[1]
    for r in (results[0], results[2], results[3]):
        assert r["ok"], f"rank {r['rank']}: {r.get('traceback') or r}"
    for r in results[2:]:
        assert r["creator_dead"] and r["serving_exact"], r
    late = results[0]
    assert late["creator_dead_before_join"] and late["late_exact"], late
    assert late["late_mode"] == "dp_shared" and late["late_serves"], late
    assert late["dir_kept_by_last_holder"] and late["dir_gone_after_last"], late
    assert not os.listdir(runtime_dir), "no hand-over directory or socket is left"
    assert shm_files() == before and not os.listdir(small_shm)


@pytest.mark.multiproc
def test_the_vllm_plugins_dp_shared_tables_above_a_64_mib_dev_shm(small_shm, runtime_dir,
                                                                   tmp_path):
    """vLLM's DP-shared branch through the plugin, unchanged: TP 2 x DP 2
    ranks, each with a 64 MiB /dev/shm, share ~100 MiB of tables; vLLM's
    loader writes them, its forward gives the whole table's rows, and PSS
    summed over the ranks is one copy."""
    from numa_engram import EngramSpec, write_synthetic_model

    from .support import vllm_harness as harness
    from .support.vllm_scenarios import serve

    wheel, why = harness.wheel_sources()
    if wheel is None:
        pytest.skip(why)
    spec = EngramSpec.small(rows_per_head=100_000, n_head_per_ngram=4, head_dim=64,
                            max_ngram_size=3)
    model_dir = str(write_synthetic_model(tmp_path / "v41", spec))
    results = run_world(4, serve, timeout_s=600, model_dir=model_dir, mode="dp_shared",
                        root=str(harness.cache_dir()), spec=spec.to_dict(), additional={},
                        hosts=[(small_shm, "container", "/dev/shm")] * 4)
    for r in results:
        assert r["ok"], r.get("traceback", r)
        assert r["mismatches"] == [] and set(r["modes"]) == {"dp_shared"}, r
    one_copy = sum(r["table_bytes"] for r in results if r["rank"] < 2)  # each TP shard once
    copies = sum(r["pss"] for r in results) / one_copy
    print(f"\nvLLM TP2 x DP2, /dev/shm {SHM_MIB} MiB: tables {one_copy / 2**20:.1f} MiB, "
          f"{copies:.3f} copies by PSS")
    assert one_copy > SHM_MIB << 20 and abs(copies - 1.0) < 0.02, (one_copy, copies)
    assert not os.listdir(small_shm) and not os.listdir(runtime_dir)


# ------------------------------------------------ in one process (threads) --

def _shared(world_size, runtime_dir, checkpoint=None):
    """A 4 KiB dp_shared table of ``world_size`` thread members; their
    tables (the caller closes them)."""
    spec = make_spec(1000)
    shard = shard_heads(spec.bucket_sizes(LAYER), 1, 0)
    tables = {}

    def member(rank, world):
        tables[rank] = SharedEngramTable.create(spec, LAYER, shard, mode="dp_shared",
                                                group=world.group(rank, 10),
                                                checkpoint=checkpoint)
        return {}
    for r in run_threads(world_size, member):
        assert r["ok"], r
    return spec, shard, [tables[r] for r in range(world_size)]


def test_members_hold_a_memfd_and_each_hands_it_over_at_a_0600_socket_in_a_0700_directory(
        runtime_dir, checkpoint):
    before = shm_files()
    spec, shard, tables = _shared(3, runtime_dir, checkpoint)
    try:
        directory = tables[0].handover
        assert os.path.dirname(directory) == runtime_dir
        assert {t.handover for t in tables} == {directory}
        assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700
        sockets = fdhandover.holders(directory)
        assert len(sockets) == 3  # one per holder
        assert all(stat.S_IMODE(os.stat(s).st_mode) == 0o600 for s in sockets)
        assert tables[0].path.startswith("memfd:") and shm_files() == before
        w, s = synthetic_layer(spec, LAYER)
        assert all(np.array_equal(t.weights, w) and np.array_equal(t.scales, s) for t in tables)
    finally:
        for t in tables:
            t.close()
    assert not os.listdir(runtime_dir), "the last holder removes the directory"


def test_a_late_attach_gets_a_read_only_descriptor_and_holds_the_table_after_the_group(
        runtime_dir, checkpoint):
    spec, shard, tables = _shared(2, runtime_dir, checkpoint)
    directory = tables[0].handover
    late = SharedEngramTable.attach(spec, LAYER, shard, peers=directory)
    for t in tables:
        t.close()
    try:
        assert late.mode == "dp_shared" and late.handover == directory
        assert fdhandover.holders(directory) and os.path.isdir(directory)
        fd = late._backing.fd
        assert os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:numa-engram-")
        info = Path(f"/proc/self/fdinfo/{fd}").read_text()
        flags = int(info.split("flags:")[1].split()[0], 8)
        assert flags & os.O_ACCMODE == os.O_RDONLY, "a READY table is handed over read-only"
        assert np.array_equal(late.weights, synthetic_layer(spec, LAYER)[0])
        # and a second late process gets it from the first, the group gone
        again = SharedEngramTable.attach(spec, LAYER, shard, peers=directory)
        assert np.array_equal(again.weights, late.weights)
        again.close()
    finally:
        late.close()
    assert not os.path.exists(directory)
    with pytest.raises(StorageError, match="does not exist: no process holds the table"):
        SharedEngramTable.attach(spec, LAYER, shard, peers=directory)


def test_a_directory_whose_holders_were_all_killed_goes_at_the_next_create(runtime_dir):
    """Every holder SIGKILLed leaves the directory and dead sockets (no
    memory); the next table made under the root removes them, but not a
    directory young enough to be another table's in the making."""
    stale = os.path.join(runtime_dir, "numa-engram-killed")
    os.mkdir(stale, 0o700)
    for name in ("a.sock", ".b"):  # a killed holder's socket; one killed before it listened
        dead = socket.socket(socket.AF_UNIX)
        dead.bind(os.path.join(stale, name))
        dead.close()  # bound, never answering
    old = time.time() - 2 * fdhandover.STALE_S
    for path in (os.path.join(stale, ".b"), stale):
        os.utime(path, (old, old))
    young = os.path.join(runtime_dir, "numa-engram-young")
    os.mkdir(young, 0o700)
    _, _, tables = _shared(2, runtime_dir)
    for t in tables:
        t.close()
    assert os.listdir(runtime_dir) == ["numa-engram-young"]


_KILLED_HOLDER = """
import os, signal, sys, time
from tests.test_memfd_sharing import _shared
_, _, tables = _shared(2, sys.argv[1])
child = os.fork()
if child == 0:  # outlives its parent, the holders' listening sockets inherited
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):  # (not the test's pipes: it reads them to their end)
        os.dup2(null, fd)
    time.sleep(60)
    os._exit(0)
print(tables[0].handover, child, flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.slow  # starts an interpreter (~1 s)
def test_a_holders_forked_child_keeps_no_dead_holders_socket_answering(runtime_dir):
    """Every holder SIGKILLed, a child it forked still alive: the child
    closed its copies of the listening sockets, so a late attach is refused
    at once (nothing waits on a socket no thread answers) and the dead
    sockets and their directory are swept."""
    done = subprocess.run([sys.executable, "-c", _KILLED_HOLDER, runtime_dir],
                          capture_output=True, text=True, timeout=60,
                          cwd=Path(__file__).resolve().parent.parent)
    assert done.returncode == -9, done.stderr
    directory, child = done.stdout.split()
    spec = make_spec(1000)
    shard = shard_heads(spec.bucket_sizes(LAYER), 1, 0)
    try:
        assert len(fdhandover.holders(directory)) == 2  # the killed holders' sockets
        started = time.monotonic()
        with pytest.raises(StorageError, match="no process holding the table answered"):
            SharedEngramTable.attach(spec, LAYER, shard, peers=directory, timeout_s=10)
        assert time.monotonic() - started < 2
        assert not os.path.exists(directory)
    finally:
        os.kill(int(child), signal.SIGKILL)


def test_a_late_attach_for_another_shard_is_refused_naming_both(runtime_dir):
    spec, shard, tables = _shared(2, runtime_dir)
    other = shard_heads(spec.bucket_sizes(LAYER), 2, 1)
    try:
        with pytest.raises(ServiceRefusal, match="heads \\[0, 8\\).*asked for.*heads \\[4, 8\\)") \
                as exc:
            SharedEngramTable.attach(spec, LAYER, other, peers=tables[0].handover)
        assert exc.value.reason == "mismatch"
    finally:
        for t in tables:
            t.close()


def test_close_waits_for_a_hand_over_already_answering(runtime_dir, monkeypatch):
    """A late attach whose answer is being made when its holder closes:
    close() waits for that answer (a header read and a dup), so the peer
    gets the table; before, close() went on and closed the descriptor the
    answer was reading (a number another open may take meanwhile), and the
    peer was dropped without an answer."""
    spec, shard, tables = _shared(2, runtime_dir)
    entered, release = threading.Event(), threading.Event()
    holder = tables[0]._backing._holder
    real = holder._answer

    def slow_answer(request):
        entered.set()
        release.wait(10)
        return real(request)
    monkeypatch.setattr(holder, "_answer", slow_answer)
    request = protocol.table_request(spec, tables[0]._backing.header.key, 4096)
    got = {}

    def late():
        try:
            got["fd"] = fdhandover.receive(holder.directory, request, 10, only=holder.path)[0]
        except Exception as exc:  # (reported by the assertion below)
            got["error"] = exc
    asker = threading.Thread(target=late)
    asker.start()
    assert entered.wait(10)
    closer = threading.Thread(target=tables[0].close)
    closer.start()
    closer.join(0.3)
    assert closer.is_alive(), "close() did not wait for the answer being made"
    release.set()
    closer.join(10)
    asker.join(10)
    tables[1].close()
    assert "error" not in got, got
    os.close(got["fd"])
    assert not closer.is_alive() and not os.listdir(runtime_dir)


def test_silent_peers_cost_a_bounded_number_of_threads_and_never_stop_the_hand_over(
        runtime_dir):
    """Peers that connect and say nothing: each held a thread of its own
    for up to 10 s, without bound (300 of them, 300 threads); now at most
    MAX_ANSWERING, a new one shedding the oldest, and a late attach is
    still served at once."""
    spec, shard, tables = _shared(2, runtime_dir)
    path = fdhandover.holders(tables[0].handover)[0]
    before = threading.active_count()
    silent = []
    try:
        for _ in range(fdhandover.MAX_ANSWERING + 60):
            peer = socket.socket(socket.AF_UNIX)
            peer.connect(path)
            silent.append(peer)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and threading.active_count() > before + \
                fdhandover.MAX_ANSWERING:
            time.sleep(0.05)
        assert threading.active_count() <= before + fdhandover.MAX_ANSWERING, \
            threading.active_count() - before
        silent[0].settimeout(5)
        assert silent[0].recv(1 << 16) is not None  # shed: closed (or refused), not waiting
        late = SharedEngramTable.attach(spec, LAYER, shard, peers=tables[0].handover,
                                        timeout_s=5)
        late.close()
    finally:
        for peer in silent:
            peer.close()
        for t in tables:
            t.close()


def test_a_hand_over_that_cannot_start_a_thread_refuses_that_peer_and_keeps_answering(
        runtime_dir, monkeypatch):
    """No thread to be had for one connection (the process at its thread
    limit): that peer is closed and the next is answered; the accept loop
    died of the RuntimeError before, and no later peer was ever answered."""
    spec, shard, tables = _shared(2, runtime_dir)
    failed = []

    class OnceShort(threading.Thread):
        def start(self):
            if self.name == "numa-engram-handover-conn" and not failed:
                failed.append(self)
                raise RuntimeError("can't start new thread")
            super().start()
    monkeypatch.setattr(fdhandover.threading, "Thread", OnceShort)
    holder = tables[0]._backing._holder
    request = protocol.table_request(spec, tables[0]._backing.header.key, 4096)
    try:
        with pytest.raises(StorageError, match="no process holding the table answered"):
            fdhandover.receive(holder.directory, request, 2, only=holder.path)
        fd, _ = fdhandover.receive(holder.directory, request, 2, only=holder.path)
        os.close(fd)
    finally:
        for t in tables:
            t.close()


def test_a_late_attach_gets_a_ple_table_from_its_group_and_holds_it_after(runtime_dir,
                                                                          tmp_path):
    """A PLE table shared on 4 KiB pages is handed over like an Engram
    one: a late process attaches with ``peers=`` (there was only
    ``service=``), holds it after the group closed, hands it on, and the
    last holder leaves nothing; another ETP shard is refused naming both."""
    import torch

    from numa_engram.checkpoints.synthetic import write_ple_checkpoint
    from numa_engram.model.ple import PLESpec
    from numa_engram.tables.pletable import SharedPLETable

    spec = PLESpec(layer_ids=[2, 5], ple_embed_dim=160, vocab_size=5000, eos_token_id=7,
                   ngram_vocab_size_base=3000, split_ngram_parts=7)
    ckpt = str(write_ple_checkpoint(tmp_path / "ple.safetensors", spec, seed=5))
    tables = {}

    def member(rank, world):
        tables[rank] = SharedPLETable.create(spec, 5, mode="dp_shared", checkpoint=ckpt,
                                             group=world.group(rank, 10))
        return {}
    for r in run_threads(2, member):
        assert r["ok"], r
    directory = tables[0].handover
    assert directory is not None and tables[1].handover == directory
    ids = np.arange(0, spec.rows(5), 97)
    want = tables[0].lookup(ids).view(torch.int16)  # (random FP8 bytes: NaNs among them)
    late = SharedPLETable.attach(spec, 5, peers=directory)
    for t in tables.values():
        t.close()
    try:
        assert late.mode == "dp_shared" and late.handover == directory
        assert late.lookup(ids).view(torch.int16).equal(want)
        again = SharedPLETable.attach(spec, 5, peers=directory)
        assert again.lookup(ids).view(torch.int16).equal(want)
        again.close()
        with pytest.raises(ServiceRefusal, match="asked for"):
            SharedPLETable.attach(spec, 5, peers=directory, etp_size=2, etp_rank=1)
        with pytest.raises(ValueError, match="exactly one of path=, fd=, service= or peers="):
            SharedPLETable.attach(spec, 5)
    finally:
        late.close()
    assert not os.listdir(runtime_dir)


@pytest.mark.slow
def test_a_late_attach_past_stopped_holders_keeps_to_its_timeout(runtime_dir):
    """Holders that accept (the kernel's queue) but never answer (stopped,
    or hung) sorted before a live one: the late attach still reaches the
    live one and returns within its timeout_s as a whole; each stopped one
    cost a whole timeout_s before (3 of them: 6 s for timeout_s=2)."""
    spec, shard, tables = _shared(2, runtime_dir)
    stopped = []
    try:
        for name in ("0000a", "0000b", "0000c"):
            listener = socket.socket(socket.AF_UNIX)
            listener.bind(os.path.join(tables[0].handover, name + fdhandover.SUFFIX))
            listener.listen(8)
            stopped.append(listener)
        started = time.monotonic()
        late = SharedEngramTable.attach(spec, LAYER, shard, peers=tables[0].handover,
                                        timeout_s=2)
        took = time.monotonic() - started
        late.close()
        assert took < 2.5, took
        for listener in stopped:
            listener.close()
        started = time.monotonic()
        with pytest.raises(StorageError, match="no process holding the table answered"):
            fdhandover.receive(tables[0].handover, protocol.table_request(
                spec, tables[0]._backing.header.key, 4096), 2,
                only=os.path.join(tables[0].handover, "0000a" + fdhandover.SUFFIX))
        assert time.monotonic() - started < 2.5
    finally:
        for listener in stopped:
            listener.close()
        for t in tables:
            t.close()


def test_a_umask_that_takes_the_owners_bits_still_makes_a_0700_directory(runtime_dir):
    """A process run under umask 0777 (or 0277): the hand-over directory
    and a late holder's new one are still 0700 and the sockets 0600 (they
    were mode 0000 or 0500: the owner itself, unless root, could not bind
    its socket there, and the share failed with EACCES)."""
    old = os.umask(0o777)
    try:
        spec, shard, tables = _shared(2, runtime_dir)
    finally:
        os.umask(old)
    try:
        directory = tables[0].handover
        assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700
        assert all(stat.S_IMODE(os.stat(s).st_mode) == 0o600
                   for s in fdhandover.holders(directory))
        again = os.path.join(runtime_dir, "numa-engram-again")
        os.umask(0o277)
        try:
            holder = fdhandover.Holder(again, lambda request: ({}, None))
        finally:
            os.umask(old)
        assert stat.S_IMODE(os.stat(again).st_mode) == 0o700
        holder.close()
    finally:
        for t in tables:
            t.close()


@pytest.mark.parametrize("timeout_s", [0, -1, "5", None, float("nan"), float("inf")])
def test_an_attach_timeout_that_is_no_finite_positive_number_is_named(runtime_dir, timeout_s):
    """attach(timeout_s=) of 0 or -1 was "no process holding the table
    answered" (and the directory swept); "5", None, NaN and inf were
    Python's TypeError, ValueError, OverflowError; both families."""
    from numa_engram.errors import SpecError
    from numa_engram.model.ple import PLESpec
    from numa_engram.tables.pletable import SharedPLETable

    spec, shard, tables = _shared(2, runtime_dir)
    ple = PLESpec(layer_ids=[2, 5], ple_embed_dim=160, vocab_size=5000, eos_token_id=7,
                  ngram_vocab_size_base=3000, split_ngram_parts=7)
    try:
        with pytest.raises(SpecError, match=f"timeout_s must be a finite number of seconds "
                                            f"> 0, got {re.escape(repr(timeout_s))}"):
            SharedEngramTable.attach(spec, LAYER, shard, peers=tables[0].handover,
                                     timeout_s=timeout_s)
        with pytest.raises(SpecError, match="timeout_s must be a finite number"):
            SharedPLETable.attach(ple, 5, peers=tables[0].handover, timeout_s=timeout_s)
        assert len(fdhandover.holders(tables[0].handover)) == 2
    finally:
        for t in tables:
            t.close()


@pytest.mark.parametrize("peers", [123, b"\xff/dir", ["/tmp"]])
def test_peers_that_is_no_path_is_named(peers):
    """attach(peers=123) was lstat's TypeError; bytes a StorageError
    quoting them as if a directory were missing."""
    from numa_engram.errors import SpecError

    spec = make_spec(1000)
    shard = shard_heads(spec.bucket_sizes(LAYER), 1, 0)
    with pytest.raises(SpecError, match=f"peers must be a hand-over directory's path "
                                        f"\\(table.handover\\), got {re.escape(repr(peers))}"):
        SharedEngramTable.attach(spec, LAYER, shard, peers=peers)


def test_a_hand_over_directory_others_may_enter_is_refused(runtime_dir):
    spec, shard, tables = _shared(2, runtime_dir)
    directory = tables[0].handover
    try:
        os.chmod(directory, 0o711)
        with pytest.raises(StorageError, match="mode 0711; a hand-over directory must be ours"):
            SharedEngramTable.attach(spec, LAYER, shard, peers=directory)
    finally:
        os.chmod(directory, 0o700)
        for t in tables:
            t.close()


@pytest.mark.skipif(not ROOT, reason="needs root to give the directory to another uid (65534)")
def test_a_hand_over_directory_another_user_owns_is_refused_and_left_alone(runtime_dir):
    """A directory of another uid at the path (planted, or chowned): a late
    attach is refused naming the owner, nothing of it is touched, and gc
    names it and keeps it."""
    from numa_engram.store.gc import gc_handover_directories

    spec, shard, tables = _shared(2, runtime_dir)
    directory = tables[0].handover
    try:
        os.chown(directory, 65534, 65534)
        with pytest.raises(StorageError, match="belongs to uid 65534 with mode 0700; a "
                                               "hand-over directory must be ours"):
            SharedEngramTable.attach(spec, LAYER, shard, peers=directory)
        (entry,) = gc_handover_directories(runtime_dir)
        assert not entry.removed and "of uid 65534" in entry.reason
        assert len(os.listdir(directory)) == 2  # the holders' sockets, untouched
    finally:
        os.chown(directory, 0, 0)
        for t in tables:
            t.close()


@pytest.mark.skipif(not ROOT, reason="needs root to connect as another uid (65534)")
def test_a_stranger_uid_gets_nothing_even_where_the_modes_let_it_connect(monkeypatch):
    walkable = tempfile.mkdtemp(prefix="engram-uid-", dir="/tmp")  # uid 65534 walks to it
    os.chmod(walkable, 0o755)
    monkeypatch.setenv(fdhandover.ROOT_ENV, walkable)
    spec, shard, tables = _shared(2, walkable)
    directory = tables[0].handover
    sock = fdhandover.holders(directory)[0]
    request = serviceclient.TableRequest(spec.fingerprint, tables[0]._backing.header.key, 4096)
    try:
        got = ask_as_nobody(sock, request.to_dict())
        assert got.startswith("error") and "permission denied" in got, got  # 0700 keeps it out
        os.chmod(directory, 0o711)
        os.chmod(sock, 0o666)  # opened up: the peer's credentials still refuse it
        assert ask_as_nobody(sock, request.to_dict()) == "refused fds=0"
    finally:
        os.chmod(directory, 0o700)
        for t in tables:
            t.close()
        os.rmdir(walkable)  # (empty: the last holder removed its directory)


def test_a_root_too_deep_for_a_socket_falls_back_in_auto_and_fails_dp_shared_at_join(
        runtime_dir, monkeypatch):
    """A group whose hand-over root cannot hold a socket path knows it at
    the join, before anything is allocated: auto makes private copies,
    saying why; dp_shared fails in every member naming the limit."""
    deep = os.path.join(runtime_dir, "d" * 90)
    os.mkdir(deep, 0o700)
    monkeypatch.setenv(fdhandover.ROOT_ENV, deep)
    spec = make_spec(200)
    shard = shard_heads(spec.bucket_sizes(LAYER), 1, 0)

    def member(mode):
        def run(rank, world):
            t = SharedEngramTable.create(spec, LAYER, shard, mode=mode,
                                         group=world.group(rank, 10))
            try:
                return {"mode": t.mode, "why": t.fallback_reason}
            finally:
                t.close()
        return run
    for r in run_threads(2, member("auto")):
        assert r["ok"] and r["mode"] == "independent", r
        assert "above the 107 a Unix socket allows" in r["why"], r["why"]
    for r in run_threads(2, member("dp_shared")):
        assert not r["ok"] and r["error_type"] == "StorageError", r
        assert "dp_shared requested but rank 0: " in r["message"], r["message"]
    assert os.listdir(deep) == []


def test_directory_none_still_asks_for_private_copies(runtime_dir):
    spec = make_spec(200)
    shard = shard_heads(spec.bucket_sizes(LAYER), 1, 0)

    def member(rank, world):
        t = SharedEngramTable.create(spec, LAYER, shard, mode="auto", directory=None,
                                     group=world.group(rank, 10))
        try:
            return {"mode": t.mode, "handover": t.handover, "why": t.fallback_reason}
        finally:
            t.close()
    for r in run_threads(2, member):
        assert r["ok"] and r["mode"] == "independent" and r["handover"] is None, r
        assert "directory=None asks for private memfd copies" in r["why"]
    assert not os.listdir(runtime_dir)


@pytest.mark.slow  # starts an interpreter (~1 s)
def test_plan_neither_checks_nor_advises_dev_shm_for_4k_dp_shared(tmp_path):
    """A 161 MiB dp_shared plan on a host whose /dev/shm is 64 MiB fits:
    no /dev/shm shortfall, no --shm-size in the fixes."""
    if not ROOT:
        pytest.skip("needs root to give `plan` a mount namespace with a 64 MiB /dev/shm")
    text = {"engram_layer_ids": [1], "engram_num_embeddings": [641428],
            "engram_max_ngram_size": 3, "engram_vocab_size": 40000, "engram_n_heads": 8,
            "engram_head_dim": 256, "engram_compressed_vocab_size": 99092,
            "engram_pad_token_id": 2}
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "deepseek_v4", "architectures": ["X"],
                                  "image_token_id": 129264, "text_config": text}))
    out = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c",
         f'mount -t tmpfs -o size={SHM_MIB}m tmpfs /dev/shm && exec "$@"', "_",
         sys.executable, "-m", "numa_engram", "plan", "--json", "--spec", str(config),
         "--tp", "1", "--dp", "2"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["fits"] and not doc["shortfalls"], doc["shortfalls"]
    assert not any("shm" in fix for fix in doc["fixes"]), doc["fixes"]
