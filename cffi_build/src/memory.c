/* memory.c: the syscall wrappers memory.h declares. */
#include "core.h"

/* Older C libraries lack these (Linux 5.14); the kernel's values. */
#ifndef MADV_POPULATE_READ
#define MADV_POPULATE_READ 22
#endif
#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif

void *ne_map_shared(int fd, size_t length, int writable)
{
    int prot = PROT_READ | (writable ? PROT_WRITE : 0);
    void *p = mmap(NULL, length, prot, MAP_SHARED, fd, 0);
    return p == MAP_FAILED ? NULL : p;
}

int ne_unmap(void *addr, size_t length)
{
    return munmap(addr, length);
}

int ne_protect_read(void *addr, size_t length)
{
    return mprotect(addr, length, PROT_READ);
}

int ne_madvise(void *addr, size_t length, int advice)
{
    return madvise(addr, length, advice);
}

long ne_mbind(void *addr, size_t length, int mode, const unsigned long *nodemask,
              unsigned long maxnode, unsigned int flags)
{
    return syscall(SYS_mbind, addr, length, mode, nodemask, maxnode, flags);
}

long ne_get_mempolicy(int *mode, unsigned long *nodemask, unsigned long maxnode, void *addr,
                      unsigned long flags)
{
    return syscall(SYS_get_mempolicy, mode, nodemask, maxnode, addr, flags);
}

/* Node of every page in [addr, addr + length): status[i] gets the node or a
 * negative errno (-ENOENT: page not mapped in this process).  Queries in
 * chunks so the pointer array stays on the stack. */
long ne_page_nodes(void *addr, size_t length, size_t page_size, int *status)
{
    enum { CHUNK = 1024 }; /* pages per move_pages call: 8 KiB of pointers on the stack */
    void *pages[CHUNK];
    size_t count = (length + page_size - 1) / page_size;
    for (size_t done = 0; done < count; done += CHUNK) {
        size_t n = count - done < CHUNK ? count - done : CHUNK;
        for (size_t i = 0; i < n; i++)
            pages[i] = (char *)addr + (done + i) * page_size;
        long rc = syscall(SYS_move_pages, 0, n, pages, NULL, status + done, 0);
        if (rc < 0)
            return -1;
    }
    return 0;
}

int ne_fallocate(int fd, int64_t offset, int64_t length)
{
    int rc = posix_fallocate(fd, (off_t)offset, (off_t)length);
    if (rc != 0) {
        errno = rc;
        return -1;
    }
    return 0;
}

int ne_statvfs(const char *path, uint64_t *free_bytes, uint64_t *total_bytes)
{
    struct statvfs st;
    if (statvfs(path, &st) != 0)
        return -1;
    *free_bytes = (uint64_t)st.f_bavail * st.f_frsize;
    *total_bytes = (uint64_t)st.f_blocks * st.f_frsize;
    return 0;
}

/* The file system's magic number (TMPFS_MAGIC, HUGETLBFS_MAGIC, ...). */
int ne_statfs_type(const char *path, int64_t *fs_type)
{
    struct statfs st;
    if (statfs(path, &st) != 0)
        return -1;
    *fs_type = (int64_t)st.f_type;
    return 0;
}

long ne_page_size(void)
{
    return sysconf(_SC_PAGESIZE);
}

/* The package version this core was built for (checked at import). */
const char *ne_core_version(void)
{
    return NE_CORE_VERSION;
}
