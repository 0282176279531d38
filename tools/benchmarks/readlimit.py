"""The random-read limit a lookup is measured against: every cache line of
``table[rows]`` read with ``ahead`` rows prefetched, by 1 or more threads.
A benchmark's own kernel, compiled here at first use (cffi, the compiler
that built the package), so it stays out of the library's ABI."""

from __future__ import annotations

import importlib
import sys
import tempfile
from functools import cache
from typing import Any

import numpy as np

CDEF = """
int read_rows(const uint8_t *table, int64_t dim, const int64_t *rows, int64_t n, int ahead,
              int n_threads, uint64_t *sum);
"""

SOURCE = r"""
#include <pthread.h>
#include <stdint.h>
#include <string.h>

enum { MAX_THREADS = 64 };

struct job { const uint8_t *table; int64_t dim; const int64_t *rows; int64_t begin, end;
             int ahead; uint64_t sum; };

/* summing one word per 64-byte line, so no read is optimised away */
static void *read_part(void *arg)
{
    struct job *j = arg;
    uint64_t sum = 0;
    for (int64_t i = j->begin; i < j->end; i++) {
        if (i + j->ahead < j->end) {
            const uint8_t *q = j->table + j->rows[i + j->ahead] * j->dim;
            for (int64_t off = 0; off < j->dim; off += 64)
                __builtin_prefetch(q + off, 0, 3);
        }
        const uint8_t *p = j->table + j->rows[i] * j->dim;
        for (int64_t off = 0; off < j->dim; off += 64) {
            uint64_t word;
            memcpy(&word, p + off, sizeof word);
            sum += word;
        }
    }
    j->sum = sum;
    return NULL;
}

int read_rows(const uint8_t *table, int64_t dim, const int64_t *rows, int64_t n, int ahead,
              int n_threads, uint64_t *sum)
{
    struct job jobs[MAX_THREADS];
    pthread_t tids[MAX_THREADS];
    if (n_threads < 1) n_threads = 1;
    if (n_threads > MAX_THREADS) n_threads = MAX_THREADS;
    int started = 0, rc = 0;
    for (int i = 0; i < n_threads; i++) {
        jobs[i] = (struct job){table, dim, rows, n * i / n_threads, n * (i + 1) / n_threads,
                               ahead, 0};
        if (i > 0 && pthread_create(&tids[i], NULL, read_part, &jobs[i]) != 0) {
            rc = -1;
            break;
        }
        started = i + 1;
    }
    read_part(&jobs[0]);
    *sum = jobs[0].sum;
    for (int i = 1; i < started; i++) {
        pthread_join(tids[i], NULL);
        *sum += jobs[i].sum;
    }
    return rc;
}
"""


@cache
def _module() -> Any:
    from cffi import FFI

    ffi = FFI()
    ffi.cdef(CDEF)
    ffi.set_source("_numa_engram_readlimit", SOURCE, extra_compile_args=["-O2"],
                   libraries=["pthread"])
    # a loaded module outlives its file: nothing is left in the temporary directory
    with tempfile.TemporaryDirectory(prefix="numa-engram-readlimit-") as where:
        ffi.compile(tmpdir=where, verbose=False)
        sys.path.insert(0, where)
        try:
            return importlib.import_module("_numa_engram_readlimit")
        finally:
            sys.path.remove(where)


def read_rows(table: np.ndarray, rows: np.ndarray, ahead: int = 32, threads: int = 1) -> int:
    """Read every cache line of ``table[rows]`` (uint8 [n, dim]); returns a
    checksum (the first word of every line read), so the reads happen."""
    rows = np.ascontiguousarray(rows, dtype=np.int64)
    if table.ndim != 2 or table.dtype != np.uint8 or not table.flags.c_contiguous:
        raise ValueError("table must be a C-contiguous uint8 [rows, dim] array")
    if rows.size and (rows.min() < 0 or rows.max() >= table.shape[0]):
        raise ValueError(f"rows must be in [0, {table.shape[0]})")
    mod = _module()
    ffi, total = mod.ffi, mod.ffi.new("uint64_t *")
    if mod.lib.read_rows(ffi.from_buffer("uint8_t[]", table), table.shape[1],
                         ffi.from_buffer("int64_t[]", rows), rows.size, ahead, threads,
                         total) != 0:
        raise OSError(f"read_rows: could not start {threads} threads")
    return int(total[0])
