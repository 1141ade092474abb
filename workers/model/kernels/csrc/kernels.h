/* The kernels every file of this library exports, in one place: decode_plan.c calls them, and each defining file
 * includes this header so the compiler checks the definitions against it. All float32, contiguous, row-major. */
#ifndef HYBRIDGEN_KERNELS_H
#define HYBRIDGEN_KERNELS_H

#include <stdint.h>

void linear_panels(const float *x, const float *panels, const float *bias, float *y, int64_t M, int64_t N,
                   int64_t K, int num_threads);
void linear_panels_int8(const float *x, const int8_t *panels, const float *scale, const float *bias, float *y,
                        int64_t M, int64_t N, int64_t K, int num_threads);
void linear_panels_bf16(const float *x, const uint16_t *panels, const float *bias, float *y, int64_t M, int64_t N,
                        int64_t K, int path, int num_threads);
int linear_bf16_path_available(int path);
int64_t linear_bf16_k_align(void);
void linear_panels_w8a8(const float *x, const int8_t *panels, const float *scale, const int32_t *correction,
                        const float *bias, float *y, int64_t M, int64_t N, int64_t K, int64_t G, int path,
                        int num_threads);
int64_t linear_w8a8_paths(void);
void rescore_top_logits(const float *x, const float *weight, const float *bias, float *logits, int64_t M,
                        int64_t N, int64_t K, int64_t top_k, int num_threads);
void rms_norm(const float *x, const float *weight, float eps, float *out, int64_t rows, int64_t d, int num_threads);
void add_rms_norm(float *hidden, const float *delta, float alpha, const float *weight, float eps, float *out,
                  int64_t rows, int64_t d, int num_threads);
void silu_mul(const float *h, float *out, int64_t rows, int64_t n, int num_threads);
void relu_square(const float *h, float *out, int64_t n, int num_threads);
void sigmoid_mul(const float *x, const float *gate, float *out, int64_t rows, int64_t n, int num_threads);
void mamba2_decode_step(const float *proj, float *conv_state, const float *conv_w, const float *conv_b,
                        const float *dt_bias, const float *A_log, const float *D, float dt_min, float dt_max,
                        float *ssm_state, const float *norm_w, int64_t norm_groups, float eps, float *xbc,
                        float *out, int64_t b, int64_t H, int64_t P, int64_t G, int64_t N, int64_t W,
                        int num_threads);
void mamba2_prefill(const float *proj, const int64_t *num_tokens, const float *conv_w, const float *conv_b,
                    const float *dt_bias, const float *A_log, const float *D, float dt_min, float dt_max,
                    const float *norm_w, int64_t norm_groups, float eps, float *xbc, const float *initial_conv,
                    const float *initial_ssm, float *conv_state, float *ssm_state, float *out, int64_t b, int64_t l,
                    int64_t H, int64_t P, int64_t G, int64_t N, int64_t W, int num_threads);
void mamba2_verify(const float *proj, const float *conv_state, const float *conv_w, const float *conv_b,
                   const float *dt_bias, const float *A_log, const float *D, float dt_min, float dt_max,
                   const float *ssm_state, const float *norm_w, int64_t norm_groups, float eps, float *xbc,
                   float *out, int64_t b, int64_t l, int64_t H, int64_t P, int64_t G, int64_t N, int64_t W,
                   int num_threads);
void mamba2_keep(const float *proj, float *conv_state, const float *conv_w, const float *conv_b,
                 const float *dt_bias, const float *A_log, const float *D, float dt_min, float dt_max,
                 float *ssm_state, float *xbc, const int64_t *accepted, int64_t b, int64_t l, int64_t H, int64_t P,
                 int64_t G, int64_t N, int64_t W, int num_threads);
void gdn_decode_step(const float *proj, float *conv_state, const float *conv_w, const float *dt_bias,
                     const float *A_log, float beta_scale, float *delta_state, const float *norm_w, float eps, float *qkv, float *out,
                     int64_t b, int64_t HK, int64_t HV, int64_t DK, int64_t DV, int64_t W, int num_threads);
