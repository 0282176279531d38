/* pool.c: worker threads that live as long as their owner (a table's
 * lookups), the job-running engine pool.h declares. */
#include "core.h"

#define NE_POOL_THREAD_NAME "numa-engram-lk"

/* Lookup threads that live as long as the tables using them (a process
 * shares one pool per CPU set and thread count): pinned once to the
 * rows' node's CPUs, woken per call (a condition variable, no thread
 * creation: creating, pinning and joining a pthread cost ~50 us a call).
 * A call is a list of jobs that the caller and the workers claim one at a
 * time, so the caller never waits for a worker that is still waking up
 * (here a sleeping worker took 20-200 us to wake, more than a decode step's
 * lookup): what no worker has claimed, the caller runs itself; it waits
 * only for jobs a worker claimed.  One call at a time per pool; a caller
 * that finds it busy runs its jobs alone.  A forked child inherits the
 * memory but not the threads: every entry point checks the pid, and the
 * child's Python side makes a pool of its own. */
enum { MAX_POOL = NE_MAX_THREADS };

struct ne_pool {
    pid_t pid;
    int n;
    int cpus[CPU_SETSIZE]; /* the rows' node's CPUs, every worker's affinity */
    int n_cpus;
    pthread_t thread[MAX_POOL];
    pthread_mutex_t call; /* one dispatch at a time */
    pthread_mutex_t mu;
    pthread_cond_t go, done;
    uint64_t generation; /* bumped per dispatch (under mu; read atomically) */
    /* The call's claims, one word: the generation's low 32 bits, the next
     * job's index (16 bits), the job count (16 bits).  A claim is a CAS of
     * it, so a worker that wakes after its call ended (or during the next)
     * claims nothing and never reads a finished call's jobs; a successful
     * claim (acquire) sees the fields below, written before the word. */
    uint64_t claim;
    int finished; /* jobs of this call done (atomic) */
    int stop;
    int sleeping;        /* workers asleep on go (under mu) */
    int caller_sleeping; /* the dispatcher asleep on done (under mu) */
    void (*fn)(void *job);
    char *jobs;
    size_t job_size;
};

/* A worker (and a dispatcher waiting for its workers) spins this long
 * before it sleeps: calls come in bursts (a prefill's chunks, a step's
 * layers), and a futex wake-up costs ~20 us here, a tenth of a 64-token
 * lookup; the spin is a bounded few us of one core after each call. */
#define NE_POOL_SPIN_NS 50000

static inline void cpu_relax(void)
{
#if defined(__x86_64__)
    _mm_pause();
#else
    __asm__ __volatile__("" ::: "memory");
#endif
}

/* Spin until *word differs from `from` (or the pool stops), at most
 * NE_POOL_SPIN_NS; the word's value then. */
static uint64_t spin_while_u64(const uint64_t *word, uint64_t from, const int *stop)
{
    const int64_t until = now_ns() + NE_POOL_SPIN_NS;
    uint64_t v;
    for (int i = 1;; i++) {
        v = __atomic_load_n(word, __ATOMIC_ACQUIRE);
        if (v != from || __atomic_load_n(stop, __ATOMIC_ACQUIRE) ||
            (i % 64 == 0 && now_ns() > until))
            return v;
        cpu_relax();
    }
}

/* The next call's generation: seen spinning, else after sleeping on go. */
static uint64_t next_call(struct ne_pool *p, uint64_t seen)
{
    uint64_t g = spin_while_u64(&p->generation, seen, &p->stop);
    if (g != seen || __atomic_load_n(&p->stop, __ATOMIC_ACQUIRE))
        return g;
    pthread_mutex_lock(&p->mu);
    p->sleeping++;
    while (!p->stop && __atomic_load_n(&p->generation, __ATOMIC_ACQUIRE) == seen)
        pthread_cond_wait(&p->go, &p->mu);
    p->sleeping--;
    g = __atomic_load_n(&p->generation, __ATOMIC_ACQUIRE);
    pthread_mutex_unlock(&p->mu);
    return g;
}

static uint64_t claim_word(uint64_t generation, uint64_t index, uint64_t n_jobs)
{
    return (generation & 0xFFFFFFFFu) << 32 | index << 16 | n_jobs;
}

/* Claim and run jobs of call `generation` until none is left (or that
 * call is over); whoever finishes the call's last job wakes a sleeping
 * dispatcher. */
