"""The dead-table collector (store/gc.py): what it removes and what it never touches."""

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

import pytest

from numa_engram.store.fileformat import PREFIX, Layout
from numa_engram.store.gc import gc_handover_directories, gc_stale_files
from numa_engram.store.storage import BackingFile

from .conftest import SHM, run_python


@pytest.fixture
def backing():
    f = BackingFile.create(Layout.of([("weights", 3 * 4096 + 5), ("scales", 100)]), bytes(32))
    yield f
    f.close()


def test_gc_removes_file_of_killed_creator_and_keeps_live_ones(backing):
    child = run_python("""
        import os, signal
        from numa_engram.store.fileformat import Layout
        from numa_engram.store.storage import BackingFile
        f = BackingFile.create(Layout.of([("w", 4096)]), bytes(32))
        print(f.path, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    assert child.returncode == -signal.SIGKILL
    dead_path = child.stdout.strip()
    assert os.path.exists(dead_path)
    preview = {e.path: e for e in gc_stale_files(dry_run=True)}
    assert not preview[dead_path].removed and os.path.exists(dead_path)
    entries = {e.path: e for e in gc_stale_files()}
    assert entries[dead_path].removed and "dead" in entries[dead_path].reason
    assert not os.path.exists(dead_path)
    assert entries[backing.path].reason.startswith("kept: in use")
    assert os.path.exists(backing.path)


def _unshare_ok(*flags) -> bool:
    return subprocess.run(["unshare", *flags, "true"], capture_output=True).returncode == 0



def test_gc_keeps_a_live_table_whose_creator_is_in_another_pid_namespace():
    if not _unshare_ok("--pid", "--fork", "--mount-proc"):
        pytest.skip("unshare --pid is not permitted here (needs root or user namespaces)")
    code = ("import sys\n"
            "from numa_engram.store.fileformat import Layout\n"
            "from numa_engram.store.storage import BackingFile\n"
            "f = BackingFile.create(Layout.of([('w', 4096)]), bytes(32))\n"
            "print(f.path, flush=True)\nsys.stdin.readline()\n")
    child = subprocess.Popen(["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-c",
                              code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        path = child.stdout.readline().strip()
        entry = {e.path: e for e in gc_stale_files()}[path]
        assert not entry.removed and entry.reason.startswith("kept: in use"), entry
        assert entry.creator_pid < 5  # the pid it had in its own namespace
        assert os.path.exists(path)
    finally:
        child.stdin.close()
        child.wait(30)
    entry = {e.path: e for e in gc_stale_files()}[path]
    assert entry.removed and "stale" in entry.reason and not os.path.exists(path)



def test_gc_skips_hostile_entries_with_a_reason():
    names = {kind: os.path.join(SHM, f"{PREFIX}hostile-{kind}") for kind in
             ("fifo", "dir", "short", "link")}
    os.mkfifo(names["fifo"])
    os.mkdir(names["dir"])
    with open(names["short"], "wb") as f:
        f.write(b"NUMAENGR\x02\x00\x00\x00")
    os.symlink("/etc/passwd", names["link"])
    try:
        for dry_run in (True, False):
            done = []
            t = threading.Thread(target=lambda done=done, dry_run=dry_run: done.append(
                gc_stale_files(dry_run=dry_run)))
            t.start()
            t.join(20)
            assert done, "gc hung on a hostile entry"
            entries = {e.path: e for e in done[0]}
            assert "a FIFO" in entries[names["fifo"]].reason
            assert "a directory" in entries[names["dir"]].reason
            assert "too short" in entries[names["short"]].reason
            assert "a symlink" in entries[names["link"]].reason
            assert not any(entries[p].removed for p in names.values())
    finally:
        os.unlink(names["fifo"])
        os.rmdir(names["dir"])
        os.unlink(names["short"])
        os.unlink(names["link"])



def test_root_gc_leaves_other_users_files_unless_asked():
    if os.geteuid() != 0:
        pytest.skip("needs root to make a file owned by another uid")
    child = run_python("""
        import os, signal
        from numa_engram.store.fileformat import Layout
        from numa_engram.store.storage import BackingFile
        f = BackingFile.create(Layout.of([("w", 4096)]), bytes(32))
        os.fchown(f.fd, 65534, 65534)
        print(f.path, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    path = child.stdout.strip()
    entry = {e.path: e for e in gc_stale_files()}[path]
    assert not entry.removed and "owned by uid 65534" in entry.reason
    entry = {e.path: e for e in gc_stale_files(all_users=True)}[path]
    assert entry.removed


def test_gc_escapes_a_name_that_would_forge_a_line(tmp_path, monkeypatch):
    """A file named with a newline (and what looks like a verdict after it)
    is one row of gc's table, its newline escaped, and no row is forged."""
    from numa_engram.store import fdhandover

    from .conftest import cli_in_process

    (tmp_path / "handover").mkdir(mode=0o700)  # (no hand-over directory's row)
    monkeypatch.setenv(fdhandover.ROOT_ENV, str(tmp_path / "handover"))

    forged = f"{PREFIX}x\nremoved  {PREFIX}forged  0.00  stale: no process holds it"
    (tmp_path / forged).write_bytes(b"NUMAENGR\x02\x00\x00\x00")  # ours by name, too short
    r = cli_in_process("gc", "--directory", str(tmp_path), check=False)
    assert r.returncode == 0, r.stderr
    rows = r.stdout.strip().splitlines()
    assert len(rows) == 2 and not rows[1].startswith("removed"), rows  # the header, one row
    assert f"{PREFIX}x\\nremoved  {PREFIX}forged" in rows[1], rows
    assert (tmp_path / forged).exists()


# ------------------------------------------------ hand-over directories --

def _dead_socket(path):
    dead = socket.socket(socket.AF_UNIX)
    dead.bind(path)
    dead.close()  # bound, never answering: a killed holder's


def test_gc_removes_hand_over_directories_whose_holders_are_all_gone(tmp_path):
    """A 4 KiB dp_shared table's hand-over directory whose holders were all
    killed (dead sockets, no memory) is gc's to remove at once; one a
    holder answers in, and one still being made (young, no socket yet),
    are kept.  Before, only the next create under the same root removed
    them, after 60 s, and gc never looked."""
    from numa_engram.store import fdhandover

    root = tempfile.mkdtemp(prefix="ne-gc-", dir="/tmp")  # (a socket's path is short)
    try:
        dead, live, young, old = (os.path.join(root, PREFIX + n) for n in
                                  ("dead", "live", "young", "old"))
        for d in (dead, live, young, old):
            os.mkdir(d, 0o700)
        _dead_socket(os.path.join(dead, "a" + fdhandover.SUFFIX))
        holder = fdhandover.Holder(live, lambda request: ({}, None))
        _dead_socket(os.path.join(live, "b" + fdhandover.SUFFIX))
        stale = time.time() - 2 * fdhandover.STALE_S
        os.utime(old, (stale, stale))
        try:
            preview = {e.path: e for e in gc_handover_directories(root, dry_run=True)}
            assert set(preview) == {dead, live, young, old}
            assert not any(e.removed for e in preview.values())
            assert all(os.path.isdir(d) for d in (dead, live, young, old))
            entries = {e.path: e for e in gc_handover_directories(root)}
            assert entries[dead].removed and entries[old].removed, entries
            assert entries[dead].reason.startswith("stale: no holder answers"), entries[dead]
            assert not entries[live].removed and "in use" in entries[live].reason
            assert not entries[young].removed and "being made" in entries[young].reason
            assert sorted(os.listdir(root)) == sorted(os.path.basename(d) for d in (live, young))
            assert fdhandover.holders(live) == [holder.path]  # (its dead neighbour swept)
        finally:
            holder.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_gc_prints_hand_over_directories_escaped(tmp_path, monkeypatch):
    """``numa-engram gc`` sweeps the hand-over root too (``$XDG_RUNTIME_DIR``
    or the temporary directory; ``--handover-root``), one row per
    directory, a newline in a planted name escaped."""
    from numa_engram.store import fdhandover

    from .conftest import cli_in_process

    root = tempfile.mkdtemp(prefix="ne-gc-", dir="/tmp")
    try:
        forged = os.path.join(root, f"{PREFIX}x\nremoved  {PREFIX}forged")
        os.mkdir(forged, 0o700)
        _dead_socket(os.path.join(forged, "a" + fdhandover.SUFFIX))
        monkeypatch.setenv(fdhandover.ROOT_ENV, root)
        r = cli_in_process("gc", "--directory", str(tmp_path), check=False)
        assert r.returncode == 0, r.stderr
        rows = r.stdout.strip().splitlines()
        assert len(rows) == 2 and rows[1].startswith("removed"), rows
        assert f"{PREFIX}x\\nremoved  {PREFIX}forged" in rows[1], rows
        assert not os.path.exists(forged)
    finally:
        shutil.rmtree(root, ignore_errors=True)
