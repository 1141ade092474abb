/* Mixture-of-experts on CPU: the router's choice and the routed experts of a MoE block, in two calls.
 *
 * `moe_route` turns router logits into each token's k experts and their weights, for every router the families
 * use: a softmax over all experts then the top k (Granite, Jamba, Mixtral), the top k logits then a softmax over
 * them (Qwen's norm_topk_prob), and sigmoid scores whose top k is chosen on scores + a correction bias within the
 * best groups of experts, weighted by the plain scores, renormalised and scaled (Nemotron-H, DeepSeek-V3-style,
 * Kimi, LFM2-MoE). Ties go to the lower index (an expert or a group), NaN scores are never preferred.
 *
 * `moe_experts` runs the chosen experts over their tokens: the (token, slot) pairs are counted and sorted by expert
 * (a counting sort: within an expert, tokens in order), each used expert's rows are gathered and multiplied by its
 * packed weights — the up projection ([gate; up] for SwiGLU), the activation, the down projection — with the same
 * panel kernels as every other linear (float32, int8 or bfloat16 panels), each read once per step however many of
 * the step's tokens chose it. Each token's output is then the weighted sum over its k slots in slot order. A row's
 * result never depends on the other rows of the batch: the panel kernels compute each row alone (same k order in
 * any tile), and the sum runs in a fixed order — which greedy speculative decoding equal to plain decoding needs.
 * Shapes: x [t, width], weights [t, k] float32, ids [t, k] int64, out [t, width]; the up panels of expert e start
 * e · up_stride elements in (scales: e · up_n), the down panels e · down_stride. Under expert parallelism an id
 * of -1 marks a slot whose expert another rank holds: it is skipped, and the row's sum runs over the other slots in
 * slot order (the rank's partial sum).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

enum { ROUTER_SOFTMAX = 0, ROUTER_SIGMOID = 1 };
enum { ACTIVATION_SILU_GATED = 0, ACTIVATION_RELU_SQUARE = 1 };
enum { FORMAT_FLOAT32 = 0, FORMAT_INT8 = 1, FORMAT_BFLOAT16 = 2 };

#define CHUNK_PAIRS 4096 /* (token, slot) pairs per pass: bounds the scratch, not the weight reads of a step */
#define SMALL_ROWS 16    /* rows per used expert up to which threads take whole experts */

/* out[0..k) = the indices of the k largest v[i] with allowed[i] (all when NULL), largest first; the lower index
 * first among equal values; NaN only once no number is left. `taken` is n bytes of scratch. */
static void top_k(const float *v, int64_t n, int64_t k, const unsigned char *allowed, unsigned char *taken,
                  int64_t *out) {
    memset(taken, 0, n);
    for (int64_t j = 0; j < k; ++j) {
        int64_t best = -1;
        for (int64_t i = 0; i < n; ++i) {
            if (taken[i] || (allowed && !allowed[i])) continue;
            if (best < 0 || v[i] > v[best] || (v[best] != v[best] && v[i] == v[i])) best = i;
        }
        if (best < 0) { /* fewer allowed than k: the lowest indices left, as -inf would give */
            for (best = 0; taken[best]; ++best) {
            }
        }
        taken[best] = 1;
        out[j] = best;
    }
}

static void route_softmax(const float *logits, int64_t E, int64_t k, int norm, float *scratch, unsigned char *taken,
                          float *w, int64_t *ids) {
    if (norm) { /* the top k logits, then a softmax over them */
        top_k(logits, E, k, NULL, taken, ids);
        const float top = logits[ids[0]];
        float sum = 0.0f;
        for (int64_t j = 0; j < k; ++j) sum += w[j] = expf(logits[ids[j]] - top);
        for (int64_t j = 0; j < k; ++j) w[j] /= sum;
        return;
    }
    float top = logits[0], sum = 0.0f; /* a softmax over all experts, then its top k */
    for (int64_t i = 1; i < E; ++i) top = logits[i] > top ? logits[i] : top;
    for (int64_t i = 0; i < E; ++i) sum += scratch[i] = expf(logits[i] - top);
    for (int64_t i = 0; i < E; ++i) scratch[i] /= sum;
    top_k(scratch, E, k, NULL, taken, ids);
    for (int64_t j = 0; j < k; ++j) w[j] = scratch[ids[j]];
}

