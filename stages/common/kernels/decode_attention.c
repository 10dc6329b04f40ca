/* One decode step's attention in float32, fused: scores, softmax and the values' weighted sum in one
 * pass per (row, key/value head), on the CPU. Built and loaded by stages/common/kernels/native.py,
 * which documents it; C with AVX2 and FMA intrinsics and GCC/Clang vector extensions, no PyTorch
 * headers.
 *
 * query  [rows, kv_heads, group, dim], contiguous
 * keys, values: element strides (row, head, column); the column's `dim` floats are contiguous.
 *   Columns [0, shared) are the same in every row and are read from row 0 (so a thread working
 *   through one head's rows finds them in its cache); columns [shared, columns) are each row's.
 * mask   additive [rows, columns] with row stride mask_row (0: one row for all)
 * out    [rows, kv_heads, group, dim], contiguous: softmax(q.k * scale + mask) . v
 * A query that may see no column (every score -inf) gets zeros.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef float v8 __attribute__((vector_size(32), aligned(4)));
typedef int32_t i8 __attribute__((vector_size(32)));

#define MAX_GROUP 16

typedef struct {
    const float *query, *keys, *values, *mask;
    float *out;
    int64_t k_row, k_head, k_col, v_row, v_head, v_col, mask_row;
    int rows, kv_heads, group, dim, columns, shared;
    float scale;
} Job;

static inline v8 load8(const float *p) { v8 x; memcpy(&x, p, sizeof x); return x; }
static inline void store8(float *p, v8 x) { memcpy(p, &x, sizeof x); }

static inline float sum8(v8 x) {
    return ((x[0] + x[4]) + (x[1] + x[5])) + ((x[2] + x[6]) + (x[3] + x[7]));
}

/* exp(x) for x <= 0 (scores minus their maximum), as Cephes' expf: x = n ln2 + r, |r| <= ln2 / 2,
 * exp(r) as 1 + r + r^2 p(r) with Cephes' degree-5 p, and 2^n put into the exponent bits. Relative
 * error about 2 float ulps; x below -87.3 (and -inf) gives 0. */
static inline v8 exp8(v8 x) {
    const i8 keep = x >= -87.3f;  /* lanes of -1 (all bits) or 0 */
    x = (v8)(((i8)x & keep) | ((i8)((v8){0} - 87.3f) & ~keep));  /* vector casts reinterpret the bits */
    v8 n = x * 1.44269504088896341f;
    i8 ni = __builtin_convertvector(n - 0.5f, i8);  /* n <= 0: round half away by truncation */
    n = __builtin_convertvector(ni, v8);
    v8 r = x - n * 0.693359375f + n * 2.12194440e-4f;
    v8 r2 = r * r;
    v8 p = (v8){0} + 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r2 + r + 1.0f;
    const v8 two_to_n = (v8)((ni + 127) << 23);
    return (v8)((i8)(p * two_to_n) & keep);
}

