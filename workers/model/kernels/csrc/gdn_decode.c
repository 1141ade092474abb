/* Gated DeltaNet on CPU, float32: everything between in_proj and out_proj, for one decode step and for a prompt.
 *
 * The pure-PyTorch path in workers/model/layers/gdn.py (conv_step_, l2norm, delta_rule_step_, HeadGatedRMSNorm) is the
 * reference; this kernel computes the same thing in one pass per request and value head over the delta-rule state
 * (the state, h_v · d_k · d_v floats per request, is what a decode step is bound by; PyTorch makes ~4 passes).
 * The prompt pass (gdn_prefill) walks the same recurrence token by token instead of the chunked form.
 * Shapes (all contiguous, row-major), with Cd = 2 · HK · DK + HV · DV:
 *   proj        [b, Cd + HV·DV + 2·HV]  in_proj output: q | k | v | z | b (beta before sigmoid) | a
 *   conv_state  [b, Cd, W-1]            updated in place        conv_w [Cd, W] (no bias)
 *   dt_bias, A_log [HV]                 g = -exp(A_log) · softplus(a + dt_bias), decay = exp(g)
 *   delta_state [b, HV, DK, DV]         updated in place
 *   norm_w      [DV]                    per-head gated RMSNorm: w · rmsnorm(o) · silu(z)
 *   qkv         [b, Cd]                 scratch: conv output (q | k | v after silu; q, k then l2-normalised)
 *   out         [b, HV·DV]              the out_proj input
 * Value head h reads key head h / (HV / HK) (repeat_interleave).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "conv_step.h"
#include "kernels.h"
#include "vexp.h"

static inline float softplus(float v) { return v > 20.0f ? v : log1pf(expf(v)); }

/* The helpers with vectorised reductions that a decode step, a verification and a keep share are not inlined: each
 * is one compiled body, so that its reduction adds in one order everywhere and the three agree bit for bit. */
#define SHARED_STEP __attribute__((noinline, noclone))

/* x ← x / sqrt(Σx² + 1e-6) · scale over n values (the FLA / transformers l2norm). */
static SHARED_STEP void l2norm_scaled(float *x, int64_t n, float scale) {
    float sq = 0.0f;
#pragma omp simd reduction(+ : sq)
    for (int64_t i = 0; i < n; ++i) sq += x[i] * x[i];
    const float factor = scale / sqrtf(sq + 1e-6f);
    for (int64_t i = 0; i < n; ++i) x[i] *= factor;
}

/* One token through NC columns of one value head's state: S ← decay·S;  S += k ⊗ beta·(v − Sᵀk);  o = Sᵀq.
 * S is [DK, NC] with rows `stride` apart (the columns of a [DK, DV] state are independent: a prompt walks
 * a block of them at a time); v and o hold the same NC columns. */
static inline void delta_head_step(float *S, int64_t stride, const float *q, const float *k, const float *v,
                                   float decay, float beta, float *o, float *delta, int64_t DK, int64_t NC) {
    for (int64_t j = 0; j < NC; ++j) delta[j] = 0.0f;
    for (int64_t i = 0; i < DK; ++i) { /* Sᵀk of the undecayed state; scaled by decay below */
        const float ki = k[i];
        const float *row = S + i * stride;
#pragma omp simd
        for (int64_t j = 0; j < NC; ++j) delta[j] += row[j] * ki;
    }
    for (int64_t j = 0; j < NC; ++j) {
        delta[j] = (v[j] - decay * delta[j]) * beta;
        o[j] = 0.0f;
    }
    for (int64_t i = 0; i < DK; ++i) { /* the update and the output in one pass over the (now cached) state */
        const float ki = k[i], qi = q[i];
        float *row = S + i * stride;
#pragma omp simd
        for (int64_t j = 0; j < NC; ++j) {
            const float s = row[j] * decay + ki * delta[j];
            row[j] = s;
            o[j] += s * qi;
        }
    }
}

/* The gates of value head h from its in_proj row p: decay = exp(g), g = -exp(A_log) · softplus(a + dt_bias);
 * beta = beta_scale · sigmoid(b) (beta_scale 1 for Qwen; 2 for OLMo-Hybrid's negative eigenvalues, where the
 * product is exact: the module path's `sigmoid(b) * 2` rounds alike). */
