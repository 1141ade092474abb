/* Kimi Delta Attention on CPU, float32: everything between the projections and o_proj, for one decode step, a
 * speculative verification, the keep after it, and a prompt.
 *
 * The pure-PyTorch path in workers/model/layers/kda.py (conv_step_, l2norm, kda_step_, SigmoidGatedRMSNorm) is the
 * reference. The delta rule is Gated DeltaNet's (csrc/gdn_decode.c) with a decay per key channel instead of one per
 * head: S ← diag(exp(g)) S;  S += k ⊗ beta·(v − Sᵀk);  o = Sᵀq. f_b_proj and g_b_proj are linears of their own
 * (the caller runs them on the f_a / g_a parts of in_proj's output); everything after them is here.
 * Shapes (all contiguous, row-major), with HD = H · D and Cd = 3 · HD:
 *   proj        [b, Cd + 2·D + H]  in_proj output: q | k | v | f_a | g_a | b (beta before sigmoid)
 *   f           [b, HD]            f_b_proj(f_a): g = -exp(A_log[h]) · softplus(f + dt_bias), decay = exp(g)
 *   gate        [b, HD]            g_b_proj(g_a): the output gate, sigmoid(gate)
 *   conv_state  [b, Cd, W-1]       updated in place        conv_w [Cd, W] (no bias)
 *   dt_bias [HD], A_log [H], norm_w [D]
 *   delta_state [b, H, D, D]       updated in place
 *   qkv         [b, Cd]            scratch: conv output (silu; q, k then l2-normalised, q scaled by D^-0.5)
 *   out         [b, HD]            the o_proj input: norm_w · rmsnorm(o) · sigmoid(gate) per head
 * The decode step, the verification and the keep walk each head through the same non-inlined helpers, so they
 * round alike; the prompt walk sums the same products in the same order a column block at a time.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "conv_step.h"
#include "kernels.h"
#include "vexp.h"

#define SHARED_STEP __attribute__((noinline, noclone))
#define KDA_COLUMNS 64 /* state columns walked at a time: a block of D · 64 floats stays in cache between passes */

/* x ← x / sqrt(Σx² + 1e-6) · scale over n values (the FLA / transformers l2norm). */
static SHARED_STEP void kda_l2norm(float *x, int64_t n, float scale) {
    float sq = 0.0f;
#pragma omp simd reduction(+ : sq)
    for (int64_t i = 0; i < n; ++i) sq += x[i] * x[i];
    const float factor = scale / sqrtf(sq + 1e-6f);
    for (int64_t i = 0; i < n; ++i) x[i] *= factor;
}

/* One token's conv output, in place: silu, then each head of q l2-normalised and scaled by D^-0.5, of k
 * l2-normalised. */
static inline void kda_activate(float *qkv, int64_t H, int64_t D) {
    silu_inplace(qkv, 3 * H * D);
    for (int64_t h = 0; h < 2 * H; ++h) kda_l2norm(qkv + h * D, D, h < H ? 1.0f / sqrtf((float)D) : 1.0f);
}

/* Natural log of x > 0 (a normal float) on LANES lanes: Cephes' logf (x = m · 2^e with m in [√½, √2), a degree-8
 * polynomial in m − 1), within ~1 ulp of logf. */
static inline vf vlogf_lanes(vf x) {
    const vi bits = (vi)x;
    vi e = ((bits >> 23) & 0xff) - 126;
    vf m = (vf)((bits & 0x807fffff) | 0x3f000000); /* in [0.5, 1) */
    const vi small = m < 0.707106781186547524f;
    e = e + small; /* small lanes: −1 + 1 … as vi true is −1 */
    m = m + (vf)((vi)m & small) - 1.0f; /* 2m − 1 where small, else m − 1 */
    const vf z = m * m;
    vf y = m * 7.0376836292e-2f - 1.1514610310e-1f;
    y = y * m + 1.1676998740e-1f;
    y = y * m - 1.2420140846e-1f;
    y = y * m + 1.4249322787e-1f;
    y = y * m - 1.6668057665e-1f;
    y = y * m + 2.0000714765e-1f;
    y = y * m - 2.4999993993e-1f;
    y = y * m + 3.3333331174e-1f;
    const vf ef = __builtin_convertvector(e, vf);
    y = y * m * z + ef * -2.12194440e-4f - 0.5f * z;
    return m + y + ef * 0.693359375f;
}