/* Sigmoid scores s; the choice is s + bias within the best `topk_groups` of `groups` equal groups (a group scores
 * the sum of its two best choices); weights s[id] (/ (their sum + eps) when norm) · scaling. */
static void route_sigmoid(const float *logits, int64_t E, int64_t k, int norm, int64_t groups, int64_t topk_groups,
                          const float *bias, float scaling, float eps, float *scratch, unsigned char *taken,
                          int64_t *group_ids, float *w, int64_t *ids) {
    float *scores = scratch, *choice = scratch + E, *group_scores = scratch + 2 * E;
    unsigned char *allowed = taken + E;
    for (int64_t i = 0; i < E; ++i) {
        scores[i] = 1.0f / (1.0f + expf(-logits[i]));
        choice[i] = bias ? scores[i] + bias[i] : scores[i];
    }
    const unsigned char *mask = NULL;
    if (groups > 1) {
        const int64_t size = E / groups;
        int64_t best[2];
        for (int64_t g = 0; g < groups; ++g) {
            const int64_t two = size < 2 ? size : 2;
            top_k(choice + g * size, size, two, NULL, taken, best);
            group_scores[g] = two == 2 ? choice[g * size + best[0]] + choice[g * size + best[1]]
                                       : choice[g * size + best[0]];
        }
        top_k(group_scores, groups, topk_groups, NULL, taken, group_ids);
        memset(allowed, 0, E);
        for (int64_t j = 0; j < topk_groups; ++j) memset(allowed + group_ids[j] * size, 1, size);
        mask = allowed;
    }
    top_k(choice, E, k, mask, taken, ids);
    float sum = 0.0f;
    for (int64_t j = 0; j < k; ++j) sum += w[j] = scores[ids[j]];
    for (int64_t j = 0; j < k; ++j) w[j] = (norm ? w[j] / (sum + eps) : w[j]) * scaling;
}

/* 0, or 1 when its scratch cannot be allocated (nothing written then). */
int64_t moe_route(const float *logits, float *weights, int64_t *ids, int64_t t, int64_t E, int64_t k, int64_t kind,
                  int64_t norm, int64_t groups, int64_t topk_groups, const float *bias, float scaling, float eps) {
    float *scratch = malloc((2 * E + groups) * sizeof(float));
    unsigned char *taken = malloc(2 * E + 1);
    int64_t *group_ids = malloc((groups + 1) * sizeof(int64_t));
    if (!scratch || !taken || !group_ids) {
        free(scratch);
        free(taken);
        free(group_ids);
        return 1;
    }
    for (int64_t r = 0; r < t; ++r) {
        if (kind == ROUTER_SOFTMAX)
            route_softmax(logits + r * E, E, k, (int)norm, scratch, taken, weights + r * k, ids + r * k);
        else
            route_sigmoid(logits + r * E, E, k, (int)norm, groups, topk_groups, bias, scaling, eps, scratch, taken,
                          group_ids, weights + r * k, ids + r * k);
    }
    free(scratch);
    free(taken);
    free(group_ids);
    return 0;
}

/* y [M, N] = x [M, K] · wᵀ for the panels of one expert in `format`. */
static void expert_linear(int64_t format, int path, const float *x, const void *panels, const float *scale, float *y,
                          int64_t M, int64_t N, int64_t K, int num_threads) {
    if (format == FORMAT_INT8)
        linear_panels_int8(x, panels, scale, NULL, y, M, N, K, num_threads);
    else if (format == FORMAT_BFLOAT16)
        linear_panels_bf16(x, panels, NULL, y, M, N, K, path, num_threads);
    else
        linear_panels(x, panels, NULL, y, M, N, K, num_threads);
}

