/* filemap.h: a checkpoint's tensors mapped read-only from their files
 * (the "mapped" tier), their pages asked for ahead and counted, and the
 * SIGBUS guard that turns a page of a truncated or replaced file into a
 * lookup's error instead of the process's death.
 *
 * Plain declarations: cffi reads this header as it is; native.c includes
 * it once, after core.h. */

/* Install the SIGBUS handler (idempotent; again when another replaced it;
 * the handler it finds is chained to for every fault outside a guarded
 * gather).  0, or -1 with errno. */
int ne_guard_install(void);
/* The address of the calling thread's last fault caught in a gather (a
 * lookup that returned NE_FAULTED), or 0. */
uint64_t ne_last_fault(void);
/* length bytes of address space, PROT_NONE and unbacked, for the files'
 * spans to be mapped into side by side (unmapped with ne_unmap); NULL
 * with errno. */
void *ne_reserve(size_t length);
/* length bytes of fd from offset (both page-aligned) mapped PROT_READ,
 * MAP_SHARED at addr (inside a reservation: MAP_FIXED), MADV_RANDOM:
 * a fault reads its own page, not a readahead window.  0, or -1. */
int ne_map_file_at(void *addr, int fd, int64_t offset, size_t length);
/* Pages of [addr, addr + length) (page-aligned) in memory now (mincore),
 * or -1 with errno. */
int64_t ne_pages_resident(const void *addr, size_t length);
/* For rows[0..n) (ascending row indices of a [.., row_bytes] array at
 * base): the distinct pages they lie on, counted into *pages, those
 * resident now (mincore) returned; with advise, the runs of pages not all
 * resident asked for with MADV_WILLNEED (the kernel reads exactly them,
 * no readahead window).  -1 with errno. */
int64_t ne_rows_readahead(const uint8_t *base, int64_t row_bytes, const int64_t *rows, int64_t n,
                          int advise, int64_t *pages);