/* decay = exp(-a · softplus(raw)) on LANES lanes; softplus(raw) = log1p(exp(raw)), raw past 20 as is (torch's
 * threshold). log1p(u) as log(1 + u) · u / ((1 + u) − 1), exact to float rounding for small u too. */
static inline vf select_lanes(vi mask, vf yes, vf no) { return (vf)(((vi)yes & mask) | ((vi)no & ~mask)); }

static inline vf decay_lanes(vf raw, float a) {
    const vf zero = {0};
    const vi large = raw > 20.0f;
    const vf u = vexpf_lanes(select_lanes(large, zero + 20.0f, raw)), one_plus = 1.0f + u, rounded = one_plus - 1.0f;
    const vi exact = rounded == zero; /* 1 + u rounds to 1: log1p(u) = u to float precision */
    vf softplus = vlogf_lanes(one_plus) * (u / select_lanes(exact, zero + 1.0f, rounded));
    softplus = select_lanes(large, raw, select_lanes(exact, u, softplus));
    return vexpf_lanes(-a * softplus);
}

/* Head h's gates of one token: decay[c] = exp(-exp(A_log[h]) · softplus(f[c] + dt_bias[c])) over its D key
 * channels (f, dt_bias at the head's channels), vectorised (a partial last vector padded); returns beta =
 * sigmoid(b). */
static SHARED_STEP float kda_gates(const float *f, const float *dt_bias, float A_log, float b_raw, float *decay,
                                   int64_t D) {
    const float a = expf(A_log);
    for (int64_t c = 0; c < D; c += LANES) {
        const int64_t n = D - c < LANES ? D - c : LANES;
        vf raw = {0}, out;
        for (int64_t i = 0; i < n; ++i) raw[i] = f[c + i] + dt_bias[c + i];
        out = decay_lanes(raw, a);
        memcpy(decay + c, &out, n * sizeof(float));
    }
    return 1.0f / (1.0f + expf(-b_raw));
}

/* One token through one head's state S [D, D]: Sᵀk of the decayed state, the correction, then the update and the
 * output in one more pass, KDA_COLUMNS columns at a time (columns are independent). */
static SHARED_STEP void kda_head_walk(float *S, const float *q, const float *k, const float *v, const float *decay,
                                      float beta, float *o, int64_t D) {
    float scaled_k[D]; /* k ∘ decay: Sᵀk of the decayed state without decaying it first */
    for (int64_t i = 0; i < D; ++i) scaled_k[i] = k[i] * decay[i];
    for (int64_t j0 = 0; j0 < D; j0 += KDA_COLUMNS) {
        const int64_t nc = D - j0 < KDA_COLUMNS ? D - j0 : KDA_COLUMNS;
        float delta[KDA_COLUMNS], acc[KDA_COLUMNS];
        for (int64_t j = 0; j < nc; ++j) delta[j] = 0.0f;
        for (int64_t i = 0; i < D; ++i) {
            const float *row = S + i * D + j0;
            const float ki = scaled_k[i];
#pragma omp simd
            for (int64_t j = 0; j < nc; ++j) delta[j] += row[j] * ki;
        }
        for (int64_t j = 0; j < nc; ++j) {
            delta[j] = (v[j0 + j] - delta[j]) * beta;
            acc[j] = 0.0f;
        }
        for (int64_t i = 0; i < D; ++i) {
            float *row = S + i * D + j0;
            const float di = decay[i], ki = k[i], qi = q[i];
#pragma omp simd
            for (int64_t j = 0; j < nc; ++j) {
                const float s = row[j] * di + ki * delta[j];
                row[j] = s;
                acc[j] += s * qi;
            }
        }
        memcpy(o + j0, acc, nc * sizeof(float));
    }
}

