/* pool.h: persistent worker threads, one pool per CPU set and thread
 * count in a process, shared by the tables that look up with several
 * threads there: pinned once to the rows' node's CPUs and woken per call
 * (creating, pinning and joining pthreads cost ~50 us a call).  One call
 * at a time per pool (a caller finding it busy runs alone).  A forked
 * child inherits the memory but not the threads: every entry point
 * checks the pid (a pool has no threads there).
 * The workers are named "numa-engram-lk" (/proc/PID/task/TID/comm).
 *
 * Plain declarations: cffi reads this header as it is; native.c includes
 * it once, after core.h. */

struct ne_pool;
struct ne_pool *ne_pool_new(int n, const int *cpus, int n_cpus);
void ne_pool_free(struct ne_pool *pool);
