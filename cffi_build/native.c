/* numa_engram's C core: thin syscall wrappers and the hot kernels, one
 * translation unit built from the parts below.  The parts' headers are
 * plain declarations, included here once: build_native.py hands the same
 * files to cffi as they are, so no prototype is typed twice (the
 * constants Python reads are listed in constants.cdef).
 *
 *   src/core.h     shared: system headers, CPU features read once, threads
 *   src/memory.c   mappings, memory policies, page nodes, file systems
 *   src/rows.c     FP8 + ue8m0 -> BF16 rows, one row function per ISA
 *   src/pool.c     persistent worker threads
 *   src/filemap.c  mapped checkpoint tensors, their pages, the SIGBUS guard
 *   src/lookup.c   gathering rows for hash ids (BF16 or packed)
 *   src/hashing.c  DeepSeek's n-gram hashes, batch and serving windows
 *   src/ple.c      Qwen4-Exp's PLE ids and per-tensor-scale rows
 *   src/step.c     a decode step's gathers for several layers in one call
 *
 * Every wrapper returns -1 (or NULL) and leaves errno set on failure; the
 * Python side (numa_engram/bindings/native.py) is the only caller and turns
 * errno into an exception.  Nothing here allocates memory that outlives a
 * call, except a pool (freed by ne_pool_free). */
#include "src/core.h"
#include "src/memory.h"
#include "src/pool.h"
#include "src/filemap.h"
#include "src/lookup.h"
#include "src/hashing.h"
#include "src/ple.h"
#include "src/step.h"
#include "src/memory.c"
#include "src/rows.c"
#include "src/pool.c"
#include "src/filemap.c"
#include "src/lookup.c"
#include "src/hashing.c"
#include "src/ple.c"
#include "src/step.c"