/* o ← norm_w · rmsnorm(o) · sigmoid(gate) over one head's D channels, in place. */
static SHARED_STEP void kda_head_norm(float *o, const float *gate, const float *norm_w, float eps, int64_t D) {
    float sq = 0.0f;
#pragma omp simd reduction(+ : sq)
    for (int64_t j = 0; j < D; ++j) sq += o[j] * o[j];
    const float scale = 1.0f / sqrtf(sq / (float)D + eps);
    for (int64_t j = 0; j < D; ++j) o[j] = norm_w[j] * (o[j] * scale) / (1.0f + expf(-gate[j]));
}

/* One token of head h: gates from its proj row p and f row, then the walk of S; o receives Sᵀq (D values). */
static inline void kda_token(float *S, const float *qkv, const float *p, const float *f, const float *dt_bias,
                             const float *A_log, int64_t h, int64_t H, int64_t D, float *o) {
    const int64_t HD = H * D;
    float decay[D];
    const float beta = kda_gates(f + h * D, dt_bias + h * D, A_log[h], p[3 * HD + 2 * D + h], decay, D);
    kda_head_walk(S, qkv + h * D, qkv + HD + h * D, qkv + 2 * HD + h * D, decay, beta, o, D);
}

void kda_decode_step(const float *proj, const float *f, const float *gate, float *conv_state, const float *conv_w,
                     const float *dt_bias, const float *A_log, float *delta_state, const float *norm_w, float eps,
                     float *qkv, float *out, int64_t b, int64_t H, int64_t D, int64_t W, int num_threads) {
    const int64_t HD = H * D, Cd = 3 * HD, row_len = Cd + 2 * D + H;
#pragma omp parallel num_threads(num_threads)
    {
        /* 1. Causal conv over the window [state, new input], shift the window; silu and the l2 norms. */
        conv_rows(conv_state, conv_w, NULL, proj, row_len, 0, qkv, 0, 1, NULL, b, Cd, W, 1);
#pragma omp for schedule(static)
        for (int64_t bi = 0; bi < b; ++bi) kda_activate(qkv + bi * Cd, H, D);
        /* 2. The delta rule per (row, head), then the gated norm of its output. */
#pragma omp for schedule(static)
        for (int64_t bh = 0; bh < b * H; ++bh) {
            const int64_t bi = bh / H, h = bh % H;
            kda_token(delta_state + bh * D * D, qkv + bi * Cd, proj + bi * row_len, f + bi * HD, dt_bias, A_log, h, H,
                      D, out + bh * D);
            kda_head_norm(out + bh * D, gate + bi * HD + h * D, norm_w, eps, D);
        }
    }
}

/* Speculative verification: l tokens per row from the states in place, which are read and left as they are (the
 * keep below advances them once the accepted count is known). proj, f, gate, out, qkv are token-major [l, b, ·].
 * Each (row, head) walks its l tokens on a copy of its state; outputs are bit for bit those of l decode steps. */
void kda_verify(const float *proj, const float *f, const float *gate, const float *conv_state, const float *conv_w,
                const float *dt_bias, const float *A_log, const float *delta_state, const float *norm_w, float eps,
                float *qkv, float *out, int64_t b, int64_t l, int64_t H, int64_t D, int64_t W, int num_threads) {
    const int64_t HD = H * D, Cd = 3 * HD, row_len = Cd + 2 * D + H;
#pragma omp parallel num_threads(num_threads)
    {
        conv_rows((float *)conv_state, conv_w, NULL, proj, row_len, b * row_len, qkv, b * Cd, l, NULL, b, Cd, W, 0);
#pragma omp for schedule(static)
        for (int64_t r = 0; r < l * b; ++r) kda_activate(qkv + r * Cd, H, D);
        float *state = malloc(D * D * sizeof(float));
#pragma omp for schedule(static)
        for (int64_t bh = 0; bh < b * H; ++bh) {
            const int64_t bi = bh / H, h = bh % H;
            memcpy(state, delta_state + bh * D * D, D * D * sizeof(float));
            for (int64_t t = 0; t < l; ++t) {
                const int64_t r = t * b + bi;
                float *o = out + (r * H + h) * D;
                kda_token(state, qkv + r * Cd, proj + r * row_len, f + r * HD, dt_bias, A_log, h, H, D, o);
                kda_head_norm(o, gate + r * HD + h * D, norm_w, eps, D);
            }
        }
        free(state);
    }
}

