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
#include <stdint.h>
#include <string.h>

#define MAX_GROUP 32
#define MAX_HEAD_DIM 256
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

int tandem_max_group(void) { return MAX_GROUP; }
int tandem_max_head_dim(void) { return MAX_HEAD_DIM; }

void tandem_paged_decode_f32(const float *q, int64_t q_row_stride, const float *k, const float *v,
                             const int64_t *page_table, int64_t pt_stride, const int64_t *seq_lens,
                             float *out, int64_t batch, int64_t num_heads, int64_t num_kv_heads,
                             int64_t head_dim, int64_t page_size, float scale) {
    const int64_t group = num_heads / num_kv_heads, D = head_dim;
    const int64_t row_stride = num_kv_heads * D; /* floats between two slots of a page */
#pragma omp parallel for collapse(2) schedule(static)
    for (int64_t b = 0; b < batch; b++) {
        for (int64_t kh = 0; kh < num_kv_heads; kh++) {
            const float *qg = q + b * q_row_stride + kh * group * D;
            const int64_t *pages = page_table + b * pt_stride;
            const int64_t len = seq_lens[b];
            float acc[MAX_GROUP * MAX_HEAD_DIM];
            float m[MAX_GROUP], l[MAX_GROUP], s[MAX_GROUP][BLOCK];
            const float *krow[BLOCK], *vrow[BLOCK];
            for (int64_t g = 0; g < group; g++) {
                m[g] = -INFINITY;
                l[g] = 0.0f;
            }
            memset(acc, 0, sizeof(float) * group * D);
            for (int64_t p0 = 0; p0 < len; p0 += BLOCK) {
                const int64_t n = len - p0 < BLOCK ? len - p0 : BLOCK;
                for (int64_t j = 0; j < n; j++) {
                    const int64_t pos = p0 + j;
                    const int64_t slot = pages[pos / page_size] * page_size + pos % page_size;
                    krow[j] = k + slot * row_stride + kh * D;
                    vrow[j] = v + slot * row_stride + kh * D;
                }
                for (int64_t j = 0; j < n; j++) {
                    const float *kr = krow[j];
                    for (int64_t g = 0; g < group; g++) {
                        const float *qr = qg + g * D;
                        float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                        for (int64_t d = 0; d < D; d++) dot += qr[d] * kr[d];
                        s[g][j] = dot * scale;
                    }
                }
                for (int64_t g = 0; g < group; g++) {
                    float block_max = s[g][0];
                    for (int64_t j = 1; j < n; j++) block_max = s[g][j] > block_max ? s[g][j] : block_max;
                    const float new_max = block_max > m[g] ? block_max : m[g];
                    const float keep = m[g] == -INFINITY ? 0.0f : exp_nonpositive(m[g] - new_max);
                    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
                    for (int64_t j = 0; j < n; j++) {
                        const float p = exp_nonpositive(s[g][j] - new_max);
                        s[g][j] = p;
                        sum += p;
                    }
                    l[g] = l[g] * keep + sum;
                    m[g] = new_max;
                    if (keep != 1.0f) {
                        float *a = acc + g * D;
#pragma omp simd
                        for (int64_t d = 0; d < D; d++) a[d] *= keep;
                    }
                }
                for (int64_t j = 0; j < n; j++) {
                    const float *vr = vrow[j];
                    for (int64_t g = 0; g < group; g++) {
                        const float p = s[g][j];
                        float *a = acc + g * D;
#pragma omp simd
                        for (int64_t d = 0; d < D; d++) a[d] += p * vr[d];
                    }
                }
            }
            for (int64_t g = 0; g < group; g++) {
                const float inv = l[g] > 0.0f ? 1.0f / l[g] : 0.0f; /* no positions: zeros */
                float *o = out + (b * num_heads + kh * group + g) * D;
                const float *a = acc + g * D;
#pragma omp simd
                for (int64_t d = 0; d < D; d++) o[d] = a[d] * inv;
            }
        }
    }
}
