/* One decode step of grouped-query attention over a paged KV cache, float32.
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

void attention_decode(const float *q, const float *k_new, const float *v_new, float *key_cache, float *value_cache,
                      const int64_t *block_tables, int64_t max_blocks, int64_t block_size, int64_t cache_tokens,
                      const int64_t *slot_ids, const int64_t *positions, float scale, float *out, int64_t b,
                      int64_t H, int64_t KV, int64_t d, int num_threads) {
    const int64_t group = H / KV;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t item = 0; item < b * KV; ++item) {
        const int64_t bi = item / KV, kv = item % KV, position = positions[bi];
        const int64_t *table = block_tables + slot_ids[bi] * max_blocks;
        float *keys = key_cache + kv * cache_tokens * d;
        float *values = value_cache + kv * cache_tokens * d;
        /* 1. The new key and value go to the request's position in its slot's block. */
        const int64_t at = table[position / block_size] * block_size + position % block_size;
        memcpy(keys + at * d, k_new + (bi * KV + kv) * d, d * sizeof(float));
        memcpy(values + at * d, v_new + (bi * KV + kv) * d, d * sizeof(float));
        for (int64_t g = 0; g < group; ++g) {
            const int64_t head = kv * group + g;
            const float *query = q + (bi * H + head) * d;
            float *o = out + (bi * H + head) * d;
            float score[256], max_score = -INFINITY, total = 0.0f;
            memset(o, 0, d * sizeof(float));
            for (int64_t start = 0; start <= position; start += block_size) {
                const int64_t n = position + 1 - start < block_size ? position + 1 - start : block_size;
                const int64_t base = table[start / block_size] * block_size;
                /* 2. This block's scores; rescale what was summed so far when the running maximum grows. */
                float block_max = -INFINITY;
                for (int64_t j = 0; j < n; ++j) {
                    const float *key = keys + (base + j) * d;
                    float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                    for (int64_t i = 0; i < d; ++i) dot += query[i] * key[i];
                    score[j] = dot * scale;
                    block_max = score[j] > block_max ? score[j] : block_max;
                }
                if (block_max > max_score) {
                    const float rescale = max_score == -INFINITY ? 0.0f : expf(max_score - block_max);
                    total *= rescale;
                    for (int64_t i = 0; i < d; ++i) o[i] *= rescale;
                    max_score = block_max;
                }
                /* 3. The weighted sum of this block's values. */
                for (int64_t j = 0; j < n; ++j) {
                    const float weight = expf(score[j] - max_score);
                    const float *value = values + (base + j) * d;
                    total += weight;
#pragma omp simd
                    for (int64_t i = 0; i < d; ++i) o[i] += weight * value[i];
                }
            }
            for (int64_t i = 0; i < d; ++i) o[i] /= total;
        }
    }
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