/* After `kda_verify`: row r advances its conv window and delta-rule state, in place, by its first accepted[r]
 * tokens of proj and f [l, b, ·] — the states accepted[r] decode steps would leave, bit for bit. qkv [l, b, Cd] is
 * scratch. */
void kda_keep(const float *proj, const float *f, float *conv_state, const float *conv_w, const float *dt_bias,
              const float *A_log, float *delta_state, float *qkv, const int64_t *accepted, int64_t b, int64_t l,
              int64_t H, int64_t D, int64_t W, int num_threads) {
    const int64_t HD = H * D, Cd = 3 * HD, row_len = Cd + 2 * D + H;
#pragma omp parallel num_threads(num_threads)
    {
        conv_rows(conv_state, conv_w, NULL, proj, row_len, b * row_len, qkv, b * Cd, 0, accepted, b, Cd, W, 1);
#pragma omp for schedule(static)
        for (int64_t r = 0; r < l * b; ++r)
            if (r / b < accepted[r % b]) kda_activate(qkv + r * Cd, H, D);
        float *o = malloc(D * sizeof(float)); /* outputs: the verification's */
#pragma omp for schedule(static)
        for (int64_t bh = 0; bh < b * H; ++bh) {
            const int64_t bi = bh / H, h = bh % H;
            for (int64_t t = 0; t < accepted[bi]; ++t) {
                const int64_t r = t * b + bi;
                kda_token(delta_state + bh * D * D, qkv + r * Cd, proj + r * row_len, f + r * HD, dt_bias, A_log, h,
                          H, D, o);
            }
        }
        free(o);
    }
}

/* A row's first n prompt tokens through nc ≤ KDA_COLUMNS columns of one head's state, held contiguous in
 * S [D, KDA_COLUMNS]: kda_head_walk token after token, except that each update pass also accumulates the next
 * token's Sᵀ(k ∘ decay) from the rows it has just written — the same products summed in the same order as that
 * token's own first pass — so the block is read once per token instead of twice, and stays in L1 for the whole
 * prompt. Token t reads q at q + t · Cd (k HD further on), v at v + t · Cd, its decays at decay + t · HD, beta at
 * beta[t · H], and writes its output columns at o + t · HD. */
static inline void kda_block_prompt(float *S, const float *q, const float *v, const float *decay, const float *beta,
                                    float *o, int64_t Cd, int64_t HD, int64_t H, int64_t D, int64_t nc, int64_t n) {
    float scaled_k[D], next_k[D], predicted[KDA_COLUMNS] = {0};
    if (n > 0) {
        for (int64_t i = 0; i < D; ++i) scaled_k[i] = q[HD + i] * decay[i];
        for (int64_t i = 0; i < D; ++i) {
            const float ki = scaled_k[i];
#pragma omp simd
            for (int64_t j = 0; j < nc; ++j) predicted[j] += S[i * KDA_COLUMNS + j] * ki;
        }
    }
    for (int64_t t = 0; t < n; ++t) {
        const float *qt = q + t * Cd, *kt = qt + HD, *dt = decay + t * HD, bt = beta[t * H];
        if (t + 1 < n) /* after the last token the next sums are not used */
            for (int64_t i = 0; i < D; ++i) next_k[i] = kt[Cd + i] * dt[HD + i];
        else
            memcpy(next_k, scaled_k, D * sizeof(float));
        float delta[KDA_COLUMNS], acc[KDA_COLUMNS] = {0}, next[KDA_COLUMNS] = {0};
        for (int64_t j = 0; j < nc; ++j) delta[j] = (v[t * Cd + j] - predicted[j]) * bt;
        for (int64_t i = 0; i < D; ++i) {
            float *row = S + i * KDA_COLUMNS;
            const float di = dt[i], ki = kt[i], qi = qt[i], ni = next_k[i];
#pragma omp simd
            for (int64_t j = 0; j < nc; ++j) {
                const float s = row[j] * di + ki * delta[j];
                row[j] = s;
                acc[j] += s * qi;
                next[j] += s * ni;
            }
        }
        memcpy(o + t * HD, acc, nc * sizeof(float));
        memcpy(predicted, next, nc * sizeof(float));
        memcpy(scaled_k, next_k, D * sizeof(float));
    }
}

