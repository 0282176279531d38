/* core.h: what every part of the C core shares, and none of the Python
 * interface: the system headers, the CPU features (resolved once per
 * process), and the one way work is split over threads.
 *
 * The core is one translation unit (native.c includes the parts in
 * order), so these helpers are static and inline where they are hot. */
#ifndef NE_CORE_H
#define NE_CORE_H

#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/statfs.h>
#include <sys/statvfs.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

/* Threads one call may use: a two-socket host's cores on one node are far
 * fewer, and the per-call job arrays live on the stack at this size. */
enum { NE_MAX_THREADS = 256 };

/* What the CPU can do and the environment allows (NUMA_ENGRAM_NO_AVX512,
 * NUMA_ENGRAM_NO_VBMI, NUMA_ENGRAM_NO_AVX2 switch paths off, for tests and benchmarks): read
 * once per process, not per call (docs/design.md, "The decode budget"). */
struct ne_cpu {
    int avx2, avx512bw, avx512dq, avx512vbmi;
};

static struct ne_cpu cpu_features;
static pthread_once_t cpu_once = PTHREAD_ONCE_INIT;

static void read_cpu_features(void)
{
#if defined(__x86_64__)
    __builtin_cpu_init();
    const int no512 = getenv("NUMA_ENGRAM_NO_AVX512") != NULL;
    cpu_features.avx512bw = __builtin_cpu_supports("avx512bw") && !no512;
    cpu_features.avx512dq = __builtin_cpu_supports("avx512f") &&
                            __builtin_cpu_supports("avx512dq") && !no512;
    /* (the VBMI row's shift table is read with 256-bit AVX-512VL loads) */
    cpu_features.avx512vbmi = cpu_features.avx512bw && __builtin_cpu_supports("avx512vbmi") &&
                              __builtin_cpu_supports("avx512vl") &&
                              getenv("NUMA_ENGRAM_NO_VBMI") == NULL;
    cpu_features.avx2 = __builtin_cpu_supports("avx2") && getenv("NUMA_ENGRAM_NO_AVX2") == NULL;
#endif
}

static const struct ne_cpu *ne_cpu(void)
{
    pthread_once(&cpu_once, read_cpu_features);
    return &cpu_features;
}

/* CLOCK_MONOTONIC in ns (the vDSO: no system call). */
static int64_t now_ns(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

/* This process's id without a system call (getpid() is one, ~300 ns in a
 * guest: a tenth of a decode step's lookup): read once, again in a forked
 * child (pthread_atfork), so a pool can tell the process that made it. */
static pid_t this_pid;
static pthread_once_t pid_once = PTHREAD_ONCE_INIT;

static void reread_pid(void)
{
    this_pid = getpid();
}

static void read_pid(void)
{
    reread_pid();
    pthread_atfork(NULL, NULL, reread_pid);
}

static pid_t current_pid(void)
{
    pthread_once(&pid_once, read_pid);
    return this_pid;
}

/* A lookup refused before it read anything: its output shares a byte with
 * the ids it reads or the table's mapping (or, packed, its two outputs one
 * another), which the kernel would write over (a read-only mapping: a
 * SIGSEGV; ids: rows it has not read yet).  Checked per call in C, where
 * it is a few compares; Python names the buffers after (docs/design.md,
 * "The decode budget"). */
#define NE_OVERLAP (-5)

/* Whether the byte spans [a, a + a_n) and [b, b + b_n) meet (an empty one
 * meets none). */
static inline int spans_meet(uintptr_t a, uintptr_t a_n, uintptr_t b, uintptr_t b_n)
{
    return a_n && b_n && a < b + b_n && b < a + a_n;
}

/* Threads to use: at least 1, at most NE_MAX_THREADS and one per item. */
static int clamp_threads(int n_threads, int64_t n_items)
{
    if (n_threads > NE_MAX_THREADS)
        n_threads = NE_MAX_THREADS;
    if (n_threads > n_items)
        n_threads = (int)n_items;
    return n_threads < 1 ? 1 : n_threads;
}

/* Part i of n of [0, total): contiguous, in order, sizes differing by at
 * most one part's rounding (the last may be short or empty). */
static void split_range(int64_t total, int n, int i, int64_t *begin, int64_t *end)
{
    int64_t per = (total + n - 1) / n;
    *begin = i * per < total ? i * per : total;
    *end = (i + 1) * per < total ? (i + 1) * per : total;
}

/* Run fn on each of n jobs (an array of job_size-byte structs), one thread
 * each, and join them all.  0, or -1 with errno when a thread cannot start
 * (the ones started are still joined). */
static int run_threads(void *(*fn)(void *), void *jobs, size_t job_size, int n)
{
    pthread_t threads[NE_MAX_THREADS];
    int started = 0, err = 0;
    for (; started < n && started < NE_MAX_THREADS; started++) {
        err = pthread_create(&threads[started], NULL, fn, (char *)jobs + started * job_size);
        if (err)
            break;
    }
    for (int i = 0; i < started; i++)
        pthread_join(threads[i], NULL);
    if (err) {
        errno = err;
        return -1;
    }
    return 0;
}

/* Bind the calling thread to the CPUs cpus[0..n) (n 0: leave it where it
 * is).  A set, not one CPU each: the kernel then puts each woken lookup
 * thread on an idle CPU of the rows' node, never beside a caller that
 * happens to run on "its" CPU; the node is what the rows need. */
static void cpu_set_of(const int *cpus, int n, cpu_set_t *set)
{
    CPU_ZERO(set);
    for (int i = 0; i < n; i++)
        if (cpus[i] >= 0 && cpus[i] < CPU_SETSIZE)
            CPU_SET(cpus[i], set);
}

static void pin_to(const int *cpus, int n)
{
    if (n <= 0)
        return;
    cpu_set_t set;
    cpu_set_of(cpus, n, &set);
    pthread_setaffinity_np(pthread_self(), sizeof(set), &set);
}

#endif