/* Eight dot products at once: lane c of the result is sum(acc[c]). */
static inline __m256 sums_of_8(const __m256 acc[8]) {
    const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(acc[0], acc[1]), _mm256_hadd_ps(acc[2], acc[3]));
    const __m256 u = _mm256_hadd_ps(_mm256_hadd_ps(acc[4], acc[5]), _mm256_hadd_ps(acc[6], acc[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(t, u, 0x20), _mm256_permute2f128_ps(t, u, 0x31));
}

/* Column c of a row's keys or values for a head: the shared columns are row 0's. */
static inline const float *column(const float *base, int64_t row_stride, int64_t head_stride, int64_t column_stride,
                                  int row, int head, int c, int shared) {
    return base + (c < shared ? 0 : row * row_stride) + head * head_stride + c * column_stride;
}

/* One (row, head): the group's scores into `scores` [group, columns], exponentiated in place, then
 * the values' weighted sums, 64 dimensions at a time so the eight accumulators stay in registers. */
static void run_task(const Job *job, int task, float *scores) {
    const int row = task % job->rows, head = task / job->rows;
    const int group = job->group, dim = job->dim, columns = job->columns;
    const float *q = job->query + ((int64_t)row * job->kv_heads + head) * group * dim;
    const float *mask = job->mask + row * job->mask_row;
    const __m256 scale = _mm256_set1_ps(job->scale);
    /* Scores, a block of eight columns at a time, every query of the group while the block's keys are in L1. */
    __m256 top8[MAX_GROUP];
    for (int g = 0; g < group; g++) top8[g] = _mm256_set1_ps(-INFINITY);
    const int blocked = columns / 8 * 8;
    for (int c = 0; c < blocked; c += 8) {
        const float *keys[8];
        for (int i = 0; i < 8; i++) {
            keys[i] = column(job->keys, job->k_row, job->k_head, job->k_col, row, head, c + i, job->shared);
            /* the values pass's columns, fetched into L2 while the keys' arithmetic runs */
            const char *v = (const char *)column(job->values, job->v_row, job->v_head, job->v_col, row, head, c + i,
                                                 job->shared);
            for (int line = 0; line < dim * 4; line += 64) _mm_prefetch(v + line, _MM_HINT_T1);
        }
        for (int g = 0; g < group; g++) {
            const float *qg = q + g * dim;
            __m256 acc[8];
            for (int i = 0; i < 8; i++) acc[i] = _mm256_setzero_ps();
            for (int d = 0; d < dim; d += 8) {
                const __m256 qd = _mm256_loadu_ps(qg + d);
                for (int i = 0; i < 8; i++) acc[i] = _mm256_fmadd_ps(_mm256_loadu_ps(keys[i] + d), qd, acc[i]);
            }
            const __m256 block = _mm256_fmadd_ps(sums_of_8(acc), scale, _mm256_loadu_ps(mask + c));
            _mm256_storeu_ps(scores + g * columns + c, block);
            top8[g] = _mm256_max_ps(top8[g], block);
        }
    }
    for (int g = 0; g < group; g++) {
        const float *qg = q + g * dim;
        float *s = scores + g * columns;
        float top = -INFINITY;
        for (int i = 0; i < 8; i++) top = fmaxf(top, top8[g][i]);
        int c = blocked;
        for (; c < columns; c++) {
            const float *k = column(job->keys, job->k_row, job->k_head, job->k_col, row, head, c, job->shared);
            float dot = 0.0f;
            for (int d = 0; d < dim; d++) dot += qg[d] * k[d];
            s[c] = dot * job->scale + mask[c];
            top = fmaxf(top, s[c]);
        }
        /* exp(score - top), and their sum */
        const v8 shift = (v8){0} + (top == -INFINITY ? 0.0f : top);
        v8 total8 = (v8){0};
        for (c = 0; c + 8 <= columns; c += 8) {
            const v8 e = exp8(load8(s + c) - shift);
            store8(s + c, e);
            total8 += e;
        }
        float total = sum8(total8);
        for (; c < columns; c++) {
            s[c] = exp8((v8){0} + (s[c] - shift[0]))[0];
            total += s[c];
        }
        const __m256 inverse = _mm256_set1_ps(total > 0.0f ? 1.0f / total : 0.0f);
        float *o = job->out + (((int64_t)row * job->kv_heads + head) * group + g) * dim;
        for (int d0 = 0; d0 < dim; d0 += 64) {
            __m256 acc[8];
            for (int j = 0; j < 8; j++) acc[j] = _mm256_setzero_ps();
            for (c = 0; c < columns; c++) {
                const float *v = column(job->values, job->v_row, job->v_head, job->v_col, row, head, c, job->shared) + d0;
                const __m256 w = _mm256_set1_ps(s[c]);
                for (int j = 0; j < 8; j++) acc[j] = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 8 * j), acc[j]);
            }
            for (int j = 0; j < 8; j++) _mm256_storeu_ps(o + d0 + 8 * j, _mm256_mul_ps(acc[j], inverse));
        }
    }
}

/* Returns 0, or -1 for shapes it does not take (the caller keeps its other path), or -2 when it
 * could not allocate. The (row, head) tasks are ordered head-major and split in contiguous blocks
 * over `threads` threads of OpenMP: the same runtime as PyTorch's (the library links libgomp.so.1,
 * which PyTorch has loaded already), so its threads are the ones PyTorch's operators just ran on,
 * not a second pool competing with them for the cores. */
int spa_decode_attention(const float *query, const float *keys, const float *values, const float *mask,
                         float *out, int64_t k_row, int64_t k_head, int64_t k_col, int64_t v_row,
                         int64_t v_head, int64_t v_col, int64_t mask_row, int rows, int kv_heads, int group,
                         int dim, int columns, int shared, float scale, int threads) {
    if (dim % 64 || dim > 128 || group < 1 || group > MAX_GROUP || rows < 1 || columns < 1) return -1;
    const Job job = {query, keys, values, mask, out, k_row, k_head, k_col, v_row, v_head, v_col, mask_row,
                     rows, kv_heads, group, dim, columns, shared, scale};
    const int tasks = rows * kv_heads;
    int failed = 0;
#pragma omp parallel num_threads(threads < 1 ? 1 : threads) reduction(| : failed)
    {
        float *scores = malloc(sizeof(float) * group * columns);
        failed = scores == NULL;
#pragma omp for schedule(static)
        for (int task = 0; task < tasks; task++)
            if (scores) run_task(&job, task, scores);
        free(scores);
    }
    return failed ? -2 : 0;
}
