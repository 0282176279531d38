import fcntl
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from numa_engram.host.topology import read_online_nodes
from numa_engram.store.fileformat import PREFIX

SHM = "/dev/shm"


def pytest_configure(config):
    """A session that may start gloo worlds starts their forkserver first,
    so its imports (torch's) run beside the collection's.  The NUMA tests
    start none (their worlds meet through SocketGroup, tests/support/socketworld.py),
    so a session of them alone, a guest's, starts no forkserver.  A
    parallel worker (pytest-xdist) must hold a /dev/shm of its own."""
    if os.environ.get("PYTEST_XDIST_WORKER") and not _own_shm():
        pytest.exit("a parallel test worker shares /dev/shm with the others, so each one's "
                    "check that it is left as found would see the others' tables: start the "
                    "workers through tools/own_shm (tools/suite.sh does)", returncode=4)
    markexpr = config.option.markexpr or ""
    if "not multiproc" not in markexpr and "numa" not in markexpr:
        from .support.dist_harness import start_forkserver

        start_forkserver()


def _own_shm() -> bool:
    """Whether /dev/shm is the tmpfs tools/own_shm mounts."""
    mounted = ""  # the last mount on it is the one seen
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            if fields[4] == SHM:
                mounted = fields[fields.index("-") + 2]
    return mounted == "numa-engram-shm"


def pytest_sessionfinish(session):
    """NUMA_ENGRAM_TEST_NO_TORCH=1 (the 4-node guest): a session that
    imported torch fails, naming the variable."""
    if os.environ.get("NUMA_ENGRAM_TEST_NO_TORCH") == "1" and "torch" in sys.modules:
        print("\nconftest: NUMA_ENGRAM_TEST_NO_TORCH=1 but torch was imported (a test that "
              "needs it must be marked 'torch')", file=sys.stderr)
        session.exitstatus = 1


def cli_in_process(*args, check=True):
    """``numa-engram ARGS`` through ``main(argv)`` in this process (what the
    command runs: ``python -m numa_engram`` exits with main's return): its
    exit code, stdout and stderr."""
    import contextlib
    import io
    from types import SimpleNamespace

    from numa_engram.cli.app import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(args))
        except SystemExit as exc:  # argparse's refusals and --help
            code = exc.code if isinstance(exc.code, int) else 2
    result = SimpleNamespace(returncode=code, stdout=out.getvalue(), stderr=err.getvalue())
    if check:
        assert result.returncode == 0, result.stderr
    return result


def shm_files() -> set[str]:
    return {n for n in os.listdir(SHM) if n.startswith(PREFIX)}


@pytest.fixture(autouse=True)
def alone_if_serial(request):
    """Under parallel workers (tools/suite.sh), a `serial` test runs while
    no other worker runs a test: it holds the suite's lock exclusive, every
    other test holds it shared.  A turnstile taken first keeps tests from
    joining the shared holders while a serial one waits (no starvation)."""
    locks = os.environ.get("NUMA_ENGRAM_TEST_LOCKS")
    if not (locks and os.environ.get("PYTEST_XDIST_WORKER")):
        yield
        return
    alone = request.node.get_closest_marker("serial") is not None
    with open(os.path.join(locks, "turnstile"), "w") as turnstile, \
            open(os.path.join(locks, "tests"), "w") as tests:
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        fcntl.flock(tests, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        fcntl.flock(turnstile, fcntl.LOCK_UN)
        yield


@pytest.fixture(autouse=True)
def no_leaked_backing_files():
    """Every test must leave /dev/shm as it found it."""
    before = shm_files()
    yield
    leaked = shm_files() - before
    for name in leaked:  # clean up so one failure does not cascade
        os.unlink(os.path.join(SHM, name))
    assert not leaked, f"test leaked backing files: {sorted(leaked)}"


@pytest.fixture
def numa_nodes() -> tuple[int, ...]:
    nodes = read_online_nodes()
    if len(nodes) < 2:
        pytest.skip(f"host has {len(nodes)} NUMA node(s); placement tests need >= 2 "
                    "(make test runs them in the tools/numa-vm guest)")
    return nodes


@pytest.fixture
def tp_shard_table():
    """(spec, table): a TP shard (heads 4..8 of 8, layer 14) of a small
    table, placed by a policy."""
    from numa_engram import EngramSpec, SharedEngramTable, shard_heads

    spec = EngramSpec.small(rows_per_head=400)
    shard = shard_heads(spec.bucket_sizes(14), 2, 1)
    with SharedEngramTable.create(spec, 14, shard, placement="interleave") as table:
        yield spec, table


def run_python(code: str, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """Run code in a fresh interpreter (a real second process)."""
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args],
                          capture_output=True, text=True, timeout=timeout)


