"""Real deployments: sharing groups from measured identities, simulated
hosts and containers (mount + UTS namespaces, each host its own tmpfs),
a serving stack's own group object, registration lifetime."""

import os
import subprocess

import numpy as np
import pytest

from numa_engram import EngramSpec, SharedEngramTable, shard_heads
from numa_engram.checkpoints.synthetic import write_synthetic_checkpoint
from numa_engram.errors import CudaUnavailable, NumaEngramError
from numa_engram.groups.group import RankIdentity, identity_groups
from numa_engram.groups.identity import HostIdentity

from .support import dist_scenarios as scenarios
from .support.dist_harness import run_world
from .support.dist_scenarios import make_spec

ROWS = 1500


def ident(rank, tp_rank, host, socket=None, directory=(40, 1)):
    return RankIdentity(rank, tp_rank, HostIdentity(host, 0, directory, host), socket, "mnt")


def test_identity_groups_follow_where_ranks_are_not_rank_arithmetic():
    two_hosts = [ident(r, r % 2, "A" if r < 4 else "B") for r in range(8)]
    assert identity_groups(two_hosts) == [(0, 2), (1, 3), (4, 6), (5, 7)]
    interleaved = [ident(r, 0, "AB"[r % 2]) for r in range(4)]
    assert identity_groups(interleaved) == [(0, 2), (1, 3)]
    uneven = [ident(r, 0, "A" if r < 3 else "B") for r in range(4)]
    assert identity_groups(uneven) == [(0, 1, 2), (3,)]
    other_tmpfs = [ident(r, 0, "A", directory=(40 + r % 2, 1)) for r in range(4)]
    assert identity_groups(other_tmpfs) == [(0, 2), (1, 3)]
    sockets = [ident(r, 0, "A", socket=r // 2) for r in range(4)]
    assert identity_groups(sockets) == [(0, 1, 2, 3)]
    assert identity_groups(sockets, per_socket=True) == [(0, 1), (2, 3)]


def test_register_device_without_a_gpu_is_cuda_unavailable():
    from numa_engram.bindings import cudart as cuda

    ok, why = cuda.available()
    if ok:
        pytest.skip("this host has a GPU: the CUDA tests cover registration")
    spec = EngramSpec.small()
    with pytest.raises(CudaUnavailable):
        SharedEngramTable.create(spec, 1, shard_heads(spec.bucket_sizes(1), 1, 0),
                                 register_device=0)


# --------------------------------------------- registration lifetime --

class FakeRuntime:
    """The cudart calls register/unregister make, counting pins."""

    def __init__(self):
        self.registered, self.unregistered = [], []

    def cudaGetDevice(self, out):
        out[0] = 0
        return 0

    def cudaSetDevice(self, device):
        return 0

    def cudaHostRegister(self, ptr, size, flags):
        self.registered.append(int(ffi_cast(ptr)))
        return 0

    def cudaHostUnregister(self, ptr):
        self.unregistered.append(int(ffi_cast(ptr)))
        return 0

    def cudaGetLastError(self):
        return 0

    def cudaDeviceGetPCIBusId(self, buf, length, device):
        from numa_engram.bindings.cudart import _ffi

        if device != 0:
            return 101  # cudaErrorInvalidDevice
        _ffi.memmove(buf, b"00000000:3B:00.0\0", 17)  # as the runtime spells it
        return 0

    def cudaGetErrorString(self, rc):
        from numa_engram.bindings.cudart import _ffi

        return _ffi.new("char[]", b"invalid device ordinal")


def ffi_cast(ptr):
    from numa_engram.bindings.cudart import _ffi

    return _ffi.cast("uintptr_t", ptr)


@pytest.fixture
def fake_cuda(monkeypatch):
    from numa_engram.bindings import cudart as cuda

    fake = FakeRuntime()
    monkeypatch.setattr(cuda, "runtime", lambda: fake)
    return fake


def test_a_gpus_numa_node_comes_from_the_runtimes_pci_address(fake_cuda, tmp_path):
    from numa_engram.host.topology import gpu_node

    dev = tmp_path / "bus" / "pci" / "devices" / "0000:3b:00.0"  # a sysfs tree (root=)
    dev.mkdir(parents=True)
    (dev / "numa_node").write_text("1\n")
    root = str(tmp_path)
    assert gpu_node(0, root=root) == 1
    assert gpu_node(1, root=root) is None  # the runtime has no such device
    assert gpu_node(None, root=root) is None
    (dev / "numa_node").write_text("-1\n")  # no affinity
    assert gpu_node(0, root=root) is None


def _registered_table():
    spec = EngramSpec.small()
    return SharedEngramTable.create(spec, 1, shard_heads(spec.bucket_sizes(1), 1, 0),
                                    register_device=0)


def test_registrations_equal_unregistrations_in_every_path(fake_cuda, monkeypatch):
    import gc

    import numa_engram.groups.steps as steps

    t = _registered_table()                       # close() with no views: unregisters now
    t.close()
    assert len(fake_cuda.registered) == len(fake_cuda.unregistered) == 1

    t = _registered_table()                       # close() with a live view: deferred
    view = t.registration                         # what a device view holds
    t.close()
    assert len(fake_cuda.unregistered) == 1, "unregistered under a live device view"
    del view
    assert len(fake_cuda.unregistered) == 2

    t = _registered_table()                       # dropped without close()
    name = t.path
    del t
    gc.collect()
    assert len(fake_cuda.unregistered) == 3
    assert name.split(":")[-1] not in " ".join(_open_files())  # its memfd given back

    spec = EngramSpec.small()                     # a create that fails after registering
    bad = checkpoint_in_tmp(spec)  # truncated once the create is under way
    monkeypatch.setattr(steps, "STEP_HOOK",
                        lambda step: step == "before-load" and os.truncate(bad, 4096))
    with pytest.raises(NumaEngramError):
        SharedEngramTable.create(spec, 1, shard_heads(spec.bucket_sizes(1), 1, 0),
                                 register_device=0, checkpoint=bad)
    gc.collect()
    assert len(fake_cuda.registered) == len(fake_cuda.unregistered) == 4
    assert sorted(fake_cuda.registered) == sorted(fake_cuda.unregistered)


def _open_files():
    for fd in os.listdir("/proc/self/fd"):
        try:
            yield os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # closed since the listing (the listing's own fd)
            pass


def checkpoint_in_tmp(spec):
    import tempfile

    path = os.path.join(tempfile.mkdtemp(), "cut.safetensors")
    write_synthetic_checkpoint(path, spec)
    return path


# ------------------------------------------------- simulated hosts --

@pytest.fixture
def hosts(tmp_path, monkeypatch):
    """Two simulated hosts' tmpfs mounts (each host its own /dev/shm, where
    its ranks also meet to hand 4 KiB tables over: real hosts' /tmp differ)."""
    monkeypatch.setenv("XDG_RUNTIME_DIR", "/dev/shm")
    if subprocess.run(["unshare", "--mount", "--uts", "true"], capture_output=True).returncode:
        pytest.skip("unshare --mount --uts is not permitted here (needs root)")
    dirs = {}
    for name in ("A", "B"):
        d = tmp_path / f"host{name}"
        d.mkdir()
        if os.system(f"mount -t tmpfs -o size=64m tmpfs {d} 2>/dev/null") != 0:
            pytest.skip("cannot mount a tmpfs here (needs root and mount permission)")
        dirs[name] = str(d)
    yield dirs
    for d in dirs.values():
        leftover = os.listdir(d)
        os.system(f"umount {d}")
        assert not leftover, f"files left in a host's /dev/shm: {leftover}"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt") / "engram.safetensors"
    return str(write_synthetic_checkpoint(path, make_spec(ROWS)))


def _on(dirs, names, mount_at="/dev/shm"):
    return [(dirs[n], f"host{n}", mount_at) for n in names]


def _check_copies(results, groups):
    """Rows bit-exact; per group, summed PSS is one copy."""
    for r in results:
        assert r["ok"], r.get("traceback") or r
        assert r["exact"]
    for group in groups:
        members = [results[m] for m in group]
        pss = sum(m["pss"] for m in members)
        one = members[0]["backing_bytes"]
        assert abs(pss - one) <= 0.05 * one, (group, pss, one)
        assert all(m["group"] == list(group) for m in members)


@pytest.mark.multiproc
def test_tp2_dp4_on_two_hosts(hosts, ckpt):
    results = run_world(8, scenarios.share_on_hosts, hosts=_on(hosts, "AAAABBBB"), tp=2,
                        mode="dp_shared", checkpoint=ckpt, rows_per_head=ROWS)
    _check_copies(results, [(0, 2), (1, 3), (4, 6), (5, 7)])
    assert {r["hostname"] for r in results} == {"hostA", "hostB"}
    assert all(r["report"]["mode"] == "dp_shared" for r in results)
    assert results[0]["report"]["identity"]["host"] == "hostA"


@pytest.mark.multiproc
def test_interleaved_ranks_share_by_identity(hosts, ckpt):
    results = run_world(4, scenarios.share_on_hosts, hosts=_on(hosts, "ABAB"), tp=1,
                        mode="dp_shared", checkpoint=ckpt, rows_per_head=ROWS)
    _check_copies(results, [(0, 2), (1, 3)])


@pytest.mark.multiproc
def test_uneven_hosts_three_share_one_alone(hosts, ckpt):
    results = run_world(4, scenarios.share_on_hosts, hosts=_on(hosts, "AAAB"), tp=1,
                        mode="auto", checkpoint=ckpt, rows_per_head=ROWS)
    _check_copies(results, [(0, 1, 2), (3,)])
    assert [r["report"]["mode"] for r in results] == ["dp_shared"] * 3 + ["independent"]


@pytest.mark.multiproc
def test_containers_sharing_one_tmpfs_at_other_paths_share(hosts, ckpt):
    """Two containers of one host: separate mount namespaces, the same tmpfs,
    mounted at /dev/shm in one and /run/engram in the other."""
    where = [(hosts["A"], "podA", "/run/engram"), (hosts["A"], "podB", "/run/engram")]
    results = run_world(2, scenarios.share_on_hosts, hosts=where, tp=1, mode="dp_shared",
                        checkpoint=ckpt, rows_per_head=ROWS, directory="/run/engram")
    _check_copies(results, [(0, 1)])


@pytest.mark.multiproc
def test_a_group_spanning_hosts_is_refused_or_falls_back(hosts):
    results = run_world(4, scenarios.world_group_across_hosts, hosts=_on(hosts, "AABB"),
                        mode="dp_shared")
    for r in results:
        assert not r["ok"] and r["error_type"] == "StorageError", r
        assert "rank 2 has another /dev/shm (dev" in r["message"], r["message"]
    results = run_world(4, scenarios.world_group_across_hosts, hosts=_on(hosts, "AABB"),
                        mode="auto")
    for r in results:
        assert r["ok"], r
        assert r["report"]["mode"] == "independent"
        assert "rank 2 has another /dev/shm" in r["report"]["fallback_reason"]


@pytest.mark.multiproc
def test_a_serving_stacks_coordinator_plugs_in():
    results = run_world(3, scenarios.coordinator_group)
    for r in results:
        assert r["ok"], r.get("traceback") or r
        assert r["report"]["mode"] == "dp_shared" and r["exact"]
    assert np.unique([r["report"]["sharing_group"] for r in results], axis=0).shape[0] == 1
