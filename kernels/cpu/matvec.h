/* Matrix-vector products over row-major float32 or bfloat16 weights on the caller's OpenMP team
 * (`matvec`): the decoder layer's (decode_layer.c) and the linear kernel's (linear.c). */
#ifndef TANDEM_CPU_MATVEC_H
#define TANDEM_CPU_MATVEC_H

#include "numerics.h"

#if defined(__AVX2__) && defined(__FMA__)
/* The four lanes' sums of a0..a3 into out[0..3]. */
static inline void sum4(__m256 a0, __m256 a1, __m256 a2, __m256 a3, float *out) {
    const __m256 sum = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(sum), _mm256_extractf128_ps(sum, 1)));
}

/* Sixteen bf16 weights w[0..15] as float32: the even ones (a shift into each 32-bit lane's top half)
 * and the odd ones (the lane with its low half cleared); the X they multiply is paired to match. */
static inline void load_w16(const uint16_t *w, __m256 *even, __m256 *odd) {
    const __m256i v = _mm256_loadu_si256((const __m256i *)w);
    *even = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
    *odd = _mm256_and_ps(_mm256_castsi256_ps(v), _mm256_castsi256_ps(_mm256_set1_epi32((int)0xffff0000u)));
}

/* *a += w[0..15] . (xe, xo): sixteen bf16 weights against one row of X's paired block. */
static inline void fma_w16(const uint16_t *w, __m256 xe, __m256 xo, __m256 *a) {
    __m256 even, odd;
    load_w16(w, &even, &odd);
    *a = _mm256_fmadd_ps(odd, xo, _mm256_fmadd_ps(even, xe, *a));
}

/* fma_w16 against two rows of X (into *a and *b), the weights loaded once. */
static inline void fma2_w16(const uint16_t *w, __m256 xe, __m256 xo, __m256 te, __m256 to, __m256 *a, __m256 *b) {
    __m256 even, odd;
    load_w16(w, &even, &odd);
    *a = _mm256_fmadd_ps(odd, xo, _mm256_fmadd_ps(even, xe, *a));
    *b = _mm256_fmadd_ps(odd, to, _mm256_fmadd_ps(even, te, *b));
}

/* *a += w[0..7] * x, *b += w[0..7] * t: eight float32 weights against two rows of X. */
static inline void fma2_w8(const float *w, __m256 x, __m256 t, __m256 *a, __m256 *b) {
    const __m256 wv = _mm256_loadu_ps(w);
    *a = _mm256_fmadd_ps(wv, x, *a);
    *b = _mm256_fmadd_ps(wv, t, *b);
}
#endif

#define M_BLOCK 32 /* rows of X a pass over the weight takes (their rows stay in L2 while it streams) */
#define PAIRED 16 /* a bf16 product's X is stored in blocks of 16: its 8 even elements, then its 8 odd ones */

/* Rows m < M of X (ldx apart) into `paired` [M, K], each block of 16 as load_w16 multiplies it (the
 * last K % 16 elements in place). On the team: call inside a parallel region, then read after. */
static inline void pair_rows(const float *x, int64_t ldx, float *paired, int64_t M, int64_t K) {
#pragma omp for schedule(static)
    for (int64_t m = 0; m < M; m++) {
        const float *src = x + m * ldx;
        float *dst = paired + m * K;
        int64_t k = 0;
        for (; k + PAIRED <= K; k += PAIRED)
            for (int64_t j = 0; j < PAIRED / 2; j++) {
                dst[k + j] = src[k + 2 * j];
                dst[k + PAIRED / 2 + j] = src[k + 2 * j + 1];
            }
        for (; k < K; k++) dst[k] = src[k];
    }
}

static inline float load_w1(const void *w, int64_t i, int bf16) {
    return bf16 ? bf16_to_f32(((const uint16_t *)w)[i]) : ((const float *)w)[i];
}

/* Y[m, r] = W[r, :] . X[m, :] + bias[r] (bias may be NULL) for rows m < M of X and rows r < N of
 * row-major W [N, K], float32 or (bf16) bfloat16 against X in pair_rows' order; `accumulate`:
 * Y[m, r] += that instead. bf16 rounds as HF's bf16 model does: the product (with its bias) to bf16,
 * then the sum with Y. Split over the team by weight rows (call inside a parallel region): four
 * weight rows a pass against two rows of X at a time, so the weight streams from memory once per
 * M_BLOCK rows of X and every row of X after the first two finds those four weight rows in L1. A
 * row of Y is summed in the same order whatever M is and whichever rows share it (batch-invariant). */
