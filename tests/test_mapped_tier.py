"""The mapped tier (tier="mapped"): tables whose rows are the checkpoint's
own pages, for both families.  Rows bit-exact with the resident tier's
(atol 0: BF16, packed, global ids, out=, threads); what does not apply
refused by name; a checkpoint truncated under a table is a CheckpointError
naming the file at the next lookup (in a child process: a regression
would kill it, not pytest), replaced files named by check_checkpoint; an
unmappable file refused with the reason; read-ahead asks for exactly the
rows' pages (counted with mincore after the file's pages are dropped)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import struct
import time

import numpy as np
import pytest

from numa_engram import EngramSpec, SharedEngramTable, shard_heads
from numa_engram.bindings import native
from numa_engram.checkpoints.mappedfiles import MappedArrays, Segment
from numa_engram.checkpoints.safetensorsfiles import TensorLocation
from numa_engram.checkpoints.synthetic import write_ple_checkpoint, write_synthetic_checkpoint
from numa_engram.errors import CheckpointError, LookupIdError, SpecError, StorageError
from numa_engram.model.ple import PLESpec
from numa_engram.tables.pletable import SharedPLETable

from .conftest import run_python

torch = pytest.importorskip("torch")

SPEC = EngramSpec.small(rows_per_head=3000, n_head_per_ngram=4, head_dim=128, seed=0)
LAYER = SPEC.layer_ids[0]
PLE = PLESpec(layer_ids=[2, 5], ple_embed_dim=160, vocab_size=5000, eos_token_id=7,
              ngram_vocab_size_base=3000, split_ngram_parts=7)
PAGE = native.PAGE_SIZE


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("mapped") / "model.safetensors"
    return str(write_synthetic_checkpoint(path, SPEC, seed=3))


@pytest.fixture(scope="module")
def ple_ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("mapped_ple") / "model.safetensors"
    return str(write_ple_checkpoint(path, PLE, seed=5))


def _ids(shape, seed=0, dead=True):
    ids = np.random.default_rng(seed).integers(0, min(SPEC.bucket_sizes(LAYER)), size=shape)
    if dead:
        ids[1, :] = -1
    return ids


@pytest.mark.parametrize("shards,rank", [(1, 0), (2, 1)])
def test_a_mapped_engram_table_reads_the_rows_a_resident_one_holds(ckpt, shards, rank):
    shard = shard_heads(SPEC.bucket_sizes(LAYER), shards, rank)
    with SharedEngramTable.create(SPEC, LAYER, shard, checkpoint=ckpt,
                                  mode="independent") as resident, \
            SharedEngramTable.create(SPEC, LAYER, shard, checkpoint=ckpt, tier="mapped",
                                     lookup_threads=2) as mapped:
        assert (mapped.tier, mapped.mode, resident.tier) == ("mapped", "mapped", "resident")
        assert np.array_equal(mapped.weights, resident.weights)
        assert np.array_equal(mapped.scales, resident.scales)
        assert not mapped.weights.flags.writeable
        assert mapped.stats().physical_bytes == 0  # the page cache's, not this process's
        for tokens in (1, 64, 4096):  # 4,096: split over the threads, sorted jobs
            ids = _ids((tokens, SPEC.n_hash_cols), seed=tokens, dead=tokens > 1)
            assert torch.equal(mapped.lookup(ids).view(torch.int16),
                               resident.lookup(ids).view(torch.int16))
            for got, want in zip(mapped.lookup(ids, packed=True),
                                 resident.lookup(ids, packed=True)):
                assert torch.equal(got, want)
        base = mapped.id_base("global")
        ids = _ids((32, SPEC.n_hash_cols))
        glob = ids.copy()
        cols = glob[:, shard.head_start:shard.head_end]
        cols[cols >= 0] += np.broadcast_to(base, cols.shape)[cols >= 0]
        assert torch.equal(mapped.lookup(glob, id_format="global"), resident.lookup(ids))
        out = torch.empty((32, shard.num_heads, SPEC.head_dim), dtype=torch.bfloat16)
        bound = mapped.bind_lookup(out)
        assert torch.equal(bound(ids), resident.lookup(ids))


def test_a_mapped_table_is_made_without_reading_its_rows(ckpt):
    """No copy at start: right after create none of the shard's pages was
    read (the file's pages dropped first)."""
    _drop_pages(ckpt)
    shard = shard_heads(SPEC.bucket_sizes(LAYER), 1, 0)
    with SharedEngramTable.create(SPEC, LAYER, shard, checkpoint=ckpt, tier="mapped") as table:
        mapping = table._backing.arrays.mapping
        # (the header's read may bring the file's first pages, with its readahead window)
        assert native.pages_resident(mapping) <= 32 < mapping.length // PAGE
        assert set(table.startup_phases) == {"map"}


@pytest.mark.parametrize("etp_size,etp_rank", [(1, 0), (3, 1)])
def test_a_mapped_ple_table_reads_the_rows_a_resident_one_holds(ple_ckpt, etp_size, etp_rank):
    kw = {"etp_size": etp_size, "etp_rank": etp_rank, "checkpoint": ple_ckpt}
    with SharedPLETable.create(PLE, 2, mode="independent", **kw) as resident, \
            SharedPLETable.create(PLE, 2, tier="mapped", lookup_threads=2, **kw) as mapped:
        assert mapped.tier == "mapped" and mapped.scale == resident.scale
        assert np.array_equal(mapped.weights, resident.weights)
        for n in (1, 40, 3000):
            ids = np.random.default_rng(n).integers(0, PLE.rows(2), size=(n, PLE.n_heads))
            assert torch.equal(mapped.lookup(ids).view(torch.int16),
                               resident.lookup(ids).view(torch.int16))
            assert np.array_equal(mapped.lookup_packed(ids), resident.lookup_packed(ids))
        with pytest.raises(StorageError, match="no 'scale' region"):
            mapped.store_scale(1.0)


def _safetensors(path, tensors):
    """A safetensors file of (name, dtype, shape, bytes) in the order given."""
    header, offset = {}, 0
    for name, dtype, shape, data in tensors:
        header[name] = {"dtype": dtype, "shape": shape,
                        "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(text)) + text)
        for *_, data in tensors:
            fh.write(data)
    return str(path)


def test_ple_parts_out_of_order_are_refused_naming_them(tmp_path):
    """A shard spanning parts that neither lie end to end nor meet at page
    boundaries cannot be one array for the kernel: refused, the parts named."""
    spec = PLESpec(layer_ids=[2, 5], ple_embed_dim=160, vocab_size=5000, eos_token_id=7,
                   ngram_vocab_size_base=3000, split_ngram_parts=4)
    prefix = "model.layers.1.ple.ple_embedding.ngram_embedding."
    parts = []
    for part in range(spec.split_ngram_parts):
        a, b = spec.part_rows(2, part)
        parts.append((f"{prefix}shard_{part}.weight", "F8_E4M3", [b - a, spec.head_dim],
                      bytes([part + 1]) * ((b - a) * spec.row_bytes)))
    scale = (f"{prefix}weight_scale", "F32", [], struct.pack("<f", 0.5))
    path = _safetensors(tmp_path / "m.safetensors", [scale, *reversed(parts)])
    with pytest.raises(CheckpointError, match=r"cannot lay out.*shard_0\.weight.*shard_1\.weight"):
        SharedPLETable.create(spec, 2, checkpoint=path, tier="mapped")
    # a shard inside one part needs no layout: it maps, whatever the parts' order
    with SharedPLETable.create(spec, 2, checkpoint=path, tier="mapped", etp_size=4,
                               etp_rank=1) as table:
        first = spec.part_rows(2, 1)[0]
        assert set(table.lookup_packed([first]).reshape(-1)) == {2}


def test_what_does_not_apply_to_a_mapped_table_is_refused_naming_why(ckpt):
    shard = shard_heads(SPEC.bucket_sizes(LAYER), 1, 0)
    cases = [({"mode": "dp_shared"}, SpecError, "page cache holds one copy"),
             ({"register_device": 0}, StorageError, "cannot register"),
             ({"placement": "local"}, SpecError, "page cache places"),
             ({"page_size": "2M"}, SpecError, "4 KiB"),
             ({"checkpoint": None}, SpecError, "pass checkpoint="),
             ({"tier": "disk"}, SpecError, "tier must be one of")]
    for extra, error, text in cases:
        kw = {"checkpoint": ckpt, "tier": "mapped", **extra}
        with pytest.raises(error, match=text):
            SharedEngramTable.create(SPEC, LAYER, shard, **kw)
    with pytest.raises(StorageError, match="cannot register"):
        SharedPLETable.create(PLE, 2, checkpoint=ckpt, tier="mapped", register_device=0)
    with SharedEngramTable.create(SPEC, LAYER, shard, checkpoint=ckpt, tier="mapped") as table, \
            pytest.raises(StorageError, match="no table file to hand over"):
        table.dup_descriptor()


def test_a_file_that_cannot_be_mapped_is_refused_with_the_reason(tmp_path):
    """A FIFO is refused before any open blocks; a regular file on a file
    system without mmap (procfs) is refused naming the file and why."""
    fifo = tmp_path / "model.safetensors"
    os.mkfifo(fifo)
    shard = shard_heads(SPEC.bucket_sizes(LAYER), 1, 0)
    with pytest.raises(CheckpointError, match="FIFO"):
        SharedEngramTable.create(SPEC, LAYER, shard, checkpoint=str(fifo), tier="mapped")
    proc = TensorLocation("/proc/self/status", "status", "U8", (64,), 0, None)
    with pytest.raises(CheckpointError, match=r"/proc/self/status cannot be mapped \(No such "
                                              r"device\).*does not map files"):
        MappedArrays({"weights": [Segment(proc, 0, 64)]}, "a test table")


TRUNCATED = """
import os, sys, numpy as np
from numa_engram import EngramSpec, SharedEngramTable, shard_heads
from numa_engram.errors import CheckpointError
from numa_engram.model.ple import PLESpec
from numa_engram.tables.pletable import SharedPLETable
ckpt, family = sys.argv[1], sys.argv[2]
if family == "engram":
    spec = EngramSpec.small(rows_per_head=3000, n_head_per_ngram=4, head_dim=128, seed=0)
    layer = spec.layer_ids[0]
    table = SharedEngramTable.create(spec, layer, shard_heads(spec.bucket_sizes(layer), 1, 0),
                                     checkpoint=ckpt, tier="mapped", lookup_threads=2)
    last = np.asarray(spec.bucket_sizes(layer), dtype=np.int64)[None, :] - 1
    many = np.repeat(last, 4096, axis=0)
    look = lambda ids: table.lookup(ids)
else:
    spec = PLESpec(layer_ids=[2, 5], ple_embed_dim=160, vocab_size=5000, eos_token_id=7,
                   ngram_vocab_size_base=3000, split_ngram_parts=7)
    table = SharedPLETable.create(spec, 5, checkpoint=ckpt, tier="mapped", lookup_threads=2)
    last = np.array([spec.rows(5) - 1])
    many = np.repeat(last, 3000)
    look = lambda ids: table.lookup(ids)
first = look(last)
os.truncate(ckpt, 4096)  # every row's page gone
for ids in (last, many, last):  # the caller alone, then the threads, then again
    try:
        look(ids)
        print("NO ERROR")
    except CheckpointError as exc:
        print("ERROR", exc)
try:
    table.check_checkpoint()
except CheckpointError as exc:
    print("CHECK", exc)
print("ALIVE")
if len(sys.argv) > 3:  # a read outside the lookups: the default action, not ours
    print(int(table.weights[-1].sum()))
"""


@pytest.mark.slow
@pytest.mark.parametrize("family", ["engram", "ple"])
def test_a_checkpoint_truncated_under_a_mapped_table_is_an_error_naming_it(
        ckpt, ple_ckpt, tmp_path, family):
    path = tmp_path / "model.safetensors"
    shutil.copyfile(ckpt if family == "engram" else ple_ckpt, path)
    result = run_python(TRUNCATED, str(path), family, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert len([ln for ln in lines if ln.startswith("ERROR")]) == 3, result.stdout
    for line in lines[:3]:
        assert f"{path}: byte" in line and "truncated under the table" in line, line
        assert "(SIGBUS)" in line and "4096 now" in line
    assert lines[3].startswith(f"CHECK {path} was truncated under the mapped"), lines[3]
    assert lines[-1] == "ALIVE"


@pytest.mark.slow
def test_a_sigbus_outside_a_lookup_still_takes_the_default_action(ckpt, tmp_path):
    """Our handler catches only faults inside a gather: a read of a
    truncated mapping anywhere else dies of SIGBUS as it would without us."""
    path = tmp_path / "model.safetensors"
    shutil.copyfile(ckpt, path)
    result = run_python(TRUNCATED, str(path), "engram", "outside", timeout=120)
    assert "ALIVE" in result.stdout
    if "AddressSanitizer" in result.stderr:  # (tools/sanitize.sh) its handler was there first
        assert "AddressSanitizer: BUS" in result.stderr, result.stderr[-2000:]
        return
    assert result.returncode == -signal.SIGBUS, (result.returncode, result.stderr[-2000:])


FAULTHANDLER_AFTER_US = """
import faulthandler, os, sys, numpy as np
from numa_engram import EngramSpec, SharedEngramTable, shard_heads
from numa_engram.errors import CheckpointError
spec = EngramSpec.small(rows_per_head=3000, n_head_per_ngram=4, head_dim=128, seed=0)
layer = spec.layer_ids[0]
shard = shard_heads(spec.bucket_sizes(layer), 1, 0)
first = SharedEngramTable.create(spec, layer, shard, checkpoint=sys.argv[1], tier="mapped")
faulthandler.enable()  # its previous handler is ours
table = SharedEngramTable.create(spec, layer, shard, checkpoint=sys.argv[1], tier="mapped")
os.truncate(sys.argv[1], 4096)
try:
    table.lookup(np.asarray(spec.bucket_sizes(layer), dtype=np.int64)[None, :] - 1)
except CheckpointError:
    print("ERROR", flush=True)
print(int(table.weights[-1].sum()))
"""


@pytest.mark.slow
def test_a_handler_chained_both_ways_dies_once_instead_of_looping(ckpt, tmp_path):
    """faulthandler installed after our handler, ours again after it (a
    second mapped table): a lookup's fault is still ours, and a fault
    elsewhere is reported once by faulthandler, which hands it back to us
    by raising it, and the process dies of SIGBUS (it looped, reporting the
    fault forever, before)."""
    path = tmp_path / "model.safetensors"
    shutil.copyfile(ckpt, path)
    result = run_python(FAULTHANDLER_AFTER_US, str(path), timeout=60)
    assert result.stdout.split() == ["ERROR"], result.stdout
    assert result.stderr.count("Fatal Python error: Bus error") == 1, result.stderr[-2000:]
    assert result.returncode == -signal.SIGBUS


SENT_DURING_A_LOOKUP = """
import signal, sys, threading, time, numpy as np
from numa_engram import EngramSpec, SharedEngramTable, shard_heads
spec = EngramSpec.small(rows_per_head=3000, n_head_per_ngram=4, head_dim=128, seed=0)
layer = spec.layer_ids[0]
table = SharedEngramTable.create(spec, layer, shard_heads(spec.bucket_sizes(layer), 1, 0),
                                 checkpoint=sys.argv[1], tier="mapped", lookup_threads=1)
ids = np.random.default_rng(0).integers(0, min(spec.bucket_sizes(layer)), (65536, 8))
table.lookup(ids)  # (torch imported, the output pool warm: the loop's time is the gather's)
errors = []

def look():  # ~all of its time inside the guarded gather (tens of ms a call)
    end = time.monotonic() + 5
    while time.monotonic() < end and not errors:
        try:
            table.lookup(ids)
        except Exception as exc:
            errors.append(exc)
worker = threading.Thread(target=look)
worker.start()
time.sleep(0.2)
signal.pthread_kill(worker.ident, signal.SIGBUS)
worker.join()
print("SURVIVED", errors, flush=True)
"""


@pytest.mark.slow
def test_a_sigbus_sent_by_a_process_during_a_lookup_is_not_taken_for_a_lost_page(ckpt):
    """A SIGBUS another process (or library) sends with kill/pthread_kill
    is no fault of a mapped page: it takes its default action even when it
    lands inside a guarded gather (it was caught there as a truncated file,
    SIGBUS "at" the sender's pid, and the process served on)."""
    result = run_python(SENT_DURING_A_LOOKUP, ckpt, timeout=60)
    assert "SURVIVED" not in result.stdout, result.stdout
    if "AddressSanitizer" in result.stderr:  # (tools/sanitize.sh) its handler was there first
        return
    assert result.returncode == -signal.SIGBUS, (result.returncode, result.stderr[-2000:])


CURING_HANDLER_C = """
#include <pthread.h>
#include <setjmp.h>
#include <signal.h>
#include <string.h>
#include <sys/mman.h>
static volatile long cured;
static __thread sigjmp_buf *volatile jump_here;
/* another library's SIGBUS handler (a JVM's, a sanitizer's): inside its
 * own guarded reads it jumps out of the fault (as ours does); elsewhere it
 * cures the fault (a zero page over the lost one) and returns */
static void on_bus(int sig, siginfo_t *info, void *context)
{
    (void)sig, (void)context;
    if (jump_here) {
        sigjmp_buf *j = jump_here;
        jump_here = 0;
        siglongjmp(*j, 1);
    }
    void *page = (void *)((unsigned long)info->si_addr & ~4095UL);
    mmap(page, 4096, PROT_READ, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0);
    cured++;
}
int install(void)
{
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = on_bus;
    sa.sa_flags = SA_SIGINFO;
    sigemptyset(&sa.sa_mask);
    return sigaction(SIGBUS, &sa, 0);
}
long cured_count(void) { return cured; }
/* a read inside the library's own guard: the byte, or -1 (its fault caught) */
long guarded_read(void *p)
{
    sigjmp_buf j;
    if (sigsetjmp(j, 1))
        return -1;
    jump_here = &j;
    long v = *(volatile unsigned char *)p;
    jump_here = 0;
    return v;
}
static void *reader(void *p) { return (void *)(long)*(volatile unsigned char *)p; }
/* a read by a thread of its own (no Python, no guard) */
long read_in_thread(void *p)
{
    pthread_t t;
    void *r;
    pthread_create(&t, 0, reader, p);
    pthread_join(t, &r);
    return (long)r;
}
"""

HANDLER_BEFORE_US = """
import ctypes, os, signal, sys, numpy as np
from numa_engram import EngramSpec, SharedEngramTable, shard_heads
from numa_engram.errors import CheckpointError
ckpt, kind = sys.argv[1], sys.argv[2]
if kind == "c":
    lib = ctypes.CDLL(sys.argv[3])
    assert lib.install() == 0
else:
    signal.signal(signal.SIGBUS, lambda *a: print("PYTHON HANDLER", flush=True))
spec = EngramSpec.small(rows_per_head=3000, n_head_per_ngram=4, head_dim=128, seed=0)
layer = spec.layer_ids[0]
table = SharedEngramTable.create(spec, layer, shard_heads(spec.bucket_sizes(layer), 1, 0),
                                 checkpoint=ckpt, tier="mapped", lookup_threads=2)
os.truncate(ckpt, 4096)
try:
    table.lookup(np.asarray(spec.bucket_sizes(layer), dtype=np.int64)[None, :] - 1)
except CheckpointError:
    print("ERROR", flush=True)
address = table.weights[-1].__array_interface__["data"][0]
if kind == "c":
    print("GUARDED", *(lib.guarded_read(ctypes.c_void_p(address)) for _ in range(3)), flush=True)
    print("CURED" if lib.cured_count() == 0 else "CURED TOO SOON", flush=True)
    print("READ", lib.read_in_thread(ctypes.c_void_p(address)), lib.cured_count(), flush=True)
else:
    print("READ", int(table.weights[-1].sum()), flush=True)
"""


@pytest.mark.slow
def test_a_fault_outside_a_lookup_goes_to_the_handler_installed_before_ours(ckpt, tmp_path):
    """Another library's SA_SIGINFO handler installed before ours sees a
    fault of a thread of its own (no guard) with its address, cures it and
    the read goes on; one that jumps out of its own guarded reads gets each
    of them, the same address again and again (the second was taken for a
    handler looping on one fault and killed the process); a lookup's fault
    stays ours (the other handler not called).  A Python handler before
    ours (a flag set, nothing cured): the process dies of SIGBUS once
    instead of faulting for ever."""
    import shutil as sh
    import subprocess
    import sysconfig

    cc = (sysconfig.get_config_var("CC") or "cc").split()[0]
    if sh.which(cc) is None:
        pytest.skip(f"no C compiler ({cc}) to build another library's handler")
    (tmp_path / "cure.c").write_text(CURING_HANDLER_C)
    lib = tmp_path / "libcure.so"
    subprocess.run([cc, "-shared", "-fPIC", "-O1", "-pthread", "-o", str(lib),
                    str(tmp_path / "cure.c")], check=True, capture_output=True, timeout=60)
    path = tmp_path / "model.safetensors"
    sh.copyfile(ckpt, path)
    result = run_python(HANDLER_BEFORE_US, str(path), "c", str(lib), timeout=60)
    if "AddressSanitizer" in result.stderr:  # (tools/sanitize.sh) its handler was there first
        return
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split("\n")[:4] == ["ERROR", "GUARDED -1 -1 -1", "CURED", "READ 0 1"], \
        result.stdout
    sh.copyfile(ckpt, path)
    result = run_python(HANDLER_BEFORE_US, str(path), "python", timeout=60)
    assert result.stdout.split() == ["ERROR"], result.stdout
    assert result.returncode == -signal.SIGBUS, (result.returncode, result.stderr[-2000:])


def test_read_ahead_refuses_ids_a_lookup_refuses_naming_them(ckpt, ple_ckpt):
    """readahead takes the ids as the lookup does: ids of no integer
    dtype, ragged or of the wrong shape are the same LookupIdError (they
    were numpy's bare ValueError, or 1-D ids read as rows of 8 columns)."""
    shard = shard_heads(SPEC.bucket_sizes(LAYER), 1, 0)
    with SharedEngramTable.create(SPEC, LAYER, shard, checkpoint=ckpt, tier="mapped") as table:
        for bad in ("abc", np.zeros(SPEC.n_hash_cols, dtype=np.int64),
                    np.zeros((2, SPEC.n_hash_cols), dtype=np.float32)):
            with pytest.raises(LookupIdError) as looked:
                table.lookup(bad)
            with pytest.raises(LookupIdError) as ahead:
                table.readahead(bad)
            assert str(ahead.value) == str(looked.value)
    with SharedPLETable.create(PLE, 5, checkpoint=ple_ckpt, tier="mapped") as ple:
        for bad in ("abc", [[1, 2], [3]], [1.5]):
            with pytest.raises(LookupIdError) as looked:
                ple.lookup(bad)
            with pytest.raises(LookupIdError) as ahead:
                ple.readahead(bad)
            assert str(ahead.value) == str(looked.value)


def test_a_replaced_checkpoint_keeps_serving_the_file_mapped_and_is_named(ckpt, tmp_path):
    path = tmp_path / "model.safetensors"
    shutil.copyfile(ckpt, path)
    shard = shard_heads(SPEC.bucket_sizes(LAYER), 1, 0)
    ids = _ids((16, SPEC.n_hash_cols))
    with SharedEngramTable.create(SPEC, LAYER, shard, checkpoint=str(path),
                                  tier="mapped") as table:
        before = table.lookup(ids).clone()
        table.check_checkpoint()
        other = tmp_path / "other.safetensors"
        write_synthetic_checkpoint(other, SPEC, seed=4)
        os.replace(other, path)
        assert torch.equal(table.lookup(ids), before)  # the old inode's pages
        with pytest.raises(CheckpointError, match=f"{path} was replaced under the mapped"):
            table.check_checkpoint()


def _drop_pages(path):
    """The file's pages out of the page cache (written back first: a dirty
    page is not dropped)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _resident_pages(mapping, start, length):
    """The set of page indices (of the mapping) of [start, start+length) in memory."""
    first, last = start // PAGE, (start + length - 1) // PAGE
    return {p for p in range(first, last + 1) if native.pages_resident(mapping, p * PAGE, PAGE)}


def _wait_resident(mapping, want, spans, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while True:
        got = set().union(*(_resident_pages(mapping, a, n) for a, n in spans))
        if got >= want or time.monotonic() > deadline:
            return got
        time.sleep(0.01)


def test_read_ahead_asks_for_exactly_the_rows_pages(tmp_path):
    """After the file's pages are dropped, read-ahead of some ids brings in
    exactly the pages their weight and scale rows lie on (mincore), and
    counts them: all misses first, all hits once read."""
    spec = EngramSpec.small(rows_per_head=40000, n_head_per_ngram=4, head_dim=128, seed=0)
    layer = spec.layer_ids[0]
    path = write_synthetic_checkpoint(tmp_path / "model.safetensors", spec, seed=1)
    shard = shard_heads(spec.bucket_sizes(layer), 1, 0)
    with SharedEngramTable.create(spec, layer, shard, checkpoint=str(path),
                                  tier="mapped") as table:
        arrays = table._backing.arrays
        mapping = arrays.mapping
        w0, s0 = arrays.offset("weights"), arrays.offset("scales")
        spans = [(w0, table.weights.nbytes), (s0, table.scales.nbytes)]
        _drop_pages(str(path))
        assert not set().union(*(_resident_pages(mapping, a, n) for a, n in spans))
        ids = np.random.default_rng(2).integers(0, min(spec.bucket_sizes(layer)),
                                                size=(8, spec.n_hash_cols))
        offsets = np.concatenate([[0], np.cumsum(spec.bucket_sizes(layer))[:-1]])
        rows = (ids + offsets).reshape(-1)
        want = set()
        for base, width in ((w0, spec.head_dim), (s0, spec.scales_per_row)):
            for r in rows:
                want |= set(range((base + r * width) // PAGE,
                                  (base + r * width + width - 1) // PAGE + 1))
        hits, pages = table.readahead(ids)
        assert (hits, pages) == (0, len(want))
        assert _wait_resident(mapping, want, spans) == want  # those pages and no others
        assert table.readahead(ids) == (len(want), len(want))
        assert table.readahead(ids[:0]) == (0, 0)


def test_the_plugins_read_ahead_rests_while_the_page_cache_is_warm(tmp_path):
    """The vLLM plugin's per-lookup read-ahead (integrations/vllm/mapped.py):
    asked at every lookup while pages are missing; once one finds every
    page in memory, the next lookups skip its mincore calls for a spell
    that doubles (1, 3, 7, ... QUIET_MAX) while they stay there; pages
    dropped meanwhile are seen at the next one asked, which ends it."""
    from numa_engram.integrations.vllm.mapped import ReadAhead

    spec = EngramSpec.small(rows_per_head=40000, n_head_per_ngram=4, head_dim=128, seed=0)
    layer = spec.layer_ids[0]
    path = str(write_synthetic_checkpoint(tmp_path / "model.safetensors", spec, seed=1))
    shard = shard_heads(spec.bucket_sizes(layer), 1, 0)
    ids = np.random.default_rng(4).integers(0, min(spec.bucket_sizes(layer)),
                                            size=(8, spec.n_hash_cols))
    with SharedEngramTable.create(spec, layer, shard, checkpoint=path, tier="mapped") as table:
        _drop_pages(path)
        ahead = ReadAhead()

        def lookups(n):
            asked = []
            for _ in range(n):
                before = ahead.pages
                ahead.ahead(lambda: table.readahead(ids))
                asked.append(ahead.pages > before)
            return asked

        def in_memory():  # the kernel's reads of what was asked for
            deadline = time.monotonic() + 10
            while table.readahead(ids, advise=False) != (pages, pages):
                assert time.monotonic() < deadline, table.readahead(ids, advise=False)
                time.sleep(0.01)

        assert lookups(1) == [True]  # cold: every page asked for
        pages = ahead.pages
        assert pages > 0 and ahead.resident == 0
        in_memory()
        # asked again (misses last time), all in memory: quiet 1, then 3, then 7
        assert lookups(1 + 1 + 1 + 3 + 1 + 7) == [True, False, True, False, False, False,
                                                  True] + [False] * 7
        assert (ahead.pages, ahead.resident) == (4 * pages, 3 * pages)
        _drop_pages(path)  # evicted (read ahead, never faulted into this process)
        resident = ahead.resident
        assert lookups(1) == [True] and ahead.resident < resident + pages  # misses: spell over
        in_memory()
        assert lookups(3) == [True, False, True]  # asked (misses last time): warm, quiet 1
        assert ahead.skipped == 1 + 3 + 7 + 1
        warm = lookups(400)  # the spell grows to QUIET_MAX and stays there
        assert warm.count(True) <= 7 + 400 // (ReadAhead.QUIET_MAX + 1)
        assert warm[-ReadAhead.QUIET_MAX - 1:].count(True) == 1


def test_the_prefetch_scheduler_reads_a_mapped_tables_rows_ahead_and_counts(ckpt):
    from numa_engram.lookup.prefetch import PrefetchScheduler

    shard = shard_heads(SPEC.bucket_sizes(LAYER), 1, 0)
    with SharedEngramTable.create(SPEC, LAYER, shard, checkpoint=ckpt, tier="mapped") as table, \
            SharedEngramTable.create(SPEC, LAYER, shard, checkpoint=ckpt,
                                     mode="independent") as resident:
        _drop_pages(ckpt)
        ids = _ids((4, SPEC.n_hash_cols))
        shape = {LAYER: (shard.num_heads, SPEC.head_dim)}
        with PrefetchScheduler({LAYER: table}, shape, max_tokens=16) as sched:
            resident_before, pages = sched.read_ahead(LAYER, ids)
            assert pages > 0
            sched.submit(LAYER, ids)
            assert torch.equal(sched.wait(LAYER)[:4], resident.lookup(ids))
            stats = sched.read_ahead_stats()[LAYER]
            assert stats["pages"] == 2 * pages and stats["hits"] >= resident_before
            assert stats["misses"] == stats["pages"] - stats["hits"]
        with PrefetchScheduler({LAYER: resident}, shape, max_tokens=16) as sched:
            assert sched.read_ahead(LAYER, ids) == (0, 0) and sched.read_ahead_stats() == {}


SECOND_PROCESS = """
import sys, numpy as np
from numa_engram import EngramSpec, SharedEngramTable, shard_heads
spec = EngramSpec.small(rows_per_head=3000, n_head_per_ngram=4, head_dim=128, seed=0)
layer = spec.layer_ids[0]
table = SharedEngramTable.create(spec, layer, shard_heads(spec.bucket_sizes(layer), 1, 0),
                                 checkpoint=sys.argv[1], tier="mapped")
int(table.weights.sum(dtype=np.uint64)), int(table.scales.sum(dtype=np.uint64))
mapping = table._backing.arrays.mapping
rss = pss = 0
inside = False
for line in open("/proc/self/smaps").read().splitlines():
    head = line.split()[0]
    if "-" in head and not head.endswith(":"):  # a mapping's first line (its spans' VMAs)
        start = int(head.split("-")[0], 16)
        inside = mapping.address <= start < mapping.address + mapping.length
    elif inside and head in ("Rss:", "Pss:"):
        rss, pss = (rss + int(line.split()[1]), pss) if head == "Rss:" else \
            (rss, pss + int(line.split()[1]))
print(rss, pss)
"""


def test_two_processes_mapping_one_checkpoint_share_one_copy_of_its_pages(ckpt):
    """The page cache is the sharing: a second process's mapped table of the
    same checkpoint holds the very pages the first one reads (its PSS half
    its RSS), no copy of its own."""
    shard = shard_heads(SPEC.bucket_sizes(LAYER), 1, 0)
    with SharedEngramTable.create(SPEC, LAYER, shard, checkpoint=ckpt, tier="mapped") as table:
        int(table.weights.sum(dtype=np.uint64)), int(table.scales.sum(dtype=np.uint64))
        result = run_python(SECOND_PROCESS, ckpt, timeout=120)
        assert result.returncode == 0, result.stderr[-2000:]
        rss, pss = map(int, result.stdout.split())
        size_kib = (table.weights.nbytes + table.scales.nbytes) // 1024
        assert rss >= size_kib * 0.99 and pss <= rss * 0.55, (rss, pss, size_kib)