static inline void head_gates(const float *p, int64_t Cd, int64_t HV, int64_t DV, int64_t h, const float *dt_bias,
                              const float *A_log, float beta_scale, float *decay, float *beta) {
    *decay = expf(-expf(A_log[h]) * softplus(p[Cd + HV * DV + HV + h] + dt_bias[h]));
    *beta = 1.0f / (1.0f + expf(-p[Cd + HV * DV + h])) * beta_scale;
}

/* o ← norm_w · rmsnorm(o) · silu(z) over one head's DV channels, in place. */
static SHARED_STEP void gated_head_norm(float *o, const float *z, const float *norm_w, float eps, int64_t DV) {
    float sq = 0.0f;
#pragma omp simd reduction(+ : sq)
    for (int64_t j = 0; j < DV; ++j) sq += o[j] * o[j];
    const float scale = 1.0f / sqrtf(sq / (float)DV + eps);
    for (int64_t j = 0; j < DV; ++j) o[j] = norm_w[j] * (o[j] * scale);
    silu_mul_row(z, o, o, DV);
}

/* Conv output of one token, in place: silu, then each key head of q l2-normalised and scaled by DK^-0.5, of k
 * l2-normalised. */
static inline void activate_qkv(float *qkv, int64_t Cd, int64_t HK, int64_t DK) {
    silu_inplace(qkv, Cd);
    for (int64_t h = 0; h < 2 * HK; ++h) l2norm_scaled(qkv + h * DK, DK, h < HK ? 1.0f / sqrtf((float)DK) : 1.0f);
}

/* Columns of a head's state a prompt walks at a time, as PREFILL_VECTORS vectors of LANES (simd.h): DK · 64 floats
 * (32 KiB for DK = 128) with AVX-512 stay close in cache, and the accumulators below (4 · PREFILL_VECTORS vectors)
 * stay in registers on AVX-512 and NEON (32 registers); AVX2 (16) spills a few but measured 1.1× faster with 4
 * vectors than with 2. Columns are independent, so the width changes no result. BLOCK_LINES: the 64-byte cache
 * lines of one state row of a block. */
#define PREFILL_VECTORS 4
#define PREFILL_COLUMNS (LANES * PREFILL_VECTORS)
#define BLOCK_LINES (PREFILL_COLUMNS / 16) /* 4 · LANES ≥ 16 on every variant */

/* delta_head_step over exactly PREFILL_COLUMNS columns, with Sᵀk, the correction and the output in registers:
 * the general step keeps them in memory (o and S may alias there), which chains every row's loads and stores. The
 * same sums in the same order. `ahead` (or NULL): DK · BLOCK_LINES cache lines from there on are prefetched
 * meanwhile, half a state row's BLOCK_LINES per pass (towards the outer caches: the block in L1 stays). */
static inline void delta_block_step(float *S, int64_t stride, const float *q, const float *k, const float *v,
                                    float decay, float beta, float *o, int64_t DK, const float *ahead) {
    vf predicted[PREFILL_VECTORS] = {0}, delta[PREFILL_VECTORS], acc[PREFILL_VECTORS] = {0};
    for (int64_t i = 0; i < DK; ++i) { /* Sᵀk of the undecayed state; scaled by decay below */
        if (ahead)
            for (int u = 0; u < BLOCK_LINES / 2; ++u)
                __builtin_prefetch(ahead + (i * BLOCK_LINES + u) * 16, 0, 1);
        for (int u = 0; u < PREFILL_VECTORS; ++u) {
            vf row;
            memcpy(&row, S + i * stride + LANES * u, sizeof row);
            predicted[u] += row * k[i];
        }
    }
    for (int u = 0; u < PREFILL_VECTORS; ++u) {
        vf value;
        memcpy(&value, v + LANES * u, sizeof value);
        delta[u] = (value - decay * predicted[u]) * beta;
    }
    for (int64_t i = 0; i < DK; ++i) { /* the update and the output in one pass over the (now cached) state */
        if (ahead)
            for (int u = BLOCK_LINES / 2; u < BLOCK_LINES; ++u)
                __builtin_prefetch(ahead + (i * BLOCK_LINES + u) * 16, 0, 1);
        for (int u = 0; u < PREFILL_VECTORS; ++u) {
            vf row;
            memcpy(&row, S + i * stride + LANES * u, sizeof row);
            row = row * decay + k[i] * delta[u];
            memcpy(S + i * stride + LANES * u, &row, sizeof row);
            acc[u] += row * q[i];
        }
    }
    memcpy(o, acc, sizeof acc);
}