void gdn_verify(const float *proj, const float *conv_state, const float *conv_w, const float *dt_bias,
                const float *A_log, float beta_scale, const float *delta_state, const float *norm_w, float eps, float *qkv, float *out,
                int64_t b, int64_t l, int64_t HK, int64_t HV, int64_t DK, int64_t DV, int64_t W, int num_threads);
void gdn_keep(const float *proj, float *conv_state, const float *conv_w, const float *dt_bias, const float *A_log,
              float beta_scale, float *delta_state, float *qkv, const int64_t *accepted, int64_t b, int64_t l, int64_t HK, int64_t HV,
              int64_t DK, int64_t DV, int64_t W, int num_threads);
void gdn_prefill(const float *proj, const int64_t *num_tokens, const float *conv_wt, const float *dt_bias,
                 const float *A_log, float beta_scale, const float *norm_w, float eps, const float *initial_conv,
                 const float *initial_delta, float *qkv, float *conv_state, float *delta_state, float *out, int64_t b,
                 int64_t l, int64_t HK, int64_t HV, int64_t DK, int64_t DV, int64_t W, int num_threads);
void kda_decode_step(const float *proj, const float *f, const float *gate, float *conv_state, const float *conv_w,
                     const float *dt_bias, const float *A_log, float *delta_state, const float *norm_w, float eps,
                     float *qkv, float *out, int64_t b, int64_t H, int64_t D, int64_t W, int num_threads);
void kda_verify(const float *proj, const float *f, const float *gate, const float *conv_state, const float *conv_w,
                const float *dt_bias, const float *A_log, const float *delta_state, const float *norm_w, float eps,
                float *qkv, float *out, int64_t b, int64_t l, int64_t H, int64_t D, int64_t W, int num_threads);
void kda_keep(const float *proj, const float *f, float *conv_state, const float *conv_w, const float *dt_bias,
              const float *A_log, float *delta_state, float *qkv, const int64_t *accepted, int64_t b, int64_t l,
              int64_t H, int64_t D, int64_t W, int num_threads);
void kda_prefill(const float *proj, const float *f, const float *gate, const int64_t *num_tokens, const float *conv_w,
                 const float *dt_bias, const float *A_log, const float *norm_w, float eps, const float *initial_conv,
                 const float *initial_delta, float *qkv, float *conv_state, float *delta_state, float *out, int64_t b,
                 int64_t l, int64_t H, int64_t D, int64_t W, int num_threads);
void mla_attention(const float *q, const float *kv, const float *norm_w, float eps, float *cache,
                   const int64_t *block_tables, int64_t max_blocks, int64_t block_size, const int64_t *slot_ids,
                   const int64_t *positions, const float *kv_b, float scale, float *out, int64_t b, int64_t l,
                   int64_t H, int64_t NOPE, int64_t R, int64_t L, int64_t V, int num_threads);
void kda_plan_step(const int64_t *a, const double *f, int verify, int num_threads);
int64_t kda_plan_shift(const int64_t *a, const int64_t *accepted, int num_threads);
int64_t mla_plan_step(const int64_t *a, const double *f, int num_threads);
void mamba1_conv(const float *proj, float *conv_state, const float *conv_w, const float *conv_b, float *xc, int64_t b,
                 int64_t l, int64_t I, int64_t W, int64_t advance, int num_threads);
void mamba1_norms(float *xdbc, const float *dt_w, const float *b_w, const float *c_w, float eps, float *dt_in,
                  int64_t rows, int64_t R, int64_t N, int num_threads);
void mamba1_ssm(const float *proj, const float *xc, const float *xdbc, const float *dt_raw, const float *A,
                const float *D, float *ssm_state, float *y, int64_t b, int64_t l, int64_t I, int64_t R, int64_t N,
                int64_t in_place, int num_threads);
void mamba1_keep(const float *proj, float *conv_state, const float *conv_w, const float *conv_b, const float *xdbc,
                 const float *dt_raw, const float *A, float *ssm_state, float *xc, const int64_t *accepted, int64_t b,
                 int64_t l, int64_t I, int64_t R, int64_t N, int64_t W, int num_threads);
void mamba1_prefill_conv(const float *proj, const int64_t *num_tokens, const float *conv_w, const float *conv_b,
                         const float *initial_conv, float *conv_state, float *xc, int64_t b, int64_t l, int64_t I,
                         int64_t W, int num_threads);
