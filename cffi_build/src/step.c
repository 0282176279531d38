/* step.c: a decode step's gathers for several layers in one call (see
 * step.h).  Each layer runs the one-layer kernel (ne_lookup, ne_ple_lookup)
 * as it is: the same per-row code, the same id checks, counting and
 * refusal once its table is closed; what is added is the check that no
 * layer's output shares a byte with another layer's ids (a layer's own
 * ids and its table's mapping are its kernel's check). */
#include "core.h"

/* The code of this thread's last failed step's layer (its kernel's
 * result, or NE_OVERLAP) and, for an overlap found across layers, the
 * layer whose ids the output met (-1: none). */
static __thread int64_t step_failure[2] = {0, -1};

void ne_step_failure(int64_t *code_and_other)
{
    code_and_other[0] = step_failure[0];
    code_and_other[1] = step_failure[1];
}

/* The bytes layer g's call reads of ids (stride: an Engram layer's row
 * stride in ids; a PLE layer's ids are contiguous). */
static void gather_ids_span(const struct ne_gather *g, const void *ids, int64_t stride,
                            uintptr_t *lo, uintptr_t *n)
{
    if (g->engram) {
        lookup_ids_span(g->engram, ids, g->tokens, stride, lo, n);
        return;
    }
    *lo = (uintptr_t)ids;
    *n = g->tokens > 0 ? (uintptr_t)g->tokens * 8 : 0;
}

/* The bytes layer g writes: (start, length) of out, then of out_scales. */
static void gather_out_spans(const struct ne_gather *g, uintptr_t spans[4])
{
    if (g->engram) {
        lookup_out_spans(g->engram, g->tokens, g->out, g->out_scales, spans);
        return;
    }
    const uintptr_t n = g->tokens > 0 ? (uintptr_t)g->tokens : 0;
    spans[0] = (uintptr_t)g->out;
    spans[1] = n * (uintptr_t)g->ple->row_bytes * (g->scaled ? 2 : 1);
    spans[2] = spans[3] = 0;
}

/* Whether layer i's outputs meet layer j's ids. */
static int out_meets_ids(const struct ne_gather *layers, int64_t i, int64_t j,
                         const void *const *ids, const int64_t *strides)
{
    uintptr_t o[4], lo, n;
    gather_out_spans(&layers[i], o);
    gather_ids_span(&layers[j], ids[j], strides[j], &lo, &n);
    return spans_meet(o[0], o[1], lo, n) || spans_meet(o[2], o[3], lo, n);
}

/* The first layer whose outputs meet another layer's ids (*other: that
 * layer), or -1.  Every output is compared with the span all ids lie in
 * first: a step's outputs (staging buffers) are apart from its ids, so
 * the pairs are compared only where that span meets an output. */
static int64_t step_overlap(const struct ne_gather *layers, int64_t n_layers,
                            const void *const *ids, const int64_t *strides, int64_t *other)
{
    uintptr_t hull_lo = UINTPTR_MAX, hull_hi = 0;
    for (int64_t j = 0; j < n_layers; j++) {
        uintptr_t lo, n;
        gather_ids_span(&layers[j], ids[j], strides[j], &lo, &n);
        if (n && lo < hull_lo)
            hull_lo = lo;
        if (n && lo + n > hull_hi)
            hull_hi = lo + n;
    }
    if (hull_hi <= hull_lo)
        return -1;
    for (int64_t i = 0; i < n_layers; i++) {
        uintptr_t o[4];
        gather_out_spans(&layers[i], o);
        if (!spans_meet(o[0], o[1], hull_lo, hull_hi - hull_lo) &&
            !spans_meet(o[2], o[3], hull_lo, hull_hi - hull_lo))
            continue;
        for (int64_t j = 0; j < n_layers; j++)
            if (j != i && out_meets_ids(layers, i, j, ids, strides)) {
                *other = j;
                return i;
            }
    }
    return -1;
}

/* Layer i of n_layers gathers from ids[i] (an Engram layer's rows
 * strides[i] ids apart) into its bound output, in order.  Nothing runs
 * when a layer's outputs share a byte with another layer's ids; else the
 * layers run until one fails (its kernel's result is not a success: bad
 * ids, the table closed, a fault, an overlap, an error), whose index is
 * returned (ne_step_failure gives the code, ne_last_bad an Engram
 * layer's first bad id; the layers before it have their rows).  -1: every
 * layer has its rows. */
int64_t ne_gather_step(const struct ne_gather *layers, int64_t n_layers, const void *const *ids,
                       const int64_t *strides)
{
    int64_t other = -1;
    const int64_t crossed = step_overlap(layers, n_layers, ids, strides, &other);
    if (crossed >= 0) {
        step_failure[0] = NE_OVERLAP;
        step_failure[1] = other;
        return crossed;
    }
    for (int64_t i = 0; i < n_layers; i++) {
        const struct ne_gather *g = &layers[i];
        int64_t rc;
        int ok;
        if (g->engram) {
            rc = ne_lookup(g->engram, ids[i], g->tokens, strides[i], g->global_ids, g->out,
                           g->out_scales);
            ok = rc == 0;
        } else {
            rc = ne_ple_lookup(g->ple, ids[i], g->tokens, g->scaled, g->out);
            ok = rc == -1;
        }
        if (!ok) {
            step_failure[0] = rc;
            step_failure[1] = -1;
            return i;
        }
    }
    return -1;
}