static const void *expert_panels(const void *base, int64_t format, int64_t index) {
    const int64_t size = format == FORMAT_INT8 ? 1 : format == FORMAT_BFLOAT16 ? 2 : 4;
    return (const char *)base + index * size;
}

typedef struct {
    float *xs, *h, *act, *o;
    const int64_t *offsets;
    int64_t width, inter, up_n, activation, format;
    int path;
    const void *up;
    const float *up_scale;
    int64_t up_stride;
    const void *down;
    const float *down_scale;
    int64_t down_stride;
} expert_work;

/* Expert e over its rows: the up projection, the activation, the down projection. */
static void run_expert(const expert_work *w, int64_t e, int num_threads) {
    const int64_t first = w->offsets[e], rows = w->offsets[e + 1] - first, up_n = w->up_n, inter = w->inter;
    expert_linear(w->format, w->path, w->xs + first * w->width, expert_panels(w->up, w->format, e * w->up_stride),
                  w->up_scale ? w->up_scale + e * up_n : NULL, w->h + first * up_n, rows, up_n, w->width, num_threads);
    if (w->activation == ACTIVATION_SILU_GATED)
        silu_mul(w->h + first * up_n, w->act + first * inter, rows, inter, num_threads);
    else
        relu_square(w->h + first * up_n, w->act + first * inter, rows * inter, num_threads);
    expert_linear(w->format, w->path, w->act + first * inter, expert_panels(w->down, w->format, e * w->down_stride),
                  w->down_scale ? w->down_scale + e * w->width : NULL, w->o + first * w->width, rows, w->width, inter,
                  num_threads);
}

/* Tokens [0, t) of one pass: pairs sorted by expert, each used expert run once over its rows, then the sums. */
static void experts_pass(const float *x, const float *weights, const int64_t *ids, float *out, int64_t t, int64_t k,
                         int64_t E, int64_t width, int64_t inter, int64_t activation, int64_t format, int path,
                         const void *up, const float *up_scale, int64_t up_stride, const void *down,
                         const float *down_scale, int64_t down_stride, float *scratch, int64_t *offsets,
                         int64_t *used, int64_t *order, int64_t *row_of, int num_threads) {
    const int64_t pairs = t * k, up_n = activation == ACTIVATION_SILU_GATED ? 2 * inter : inter;
    float *xs = scratch, *h = xs + pairs * width, *act = h + pairs * up_n, *o = act + pairs * inter;
    memset(offsets, 0, (E + 1) * sizeof(int64_t));
    for (int64_t p = 0; p < pairs; ++p)
        if (ids[p] >= 0) offsets[ids[p] + 1] += 1;
    for (int64_t e = 0; e < E; ++e) offsets[e + 1] += offsets[e];
    const int64_t local_pairs = offsets[E]; /* pairs whose expert this call holds (id -1: another rank's) */
    for (int64_t p = 0; p < pairs; ++p) { /* token-major walk: within an expert, tokens stay in order */
        if (ids[p] < 0) {
            row_of[p] = -1;
            continue;
        }
        const int64_t row = offsets[ids[p]]++;
        order[row] = p;
        row_of[p] = row;
    }
    for (int64_t e = E; e > 0; --e) offsets[e] = offsets[e - 1]; /* back to each expert's first row */
    offsets[0] = 0;
    for (int64_t r = 0; r < local_pairs; ++r) memcpy(xs + r * width, x + (order[r] / k) * width, width * sizeof(float));
    int64_t num_used = 0;
    for (int64_t e = 0; e < E; ++e)
        if (offsets[e + 1] > offsets[e]) used[num_used++] = e;
    const expert_work work = {xs, h, act, o, offsets, width, inter, up_n, activation, format, path,
                              up, up_scale, up_stride, down, down_scale, down_stride};
    /* Few rows per expert (decode steps): each thread runs whole experts, one parallel region for the call. Many
     * (prompts), or fewer experts than threads can share: each expert's linears split over the threads. Either way
     * a row's result is the same (the panel kernels compute each row alone). */
    if (num_threads > 1 && num_used >= 2 * num_threads && pairs <= SMALL_ROWS * num_used) {
#pragma omp parallel for num_threads(num_threads) schedule(dynamic, 1)
        for (int64_t j = 0; j < num_used; ++j) run_expert(&work, used[j], 1);
    } else {
        for (int64_t j = 0; j < num_used; ++j) run_expert(&work, used[j], num_threads);
    }
    for (int64_t r = 0; r < t; ++r) { /* each token's slots in order: the same sum in any batch */
        float *y = out + r * width;
        for (int64_t i = 0; i < width; ++i) y[i] = 0.0f;
        for (int64_t s = 0; s < k; ++s) {
            if (row_of[r * k + s] < 0) continue; /* an expert another rank holds: its share of the partial sum */
            const float w = weights[r * k + s], *src = o + row_of[r * k + s] * width;
            for (int64_t i = 0; i < width; ++i) y[i] += w * src[i];
        }
    }
}

