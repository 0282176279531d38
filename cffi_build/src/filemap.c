/* filemap.c: mapped checkpoint tensors, their pages, and the SIGBUS guard
 * (filemap.h).
 *
 * A page of a file mapping whose file was truncated below it raises
 * SIGBUS when read.  A gather over such rows runs inside guarded(): the
 * handler finds the thread's guard (one thread-local pointer, set around
 * the job) and jumps back to it with the faulting address; the job ends
 * as NE_FAULTED and Python names the file.  A SIGBUS anywhere else goes
 * to the handler that was there before ours (faulthandler's, or the
 * default action), as if ours were not installed. */
#include "core.h"
#include <setjmp.h>
#include <signal.h>

/* a lookup stopped by a SIGBUS of a mapped page (ne_lookup, ne_ple_lookup) */
#define NE_FAULTED (-3)

struct ne_guard {
    sigjmp_buf env;
    volatile uint64_t fault;
};

/* initial-exec: the handler reads it, and a dynamic TLS access may
 * allocate, which a signal handler must not (one pointer of the static
 * TLS surplus) */
static __thread struct ne_guard *guard_here __attribute__((tls_model("initial-exec")));
static __thread uint64_t last_fault;
static struct sigaction previous_bus;
static int handing_on;         /* a fault is being handed to previous_bus */
static uint64_t returned_from; /* the fault address previous_bus last returned from */
static pthread_mutex_t guard_lock = PTHREAD_MUTEX_INITIALIZER;

static void on_sigbus(int sig, siginfo_t *info, void *context)
{
    struct ne_guard *g = guard_here;
    /* only the kernel's fault of a page (si_code > 0) is a lost page: a
     * SIGBUS sent by kill or pthread_kill (si_code <= 0, si_addr the
     * sender's pid) is passed on as if no gather were running */
    if (g && info->si_code > 0) {
        guard_here = NULL;
        g->fault = (uint64_t)(uintptr_t)info->si_addr;
        siglongjmp(g->env, 1);
    }
    /* A previous handler that returns without curing a fault sees it again
     * forever, and one that raises it again (faulthandler restores our
     * handler and raises, delivered once it returns) would be called again
     * forever: a fault at the address the previous handler last returned
     * from, or a SIGBUS raised while or after a fault was handed on and
     * returned from, takes the default action instead.  One that jumps out
     * of the fault (its own guard) never returns, so it gets every fault of
     * its reads, the same address again and again. */
    const uint64_t at = (uint64_t)(uintptr_t)info->si_addr;
    int again;
    if (info->si_code > 0)
        again = __atomic_load_n(&returned_from, __ATOMIC_RELAXED) == at;
    else
        again = __atomic_load_n(&handing_on, __ATOMIC_RELAXED) != 0 ||
                __atomic_load_n(&returned_from, __ATOMIC_RELAXED) != 0;
    const int with_info = (previous_bus.sa_flags & SA_SIGINFO) != 0;
    if (!again &&
        (with_info || (previous_bus.sa_handler != SIG_DFL && previous_bus.sa_handler != SIG_IGN))) {
        __atomic_store_n(&handing_on, 1, __ATOMIC_RELAXED);
        if (with_info)
            previous_bus.sa_sigaction(sig, info, context);
        else
            previous_bus.sa_handler(sig);
        __atomic_store_n(&handing_on, 0, __ATOMIC_RELAXED);
        if (info->si_code > 0)
            __atomic_store_n(&returned_from, at, __ATOMIC_RELAXED);
        return;
    }
    /* the default action: a fault re-runs its instruction and dies of it;
     * a SIGBUS sent by a process is sent again (blocked until we return) */
    signal(SIGBUS, SIG_DFL);
    if (info->si_code <= 0)
        raise(SIGBUS);
}

