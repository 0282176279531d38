/* pool.c: worker threads that live as long as their owner (a table's
 * lookups), the job-running engine pool.h declares. */
#include "core.h"
#include "pool.h"

/* Lookup threads that live as long as their table: pinned once to the
 * rows' node's CPUs, woken per call (a condition variable, no thread
 * creation: creating, pinning and joining a pthread cost ~50 us a call).
 * One call at a time per pool; a caller that finds it busy waits.  A
 * forked child inherits the memory but not the threads: every entry point
 * checks the pid, and the child's Python side makes a pool of its own. */
enum { MAX_POOL = NE_MAX_THREADS }; /* a pool runs one call's jobs, one per thread */

struct ne_pool {
    pid_t pid;
    int n;
    int cpu[MAX_POOL];
    pthread_t thread[MAX_POOL];
    pthread_mutex_t call;     /* one dispatch at a time */
    pthread_mutex_t mu;
    pthread_cond_t go, done;
    uint64_t generation;      /* bumped per dispatch (guarded by mu) */
    int n_jobs, remaining, stop;
    void (*fn)(void *job);
    char *jobs;
    size_t job_size;
};

struct pool_worker_arg {
    struct ne_pool *pool;
    int index;
};

static void *pool_worker(void *arg)
{
    struct pool_worker_arg *a = arg;
    struct ne_pool *p = a->pool;
    const int me = a->index;
    free(a);
    pin_self(p->cpu[me]);
    uint64_t seen = 0;
    pthread_mutex_lock(&p->mu);
    for (;;) {
        while (!p->stop && p->generation == seen)
            pthread_cond_wait(&p->go, &p->mu);
        if (p->stop)
            break;
        seen = p->generation;
        if (me < p->n_jobs) {
            void *job = p->jobs + (size_t)me * p->job_size;
            void (*fn)(void *) = p->fn;
            pthread_mutex_unlock(&p->mu);
            fn(job);
            pthread_mutex_lock(&p->mu);
            if (--p->remaining == 0)
                pthread_cond_signal(&p->done);
        }
    }
    pthread_mutex_unlock(&p->mu);
    return NULL;
}

/* A pool of n threads, thread i pinned to cpus[i % n_cpus] (n_cpus 0: not
 * pinned).  NULL with errno when a thread cannot start. */
struct ne_pool *ne_pool_new(int n, const int *cpus, int n_cpus)
{
    if (n < 1 || n > MAX_POOL) {
        errno = EINVAL;
        return NULL;
    }
    struct ne_pool *p = calloc(1, sizeof *p);
    if (!p)
        return NULL;
    p->pid = getpid();
    pthread_mutex_init(&p->call, NULL);
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->go, NULL);
    pthread_cond_init(&p->done, NULL);
    for (int i = 0; i < n; i++) {
        p->cpu[i] = n_cpus > 0 ? cpus[i % n_cpus] : -1;
        struct pool_worker_arg *a = malloc(sizeof *a);
        if (a)
            *a = (struct pool_worker_arg){p, i};
        int err = a ? pthread_create(&p->thread[i], NULL, pool_worker, a) : ENOMEM;
        if (err) {
            free(a);
            ne_pool_free(p);
            errno = err;
            return NULL;
        }
        p->n = i + 1;
    }
    return p;
}

/* Stop and join the threads (in the process that made them; a forked
 * child only frees the memory: it has none of the threads). */
void ne_pool_free(struct ne_pool *p)
{
    if (!p)
        return;
    if (p->pid == getpid()) {
        pthread_mutex_lock(&p->mu);
        p->stop = 1;
        pthread_cond_broadcast(&p->go);
        pthread_mutex_unlock(&p->mu);
        for (int i = 0; i < p->n; i++)
            pthread_join(p->thread[i], NULL);
    }
    free(p);
}

int ne_pool_size(const struct ne_pool *p)
{
    return p && p->pid == getpid() ? p->n : 0;
}

/* Hand n jobs (an array of job_size-byte structs) to the pool's first n
 * threads and return at once: the caller runs a job of its own meanwhile
 * (one thread fewer to wake), then waits in pool_wait.  One call at a
 * time: the call lock is held from here to pool_wait. */
static void pool_start(struct ne_pool *p, void (*fn)(void *), void *jobs, size_t job_size, int n)
{
    pthread_mutex_lock(&p->call);
    pthread_mutex_lock(&p->mu);
    p->fn = fn;
    p->job_size = job_size;
    p->jobs = jobs;
    p->n_jobs = n;
    p->remaining = n;
    p->generation++;
    pthread_cond_broadcast(&p->go);
    pthread_mutex_unlock(&p->mu);
}

static void pool_wait(struct ne_pool *p)
{
    pthread_mutex_lock(&p->mu);
    while (p->remaining > 0)
        pthread_cond_wait(&p->done, &p->mu);
    p->jobs = NULL;
    p->n_jobs = 0;
    pthread_mutex_unlock(&p->mu);
    pthread_mutex_unlock(&p->call);
}
