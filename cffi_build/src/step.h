/* step.h: a decode step's gathers for several layers (Engram shards and
 * PLE shards alike) in one call, so the GIL is released and the call
 * crossed once per step, not once per layer.
 *
 * Plain declarations: cffi reads this header as it is; native.c includes
 * it once, after lookup.h and ple.h. */

struct ne_kernel;
struct ne_ple_shard;
/* One layer's gather, bound once: an Engram shard's kernel (engram; ids
 * are rows of the layer's table with global_ids) or a PLE shard (ple;
 * scaled: FP8 bytes to BF16), and its output for exactly `tokens` tokens
 * (a PLE layer: `tokens` ids): BF16 rows into out, or packed Engram rows
 * into out and their scale bytes into out_scales (NULL otherwise). */
struct ne_gather {
    const struct ne_kernel *engram;
    const struct ne_ple_shard *ple;
    int global_ids, scaled;
    int64_t tokens;
    void *out, *out_scales;
};
int64_t ne_gather_step(const struct ne_gather *layers, int64_t n_layers, const void *const *ids,
                       const int64_t *strides);
/* (the failed layer's code, the other layer) of this thread's last step
 * that failed (ne_gather_step says which layer) */
void ne_step_failure(int64_t *code_and_other);