void mamba1_prefill_scan(const float *proj, const int64_t *num_tokens, const float *xc, const float *xdbc,
                         const float *dt_raw, const float *A, const float *D, const float *initial_ssm,
                         float *ssm_state, float *dt_out, float *y, int64_t b, int64_t l, int64_t I, int64_t R,
                         int64_t N, int num_threads);
void mamba1_state_after(const float *x, const float *dt, const float *B, const float *A, float *ssm_state,
                        const int64_t *num_tokens, int64_t b, int64_t l, int64_t I, int64_t N, int num_threads);
void short_conv_step(const float *proj, float *window, const float *conv_w, const float *conv_b, float *u,
                     float *out, int64_t b, int64_t d, int64_t W, int num_threads);
void short_conv_verify(const float *proj, const float *window, const float *conv_w, const float *conv_b, float *u,
                       float *out, int64_t b, int64_t l, int64_t d, int64_t W, int num_threads);
void short_conv_keep(const float *proj, float *window, const float *conv_w, const float *conv_b, float *u,
                     const int64_t *accepted, int64_t b, int64_t l, int64_t d, int64_t W, int num_threads);
void short_conv_prefill(const float *proj, const int64_t *num_tokens, const float *conv_wt, const float *conv_b,
                        const float *initial, float *u, float *out, float *window, int64_t b, int64_t l, int64_t d,
                        int64_t W, int num_threads);
void attention_verify_window(const float *q, const float *k_new, const float *v_new, float *key_cache,
                             float *value_cache, const int64_t *block_tables, int64_t max_blocks, int64_t block_size,
                             int64_t cache_tokens, const int64_t *slot_ids, const int64_t *positions, float scale,
                             float *out, int64_t b, int64_t l, int64_t H, int64_t KV, int64_t d, int64_t window,
                             int num_threads);
void attention_decode(const float *q, const float *k_new, const float *v_new, float *key_cache, float *value_cache,
                      const int64_t *block_tables, int64_t max_blocks, int64_t block_size, int64_t cache_tokens,
                      const int64_t *slot_ids, const int64_t *positions, float scale, float *out, int64_t b,
                      int64_t H, int64_t KV, int64_t d, int num_threads);
void attention_verify(const float *q, const float *k_new, const float *v_new, float *key_cache, float *value_cache,
                      const int64_t *block_tables, int64_t max_blocks, int64_t block_size, int64_t cache_tokens,
                      const int64_t *slot_ids, const int64_t *positions, float scale, float *out, int64_t b,
                      int64_t l, int64_t H, int64_t KV, int64_t d, int num_threads);
void rope_rows(float *x, const int64_t *positions, const float *inv_freq, int64_t b, int64_t heads, int64_t head_dim,
               int64_t rotary_dim);
int64_t argmax_row(const float *row, int64_t n);
void argmax_rows(const float *x, int64_t *out, int64_t rows, int64_t n, int num_threads);
void logprobs_rows(const float *x, const int64_t *tokens, int64_t rows, int64_t n, int64_t k, float *token_logprobs,
                   int64_t *top_ids, float *top_logprobs, int num_threads);
int64_t moe_route(const float *logits, float *weights, int64_t *ids, int64_t t, int64_t E, int64_t k, int64_t kind,
                  int64_t norm, int64_t groups, int64_t topk_groups, const float *bias, float scaling, float eps);
int64_t moe_experts(const float *x, const float *weights, const int64_t *ids, float *out, int64_t t, int64_t k,
                    int64_t E, int64_t width, int64_t inter, int64_t activation, int64_t format, int64_t path,
                    const void *up, const float *up_scale, int64_t up_stride, const void *down,
                    const float *down_scale, int64_t down_stride, int num_threads);
void moe_combine(const float *routed, const float *shared, const float *gate, float *out, int64_t rows, int64_t d);
int64_t linear_panel_width(void);
const char *kernel_isa(void);
void flush_denormals_on_threads(int num_threads);
void gelu_mul(const float *h, float *out, int64_t rows, int64_t n, int num_threads);
void add_rows(const float *x, const float *y, float *out, int64_t n, int num_threads);

#endif
