import os
import subprocess
import sys
import textwrap

import pytest

from numa_engram.storage import PREFIX
from numa_engram.topology import read_online_nodes

SHM = "/dev/shm"


def shm_files() -> set[str]:
    return {n for n in os.listdir(SHM) if n.startswith(PREFIX)}


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


def run_python(code: str, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """Run code in a fresh interpreter (a real second process)."""
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args],
                          capture_output=True, text=True, timeout=timeout)
