/* Log-probabilities of a step's rows (`workers/logprobs.py`) without writing the log-softmax out: per row of logits
 * x [n], one pass keeps the row's maximum and its k largest values with their indices, a second sums
 * exp(x − max) (vexpf, in float lanes, added up in double), so log p(t) = x[t] − max − log(sum). torch's
 * log_softmax + topk + gather over a 32 × 32k step read and write the logits three times (~0.8 ms on 2 cores);
 * this reads them twice from cache. All tensors contiguous, row-major.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "kernels.h"
#include "vexp.h"

/* Insert (value, index) into the k largest so far, sorted by value descending; an equal value goes after the ones
 * already there (the earlier index ranks first, as the scan visits indices in order). */
static void top_insert(float *values, int64_t *ids, int64_t k, float value, int64_t index) {
    int64_t at = k - 1;
    while (at > 0 && values[at - 1] < value) {
        values[at] = values[at - 1];
        ids[at] = ids[at - 1];
        --at;
    }
    values[at] = value;
    ids[at] = index;
}

/* The maximum of row [n] and, for k > 0, its k largest values in values / ids. A row with fewer than k values
 * above −inf fills the rest with its first −inf entries (torch.topk would take some of them); ids stay −1 only past
 * the row's n entries (k > n). */
static float max_and_top(const float *row, int64_t n, int64_t k, float *values, int64_t *ids) {
    for (int64_t j = 0; j < k; ++j) {
        values[j] = -INFINITY;
        ids[j] = -1;
    }
    vf lane_max;
    int64_t i = 0;
    for (int lane = 0; lane < LANES; ++lane) lane_max[lane] = -INFINITY;
    for (; i + LANES <= n; i += LANES) {
        vf v;
        memcpy(&v, row + i, sizeof v);
        const vi larger = v > lane_max;
        lane_max = (vf)(((vi)v & larger) | ((vi)lane_max & ~larger));
        if (k == 0) continue;
        const vi above = v > values[k - 1];
        int any = 0;
        for (int lane = 0; lane < LANES; ++lane) any |= above[lane];
        if (!any) continue;
        for (int lane = 0; lane < LANES; ++lane)
            if (row[i + lane] > values[k - 1]) top_insert(values, ids, k, row[i + lane], i + lane);
    }
    float best = -INFINITY;
    for (int lane = 0; lane < LANES; ++lane) best = lane_max[lane] > best ? lane_max[lane] : best;
    for (; i < n; ++i) {
        best = row[i] > best ? row[i] : best;
        if (k > 0 && row[i] > values[k - 1]) top_insert(values, ids, k, row[i], i);
    }
    int64_t free = 0;
    while (free < k && ids[free] >= 0) ++free;
    for (int64_t j = 0; j < n && free < k; ++j)
        if (row[j] == -INFINITY) ids[free++] = j;
    return best;
}

/* log(sum exp(row − max)) + max: the row's log-normaliser. */
static float log_normaliser(const float *row, int64_t n, float max) {
    vf lane_sum = {0};
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES) {
        vf v;
        memcpy(&v, row + i, sizeof v);
        lane_sum += vexpf_lanes(v - max);
    }
    double sum = 0.0;
    for (int lane = 0; lane < LANES; ++lane) sum += lane_sum[lane];
    for (; i < n; ++i) sum += vexpf(row[i] - max);
    return max + (float)log(sum);
}

/* For each of `rows` rows of x [rows, n]: token_logprobs[r] = log p(tokens[r]) and, for k > 0, the k most likely
 * tokens top_ids [rows, k] with their log-probabilities top_logprobs [rows, k] (−inf entries after the finite ones;
 * ids −1 past n). tokens[r] must lie in [0, n). */
void logprobs_rows(const float *x, const int64_t *tokens, int64_t rows, int64_t n, int64_t k, float *token_logprobs,
                   int64_t *top_ids, float *top_logprobs, int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
        const float *row = x + r * n;
        float *values = top_logprobs + r * k;
        const float max = max_and_top(row, n, k, values, top_ids + r * k);
        const float normaliser = max == -INFINITY ? 0.0f : log_normaliser(row, n, max);
        token_logprobs[r] = row[tokens[r]] - normaliser;
        for (int64_t j = 0; j < k; ++j) values[j] -= normaliser;
    }
}
