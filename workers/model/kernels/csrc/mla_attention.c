/* Multi-head latent attention (DeepSeek-V2's MLA, as Kimi-Linear uses it) over a paged latent cache, float32: the
 * absorbed form of workers/model/layers/mla.py, for decode steps and speculative verification.
 *
 * The cache holds one "key" head per token, [c | k_r] (L + R wide): c = rmsnorm(latent) · norm_w and k_r the shared
 * key part, both from kv_a_proj_with_mqa's output [latent | k_r]. Per query head i, with kv_b [H, NOPE + V, L]
 * stacking W_uk,i [NOPE, L] and W_uv,i [V, L]: q' = [W_uk,iᵀ q_nope | q_rope], scores q'·[c | k_r] · scale over
 * the positions up to the query's own, softmax, the weighted average of the latents c, and out_i = W_uv,i · that.
 * Nothing per cached token is up-projected. Shapes (contiguous, token-major: token t of row r is row t · b + r):
 *   q [l, b, H, NOPE + R]; kv [l, b, L + R] (kv_a output, latent not yet normed); out [l, b, H, V]
 *   cache [cache_tokens, L + R], position p of slot s at block_tables[s, p / block_size] · block_size + p % block_size
 *   slot_ids, positions [b] int64 (positions: each row's first new token). block_size <= 256.
 * Every query runs the same per-block helpers in the same order, so a verification's outputs are bit for bit those
 * of l decode steps, whatever the batch size or the grouping of heads.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

#define SHARED_STEP __attribute__((noinline, noclone)) /* one compiled body: every query adds in one order */

/* out = norm_w · rmsnorm(x) over L values (kv_a_layernorm). */
static SHARED_STEP void latent_norm(const float *x, const float *norm_w, float eps, float *out, int64_t L) {
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < L; ++i) sum += x[i] * x[i];
    const float scale = 1.0f / sqrtf(sum / (float)L + eps);
    for (int64_t i = 0; i < L; ++i) out[i] = norm_w[i] * (x[i] * scale);
}

/* absorbed [L + R] = [W_ukᵀ q_nope | q_rope] for one query head: q [NOPE + R], w_uk [NOPE, L]. */
static SHARED_STEP void absorb_query(const float *q, const float *w_uk, float *absorbed, int64_t NOPE, int64_t R,
                                     int64_t L) {
    for (int64_t c = 0; c < L; ++c) absorbed[c] = 0.0f;
    for (int64_t n = 0; n < NOPE; ++n) {
        const float qn = q[n], *row = w_uk + n * L;
#pragma omp simd
        for (int64_t c = 0; c < L; ++c) absorbed[c] += qn * row[c];
    }
    for (int64_t r = 0; r < R; ++r) absorbed[L + r] = q[NOPE + r];
}

/* Scores of one absorbed query against n entries [n, E] (scaled) into score[n]; returns their maximum. */
static SHARED_STEP float block_scores(const float *absorbed, const float *entries, int64_t n, int64_t E, float scale,
                                      float *score) {
    float block_max = -INFINITY;
    for (int64_t j = 0; j < n; ++j) {
        const float *entry = entries + j * E;
        float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
        for (int64_t i = 0; i < E; ++i) dot += absorbed[i] * entry[i];
        score[j] = dot * scale;
        block_max = score[j] > block_max ? score[j] : block_max;
    }
    return block_max;
}

/* latent += Σ_j exp(score[j] − max) · c_j over one block (latent and the running total rescaled first when the
 * running maximum grew); returns the new total. */
static SHARED_STEP float block_latents(float *latent, const float *entries, const float *score, int64_t n, int64_t E,
                                       int64_t L, float block_max, float *max_score, float total) {
    if (block_max > *max_score) {
        const float rescale = *max_score == -INFINITY ? 0.0f : expf(*max_score - block_max);
        total *= rescale;
        for (int64_t c = 0; c < L; ++c) latent[c] *= rescale;
        *max_score = block_max;
    }
    for (int64_t j = 0; j < n; ++j) {
        const float weight = expf(score[j] - *max_score);
        const float *entry = entries + j * E;
        total += weight;
#pragma omp simd
        for (int64_t c = 0; c < L; ++c) latent[c] += weight * entry[c];
    }
    return total;
}

/* out [V] = W_uv · (latent / total), w_uv [V, L]; latent is divided in place. */
static SHARED_STEP void latent_output(float *latent, float total, const float *w_uv, float *out, int64_t L, int64_t V) {
    for (int64_t c = 0; c < L; ++c) latent[c] /= total;
    for (int64_t v = 0; v < V; ++v) {
        const float *row = w_uv + v * L;
        float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
        for (int64_t c = 0; c < L; ++c) dot += row[c] * latent[c];
        out[v] = dot;
    }
}

/* Heads h0 … h0 + G − 1 of row bi, all l query tokens: each block of the slot's cache is read once for all of them
 * (it stays in cache while they score it), and every query runs the per-block arithmetic a decode step at its
 * position runs. `scratch`: G · l · (E + L + 2) + block_size floats. */
