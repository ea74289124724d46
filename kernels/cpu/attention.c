/* CPU decode attention over paged KV: one query token per sequence, every query head of a GQA group
 * at once, the K/V pages read in place (no gather copy), softmax online. The "cpu" attention
 * backend's decode rows (kernels/cpu/attention_backend.py). Built with the other kernels of this
 * folder into one library and loaded at run time by kernels/cpu/native.py (see its docstring);
 * threads are the caller's OpenMP team (torch's, whose libgomp the process has already loaded).
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
#include "attend.h"

int tandem_max_heads(void) { return MAX_HEADS; }
int tandem_max_head_dim(void) { return MAX_HEAD_DIM; }
int tandem_max_head_floats(void) { return MAX_HEAD_FLOATS; }

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
