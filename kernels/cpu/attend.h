/* Decode attention of one sequence's query heads over its paged KV, online softmax, the pages read
 * in place (`attend`, `attend_bf16`): the paged decode kernel's (attention.c) and the decoder layer's
 * (decode_layer.c). Layouts: attention.c's header. */
#ifndef TANDEM_CPU_ATTEND_H
#define TANDEM_CPU_ATTEND_H

#include "numerics.h"

#define MAX_HEADS 128
#define MAX_HEAD_DIM 256
#define MAX_HEAD_FLOATS 32768 /* heads x head_dim of one work item: its accumulator, on the stack */
#define BLOCK 32

/* Row `index` (in elements) of a K or V cache as float32: in place, or (bf16) widened into `tmp`. */
static inline const float *kv_row(const void *cache, int64_t index, int64_t D, int bf16, float *tmp) {
    if (!bf16) return (const float *)cache + index;
    const uint16_t *row = (const uint16_t *)cache + index;
#pragma omp simd
    for (int64_t d = 0; d < D; d++) tmp[d] = bf16_to_f32(row[d]);
    return tmp;
}

/* Query heads [kh0 * group, kh1 * group) of sequence b over its positions [0, len): the K/V heads
 * [kh0, kh1) of each slot lie side by side, so a block's rows are read front to back, once. K/V
 * float32, or bfloat16 (`bf16`: the output rounded to bf16, as HF's bf16 attention returns it). */
static inline __attribute__((always_inline)) void attend_impl(
    const float *q, const void *k, const void *v, const int64_t *pages, int64_t len, float *out, int64_t kh0,
    int64_t kh1, int64_t group, int64_t D, int64_t row_stride, int64_t page_size, float scale, int bf16) {
    const int64_t h0 = kh0 * group, num = (kh1 - kh0) * group; /* query heads [h0, h0 + num) */
    float acc[MAX_HEAD_FLOATS];
    float m[MAX_HEADS], l[MAX_HEADS], s[MAX_HEADS][BLOCK], tmp[MAX_HEAD_DIM];
    int64_t slot[BLOCK];
    for (int64_t h = 0; h < num; h++) {
        m[h] = -INFINITY;
        l[h] = 0.0f;
    }
    memset(acc, 0, sizeof(float) * num * D);
    for (int64_t p0 = 0; p0 < len; p0 += BLOCK) {
        const int64_t n = len - p0 < BLOCK ? len - p0 : BLOCK;
        for (int64_t j = 0; j < n; j++) slot[j] = pages[(p0 + j) / page_size] * page_size + (p0 + j) % page_size;
        for (int64_t j = 0; j < n; j++) {
            for (int64_t kh = kh0; kh < kh1; kh++) {
                const float *kr = kv_row(k, slot[j] * row_stride + kh * D, D, bf16, tmp);
                for (int64_t g = 0; g < group; g++) {
                    const int64_t h = (kh - kh0) * group + g;
                    const float *qr = q + (h0 + h) * D;
                    s[h][j] = dot_fixed(qr, kr, D) * scale;
                }
            }
        }
        for (int64_t h = 0; h < num; h++) {
            float block_max = s[h][0];
            for (int64_t j = 1; j < n; j++) block_max = s[h][j] > block_max ? s[h][j] : block_max;
            const float new_max = block_max > m[h] ? block_max : m[h];
            const float keep = m[h] == -INFINITY ? 0.0f : exp_nonpositive(m[h] - new_max);
#pragma omp simd
            for (int64_t j = 0; j < n; j++) s[h][j] = exp_nonpositive(s[h][j] - new_max);
            l[h] = l[h] * keep + sum_fixed(s[h], n);
            m[h] = new_max;
            if (keep != 1.0f) {
                float *a = acc + h * D;
#pragma omp simd
                for (int64_t d = 0; d < D; d++) a[d] *= keep;
            }
        }
        for (int64_t j = 0; j < n; j++) {
            for (int64_t kh = kh0; kh < kh1; kh++) {
                const float *vr = kv_row(v, slot[j] * row_stride + kh * D, D, bf16, tmp);
                for (int64_t g = 0; g < group; g++) {
                    const int64_t h = (kh - kh0) * group + g;
                    const float p = s[h][j];
                    float *a = acc + h * D;
#pragma omp simd
                    for (int64_t d = 0; d < D; d++) a[d] += p * vr[d];
                }
            }
        }
    }
    for (int64_t h = 0; h < num; h++) {
        const float inv = l[h] > 0.0f ? 1.0f / l[h] : 0.0f; /* no positions: zeros */
        float *o = out + (h0 + h) * D;
        const float *a = acc + h * D;
#pragma omp simd
        for (int64_t d = 0; d < D; d++) o[d] = bf16 ? rb(a[d] * inv) : a[d] * inv;
    }
}

static inline void attend(const float *q, const float *k, const float *v, const int64_t *pages, int64_t len,
                          float *out, int64_t kh0, int64_t kh1, int64_t group, int64_t D, int64_t row_stride,
                          int64_t page_size, float scale) {
    attend_impl(q, k, v, pages, len, out, kh0, kh1, group, D, row_stride, page_size, scale, 0);
}

static inline void attend_bf16(const float *q, const uint16_t *k, const uint16_t *v, const int64_t *pages,
                               int64_t len, float *out, int64_t kh0, int64_t kh1, int64_t group, int64_t D,
                               int64_t row_stride, int64_t page_size, float scale) {
    attend_impl(q, k, v, pages, len, out, kh0, kh1, group, D, row_stride, page_size, scale, 1);
}

#endif
