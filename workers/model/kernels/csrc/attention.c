/* Decode steps (and speculative verification) of grouped-query attention over a paged KV cache, float32.
 *
 * Each request writes its new key/value at its position, then every query head attends over its slot's cache up
 * to and including that position: the work of F.scaled_dot_product_attention plus the cache writes, masks and
 * gathers around it, in one pass over the cached keys and values, block by block with an online softmax (no
 * score buffer the size of the context). The reference is attention.py's PyTorch path.
 * Shapes: q [b, H, d]; k_new, v_new [b, KV, d]; key_cache, value_cache [KV, cache_tokens, d] where position t of
 * slot s is token block_tables[s, t / block_size] * block_size + t % block_size (kv_blocks.py);
 * block_tables [slots, max_blocks] int64; slot_ids, positions [b] int64; out [b, H, d]; block_size <= 256.
 * rope_rows applies rotary position embeddings to q and k before that, in place.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "kernels.h"

/* This block's scores of one query (scaled), into score[n]; returns their maximum. Not inlined, so that every
 * query of every step adds its dot products in one compiled order (decode steps and verification agree). */
static __attribute__((noinline, noclone)) float block_scores(const float *query, const float *keys, int64_t n,
                                                             int64_t d, float scale, float *score) {
    float block_max = -INFINITY;
    for (int64_t j = 0; j < n; ++j) {
        const float *key = keys + j * d;
        float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
        for (int64_t i = 0; i < d; ++i) dot += query[i] * key[i];
        score[j] = dot * scale;
        block_max = score[j] > block_max ? score[j] : block_max;
    }
    return block_max;
}

/* o += Σ_j exp(score[j] − max) · values[j] over one block (o rescaled first when the running maximum grew);
 * returns `total` plus the block's share of the softmax denominator. Elementwise and sequential sums only (no
 * reduction a compiler may reorder), so it may be inlined wherever it is called. */
static inline float block_values(float *o, const float *values, const float *score, int64_t n, int64_t d,
                                 float block_max, float *max_score, float total) {
    if (block_max > *max_score) {
        const float rescale = *max_score == -INFINITY ? 0.0f : expf(*max_score - block_max);
        total *= rescale;
        for (int64_t i = 0; i < d; ++i) o[i] *= rescale;
        *max_score = block_max;
    }
    for (int64_t j = 0; j < n; ++j) {
        const float weight = expf(score[j] - *max_score);
        const float *value = values + j * d;
        total += weight;
#pragma omp simd
        for (int64_t i = 0; i < d; ++i) o[i] += weight * value[i];
    }
    return total;
}

/* The first position a query at `position` attends to: 0, or with a sliding window (LFM3's sliding layers; window
 * > 0) the oldest of its last `window` positions — as attention.py's mask, key > position − window. */
static inline int64_t first_visible(int64_t position, int64_t window) {
    return window > 0 && position - window + 1 > 0 ? position - window + 1 : 0;
}

/* l tokens per request at positions[r] … positions[r] + l − 1 (l = 1: a decode step; more: speculative
 * verification). q, out [l, b, H, d]; k_new, v_new [l, b, KV, d]. All l keys/values are written first; token t
 * then attends causally up to its own position (from first_visible on: `window` 0 for none). Per (request, KV
 * head) the cache is walked block by block once for all l · H / KV queries (each block stays in cache while they
 * read it); every query runs the same per-block arithmetic as a decode step at its position, so the outputs are
 * bit for bit those of l decode steps. */