static void latent_heads(const float *q, const float *cache, const int64_t *table, int64_t block_size, int64_t first,
                         const float *kv_b, float scale, float *out, int64_t bi, int64_t b, int64_t l, int64_t h0,
                         int64_t G, int64_t H, int64_t NOPE, int64_t R, int64_t L, int64_t V, float *scratch) {
    const int64_t E = L + R, queries = G * l;
    float *absorbed = scratch, *latent = absorbed + queries * E, *max_score = latent + queries * L;
    float *total = max_score + queries, *score = total + queries;
    for (int64_t t = 0; t < l; ++t)
        for (int64_t g = 0; g < G; ++g) {
            const int64_t query = t * G + g, h = h0 + g;
            absorb_query(q + ((t * b + bi) * H + h) * (NOPE + R), kv_b + h * (NOPE + V) * L, absorbed + query * E,
                         NOPE, R, L);
            for (int64_t c = 0; c < L; ++c) latent[query * L + c] = 0.0f;
            max_score[query] = -INFINITY;
            total[query] = 0.0f;
        }
    for (int64_t start = 0; start <= first + l - 1; start += block_size) {
        const float *entries = cache + table[start / block_size] * block_size * E;
        for (int64_t t = 0; t < l; ++t) {
            const int64_t position = first + t;
            if (start > position) continue;
            const int64_t n = position + 1 - start < block_size ? position + 1 - start : block_size;
            for (int64_t query = t * G; query < (t + 1) * G; ++query) {
                const float block_max = block_scores(absorbed + query * E, entries, n, E, scale, score);
                total[query] = block_latents(latent + query * L, entries, score, n, E, L, block_max, &max_score[query],
                                             total[query]);
            }
        }
    }
    for (int64_t t = 0; t < l; ++t)
        for (int64_t g = 0; g < G; ++g) {
            const int64_t query = t * G + g, h = h0 + g;
            latent_output(latent + query * L, total[query], kv_b + (h * (NOPE + V) + NOPE) * L,
                          out + ((t * b + bi) * H + h) * V, L, V);
        }
}

/* l tokens per row at positions[r] … positions[r] + l − 1 (l = 1: a decode step; more: a verification): the new
 * entries [rmsnorm(latent) · norm_w | k_r] are written first, then every query head of every token attends causally
 * up to its own position. Work items are (row, group of heads), as many groups per row as it takes to give every
 * thread work (each group reads the row's cache once). The caller has checked that every new position has a block. */
void mla_attention(const float *q, const float *kv, const float *norm_w, float eps, float *cache,
                   const int64_t *block_tables, int64_t max_blocks, int64_t block_size, const int64_t *slot_ids,
                   const int64_t *positions, const float *kv_b, float scale, float *out, int64_t b, int64_t l,
                   int64_t H, int64_t NOPE, int64_t R, int64_t L, int64_t V, int num_threads) {
    const int64_t E = L + R;
    int64_t groups = (num_threads + b - 1) / b;
    groups = groups < 1 ? 1 : groups > H ? H : groups;
    const int64_t G = (H + groups - 1) / groups; /* heads per group; the last group may have fewer */
    groups = (H + G - 1) / G;
#pragma omp parallel num_threads(num_threads)
    {
#pragma omp for schedule(static)
        for (int64_t tr = 0; tr < l * b; ++tr) {
            const int64_t t = tr / b, bi = tr % b, position = positions[bi] + t;
            const int64_t at = block_tables[slot_ids[bi] * max_blocks + position / block_size] * block_size +
                               position % block_size;
            latent_norm(kv + tr * E, norm_w, eps, cache + at * E, L);
            memcpy(cache + at * E + L, kv + tr * E + L, R * sizeof(float));
        }
        float *scratch = malloc((G * l * (E + L + 2) + block_size) * sizeof(float));
#pragma omp for schedule(static)
        for (int64_t item = 0; item < b * groups; ++item) {
            const int64_t bi = item / groups, h0 = item % groups * G, count = H - h0 < G ? H - h0 : G;
            latent_heads(q, cache, block_tables + slot_ids[bi] * max_blocks, block_size, positions[bi], kv_b, scale,
                         out, bi, b, l, h0, count, H, NOPE, R, L, V, scratch);
        }
        free(scratch);
    }
}

/* A decode plan's latent attention record (decode_plan.c): a = q, kv, norm weight, cache, slot ids, positions,
 * block tables, kv_b, out, b, l, H, NOPE, R, L, V, capacity, max blocks, block size; f = scale, eps. 1 (nothing
 * written) when a new position lies outside the cache or has no block, else 0. */
int64_t mla_plan_step(const int64_t *a, const double *f, int num_threads) {
    const int64_t *slot_ids = (const int64_t *)a[4], *positions = (const int64_t *)a[5];
    const int64_t *tables = (const int64_t *)a[6];
    const int64_t b = a[9], l = a[10], capacity = a[16], max_blocks = a[17], block_size = a[18];
    for (int64_t r = 0; r < b; ++r)
        for (int64_t t = 0; t < l; ++t) {
            const int64_t position = positions[r] + t;
            if (position < 0 || position >= capacity) return 1;
            if (tables[slot_ids[r] * max_blocks + position / block_size] == 0) return 1; /* no block */
        }
    mla_attention((const float *)a[0], (const float *)a[1], (const float *)a[2], (float)f[1], (float *)a[3], tables,
                  max_blocks, block_size, slot_ids, positions, (const float *)a[7], (float)f[0], (float *)a[8], b, l,
                  a[11], a[12], a[13], a[14], a[15], num_threads);
    return 0;
}