class HugePool:
    """2 MiB huge pages reserved for one test (per node where asked) and a
    hugetlbfs mount of them; undone afterwards."""

    def __init__(self, tmp_path, size_kb: int = 2048):
        self.SIZE_KB = size_kb
        self.mount = str(tmp_path / f"hugepages-{size_kb}kB")
        self._saved: dict[str, int] = {}

    def _knob(self, node):
        base = ("/sys/kernel/mm/hugepages" if node is None
                else f"/sys/devices/system/node/node{node}/hugepages")
        return f"{base}/hugepages-{self.SIZE_KB}kB/nr_hugepages"

    def reserve(self, pages: int, node: int | None = None) -> int:
        """Set the pool (of a node, or host-wide) to ``pages`` free pages
        more than are in use; returns the pages it really got."""
        knob = self._knob(node)
        current = int(Path(knob).read_text())
        self._saved.setdefault(knob, current)
        free_file = Path(knob.replace("nr_hugepages", "free_hugepages"))
        in_use = current - int(free_file.read_text())
        Path(knob).write_text(str(in_use + pages))
        return int(free_file.read_text())

    def restore(self):
        for knob, value in reversed(list(self._saved.items())):
            Path(knob).write_text(str(value))


POOLS = ("huge_pool", "gib_pool")


def pytest_collection_modifyitems(items):
    """A test that takes a huge page pool as an argument is `serial`: the
    pools are the host's, and a test elsewhere may count on an empty one (a
    test asking for a pool inside, through request.getfixturevalue, says
    `serial` itself).  Parallel workers take the longest files first."""
    for item in items:
        if any(pool in getattr(item, "fixturenames", ()) for pool in POOLS):
            item.add_marker(pytest.mark.serial)
    if os.environ.get("PYTEST_XDIST_WORKER"):
        items[:] = _longest_files_first(items)


def _longest_files_first(items: list) -> list:
    """The files (a worker's unit) ordered so that a long one is not the
    last one left: those marked `slow` as a whole (a real vLLM engine's),
    then by how many of their tests start worlds or interpreters; the rest
    as collected.  Every worker sorts alike (the order is the collection's)."""
    heavy: dict[str, int] = {}
    whole: dict[str, bool] = {}
    for item in items:
        path = item.nodeid.split("::")[0]
        module = item.getparent(pytest.Module)
        whole[path] = any(m.name == "slow" for m in getattr(module, "own_markers", ()))
        long = item.get_closest_marker("slow") or item.get_closest_marker("multiproc")
        heavy[path] = heavy.get(path, 0) + (1 if long else 0)
    first = {path: n for n, path in enumerate(heavy)}
    return sorted(items, key=lambda item: (
        not whole[p := item.nodeid.split("::")[0]], -heavy[p], first[p]))


@pytest.fixture
def huge_pool(tmp_path, request):
    """A HugePool of 2 MiB pages with a mounted hugetlbfs, or a skip that says why not."""
    yield from _pool(tmp_path, request, 2048, "2M", 8)


@pytest.fixture
def gib_pool(tmp_path, request):
    """The same with 1 GiB pages (skips where 2 cannot be reserved)."""
    yield from _pool(tmp_path, request, 1 << 20, "1G", 2)


def _pool(tmp_path, request, size_kb: int, name: str, want: int):
    if os.environ.get("PYTEST_XDIST_WORKER") and not request.node.get_closest_marker("serial"):
        pytest.fail(f"{request.node.nodeid} reserves the host's {name} pages beside other "
                    "workers' tests: mark it serial")
    pool = HugePool(tmp_path, size_kb)
    knob = pool._knob(None)
    if os.geteuid() != 0 or not os.access(knob, os.W_OK):
        pytest.skip(f"reserving huge pages needs root and a writable {knob}")
    os.makedirs(pool.mount)
    mounted = subprocess.run(["mount", "-t", "hugetlbfs", "-o", f"pagesize={name},mode=0700",
                              "none", pool.mount], capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount hugetlbfs: {mounted.stderr.strip()}")
    if pool.reserve(want) < want:
        pool.restore()
        subprocess.run(["umount", pool.mount])
        pytest.skip(f"the kernel gave fewer than {want} free {name} pages (memory fragmented)")
    try:
        yield pool
    finally:
        leaked = [n for n in os.listdir(pool.mount) if n.startswith(PREFIX)]
        subprocess.run(["umount", "-l", pool.mount])
        pool.restore()
        assert not leaked, f"test leaked hugetlbfs files: {leaked}"