int ne_guard_install(void)
{
    struct sigaction now, ours;
    pthread_mutex_lock(&guard_lock);
    int rc = sigaction(SIGBUS, NULL, &now);
    if (rc == 0 && !((now.sa_flags & SA_SIGINFO) && now.sa_sigaction == on_sigbus)) {
        memset(&ours, 0, sizeof ours);
        ours.sa_sigaction = on_sigbus;
        ours.sa_flags = SA_SIGINFO | SA_ONSTACK;
        sigemptyset(&ours.sa_mask);
        previous_bus = now;
        rc = sigaction(SIGBUS, &ours, NULL);
    }
    pthread_mutex_unlock(&guard_lock);
    return rc;
}

uint64_t ne_last_fault(void)
{
    return last_fault;
}

/* fn(arg) with a SIGBUS inside it caught: 0, or -1 with the faulting
 * address in *fault (fn stopped where it faulted; SIGBUS unblocked again,
 * the handler having run with it blocked). */
static int guarded(void (*fn)(void *), void *arg, uint64_t *fault)
{
    struct ne_guard g;
    g.fault = 0;
    if (sigsetjmp(g.env, 0)) {
        sigset_t bus;
        sigemptyset(&bus);
        sigaddset(&bus, SIGBUS);
        pthread_sigmask(SIG_UNBLOCK, &bus, NULL);
        *fault = g.fault;
        return -1;
    }
    guard_here = &g;
    fn(arg);
    guard_here = NULL;
    return 0;
}

void *ne_reserve(size_t length)
{
    void *p = mmap(NULL, length, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    return p == MAP_FAILED ? NULL : p;
}

int ne_map_file_at(void *addr, int fd, int64_t offset, size_t length)
{
    void *p = mmap(addr, length, PROT_READ, MAP_SHARED | MAP_FIXED, fd, (off_t)offset);
    if (p == MAP_FAILED)
        return -1;
    return madvise(p, length, MADV_RANDOM);
}

int64_t ne_pages_resident(const void *addr, size_t length)
{
    const size_t page = (size_t)sysconf(_SC_PAGESIZE);
    unsigned char vec[256];
    int64_t resident = 0;
    for (size_t done = 0; done < length; done += sizeof vec * page) {
        size_t n = (length - done) / page < sizeof vec ? (length - done) / page : sizeof vec;
        if (mincore((char *)addr + done, n * page, vec) != 0)
            return -1;
        for (size_t i = 0; i < n; i++)
            resident += vec[i] & 1;
    }
    return resident;
}

/* One run of whole pages [first, last]: counted, its resident pages
 * returned, asked for when advise and some are not resident. */
static int64_t run_readahead(uintptr_t first, uintptr_t last, size_t page, int advise)
{
    const size_t length = last - first + page;
    int64_t resident = ne_pages_resident((const void *)first, length);
    if (resident < 0)
        return -1;
    if (advise && (size_t)resident < length / page &&
        madvise((void *)first, length, MADV_WILLNEED) != 0)
        return -1;
    return resident;
}

int64_t ne_rows_readahead(const uint8_t *base, int64_t row_bytes, const int64_t *rows, int64_t n,
                          int advise, int64_t *pages)
{
    const uintptr_t page = (uintptr_t)sysconf(_SC_PAGESIZE);
    int64_t resident = 0, got;
    uintptr_t first = 0, last = 0;
    int open_run = 0;
    *pages = 0;
    for (int64_t i = 0; i < n; i++) {
        uintptr_t a = (uintptr_t)(base + rows[i] * row_bytes) & ~(page - 1);
        uintptr_t b = (uintptr_t)(base + rows[i] * row_bytes + row_bytes - 1) & ~(page - 1);
        if (open_run && a <= last + page) { /* (rows ascend: runs only grow) */
            if (b > last)
                last = b;
            continue;
        }
        if (open_run) {
            if ((got = run_readahead(first, last, page, advise)) < 0)
                return -1;
            resident += got;
            *pages += (int64_t)((last - first) / page + 1);
        }
        first = a, last = b, open_run = 1;
    }
    if (open_run) {
        if ((got = run_readahead(first, last, page, advise)) < 0)
            return -1;
        resident += got;
        *pages += (int64_t)((last - first) / page + 1);
    }
    return resident;
}
