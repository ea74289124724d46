/* A whole decoder layer for decode tokens, one per sequence (`tandem_decode_layer`): norms, the
 * qkv / o / gate-up / down products (matvec.h), rotary, the K/V write and attention (attend.h) on one
 * OpenMP team, float32 or with bfloat16 weights and KV (`bf16`: widened to float32 in registers,
 * every value rounded to bf16 where HF's bfloat16 model rounds it, so the two compute the same
 * numbers up to the order of sums). Driven by kernels/cpu/decode_layer.py. */
#include "attend.h"
#include "matvec.h"

/* out = x / rms(x) * weight (HF LlamaRMSNorm: float32; bf16 rounds the normalised x, then the product). */
static inline __attribute__((always_inline)) void rms_norm(const float *x, const float *weight, float *out, int64_t n,
                                                           float eps, int bf16) {
    const float sq = dot_fixed(x, x, n);
    const float inv = 1.0f / sqrtf(sq / (float)n + eps);
    for (int64_t i = 0; i < n; i++) out[i] = bf16 ? rb(rb(x[i] * inv) * weight[i]) : x[i] * inv * weight[i];
}

/* HF rotate-half rotary of `heads` heads of size D in place; signed_sin's first half carries the
 * minus sign of rotate_half(x) = [-x2, x1]. bf16: each product and the sum rounded, as HF's. */
static inline __attribute__((always_inline)) void rotate(float *x, int64_t heads, int64_t D, const float *cos,
                                                         const float *signed_sin, int bf16) {
    const int64_t half = D / 2;
    for (int64_t h = 0; h < heads; h++) {
        float *r = x + h * D;
        for (int64_t i = 0; i < half; i++) {
            const float a = r[i], b = r[i + half];
            if (bf16) {
                r[i] = rb(rb(a * cos[i]) + rb(b * signed_sin[i]));
                r[i + half] = rb(rb(b * cos[i + half]) + rb(a * signed_sin[i + half]));
            } else {
                r[i] = a * cos[i] + b * signed_sin[i];
                r[i + half] = b * cos[i + half] + a * signed_sin[i + half];
            }
        }
    }
}

/* The K/V heads of one token into its cache slot: float32 rows, or bf16 rows (values already bf16's). */
static inline void store_kv(void *cache, int64_t slot, const float *t, int64_t n, int bf16) {
    if (!bf16) {
        memcpy((float *)cache + slot * n, t, sizeof(float) * n);
        return;
    }
    uint16_t *row = (uint16_t *)cache + slot * n;
    for (int64_t i = 0; i < n; i++) row[i] = f32_to_bf16(t[i]);
}

/* Scratch floats tandem_decode_layer needs for `rows` tokens. */
int64_t tandem_decode_layer_scratch(int64_t rows, int64_t hidden, int64_t num_heads, int64_t num_kv_heads,
                                    int64_t head_dim, int64_t inter) {
    const int64_t q_dim = num_heads * head_dim, widest = hidden > q_dim ? (hidden > inter ? hidden : inter)
                                                                       : (q_dim > inter ? q_dim : inter);
    return rows * (hidden + (num_heads + 2 * num_kv_heads) * head_dim + q_dim + 3 * inter + widest);
}