/* One token through a whole value head's state S [DK, DV] (rows DV apart): the decode step, the verification and
 * the keep all walk a head through this one function, so that they round alike. Blocks of PREFILL_COLUMNS columns
 * run in registers (a block's DK · 64 floats stay in L1 between the two passes), a partial last block through the
 * general step. `next` (or NULL): the state walked after this one, DK · DV floats, prefetched meanwhile. At
 * gdn-bench shapes, batch 32, a decode step's Gated DeltaNet layers take 6.2 ms instead of 6.5 with blocks, 5.95
 * with the prefetch too (benchmarks/decode_step_profile.py): 31 GiB/s of state read and written, against 37-45
 * GiB/s measured for an in-place pass over 2 GiB here. */
static SHARED_STEP void delta_head_walk(float *S, const float *q, const float *k, const float *v, float decay,
                                        float beta, float *o, int64_t DK, int64_t DV, const float *next) {
    const int64_t full = DV / PREFILL_COLUMNS;
    for (int64_t j0 = 0; j0 < full * PREFILL_COLUMNS; j0 += PREFILL_COLUMNS)
        delta_block_step(S + j0, DV, q, k, v + j0, decay, beta, o + j0, DK, next ? next + j0 * DK : NULL);
    if (DV > full * PREFILL_COLUMNS) {
        float delta[PREFILL_COLUMNS];
        const int64_t j0 = full * PREFILL_COLUMNS;
        delta_head_step(S + j0, DV, q, k, v + j0, decay, beta, o + j0, delta, DK, DV - j0);
    }
}

void gdn_decode_step(const float *proj, float *conv_state, const float *conv_w, const float *dt_bias,
                     const float *A_log, float beta_scale, float *delta_state, const float *norm_w, float eps, float *qkv,
                     float *out, int64_t b, int64_t HK, int64_t HV, int64_t DK, int64_t DV, int64_t W, int num_threads) {
    const int64_t Cd = 2 * HK * DK + HV * DV, row_len = Cd + HV * DV + 2 * HV, per_key = HV / HK;
#pragma omp parallel num_threads(num_threads)
    {
        /* 1. Causal conv over the window [state, new input], shift the window. */
        conv_rows(conv_state, conv_w, NULL, proj, row_len, 0, qkv, 0, 1, NULL, b, Cd, W, 1);
        /* 2. silu; l2-normalise each key head of q (then scale by DK^-0.5) and of k. */
#pragma omp for schedule(static)
        for (int64_t bi = 0; bi < b; ++bi) activate_qkv(qkv + bi * Cd, Cd, HK, DK);
        /* 3. The delta rule per (row, value head), then the gated norm of its output. */
#pragma omp for schedule(static)
        for (int64_t bh = 0; bh < b * HV; ++bh) {
            const int64_t bi = bh / HV, h = bh % HV, kh = h / per_key;
            const float *row = qkv + bi * Cd, *p = proj + bi * row_len;
            float decay, beta;
            head_gates(p, Cd, HV, DV, h, dt_bias, A_log, beta_scale, &decay, &beta);
            float *o = out + bh * DV;
            delta_head_walk(delta_state + bh * DK * DV, row + kh * DK, row + HK * DK + kh * DK,
                            row + 2 * HK * DK + h * DV, decay, beta, o, DK, DV,
                            bh + 1 < b * HV ? delta_state + (bh + 1) * DK * DV : NULL);
            gated_head_norm(o, p + Cd + h * DV, norm_w, eps, DV);
        }
    }
}

/* Speculative verification: l tokens per row from the states in place, which are read and left as they are (the
 * keep below advances them once the accepted count is known). proj [l, b, ·] token-major → out [l, b, HV·DV]; qkv
 * [l, b, Cd] scratch. Each (row, value head) walks its l tokens on a copy of its state in cache: the state is read
 * once instead of saved, updated l times and restored. Outputs are bit for bit those of l decode steps. */