/* A prompt (or the next chunk of one): proj [b, l, ·], f and gate [b, l, HD] (rows right-padded, row r has
 * num_tokens[r] valid tokens), continuing initial_conv [b, Cd, W-1] and initial_delta [b, H, D, D] (zeros where
 * NULL) → out [b, l, HD] (0 at padding), the states after each row's last valid token into conv_state and
 * delta_state, and the activated conv output into qkv [b, l, Cd] (0 at padding). The decode step's recurrence token
 * after token, walked per (row, head, block of KDA_COLUMNS state columns) so that the block stays in cache for the
 * whole prompt: no chunked-scan passes, no Python loop. */
void kda_prefill(const float *proj, const float *f, const float *gate, const int64_t *num_tokens, const float *conv_w,
                 const float *dt_bias, const float *A_log, const float *norm_w, float eps, const float *initial_conv,
                 const float *initial_delta, float *qkv, float *conv_state, float *delta_state, float *out, int64_t b,
                 int64_t l, int64_t H, int64_t D, int64_t W, int num_threads) {
    const int64_t HD = H * D, Cd = 3 * HD, row_len = Cd + 2 * D + H;
    const int64_t blocks = (Cd + CONV_BLOCK - 1) / CONV_BLOCK, column_blocks = (D + KDA_COLUMNS - 1) / KDA_COLUMNS;
    float *decay = malloc((b * l * (HD + H) + 1) * sizeof(float)), *beta = decay + b * l * HD;
#pragma omp parallel num_threads(num_threads)
    {
        /* 1. The conv per (row, channel block) over the row's valid tokens from its initial window, which is left
         * advanced in conv_state; padding gets 0. Then silu, the l2 norms, and the gates of every valid token. */
#pragma omp for schedule(static)
        for (int64_t item = 0; item < b * blocks; ++item) {
            const int64_t bi = item / blocks, c = item % blocks * CONV_BLOCK;
            const int64_t channels = Cd - c < CONV_BLOCK ? Cd - c : CONV_BLOCK, n = num_tokens[bi];
            float *window = conv_state + (bi * Cd + c) * (W - 1);
            for (int64_t i = 0; i < channels * (W - 1); ++i)
                window[i] = initial_conv ? initial_conv[(bi * Cd + c) * (W - 1) + i] : 0.0f;
            conv_block_steps(window, conv_w + c * W, NULL, proj + bi * l * row_len + c, row_len, qkv + bi * l * Cd + c,
                             Cd, n, channels, W, 1);
            for (int64_t t = n; t < l; ++t) memset(qkv + (bi * l + t) * Cd + c, 0, channels * sizeof(float));
        }
#pragma omp for schedule(static)
        for (int64_t bt = 0; bt < b * l; ++bt) {
            if (bt % l >= num_tokens[bt / l]) continue;
            kda_activate(qkv + bt * Cd, H, D);
            for (int64_t h = 0; h < H; ++h)
                beta[bt * H + h] = kda_gates(f + bt * HD + h * D, dt_bias + h * D, A_log[h],
                                             proj[bt * row_len + Cd + 2 * D + h], decay + bt * HD + h * D, D);
        }
        /* 2. The delta rule per (row, head, column block) over the row's valid tokens, in a contiguous copy of the
         * block (rows D floats apart in place would share L1 sets), from the initial state (zeros without one). */
        float *S = malloc(D * KDA_COLUMNS * sizeof(float));
#pragma omp for schedule(static)
        for (int64_t item = 0; item < b * H * column_blocks; ++item) {
            const int64_t bh = item / column_blocks, bi = bh / H, h = bh % H, j0 = item % column_blocks * KDA_COLUMNS;
            const int64_t nc = D - j0 < KDA_COLUMNS ? D - j0 : KDA_COLUMNS, bt = bi * l;
            float *state = delta_state + bh * D * D + j0;
            for (int64_t i = 0; i < D; ++i)
                for (int64_t j = 0; j < nc; ++j)
                    S[i * KDA_COLUMNS + j] = initial_delta ? initial_delta[bh * D * D + i * D + j0 + j] : 0.0f;
            const float *q = qkv + bt * Cd + h * D, *v = qkv + bt * Cd + 2 * HD + h * D + j0;
            float *o = out + bt * HD + h * D + j0;
            if (nc == KDA_COLUMNS) /* the full width as a constant: the column loops vectorise whole */
                kda_block_prompt(S, q, v, decay + bt * HD + h * D, beta + bt * H + h, o, Cd, HD, H, D, KDA_COLUMNS,
                                 num_tokens[bi]);
            else
                kda_block_prompt(S, q, v, decay + bt * HD + h * D, beta + bt * H + h, o, Cd, HD, H, D, nc,
                                 num_tokens[bi]);
            for (int64_t i = 0; i < D; ++i) memcpy(state + i * D, S + i * KDA_COLUMNS, nc * sizeof(float));
        }
        free(S);
        /* 3. The gated norm per (token, head); 0 at padding. */
#pragma omp for schedule(static)
        for (int64_t bth = 0; bth < b * l * H; ++bth) {
            const int64_t bt = bth / H, h = bth % H;
            if (bt % l < num_tokens[bt / l])
                kda_head_norm(out + bth * D, gate + bt * HD + h * D, norm_w, eps, D);
            else
                memset(out + bth * D, 0, D * sizeof(float));
        }
    }
    free(decay);
}

