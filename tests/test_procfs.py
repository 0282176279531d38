"""procfs: one reader per /proc file, against a directory laid out like
/proc (root=) and the real one."""

import os

import pytest

from numa_engram.errors import NoSuchProcess
from numa_engram.host import procfs


@pytest.fixture
def proc(tmp_path):
    me = tmp_path / "42"
    (me / "fd").mkdir(parents=True)
    (me / "numa_maps").write_text(
        "7f00 bind:0 file=/dev/shm/numa-engram-a dirty=4 N0=3 N1=1 kernelpagesize_kB=4\n"
        "7f80 bind:1 file=/dev/hugepages/numa-engram-b huge dirty=2 N1=2 "
        "kernelpagesize_kB=2048\n"
        "7fa0 default anon=5 N0=5 kernelpagesize_kB=4\n")
    (me / "smaps_rollup").write_text(
        "00-ff ---p 0 0:0 0 [rollup]\nRss:  100 kB\nPss:  60 kB\nPss_Shmem: 40 kB\n"
        "Shared_Clean: 8 kB\nShared_Dirty: 2 kB\n")
    (me / "stat").write_text("42 (a (b) c) S " + " ".join(["1"] * 18) + " 777 0 0\n")
    os.symlink("/dev/shm/numa-engram-a (deleted)", me / "fd" / "3")
    return tmp_path


def test_numa_maps_counts_bytes_in_each_lines_page_size(proc):
    assert procfs.numa_maps(42, "numa-engram-", root=str(proc)) == {
        0: 3 * 4096, 1: 4096 + 2 * (2 << 20)}
    assert procfs.numa_maps(42, root=str(proc))[0] == 8 * 4096


def test_rollup_stat_and_fds(proc):
    m = procfs.smaps_rollup(42, root=str(proc))
    assert (m.rss, m.pss, m.pss_shmem, m.shared) == (100 << 10, 60 << 10, 40 << 10, 10 << 10)
    assert procfs.start_time(42, root=str(proc)) == 777  # a ')' in the name is no trouble
    assert list(procfs.fd_targets(42, root=str(proc))) == [(3, "/dev/shm/numa-engram-a (deleted)")]


def test_a_missing_pid_is_no_such_process_naming_it(proc):
    for call in (lambda: procfs.smaps_rollup(7, root=str(proc)),
                 lambda: procfs.numa_maps(7, root=str(proc)),
                 lambda: list(procfs.fd_targets(7, root=str(proc))),
                 lambda: procfs.check_pid(7, root=str(proc))):
        with pytest.raises(NoSuchProcess, match="pid 7"):
            call()
    assert procfs.start_time(7, root=str(proc)) is None


def test_the_real_proc():
    me = os.getpid()
    assert procfs.check_pid(me) == me and procfs.smaps_rollup(me).rss > 0
    assert len(procfs.boot_id()) == 16 and procfs.namespace("mnt").startswith("mnt:[")
    assert procfs.meminfo()["MemTotal"] > 1 << 20
    assert any(fs == "proc" for _, _, fs, _ in procfs.mounts())
    assert "v2" in procfs.cgroups() or any("memory" in k for k in procfs.cgroups())