void attention_verify_window(const float *q, const float *k_new, const float *v_new, float *key_cache,
                             float *value_cache, const int64_t *block_tables, int64_t max_blocks, int64_t block_size,
                             int64_t cache_tokens, const int64_t *slot_ids, const int64_t *positions, float scale,
                             float *out, int64_t b, int64_t l, int64_t H, int64_t KV, int64_t d, int64_t window,
                             int num_threads) {
    const int64_t group = H / KV;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t item = 0; item < b * KV; ++item) {
        const int64_t bi = item / KV, kv = item % KV, first = positions[bi], last = first + l - 1;
        const int64_t *table = block_tables + slot_ids[bi] * max_blocks;
        float *keys = key_cache + kv * cache_tokens * d;
        float *values = value_cache + kv * cache_tokens * d;
        /* 1. The new keys and values go to the request's positions in its slot's blocks. */
        for (int64_t t = 0; t < l; ++t) {
            const int64_t position = first + t;
            const int64_t at = table[position / block_size] * block_size + position % block_size;
            memcpy(keys + at * d, k_new + ((t * b + bi) * KV + kv) * d, d * sizeof(float));
            memcpy(values + at * d, v_new + ((t * b + bi) * KV + kv) * d, d * sizeof(float));
        }
        float max_score[l * group], total[l * group], score[256];
        for (int64_t t = 0; t < l; ++t)
            for (int64_t g = 0; g < group; ++g) {
                max_score[t * group + g] = -INFINITY;
                total[t * group + g] = 0.0f;
                memset(out + ((t * b + bi) * H + kv * group + g) * d, 0, d * sizeof(float));
            }
        /* 2. Block by block: each query that reaches the block scores it and adds its weighted values (online
         * softmax: what was summed so far is rescaled when the running maximum grows). */
        for (int64_t start = first_visible(first, window) / block_size * block_size; start <= last;
             start += block_size) {
            const int64_t base = table[start / block_size] * block_size;
            for (int64_t t = 0; t < l; ++t) {
                const int64_t position = first + t, lo = first_visible(position, window);
                if (start > position || start + block_size <= lo) continue;
                const int64_t skip = lo > start ? lo - start : 0; /* keys of this block before the window */
                const int64_t n = (position + 1 - start < block_size ? position + 1 - start : block_size) - skip;
                const int64_t from = (base + skip) * d;
                for (int64_t g = 0; g < group; ++g) {
                    const int64_t head = kv * group + g, at = (t * b + bi) * H + head;
                    const float block_max = block_scores(q + at * d, keys + from, n, d, scale, score);
                    total[t * group + g] = block_values(out + at * d, values + from, score, n, d, block_max,
                                                        &max_score[t * group + g], total[t * group + g]);
                }
            }
        }
        for (int64_t t = 0; t < l; ++t)
            for (int64_t g = 0; g < group; ++g) {
                float *o = out + ((t * b + bi) * H + kv * group + g) * d;
                for (int64_t i = 0; i < d; ++i) o[i] /= total[t * group + g];
            }
    }
}

void attention_verify(const float *q, const float *k_new, const float *v_new, float *key_cache, float *value_cache,
                      const int64_t *block_tables, int64_t max_blocks, int64_t block_size, int64_t cache_tokens,
                      const int64_t *slot_ids, const int64_t *positions, float scale, float *out, int64_t b,
                      int64_t l, int64_t H, int64_t KV, int64_t d, int num_threads) {
    attention_verify_window(q, k_new, v_new, key_cache, value_cache, block_tables, max_blocks, block_size,
                            cache_tokens, slot_ids, positions, scale, out, b, l, H, KV, d, 0, num_threads);
}

void attention_decode(const float *q, const float *k_new, const float *v_new, float *key_cache, float *value_cache,
                      const int64_t *block_tables, int64_t max_blocks, int64_t block_size, int64_t cache_tokens,
                      const int64_t *slot_ids, const int64_t *positions, float scale, float *out, int64_t b,
                      int64_t H, int64_t KV, int64_t d, int num_threads) {
    attention_verify(q, k_new, v_new, key_cache, value_cache, block_tables, max_blocks, block_size, cache_tokens,
                     slot_ids, positions, scale, out, b, 1, H, KV, d, num_threads);
}

/* Rotary position embedding of the first rotary_dim dims of every head (half-split convention), in place:
 * x [b, heads, head_dim], positions [b], inv_freq [rotary_dim / 2]. The angle is position · inv_freq in float32 as
 * attention.py's `rotary` computes it; cos and sin come from libm, within an ulp or two of PyTorch's. */
void rope_rows(float *x, const int64_t *positions, const float *inv_freq, int64_t b, int64_t heads, int64_t head_dim,
               int64_t rotary_dim) {
    const int64_t half = rotary_dim / 2;
    for (int64_t r = 0; r < b; ++r) {
        const float position = (float)positions[r];
        for (int64_t i = 0; i < half; ++i) {
            const float angle = position * inv_freq[i], c = cosf(angle), s = sinf(angle);
            for (int64_t h = 0; h < heads; ++h) {
                float *v = x + (r * heads + h) * head_dim;
                const float lo = v[i], hi = v[i + half];
                v[i] = lo * c - hi * s;
                v[i + half] = hi * c + lo * s;
            }
        }
    }
}