/* out [t, width] = Σ_s weights[r, s] · expert_{ids[r, s]}(x[r]) over the slots whose id is not -1 (expert
 * parallel: an expert another rank holds, skipped); 1 when an id is outside [-1, E), 2 when the scratch cannot be
 * allocated (nothing written then), else 0. */
int64_t moe_experts(const float *x, const float *weights, const int64_t *ids, float *out, int64_t t, int64_t k,
                    int64_t E, int64_t width, int64_t inter, int64_t activation, int64_t format, int64_t path,
                    const void *up, const float *up_scale, int64_t up_stride, const void *down,
                    const float *down_scale, int64_t down_stride, int num_threads) {
    for (int64_t p = 0; p < t * k; ++p)
        if (ids[p] < -1 || ids[p] >= E) return 1;
    const int64_t chunk = k >= CHUNK_PAIRS ? 1 : CHUNK_PAIRS / k, max_pairs = (t < chunk ? t : chunk) * k;
    const int64_t up_n = activation == ACTIVATION_SILU_GATED ? 2 * inter : inter;
    float *scratch = malloc(max_pairs * (2 * width + up_n + inter) * sizeof(float));
    int64_t *offsets = malloc((2 * E + 1) * sizeof(int64_t)), *order = malloc(2 * max_pairs * sizeof(int64_t));
    if (!scratch || !offsets || !order) {
        free(scratch);
        free(offsets);
        free(order);
        return 2;
    }
    for (int64_t first = 0; first < t; first += chunk) {
        const int64_t n = t - first < chunk ? t - first : chunk;
        experts_pass(x + first * width, weights + first * k, ids + first * k, out + first * width, n, k, E, width,
                     inter, activation, format, (int)path, up, up_scale, up_stride, down, down_scale, down_stride,
                     scratch, offsets, offsets + E + 1, order, order + max_pairs, num_threads);
    }
    free(scratch);
    free(offsets);
    free(order);
    return 0;
}

/* out = routed + shared · (sigmoid(gate[r]) when gate is given, else 1), rows of d: a MoE block's two halves. */
void moe_combine(const float *routed, const float *shared, const float *gate, float *out, int64_t rows, int64_t d) {
    for (int64_t r = 0; r < rows; ++r) {
        const float g = gate ? 1.0f / (1.0f + expf(-gate[r])) : 1.0f;
        for (int64_t i = 0; i < d; ++i) out[r * d + i] = routed[r * d + i] + g * shared[r * d + i];
    }
}
