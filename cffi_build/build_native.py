"""cffi builder (API mode, out-of-line) for numa_engram._native.

Run by setuptools at install time (``cffi_modules`` in setup.py); nothing
prebuilt is committed.  Declarations are grouped by topic; the C source is
native.c beside this file.
"""

import re
from pathlib import Path

from cffi import FFI

HERE = Path(__file__).resolve().parent
# the package version, compiled in: native.py refuses a core built for another
VERSION = re.search(r'__version__ = "([^"]+)"',
                    (HERE.parent / "numa_engram" / "_version.py").read_text()).group(1)

# constants come from the system headers (the values the kernel uses), not
# from numbers typed in Python
MEMORY_DECLS = """
    #define MADV_DONTNEED ...
    #define MADV_NOHUGEPAGE ...
    #define MADV_HUGEPAGE ...
    #define MADV_POPULATE_READ ...
    #define MADV_POPULATE_WRITE ...
    #define MFD_CLOEXEC ...
    #define MFD_HUGETLB ...
    #define MFD_HUGE_SHIFT ...
    #define TMPFS_MAGIC ...
    #define HUGETLBFS_MAGIC ...
    void *ne_map_shared(int fd, size_t length, int writable);
    int ne_unmap(void *addr, size_t length);
    int ne_protect_read(void *addr, size_t length);
    int ne_madvise(void *addr, size_t length, int advice);
    int ne_fallocate(int fd, int64_t offset, int64_t length);
    int ne_statvfs(const char *path, uint64_t *free_bytes, uint64_t *total_bytes);
    int ne_statfs_type(const char *path, int64_t *fs_type);
    long ne_page_size(void);
    const char *ne_core_version(void);
"""

NUMA_DECLS = """
    static const int MPOL_DEFAULT;
    static const int MPOL_PREFERRED;
    static const int MPOL_BIND;
    static const int MPOL_INTERLEAVE;
    static const int MPOL_LOCAL;
    #define MPOL_MF_STRICT ...
    #define MPOL_MF_MOVE ...
    #define MPOL_MF_MOVE_ALL ...
    #define MPOL_F_NODE ...
    #define MPOL_F_ADDR ...
    long ne_mbind(void *addr, size_t length, int mode, const unsigned long *nodemask,
                  unsigned long maxnode, unsigned int flags);
    long ne_get_mempolicy(int *mode, unsigned long *nodemask, unsigned long maxnode,
                          void *addr, unsigned long flags);
    long ne_page_nodes(void *addr, size_t length, size_t page_size, int *status);
"""

KERNEL_DECLS = """
    uint16_t ne_dequant_one(uint8_t weight, uint8_t scale);
    struct ne_pool;
    struct ne_pool *ne_pool_new(int n, const int *cpus, int n_cpus);
    void ne_pool_free(struct ne_pool *pool);
    int ne_pool_size(const struct ne_pool *pool);
    #define NE_SMALL_ROWS ...
    int ne_tune_small_rows(int64_t rows);
    int64_t ne_first_bad_id(const int64_t *ids, int64_t n_tokens, int64_t stride,
                            int64_t n_heads, const int64_t *bucket_sizes,
                            const int64_t *id_base);
    int ne_lookup_bf16(const uint8_t *weights, const uint8_t *scales, int64_t dim,
                       int64_t block, const int64_t *ids, int64_t n_tokens,
                       int64_t stride, int64_t n_heads, const int64_t *head_offsets,
                       const int64_t *bucket_sizes, const int64_t *id_base, uint16_t *out,
                       int n_threads, const int *cpus, int n_cpus, int64_t *bad,
                       struct ne_pool *pool);
    int ne_gather_fp8(const uint8_t *weights, const uint8_t *scales, int64_t dim, int64_t block,
                      const int64_t *ids, int64_t n_tokens, int64_t stride, int64_t n_heads,
                      const int64_t *head_offsets, const int64_t *bucket_sizes,
                      const int64_t *id_base, uint8_t *out_w, uint8_t *out_s, int n_threads,
                      const int *cpus, int n_cpus, int64_t *bad, struct ne_pool *pool);
    int ne_ngram_hashes(const int64_t *ids, int64_t n_rows, int64_t t, int64_t pad_id,
                        const int64_t *multipliers, int64_t max_ngram, const int64_t *primes,
                        int64_t n_head, int64_t *out, int n_threads, int hardware_division);
    #define NE_PREFETCH_AHEAD ...
    #define NE_PREFETCH_HINT ...
    int ne_tune_prefetch(int ahead, int hint);
    int ne_read_rows(const uint8_t *table, int64_t dim, const int64_t *rows, int64_t n,
                     int ahead, int n_threads, uint64_t *sum);
    int64_t ne_hash_windows(const int64_t *ids, const int64_t *slots, const int64_t *positions,
                            const uint8_t *commit, int64_t n_tokens, int64_t n_slots,
                            int64_t n1, int64_t *hist, int64_t *next_pos, int64_t *cur,
                            int64_t *cur_next, int64_t *last, int64_t *win, int64_t *why);
    int ne_hash_window_batch(const int64_t *win, int64_t n_tokens, int64_t n, int64_t pad_id,
                             const int64_t *multipliers, const int64_t *primes,
                             const int64_t *offsets, int64_t n_layers, int64_t n_head,
                             int64_t *out, int n_threads);
"""

ffibuilder = FFI()
ffibuilder.cdef(MEMORY_DECLS + NUMA_DECLS + KERNEL_DECLS)
ffibuilder.set_source(
    "numa_engram._native",
    '#include <sys/mman.h>\n#include <linux/magic.h>\n#include <linux/memfd.h>\n'
    '#include <linux/mempolicy.h>\n'
    '#include "native.c"',
    include_dirs=[str(HERE)],
    define_macros=[("NE_CORE_VERSION", f'"{VERSION}"')],
    # -O3 lets GCC vectorise the branch-free dequant loop for the baseline
    # ISA; nothing here assumes the build host's CPU (no -march=native).
    extra_compile_args=["-O3", "-std=gnu11", "-Wall", "-Wno-unused-function"],
    libraries=["pthread"],
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
