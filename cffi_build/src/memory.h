/* memory.h: mappings, memory policies, page queries and file-system
 * facts, as thin syscall wrappers.  Each returns -1 (or NULL) with errno
 * set on failure; numa_engram/bindings/native.py turns errno into an
 * exception.  The builder reads this header as the cffi declarations.
 *
 * cffi-constants (values taken from the system headers at build time):
 *   #define MADV_DONTNEED ...
 *   #define MADV_NOHUGEPAGE ...
 *   #define MADV_POPULATE_READ ...
 *   #define MADV_POPULATE_WRITE ...
 *   #define MFD_CLOEXEC ...
 *   #define MFD_HUGETLB ...
 *   #define MFD_HUGE_SHIFT ...
 *   #define TMPFS_MAGIC ...
 *   #define HUGETLBFS_MAGIC ...
 *   static const int MPOL_DEFAULT;
 *   static const int MPOL_PREFERRED;
 *   static const int MPOL_BIND;
 *   static const int MPOL_INTERLEAVE;
 *   #define MPOL_F_NODE ...
 *   #define MPOL_F_ADDR ...
 */
#ifndef NE_MEMORY_H
#define NE_MEMORY_H
#include <stddef.h>
#include <stdint.h>

void *ne_map_shared(int fd, size_t length, int writable);
int ne_unmap(void *addr, size_t length);
int ne_protect_read(void *addr, size_t length);
int ne_madvise(void *addr, size_t length, int advice);
long ne_mbind(void *addr, size_t length, int mode, const unsigned long *nodemask,
              unsigned long maxnode, unsigned int flags);
long ne_get_mempolicy(int *mode, unsigned long *nodemask, unsigned long maxnode,
                      void *addr, unsigned long flags);
long ne_page_nodes(void *addr, size_t length, size_t page_size, int *status);
int ne_fallocate(int fd, int64_t offset, int64_t length);
int ne_statvfs(const char *path, uint64_t *free_bytes, uint64_t *total_bytes);
int ne_statfs_type(const char *path, int64_t *fs_type);
long ne_page_size(void);
const char *ne_core_version(void);

#endif