void gdn_verify(const float *proj, const float *conv_state, const float *conv_w, const float *dt_bias,
                const float *A_log, float beta_scale, const float *delta_state, const float *norm_w, float eps, float *qkv, float *out,
                int64_t b, int64_t l, int64_t HK, int64_t HV, int64_t DK, int64_t DV, int64_t W, int num_threads) {
    const int64_t Cd = 2 * HK * DK + HV * DV, row_len = Cd + HV * DV + 2 * HV, per_key = HV / HK;
#pragma omp parallel num_threads(num_threads)
    {
        conv_rows((float *)conv_state, conv_w, NULL, proj, row_len, b * row_len, qkv, b * Cd, l, NULL, b, Cd, W,
                  0);
#pragma omp for schedule(static)
        for (int64_t r = 0; r < l * b; ++r) activate_qkv(qkv + r * Cd, Cd, HK, DK);
        float *state = malloc(DK * DV * sizeof(float));
#pragma omp for schedule(static)
        for (int64_t bh = 0; bh < b * HV; ++bh) {
            const int64_t bi = bh / HV, h = bh % HV, kh = h / per_key;
            memcpy(state, delta_state + bh * DK * DV, DK * DV * sizeof(float));
            for (int64_t t = 0; t < l; ++t) {
                const int64_t r = t * b + bi;
                const float *row = qkv + r * Cd, *p = proj + r * row_len;
                float decay, beta;
                head_gates(p, Cd, HV, DV, h, dt_bias, A_log, beta_scale, &decay, &beta);
                float *o = out + (r * HV + h) * DV;
                delta_head_walk(state, row + kh * DK, row + HK * DK + kh * DK, row + 2 * HK * DK + h * DV, decay,
                                beta, o, DK, DV, NULL);
                gated_head_norm(o, p + Cd + h * DV, norm_w, eps, DV);
            }
        }
        free(state);
    }
}

/* After `gdn_verify`: row r advances its conv window and delta-rule state, in place, by its first accepted[r]
 * tokens of proj [l, b, ·] — the states accepted[r] decode steps would leave, bit for bit. qkv [l, b, Cd] is
 * scratch. */
void gdn_keep(const float *proj, float *conv_state, const float *conv_w, const float *dt_bias, const float *A_log,
              float beta_scale, float *delta_state, float *qkv, const int64_t *accepted, int64_t b, int64_t l, int64_t HK, int64_t HV,
              int64_t DK, int64_t DV, int64_t W, int num_threads) {
    const int64_t Cd = 2 * HK * DK + HV * DV, row_len = Cd + HV * DV + 2 * HV, per_key = HV / HK;
#pragma omp parallel num_threads(num_threads)
    {
        conv_rows(conv_state, conv_w, NULL, proj, row_len, b * row_len, qkv, b * Cd, 0, accepted, b, Cd, W, 1);
#pragma omp for schedule(static)
        for (int64_t r = 0; r < l * b; ++r)
            if (r / b < accepted[r % b]) activate_qkv(qkv + r * Cd, Cd, HK, DK);
        float *o = malloc(DV * sizeof(float)); /* outputs: the verification's */
#pragma omp for schedule(static)
        for (int64_t bh = 0; bh < b * HV; ++bh) {
            const int64_t bi = bh / HV, h = bh % HV, kh = h / per_key;
            for (int64_t t = 0; t < accepted[bi]; ++t) {
                const int64_t r = t * b + bi;
                const float *row = qkv + r * Cd;
                float decay, beta;
                head_gates(proj + r * row_len, Cd, HV, DV, h, dt_bias, A_log, beta_scale, &decay, &beta);
                delta_head_walk(delta_state + bh * DK * DV, row + kh * DK, row + HK * DK + kh * DK,
                                row + 2 * HK * DK + h * DV, decay, beta, o, DK, DV, NULL);
            }
        }
        free(o);
    }
}

/* A row's first n prompt tokens through one value head's block of PREFILL_COLUMNS state columns, held contiguous in
 * S [DK, PREFILL_COLUMNS]: delta_block_step token after token, except that each update pass also accumulates the
 * next token's Sᵀk from the rows it has just written — the same products summed in the same order as that token's
 * own first pass would, so the results are delta_block_step's bit for bit with one pass over the block per token
 * instead of two. Token t reads q, k at q_k + t · Cd (k HK · DK further on), v at v + t · Cd, its gates from
 * gate_row + t · row_len, and writes its output columns at o + t · o_stride. */