/* A decode plan's KDA record (decode_plan.c): a = proj, f, gate, conv windows, conv weight, dt_bias, A_log,
 * delta-rule states, norm weight, qkv scratch, out, b, H, D, W, l; f[0] = eps. `verify`: l tokens per row,
 * token-major, states left as they are; else one token per row, states advanced. */
#define A_F32(i) ((float *)a[i])
void kda_plan_step(const int64_t *a, const double *f, int verify, int num_threads) {
    if (verify)
        kda_verify(A_F32(0), A_F32(1), A_F32(2), A_F32(3), A_F32(4), A_F32(5), A_F32(6), A_F32(7), A_F32(8),
                   (float)f[0], A_F32(9), A_F32(10), a[11], a[15], a[12], a[13], a[14], num_threads);
    else
        kda_decode_step(A_F32(0), A_F32(1), A_F32(2), A_F32(3), A_F32(4), A_F32(5), A_F32(6), A_F32(7), A_F32(8),
                        (float)f[0], A_F32(9), A_F32(10), a[11], a[12], a[13], a[14], num_threads);
}

/* A decode plan's KDA shift record: a = kept proj [l, b, ·], kept f [l, b, HD], conv windows, conv weight, dt_bias,
 * A_log, delta-rule states, qkv scratch, b, H, D, W, l. 1 (nothing done) when an accepted count is outside 1 … l. */
int64_t kda_plan_shift(const int64_t *a, const int64_t *accepted, int num_threads) {
    for (int64_t r = 0; r < a[8]; ++r)
        if (accepted[r] < 1 || accepted[r] > a[12]) return 1;
    kda_keep(A_F32(0), A_F32(1), A_F32(2), A_F32(3), A_F32(4), A_F32(5), A_F32(6), A_F32(7), accepted, a[8], a[12],
             a[9], a[10], a[11], num_threads);
    return 0;
}
#undef A_F32
