/* Decode attention over paged float32 KV on a CPU: one query token per sequence, every query head of
 * a GQA group at once, the K/V pages read in place (no gather copy), softmax online in fp32.
 * Built and loaded at run time by kernels/attention/cpu_native.py (see its docstring); threads are
 * the caller's OpenMP team (torch's, whose libgomp the process has already loaded).
 *
 * Layouts (row-major):
 *   q          [B, H, D]  rows q_row_stride floats apart, heads D apart
 *   k, v       [num_pages, page_size, KVH, D]
 *   page_table [B, *]     rows pt_stride apart; position p of sequence b is in page
 *                         page_table[b][p / page_size] at slot p % page_size
 *   seq_lens   [B]        positions [0, seq_lens[b]) are attended (at least 1)
 *   out        [B, H, D]  contiguous
 * Query head h reads KV head h / (H / KVH).
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#define MAX_HEADS 128
#define MAX_HEAD_DIM 256
#define MAX_HEAD_FLOATS 32768 /* heads x head_dim of one work item: its accumulator, on the stack */
#define BLOCK 32

/* e^x for x <= 0 (a score minus the running max), float32 to ~2 ulp: 2^n * e^r, |r| <= ln2/2, with
 * the Cephes polynomial. Inline and branch-free, so loops over it vectorise. */
static inline float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x;
    float n = floorf(x * 1.44269504088896341f + 0.5f);
    float r = x - n * 0.693359375f;
    r = r + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

int tandem_max_heads(void) { return MAX_HEADS; }
int tandem_max_head_dim(void) { return MAX_HEAD_DIM; }
int tandem_max_head_floats(void) { return MAX_HEAD_FLOATS; }

/* Query heads [kh0 * group, kh1 * group) of sequence b over its positions [0, len): the K/V heads
 * [kh0, kh1) of each slot lie side by side, so a block's rows are read front to back, once. */
static void attend(const float *q, const float *k, const float *v, const int64_t *pages, int64_t len,
                   float *out, int64_t kh0, int64_t kh1, int64_t group, int64_t D, int64_t row_stride,
                   int64_t page_size, float scale) {
    const int64_t h0 = kh0 * group, num = (kh1 - kh0) * group; /* query heads [h0, h0 + num) */
    float acc[MAX_HEAD_FLOATS];
    float m[MAX_HEADS], l[MAX_HEADS], s[MAX_HEADS][BLOCK];
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
                const float *kr = k + slot[j] * row_stride + kh * D;
                for (int64_t g = 0; g < group; g++) {
                    const int64_t h = (kh - kh0) * group + g;
                    const float *qr = q + (h0 + h) * D;
                    float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                    for (int64_t d = 0; d < D; d++) dot += qr[d] * kr[d];
                    s[h][j] = dot * scale;
                }
            }
        }
        for (int64_t h = 0; h < num; h++) {
            float block_max = s[h][0];
            for (int64_t j = 1; j < n; j++) block_max = s[h][j] > block_max ? s[h][j] : block_max;
            const float new_max = block_max > m[h] ? block_max : m[h];
            const float keep = m[h] == -INFINITY ? 0.0f : exp_nonpositive(m[h] - new_max);
            float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
            for (int64_t j = 0; j < n; j++) {
                const float p = exp_nonpositive(s[h][j] - new_max);
                s[h][j] = p;
                sum += p;
            }
            l[h] = l[h] * keep + sum;
            m[h] = new_max;
            if (keep != 1.0f) {
                float *a = acc + h * D;
#pragma omp simd
                for (int64_t d = 0; d < D; d++) a[d] *= keep;
            }
        }
        for (int64_t j = 0; j < n; j++) {
            for (int64_t kh = kh0; kh < kh1; kh++) {
                const float *vr = v + slot[j] * row_stride + kh * D;
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
        for (int64_t d = 0; d < D; d++) o[d] = a[d] * inv;
    }
}

void tandem_paged_decode_f32(const float *q, int64_t q_row_stride, const float *k, const float *v,
                             const int64_t *page_table, int64_t pt_stride, const int64_t *seq_lens,
                             float *out, int64_t batch, int64_t num_heads, int64_t num_kv_heads,
                             int64_t head_dim, int64_t page_size, float scale) {
    const int64_t group = num_heads / num_kv_heads;
    /* A work item is a sequence, all its heads (its pages read front to back once); split by K/V
     * head only when there are fewer sequences than threads. */
    const int64_t kv_per_item = batch >= omp_get_max_threads() ? num_kv_heads : 1;
    const int64_t items_per_seq = num_kv_heads / kv_per_item;
#pragma omp parallel for schedule(static)
    for (int64_t item = 0; item < batch * items_per_seq; item++) {
        const int64_t b = item / items_per_seq, kh0 = (item % items_per_seq) * kv_per_item;
        attend(q + b * q_row_stride, k, v, page_table + b * pt_stride, seq_lens[b], out + b * num_heads * head_dim,
               kh0, kh0 + kv_per_item, group, head_dim, num_kv_heads * head_dim, page_size, scale);
    }
}