static void delta_block_prompt(float *S, const float *q_k, const float *v, int64_t Cd, int64_t HK, int64_t DK,
                               const float *gate_row, int64_t row_len, int64_t HV, int64_t DV, int64_t h,
                               const float *dt_bias, const float *A_log, float beta_scale, float *o,
                               int64_t o_stride, int64_t n) {
    vf predicted[PREFILL_VECTORS] = {0};
    if (n > 0)
        for (int64_t i = 0; i < DK; ++i) { /* the first token's Sᵀk */
            const float ki = q_k[HK * DK + i];
            for (int u = 0; u < PREFILL_VECTORS; ++u) {
                vf row;
                memcpy(&row, S + i * PREFILL_COLUMNS + LANES * u, sizeof row);
                predicted[u] += row * ki;
            }
        }
    for (int64_t t = 0; t < n; ++t) {
        /* after the last token `next` is not used: its k stands in for the missing next one */
        const float *q = q_k + t * Cd, *k = q + HK * DK, *k_next = t + 1 < n ? k + Cd : k;
        float decay, beta;
        head_gates(gate_row + t * row_len, Cd, HV, DV, h, dt_bias, A_log, beta_scale, &decay, &beta);
        vf delta[PREFILL_VECTORS], acc[PREFILL_VECTORS] = {0}, next[PREFILL_VECTORS] = {0};
        for (int u = 0; u < PREFILL_VECTORS; ++u) {
            vf value;
            memcpy(&value, v + t * Cd + LANES * u, sizeof value);
            delta[u] = (value - decay * predicted[u]) * beta;
        }
        for (int64_t i = 0; i < DK; ++i)
            for (int u = 0; u < PREFILL_VECTORS; ++u) {
                vf row;
                memcpy(&row, S + i * PREFILL_COLUMNS + LANES * u, sizeof row);
                row = row * decay + k[i] * delta[u];
                memcpy(S + i * PREFILL_COLUMNS + LANES * u, &row, sizeof row);
                acc[u] += row * q[i];
                next[u] += row * k_next[i];
            }
        memcpy(o + t * o_stride, acc, sizeof acc);
        memcpy(predicted, next, sizeof next);
    }
}

/* A prompt (or the next chunk of one) through a Gated DeltaNet mixer: proj [b, l, Cd + HV·DV + 2·HV] (rows
 * right-padded, row r has num_tokens[r] valid tokens), continuing initial_conv [b, Cd, W-1] and initial_delta
 * [b, HV, DK, DV] (zeros where NULL), with conv_wt [W, Cd] the conv weight transposed (a tap's weights side by side
 * over the channels) → out [b, l, HV·DV] (the out_proj input; 0 at padding), and the states after
 * each row's last valid token into conv_state [b, Cd, W-1] and delta_state [b, HV, DK, DV]. qkv [b, l, Cd]
 * receives the conv output (after silu; q and k l2-normalised, q scaled). The decode step's recurrence token after
 * token, walked per (row, value head, block of PREFILL_COLUMNS state columns) so that block stays in cache for the
 * whole prompt: no chunked-scan passes. */
