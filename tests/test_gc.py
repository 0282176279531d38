"""The dead-table collector (store/gc.py): what it removes and what it never touches."""

import os
import signal
import subprocess
import sys
import threading

import pytest

from numa_engram.store.fileformat import PREFIX, Layout
from numa_engram.store.gc import gc_stale_files
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


def test_gc_escapes_a_name_that_would_forge_a_line(tmp_path):
    """A file named with a newline (and what looks like a verdict after it)
    is one row of gc's table, its newline escaped, and no row is forged."""
    from .conftest import cli_in_process

    forged = f"{PREFIX}x\nremoved  {PREFIX}forged  0.00  stale: no process holds it"
    (tmp_path / forged).write_bytes(b"NUMAENGR\x02\x00\x00\x00")  # ours by name, too short
    r = cli_in_process("gc", "--directory", str(tmp_path), check=False)
    assert r.returncode == 0, r.stderr
    rows = r.stdout.strip().splitlines()
    assert len(rows) == 2 and not rows[1].startswith("removed"), rows  # the header, one row
    assert f"{PREFIX}x\\nremoved  {PREFIX}forged" in rows[1], rows
    assert (tmp_path / forged).exists()
