/* memory.h: mappings, memory policies, page queries and file-system
 * facts, as thin syscall wrappers.  Each returns -1 (or NULL) with errno
 * set on failure; numa_engram/bindings/native.py turns errno into an
 * exception.
 * Plain declarations: cffi reads this header as it is; native.c includes
 * it once, after core.h. */

void *ne_map_shared(int fd, size_t length, int writable);
int ne_unmap(void *addr, size_t length);
int ne_protect_read(void *addr, size_t length);
int ne_madvise(void *addr, size_t length, int advice);
long ne_mbind(void *addr, size_t length, int mode, const unsigned long *nodemask,
              unsigned long maxnode, unsigned int flags);
long ne_get_mempolicy(int *mode, unsigned long *nodemask, unsigned long maxnode, void *addr,
                      unsigned long flags);
long ne_page_nodes(void *addr, size_t length, size_t page_size, int *status);
int ne_fallocate(int fd, int64_t offset, int64_t length);
int ne_statvfs(const char *path, uint64_t *free_bytes, uint64_t *total_bytes);
int ne_statfs_type(const char *path, int64_t *fs_type);
long ne_page_size(void);
const char *ne_core_version(void);
