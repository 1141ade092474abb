/* One decode step of grouped-query attention over a slot-indexed KV cache, float32.
 *
 * Each request writes its new key/value at its position, then every query head attends over its slot's cache up
 * to and including that position: the work of F.scaled_dot_product_attention plus the cache writes, masks and
 * gathers around it, in one pass over the cached keys and values. The reference is attention.py's PyTorch path.
 * Shapes: q [b, H, d]; k_new, v_new [b, KV, d]; key_cache, value_cache [slots, KV, capacity, d];
 * slot_ids, positions [b] int64; scores: scratch [b, H, max(positions) + 1]; out [b, H, d].
 * rope_rows applies rotary position embeddings to q and k before that, in place.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "kernels.h"

void attention_decode(const float *q, const float *k_new, const float *v_new, float *key_cache, float *value_cache,
                      const int64_t *slot_ids, const int64_t *positions, float scale, float *scores, float *out,
                      int64_t b, int64_t H, int64_t KV, int64_t d, int64_t capacity, int64_t span,
                      int num_threads) {
    const int64_t group = H / KV;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t item = 0; item < b * KV; ++item) {
        const int64_t bi = item / KV, kv = item % KV, position = positions[bi];
        float *keys = key_cache + ((slot_ids[bi] * KV + kv) * capacity) * d;
        float *values = value_cache + ((slot_ids[bi] * KV + kv) * capacity) * d;
        /* 1. The new key and value go to the request's position in its slot. */
        memcpy(keys + position * d, k_new + (bi * KV + kv) * d, d * sizeof(float));
        memcpy(values + position * d, v_new + (bi * KV + kv) * d, d * sizeof(float));
        for (int64_t g = 0; g < group; ++g) {
            const int64_t head = kv * group + g;
            const float *query = q + (bi * H + head) * d;
            float *score = scores + (bi * H + head) * span;
            /* 2. Scores over positions 0 … position, softmax. */
            float max_score = -INFINITY;
            for (int64_t t = 0; t <= position; ++t) {
                const float *key = keys + t * d;
                float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                for (int64_t i = 0; i < d; ++i) dot += query[i] * key[i];
                score[t] = dot * scale;
                max_score = score[t] > max_score ? score[t] : max_score;
            }
            float total = 0.0f;
            for (int64_t t = 0; t <= position; ++t) {
                score[t] = expf(score[t] - max_score);
                total += score[t];
            }
            /* 3. The weighted sum of values. */
            float *o = out + (bi * H + head) * d;
            memset(o, 0, d * sizeof(float));
            for (int64_t t = 0; t <= position; ++t) {
                const float weight = score[t] / total;
                const float *value = values + t * d;
#pragma omp simd
                for (int64_t i = 0; i < d; ++i) o[i] += weight * value[i];
            }
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