void gdn_prefill(const float *proj, const int64_t *num_tokens, const float *conv_wt, const float *dt_bias,
                 const float *A_log, float beta_scale, const float *norm_w, float eps, const float *initial_conv,
                 const float *initial_delta, float *qkv, float *conv_state, float *delta_state, float *out, int64_t b,
                 int64_t l, int64_t HK, int64_t HV, int64_t DK, int64_t DV, int64_t W, int num_threads) {
    const int64_t Cd = 2 * HK * DK + HV * DV, row_len = Cd + HV * DV + 2 * HV, per_key = HV / HK;
    const int64_t num_blocks = (DV + PREFILL_COLUMNS - 1) / PREFILL_COLUMNS;
#pragma omp parallel num_threads(num_threads)
    {
        /* 1. Causal conv per token, continuing the initial window (zeros without one): input src < 0 is entry
         * W-1+src of the window. Then silu and the l2 norms. */
#pragma omp for schedule(static)
        for (int64_t bt = 0; bt < b * l; ++bt) {
            const int64_t bi = bt / l, t = bt % l;
            const float *window = initial_conv ? initial_conv + bi * Cd * (W - 1) : NULL;
            float *acc = qkv + bt * Cd;
            for (int64_t c = 0; c < Cd; ++c) acc[c] = 0.0f;
            for (int64_t k = 0; k < W; ++k) {
                const int64_t src = t - (W - 1) + k;
                const float *w = conv_wt + k * Cd;
                if (src >= 0) {
                    const float *in = proj + (bi * l + src) * row_len;
#pragma omp simd
                    for (int64_t c = 0; c < Cd; ++c) acc[c] += in[c] * w[c];
                } else if (window) {
                    for (int64_t c = 0; c < Cd; ++c) acc[c] += window[c * (W - 1) + W - 1 + src] * w[c];
                }
            }
            activate_qkv(acc, Cd, HK, DK);
        }
        /* 2. Each row's conv window after its last valid input. */
#pragma omp for schedule(static)
        for (int64_t bc = 0; bc < b * Cd; ++bc) {
            const int64_t bi = bc / Cd, c = bc % Cd, n = num_tokens[bi];
            const float *window = initial_conv ? initial_conv + bc * (W - 1) : NULL;
            for (int64_t k = 0; k < W - 1; ++k) {
                const int64_t src = n - (W - 1) + k;
                conv_state[bc * (W - 1) + k] =
                    src >= 0 ? proj[(bi * l + src) * row_len + c] : (window ? window[W - 1 + src] : 0.0f);
            }
        }
        /* 3. The delta rule per (row, value head, column block) over the row's valid tokens, from the initial
         * state (zeros without one); padding outputs 0. A block is walked in a contiguous copy: in place, its rows
         * DV floats apart map onto half of L1's sets (for DV = 128) and it would be re-read from L2 each token
         * (gdn-bench shapes, 32 rows of 32 tokens: 10.5 ms a layer instead of 12.5). */
        float *block = malloc(DK * PREFILL_COLUMNS * sizeof(float));
#pragma omp for schedule(static)
        for (int64_t bhj = 0; bhj < b * HV * num_blocks; ++bhj) {
            const int64_t bh = bhj / num_blocks, bi = bh / HV, h = bh % HV, kh = h / per_key;
            const int64_t j0 = bhj % num_blocks * PREFILL_COLUMNS, n = num_tokens[bi];
            const int64_t NC = DV - j0 < PREFILL_COLUMNS ? DV - j0 : PREFILL_COLUMNS;
            float *S = NC == PREFILL_COLUMNS ? block : delta_state + bh * DK * DV + j0;
            const int64_t stride = NC == PREFILL_COLUMNS ? PREFILL_COLUMNS : DV;
            const float *S0 = initial_delta ? initial_delta + bh * DK * DV + j0 : NULL;
            for (int64_t i = 0; i < DK; ++i)
                for (int64_t j = 0; j < NC; ++j) S[i * stride + j] = S0 ? S0[i * DV + j] : 0.0f;
            float delta[PREFILL_COLUMNS]; /* the general step's scratch (a partial block) */
            if (S == block) {
                const float *first = qkv + bi * l * Cd;
                delta_block_prompt(S, first + kh * DK, first + 2 * HK * DK + h * DV + j0, Cd, HK, DK,
                                   proj + bi * l * row_len, row_len, HV, DV, h, dt_bias, A_log, beta_scale,
                                   out + bi * l * HV * DV + h * DV + j0, HV * DV, n);
            }
            for (int64_t t = S == block ? n : 0; t < l; ++t) {
                float *o = out + (bi * l + t) * HV * DV + h * DV + j0;
                if (t >= n) {
                    for (int64_t j = 0; j < NC; ++j) o[j] = 0.0f;
                    continue;
                }
                const float *row = qkv + (bi * l + t) * Cd;
                float decay, beta;
                head_gates(proj + (bi * l + t) * row_len, Cd, HV, DV, h, dt_bias, A_log, beta_scale, &decay, &beta);
                const float *q = row + kh * DK, *k = row + HK * DK + kh * DK, *v = row + 2 * HK * DK + h * DV + j0;
                delta_head_step(S, stride, q, k, v, decay, beta, o, delta, DK, NC);
            }
            if (S == block)
                for (int64_t i = 0; i < DK; ++i)
                    memcpy(delta_state + bh * DK * DV + i * DV + j0, block + i * PREFILL_COLUMNS,
                           PREFILL_COLUMNS * sizeof(float));
        }
        free(block);
        /* 4. The gated norm per (token, value head). */
#pragma omp for schedule(static)
        for (int64_t bth = 0; bth < b * l * HV; ++bth) {
            const int64_t bt = bth / HV, h = bth % HV;
            gated_head_norm(out + bth * DV, proj + bt * row_len + Cd + h * DV, norm_w, eps, DV);
        }
    }
}