static void pool_work(struct ne_pool *p, uint64_t generation)
{
    uint64_t w = __atomic_load_n(&p->claim, __ATOMIC_ACQUIRE);
    for (;;) {
        const uint64_t index = (w >> 16) & 0xFFFF, n_jobs = w & 0xFFFF;
        if (w >> 32 != (generation & 0xFFFFFFFFu) || index >= n_jobs)
            return;
        if (!__atomic_compare_exchange_n(&p->claim, &w, claim_word(generation, index + 1, n_jobs),
                                         1, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
            continue; /* w is the word another thread left */
        p->fn(p->jobs + index * p->job_size);
        if (__atomic_add_fetch(&p->finished, 1, __ATOMIC_ACQ_REL) == (int)n_jobs) {
            pthread_mutex_lock(&p->mu); /* the dispatcher checks and sleeps under mu */
            if (p->caller_sleeping)
                pthread_cond_signal(&p->done);
            pthread_mutex_unlock(&p->mu);
        }
        w = __atomic_load_n(&p->claim, __ATOMIC_ACQUIRE);
    }
}

static void *pool_worker(void *arg)
{
    struct ne_pool *p = arg;
    uint64_t seen = 0;
    for (;;) {
        seen = next_call(p, seen);
        if (__atomic_load_n(&p->stop, __ATOMIC_ACQUIRE))
            break;
        pool_work(p, seen);
    }
    return NULL;
}

/* A pool of n threads bound to the CPUs cpus[0..n_cpus) (n_cpus 0: not
 * bound).  NULL with errno when a thread cannot start. */
struct ne_pool *ne_pool_new(int n, const int *cpus, int n_cpus)
{
    if (n < 1 || n > MAX_POOL) {
        errno = EINVAL;
        return NULL;
    }
    struct ne_pool *p = calloc(1, sizeof *p);
    if (!p)
        return NULL;
    p->pid = current_pid();
    p->n_cpus = n_cpus < CPU_SETSIZE ? n_cpus : CPU_SETSIZE;
    for (int i = 0; i < p->n_cpus; i++)
        p->cpus[i] = cpus[i];
    pthread_mutex_init(&p->call, NULL);
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->go, NULL);
    pthread_cond_init(&p->done, NULL);
    /* born bound: a thread that pins itself runs unbound until it first
     * runs */
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    if (p->n_cpus > 0) {
        cpu_set_t set;
        cpu_set_of(p->cpus, p->n_cpus, &set);
        pthread_attr_setaffinity_np(&attr, sizeof(set), &set);
    }
    for (int i = 0; i < n; i++) {
        int err = pthread_create(&p->thread[i], &attr, pool_worker, p);
        if (err == EINVAL && p->n_cpus > 0) /* none of cpus is ours (a cpuset): unbound */
            err = pthread_create(&p->thread[i], NULL, pool_worker, p);
        if (err) {
            pthread_attr_destroy(&attr);
            ne_pool_free(p);
            errno = err;
            return NULL;
        }
        /* named, so an operator's top -H (and a test) tells them apart */
        pthread_setname_np(p->thread[i], NE_POOL_THREAD_NAME);
        p->n = i + 1;
    }
    pthread_attr_destroy(&attr);
    return p;
}

/* Stop and join the threads (in the process that made them; a forked
 * child only frees the memory: it has none of the threads). */
void ne_pool_free(struct ne_pool *p)
{
    if (!p)
        return;
    if (p->pid == current_pid()) {
        pthread_mutex_lock(&p->mu);
        __atomic_store_n(&p->stop, 1, __ATOMIC_RELEASE);
        pthread_cond_broadcast(&p->go);
        pthread_mutex_unlock(&p->mu);
        for (int i = 0; i < p->n; i++)
            pthread_join(p->thread[i], NULL);
    }
    free(p);
}

static int ne_pool_size(const struct ne_pool *p)
{
    return p && p->pid == current_pid() ? p->n : 0;
}

/* Run n jobs (an array of job_size-byte structs, n < 65536: the claim
 * word's count) on the calling thread and the pool's: the caller claims
 * jobs like any worker, so a call whose workers are all asleep costs it
 * one wake-up call; then it waits for the jobs workers claimed (spinning,
 * then asleep).  One call at a time: the call lock is held throughout.  A
 * pool busy with another call (another thread's, or another table's on the
 * same CPUs: a process shares one pool per CPU set) leaves this one to run
 * on its caller alone, at once, rather than behind that call. */
static void pool_run(struct ne_pool *p, void (*fn)(void *), void *jobs, size_t job_size, int n)
{
    if (pthread_mutex_trylock(&p->call) != 0) {
        for (int i = 0; i < n; i++)
            fn((char *)jobs + (size_t)i * job_size);
        return;
    }
    p->fn = fn;
    p->job_size = job_size;
    p->jobs = jobs;
    __atomic_store_n(&p->finished, 0, __ATOMIC_RELAXED);
    const uint64_t g = p->generation + 1; /* only a dispatcher writes it, under the call lock */
    __atomic_store_n(&p->claim, claim_word(g, 0, (uint64_t)n), __ATOMIC_RELEASE);
    pthread_mutex_lock(&p->mu);
    __atomic_store_n(&p->generation, g, __ATOMIC_RELEASE);
    if (p->sleeping)
        pthread_cond_broadcast(&p->go);
    pthread_mutex_unlock(&p->mu);
    pool_work(p, g);
    const int64_t until = now_ns() + NE_POOL_SPIN_NS;
    for (int i = 1; __atomic_load_n(&p->finished, __ATOMIC_ACQUIRE) < n; i++) {
        if (i % 64 == 0 && now_ns() > until) {
            pthread_mutex_lock(&p->mu);
            while (__atomic_load_n(&p->finished, __ATOMIC_ACQUIRE) < n) {
                p->caller_sleeping = 1;
                pthread_cond_wait(&p->done, &p->mu);
            }
            p->caller_sleeping = 0;
            pthread_mutex_unlock(&p->mu);
            break;
        }
        cpu_relax();
    }
    pthread_mutex_unlock(&p->call);
}
