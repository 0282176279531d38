import errno
import os

import numpy as np
import pytest

from numa_engram.bindings import hashkernels, lookupkernel, native
from numa_engram.errors import CapacityError, SyscallError


@pytest.fixture
def mapped(tmp_path):
    fd = os.open("/dev/shm/numa-engram-test-native", os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    os.unlink("/dev/shm/numa-engram-test-native")
    os.ftruncate(fd, 16 * native.PAGE_SIZE)
    m = native.Mapping(fd, 16 * native.PAGE_SIZE)
    yield fd, m
    m.close()
    os.close(fd)


def test_page_size_is_a_power_of_two():
    assert native.PAGE_SIZE >= 4096 and native.PAGE_SIZE & (native.PAGE_SIZE - 1) == 0


def test_mbind_then_populate_lands_on_the_bound_node(mapped):
    fd, m = mapped
    native.madvise(m, native.MADV_NOHUGEPAGE)
    native.mbind(m, 0, m.length, native.MPOL_BIND, [0])
    native.fallocate(fd, 0, m.length)
    native.madvise(m, native.MADV_POPULATE_READ)
    assert (native.page_nodes(m, 0, m.length) == 0).all()
    assert native.policy_of_address(m, 0) == (native.MPOL_BIND, [0])
    assert native.node_of_address(m, native.PAGE_SIZE) == 0


def test_unmapped_pages_report_enoent(mapped):
    fd, m = mapped
    native.fallocate(fd, 0, m.length)
    status = native.page_nodes(m, 0, m.length)
    assert (status == -errno.ENOENT).all()


def test_mbind_on_missing_node_names_call_args_and_errno(mapped):
    _, m = mapped
    with pytest.raises(SyscallError) as info:
        native.mbind(m, 0, native.PAGE_SIZE, native.MPOL_BIND, [63])
    err = info.value
    assert err.errno == errno.EINVAL and err.errno_name == "EINVAL" and err.call == "mbind"
    assert "nodes=63 " in str(err) and "MPOL_BIND" in str(err)


def test_nodemask_wider_than_64_nodes():
    mask, maxnode = native.nodemask([1, 64, 130])
    assert maxnode == 3 * 64 + 1
    assert (mask[0], mask[1], mask[2]) == (1 << 1, 1, 1 << 2)
    with pytest.raises(ValueError, match="empty node set"):
        native.nodemask([])
    with pytest.raises(ValueError, match="beyond any kernel"):
        native.nodemask([10**9])  # refused before allocating a giant mask
    with pytest.raises(ValueError, match="negative"):
        native.nodemask([-1])


def test_unaligned_and_out_of_mapping_ranges_refused(mapped):
    _, m = mapped
    with pytest.raises(ValueError, match="page-aligned"):
        native.mbind(m, 1, native.PAGE_SIZE, native.MPOL_BIND, [0])
    with pytest.raises(ValueError, match="inside the mapping"):
        native.madvise(m, native.MADV_DONTNEED, 0, m.length + native.PAGE_SIZE)


def test_views_keep_memory_mapped_after_close(mapped):
    _, m = mapped
    view = m.array()
    view[:4] = [1, 2, 3, 4]
    m.close()
    assert m.mapped  # the view still holds it: no dangling pointer
    assert list(view[:4]) == [1, 2, 3, 4]
    del view
    assert not m.mapped


def test_fallocate_enospc_is_capacity_error(tmp_path):
    mnt = tmp_path / "small"
    mnt.mkdir()
    if os.system(f"mount -t tmpfs -o size=1m tmpfs {mnt} 2>/dev/null") != 0:
        pytest.skip("cannot mount a small tmpfs here (needs root and mount permission)")
    try:
        fd = os.open(mnt / "f", os.O_RDWR | os.O_CREAT, 0o600)
        os.ftruncate(fd, 8 << 20)  # succeeds: tmpfs only fails when pages are touched
        with pytest.raises(CapacityError, match="no space"):
            native.fallocate(fd, 0, 8 << 20, str(mnt / "f"))
        os.close(fd)
    finally:
        os.system(f"umount {mnt}")


def test_statvfs_reports_shm():
    free, total = native.statvfs("/dev/shm")
    assert 0 < free <= total
    with pytest.raises(SyscallError, match="ENOENT"):
        native.statvfs("/no/such/dir")


def test_array_is_a_real_view_across_two_mappings(mapped):
    fd, m = mapped
    other = native.Mapping(fd, m.length, writable=False)
    m.array()[100:104] = np.arange(4, dtype=np.uint8) + 7
    assert list(other.array()[100:104]) == [7, 8, 9, 10]
    with pytest.raises(ValueError, match="read-only"):
        other.array()[0] = 1  # PROT_READ: refused by numpy, not a SIGSEGV
    other.close()


def test_a_kernel_tuning_outside_its_bounds_is_refused_naming_them():
    """Thresholds the kernel's stack scratch or a division could not take
    never reach it: ShardKernel(tuning=) checks them (through C, which
    holds the bounds) before anything is bound."""
    bad = [dict(prefetch_ahead=-1), dict(prefetch_ahead=257), dict(prefetch_hint=4),
           dict(small_rows=-1), dict(small_rows=native.lib.NE_MAX_SMALL_ROWS + 1),
           dict(split_rows=0), dict(job_rows=0), dict(job_rows=native.lib.NE_SHARE_ROWS + 1),
           dict(stream_bytes=-1)]
    for fields in bad:
        with pytest.raises(ValueError, match="prefetch_ahead in 0..256, prefetch_hint in 0..3"):
            lookupkernel.Tuning(**fields).struct()
    lookupkernel.Tuning(small_rows=native.lib.NE_MAX_SMALL_ROWS, split_rows=1, job_rows=1,
                        stream_bytes=0, prefetch_ahead=256, prefetch_hint=3).struct()  # the edges


def test_hardware_division_and_reciprocals_hash_alike():
    rng = np.random.default_rng(5)
    ids = rng.integers(-(2**62), 2**62, (3, 500))
    mult = rng.integers(1, 2**40, 4) | 1
    primes = np.array([3, 1_000_003, 2**31 - 1, 998_244_353, 1_099_511_627_791, 7], np.int64)
    fast = hashkernels.ngram_hashes(ids, 2, mult, 4, primes, 2)
    slow = hashkernels.ngram_hashes(ids, 2, mult, 4, primes, 2, hardware_division=True)
    np.testing.assert_array_equal(fast, slow)


@pytest.mark.parametrize("n_head", [1, 8, 11, 17])
def test_vector_and_scalar_floor_modulo_agree_for_any_head_count(n_head):
    rng = np.random.default_rng(n_head)
    ids = rng.integers(-(2**63), 2**63 - 1, (2, 300), dtype=np.int64)
    mult = rng.integers(1, 2**62, 4) | 1
    primes = rng.integers(2, 2**45, 3 * n_head).astype(np.int64)
    primes[::5] = 1  # and the smallest divisors
    primes[1::7] = 2**62 + 1
    fast = hashkernels.ngram_hashes(ids, 2, mult, 4, primes, n_head)
    slow = hashkernels.ngram_hashes(ids, 2, mult, 4, primes, n_head, hardware_division=True)
    np.testing.assert_array_equal(fast, slow)
    assert (fast >= 0).all() and (fast < primes).all()


def test_the_c_core_compiles_clean_under_wextra_werror():
    """The C core as one translation unit (what the cffi build compiles,
    less cffi's own wrappers), with -Wall -Wextra -Werror: a new warning
    fails here before it hides a bug."""
    import shutil
    import subprocess
    import sysconfig
    from pathlib import Path

    cc = (sysconfig.get_config_var("CC") or "cc").split()[0]
    if shutil.which(cc) is None:
        pytest.skip(f"no C compiler ({cc}) on this machine")
    core = Path(__file__).resolve().parent.parent / "cffi_build"
    includes = [f"-include{h}" for h in ("sys/mman.h", "linux/magic.h", "linux/memfd.h",
                                         "linux/mempolicy.h")]
    run = subprocess.run([cc, "-D_GNU_SOURCE", "-DNE_CORE_VERSION=\"check\"", "-std=gnu11",
                          "-O2", "-Wall", "-Wextra", "-Werror", "-Wno-unused-function",
                          "-fsyntax-only", *includes, str(core / "native.c")],
                         capture_output=True, text=True, timeout=120, check=False)
    assert run.returncode == 0, run.stderr[-4000:]


def test_every_exported_c_function_has_a_python_caller():
    """The cffi declarations are the library's C ABI: a function declared
    there that no module of the package calls is a dead export (internal
    helpers stay static in their part, out of the headers)."""
    from pathlib import Path

    package = Path(native.__file__).resolve().parent.parent
    sources = "\n".join(p.read_text() for p in package.rglob("*.py"))
    exported = [name for name in dir(native.lib)
                if name.startswith("ne_") and callable(getattr(native.lib, name))]
    assert len(exported) > 20, exported
    # called, or bound with its first argument for calls (functools.partial)
    dead = [name for name in exported
            if f"lib.{name}(" not in sources and f"partial(lib.{name}," not in sources]
    assert dead == [], f"declared in cffi_build/src/*.h, called by no module: {dead}"