static inline __attribute__((always_inline)) void matvec_impl(const void *w, const float *bias, const float *x,
                                                             int64_t ldx, float *y, int64_t ldy, int64_t M,
                                                             int64_t N, int64_t K, int accumulate, int bf16) {
    for (int64_t m0 = 0; m0 < M; m0 += M_BLOCK)
#pragma omp for schedule(static) nowait
    for (int64_t r = 0; r < N; r += 4) {
        const int64_t n = N - r < 4 ? N - r : 4, m1 = M - m0 < M_BLOCK ? M : m0 + M_BLOCK;
        for (int64_t m = m0; m < m1; m += 2) {
            const int64_t pair = m1 - m < 2 ? 1 : 2;
            const float *x0 = x + m * ldx, *x1 = x0 + (pair - 1) * ldx;
            float dot[2][4] = {{0.0f, 0.0f, 0.0f, 0.0f}, {0.0f, 0.0f, 0.0f, 0.0f}};
            int64_t k0 = 0;
#if defined(__AVX2__) && defined(__FMA__)
            if (n == 4 && bf16) { /* 16 weights of each row a step, as even and odd halves */
                const uint16_t *w0 = (const uint16_t *)w + r * K, *w1 = w0 + K, *w2 = w1 + K, *w3 = w2 + K;
                __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
                for (; pair == 1 && k0 + PAIRED <= K; k0 += PAIRED) { /* one row of X, summed as two are */
                    const __m256 ue = _mm256_loadu_ps(x0 + k0), uo = _mm256_loadu_ps(x0 + k0 + 8);
                    _mm_prefetch((const char *)(w0 + 4 * K + 4 * k0), _MM_HINT_T0); /* the next 4 rows */
                    _mm_prefetch((const char *)(w0 + 4 * K + 4 * k0 + 32), _MM_HINT_T0);
                    fma_w16(w0 + k0, ue, uo, &a0);
                    fma_w16(w1 + k0, ue, uo, &a1);
                    fma_w16(w2 + k0, ue, uo, &a2);
                    fma_w16(w3 + k0, ue, uo, &a3);
                }
                for (; k0 + PAIRED <= K; k0 += PAIRED) {
                    const __m256 ue = _mm256_loadu_ps(x0 + k0), uo = _mm256_loadu_ps(x0 + k0 + 8);
                    const __m256 te = _mm256_loadu_ps(x1 + k0), to = _mm256_loadu_ps(x1 + k0 + 8);
                    fma2_w16(w0 + k0, ue, uo, te, to, &a0, &b0);
                    fma2_w16(w1 + k0, ue, uo, te, to, &a1, &b1);
                    fma2_w16(w2 + k0, ue, uo, te, to, &a2, &b2);
                    fma2_w16(w3 + k0, ue, uo, te, to, &a3, &b3);
                }
                sum4(a0, a1, a2, a3, dot[0]);
                sum4(b0, b1, b2, b3, dot[1]);
            } else if (n == 4) { /* float32: 8 weights of each row a step */
                const float *w0 = (const float *)w + r * K, *w1 = w0 + K, *w2 = w1 + K, *w3 = w2 + K;
                __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
                for (; pair == 1 && k0 + 8 <= K; k0 += 8) {
                    const __m256 u = _mm256_loadu_ps(x0 + k0);
                    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w0 + k0), u, a0);
                    a1 = _mm256_fmadd_ps(_mm256_loadu_ps(w1 + k0), u, a1);
                    a2 = _mm256_fmadd_ps(_mm256_loadu_ps(w2 + k0), u, a2);
                    a3 = _mm256_fmadd_ps(_mm256_loadu_ps(w3 + k0), u, a3);
                }
                for (; k0 + 8 <= K; k0 += 8) {
                    const __m256 u = _mm256_loadu_ps(x0 + k0), t = _mm256_loadu_ps(x1 + k0);
                    fma2_w8(w0 + k0, u, t, &a0, &b0);
                    fma2_w8(w1 + k0, u, t, &a1, &b1);
                    fma2_w8(w2 + k0, u, t, &a2, &b2);
                    fma2_w8(w3 + k0, u, t, &a3, &b3);
                }
                sum4(a0, a1, a2, a3, dot[0]);
                sum4(b0, b1, b2, b3, dot[1]);
            }
#endif
            for (int64_t p = 0; p < pair; p++) {
                const float *xm = p ? x1 : x0;
                float *ym = y + (m + p) * ldy + r;
                for (int64_t i = 0; i < n; i++) {
                    float acc = 0.0f;
                    for (int64_t k = (n == 4 ? k0 : 0); k < K; k++) {
                        /* bf16 without the vector loop: X's blocks of 16 are paired, undo it */
                        const int64_t j = bf16 && k0 == 0 && k < K - K % PAIRED
                                              ? k - k % PAIRED + (k % 2) * (PAIRED / 2) + (k % PAIRED) / 2
                                              : k;
                        acc += load_w1(w, (r + i) * K + k, bf16) * xm[j];
                    }
                    float v = dot[p][i] + acc + (bias ? bias[r + i] : 0.0f);
                    if (bf16) v = rb(v);
                    ym[i] = !accumulate ? v : bf16 ? rb(ym[i] + v) : ym[i] + v;
                }
            }
        }
    }
#pragma omp barrier
}

/* matvec_impl on the team, X first paired into `paired` (rows M x K floats) where the weights are bf16. */
static inline __attribute__((always_inline)) void matvec(const void *w, const float *bias, const float *x, int64_t ldx,
                                                         float *y, int64_t ldy, int64_t M, int64_t N, int64_t K,
                                                         int accumulate, int bf16, float *paired) {
    if (bf16) {
        pair_rows(x, ldx, paired, M, K);
        matvec_impl(w, bias, paired, K, y, ldy, M, N, K, accumulate, 1);
    } else {
        matvec_impl(w, bias, x, ldx, y, ldy, M, N, K, accumulate, 0);
    }
}

#endif
