/* hashing.h: DeepSeek's n-gram hashes, for whole sequences and for the
 * serving state's look-back windows (V4.1's rule).  n (max_ngram) is at
 * most NE_MAX_NGRAM; larger is EINVAL.  Each returns 0 (or -1 for "all
 * good" where it returns an index) or -1 with errno.
 *
 * Plain declarations: cffi reads this header as it is; native.c includes
 * it once, after core.h. */

/* Longest n-gram a window holds (the spec's bound; the windows live on the
 * stack). */
enum { NE_MAX_NGRAM = 64 };

int ne_ngram_hashes(const int64_t *ids, int64_t n_rows, int64_t t, int64_t pad_id,
                    const int64_t *multipliers, int64_t max_ngram, const int64_t *primes,
                    int64_t n_head, int64_t *out, int n_threads, int hardware_division);
int ne_hash_window_batch(const int64_t *win, int64_t n_tokens, int64_t n, int64_t pad_id,
                         const int64_t *multipliers, const int64_t *primes, const int64_t *offsets,
                         int64_t n_layers, int64_t n_head, int64_t *out, int n_threads);

/* A HashState's fixed arrays, filled once (the scratch fields again when
 * it grows): the per-slot history and next positions, the window pass's
 * scratch, the layers' multipliers, primes and head offsets, the token map
 * (NULL: ids are compressed ids already) and the sorted dead ids, and
 * scratch for steps of up to capacity tokens. */
struct ne_hash_state {
    int64_t n_slots, n1, pad_id, n_layers, n_head;
    int64_t *hist, *next_pos, *cur, *cur_next, *last;
    const int64_t *multipliers, *primes, *offsets;
    const int64_t *token_map;
    int64_t map_len;
    const int64_t *dead_ids;
    int64_t n_dead;
    int64_t capacity;
    int64_t *ids, *win;
    const uint8_t *all_commit, *no_commit;
};
int64_t ne_hash_step(const struct ne_hash_state *st, const void *tokens_, const void *mask_,
                     const void *slots_, const void *positions_, const void *commit_,
                     int commit_all, int64_t n_tokens, int global_rows, void *out_, int n_threads,
                     int64_t *why);