static inline __attribute__((always_inline)) void decode_layer(
    int64_t rows, float *x, int64_t hidden, float eps, const float *in_norm, const void *qkv_w,
    const float *qkv_bias, const void *o_w, const float *o_bias, const float *post_norm, const void *gate_up_w,
    const void *down_w, int64_t inter, const float *cos, const float *signed_sin, void *k_cache, void *v_cache,
    const int64_t *page_table, int64_t pt_stride, const int64_t *seq_len, const int64_t *slot, int64_t num_heads,
    int64_t num_kv_heads, int64_t head_dim, int64_t page_size, float scale, float *scratch, int bf16) {
    const int64_t D = head_dim, q_dim = num_heads * D, kv_dim = num_kv_heads * D, qkv_rows = q_dim + 2 * kv_dim;
    float *normed = scratch, *qkv = normed + rows * hidden, *attn = qkv + rows * qkv_rows;
    float *gate_up = attn + rows * q_dim, *act = gate_up + rows * 2 * inter, *paired = act + rows * inter;
#pragma omp parallel
    {
#pragma omp for schedule(static)
        for (int64_t b = 0; b < rows; b++) rms_norm(x + b * hidden, in_norm, normed + b * hidden, hidden, eps, bf16);
        matvec(qkv_w, qkv_bias, normed, hidden, qkv, qkv_rows, rows, qkv_rows, hidden, 0, bf16, paired);
#pragma omp for schedule(static)
        for (int64_t b = 0; b < rows; b++) {
            float *t = qkv + b * qkv_rows;
            rotate(t, num_heads + num_kv_heads, D, cos + b * D, signed_sin + b * D, bf16);
            store_kv(k_cache, slot[b], t + q_dim, kv_dim, bf16);
            store_kv(v_cache, slot[b], t + q_dim + kv_dim, kv_dim, bf16);
        }
#pragma omp for collapse(2) schedule(static)
        for (int64_t b = 0; b < rows; b++)
            for (int64_t kh = 0; kh < num_kv_heads; kh++) {
                const float *q = qkv + b * qkv_rows;
                const int64_t *pages = page_table + b * pt_stride, group = num_heads / num_kv_heads;
                if (bf16)
                    attend_bf16(q, k_cache, v_cache, pages, seq_len[b], attn + b * q_dim, kh, kh + 1, group, D, kv_dim,
                                page_size, scale);
                else
                    attend(q, k_cache, v_cache, pages, seq_len[b], attn + b * q_dim, kh, kh + 1, group, D, kv_dim,
                           page_size, scale);
            }
        matvec(o_w, o_bias, attn, q_dim, x, hidden, rows, hidden, q_dim, 1, bf16, paired);
#pragma omp for schedule(static)
        for (int64_t b = 0; b < rows; b++) rms_norm(x + b * hidden, post_norm, normed + b * hidden, hidden, eps, bf16);
        matvec(gate_up_w, NULL, normed, hidden, gate_up, 2 * inter, rows, 2 * inter, hidden, 0, bf16, paired);
#pragma omp for collapse(2) schedule(static)
        for (int64_t b = 0; b < rows; b++)
            for (int64_t i = 0; i < inter; i++) {
                const float g = gate_up[b * 2 * inter + i], up = gate_up[b * 2 * inter + inter + i];
                const float silu = g / (1.0f + expf(-g));
                act[b * inter + i] = bf16 ? rb(rb(silu) * up) : silu * up;
            }
        matvec(down_w, NULL, act, inter, x, hidden, rows, hidden, inter, 1, bf16, paired);
    }
}

/* x [rows, hidden] <- decoder layer(x), in place, for one new token of each of `rows` sequences:
 * row b's K/V written to slot slot[b], its attention over positions [0, seq_len[b]) of its pages
 * page_table[b] (rows pt_stride apart). cos, signed_sin [rows, D]. Matrices row-major as HF stores
 * them (qkv [(H + 2 KVH) D, hidden] with q, k, v stacked; gate_up [2 inter, hidden]), float32, or with
 * `bf16` bfloat16 like the K/V cache (x, norms, biases, cos and sin float32 always: under bf16 they
 * hold bf16 values); qkv_bias and o_bias may be NULL. Lengths and slots are read here, not by the
 * caller (no host sync). */
void tandem_decode_layer(int64_t rows, float *x, int64_t hidden, float eps, const float *in_norm, const void *qkv_w,
                         const float *qkv_bias, const void *o_w, const float *o_bias, const float *post_norm,
                         const void *gate_up_w, const void *down_w, int64_t inter, const float *cos,
                         const float *signed_sin, void *k_cache, void *v_cache, const int64_t *page_table,
                         int64_t pt_stride, const int64_t *seq_len, const int64_t *slot, int64_t num_heads,
                         int64_t num_kv_heads, int64_t head_dim, int64_t page_size, float scale, float *scratch,
                         int bf16) {
    if (bf16)
        decode_layer(rows, x, hidden, eps, in_norm, qkv_w, qkv_bias, o_w, o_bias, post_norm, gate_up_w, down_w, inter,
                     cos, signed_sin, k_cache, v_cache, page_table, pt_stride, seq_len, slot, num_heads, num_kv_heads,
                     head_dim, page_size, scale, scratch, 1);
    else
        decode_layer(rows, x, hidden, eps, in_norm, qkv_w, qkv_bias, o_w, o_bias, post_norm, gate_up_w, down_w, inter,
                     cos, signed_sin, k_cache, v_cache, page_table, pt_stride, seq_len, slot, num_heads, num_kv_heads,
                     head_dim, page_size, scale, scratch, 0);
}
