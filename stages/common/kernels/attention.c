/* Attention over a KV cache, fused: scores, softmax and the values' weighted sum in one pass per
 * (row, key/value head, block of query tokens), on the CPU, computed in float32 over keys and values
 * stored in float32 or bfloat16: a decode step's (one token a row) or a prefill's (several, each
 * under its own mask row). Built and loaded by stages/common/kernels/native.py, which documents it;
 * C with AVX2 and FMA intrinsics, no PyTorch headers; over a bfloat16 cache with bfloat16 queries,
 * AVX512-BF16's dot products and AVX512's registers where the CPU has them (spa_bf16_dots).
 *
 * query  [rows, heads, tokens, dim], float32 or (bf16_io = 1) bfloat16, with element strides (row,
 *   head, token), each query's `dim` elements contiguous; head h is key/value head h / group's
 * keys, values: float32 (bf16 = 0) or bfloat16 (bf16 = 1), with element strides (row, head,
 *   column); the column's `dim` elements are contiguous.
 *   Columns [0, shared) are the same in every row and are read from row 0 (so a thread working
 *   through one head's rows finds them in its cache); columns [shared, columns) are each row's.
 * mask   token t of row r's at mask + r * mask_row + t * mask_token (element strides; 0: one row, or one
 *   token's row, for all), its columns contiguous: additive float32 (mask_dtype 0) or bfloat16 (1),
 *   or bool (2: 1 where the query attends), each task's rows made additive float32 as it starts
 * out    [rows, tokens, heads, dim] contiguous, in the query's dtype: softmax(q.k * scale + mask) . v,
 *   rounded to bfloat16 (to nearest, ties to even) only here
 * A query that may see no column (every score -inf) gets zeros.
 */
#include <stdlib.h>

#include "vectors.h"

/* Compilers that emit AVX512-BF16 for a function of its own (target attribute), used only where
 * the CPU has it (spa_bf16_dots). */
#if (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 10) || (defined(__clang__) && __clang_major__ >= 11)
#define SPA_BF16_DOTS 1
#endif

#define MAX_GROUP 16
/* Queries one task computes (its group's heads times a block of tokens): their scores, a row of
 * `columns` each, stay in L2 while the values pass reads them. */
#define MAX_QUERIES 48

typedef struct {
    const char *query, *keys, *values, *mask;
    char *out;
    int64_t q_row, q_head, q_token, k_row, k_head, k_col, v_row, v_head, v_col, mask_row, mask_token;
    int rows, kv_heads, group, tokens, dim, columns, shared, mask_dtype, bf16_io;
    float scale;
} Job;

/* A row of scores' length: columns rounded up to whole vectors of 8. */
static inline int padded(int columns) { return (columns + 7) / 8 * 8; }

/* Eight dot products at once: lane c of the result is sum(acc[c]). */
static inline __m256 sums_of_8(const __m256 acc[8]) {
    const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(acc[0], acc[1]), _mm256_hadd_ps(acc[2], acc[3]));
    const __m256 u = _mm256_hadd_ps(_mm256_hadd_ps(acc[4], acc[5]), _mm256_hadd_ps(acc[6], acc[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(t, u, 0x20), _mm256_permute2f128_ps(t, u, 0x31));
}

/* Column c of a row's keys or values for a head: the shared columns are row 0's. Strides count
 * elements of 2 (bfloat16) or 4 bytes. */
static inline const char *column(const char *base, int64_t row_stride, int64_t head_stride, int64_t column_stride,
                                 int row, int head, int c, int shared, int bf16) {
    const int64_t element = (c < shared ? 0 : row * row_stride) + head * head_stride + c * column_stride;
    return base + (element << (bf16 ? 1 : 2));
}

/* Column c's values for a head, fetched into L2 while the keys' arithmetic runs, for the values
 * pass that follows. */
static inline __attribute__((always_inline)) void prefetch_values(const Job *job, int row, int head, int c, int bf16) {
    const char *v = column(job->values, job->v_row, job->v_head, job->v_col, row, head, c, job->shared, bf16);
    for (int line = 0; line < job->dim << (bf16 ? 1 : 2); line += 64) _mm_prefetch(v + line, _MM_HINT_T1);
}

/* The weighted sums of the values for `nq` queries (weights `weights`, [nq][columns], rows
 * padded(columns) apart), dimensions [d0, d0 + 8 * vecs), scaled by `inverse` into `outs`: each
 * column's values are loaded, and widened, once for all `nq` queries. nq * vecs accumulators, nq
 * broadcast weights and one value vector fit AVX2's 16 registers for the shapes run_task uses
 * (3 x 4, 2 x 4, 1 x 8). */
static inline __attribute__((always_inline)) void weighted_values(const Job *job, int row, int head,
                                                                  const float *weights, const float *inverse,
                                                                  float *const *outs, int d0, const int nq,
                                                                  const int vecs, const int bf16) {
    const int log_bytes = bf16 ? 1 : 2, columns = job->columns, stride = padded(columns);
    __m256 acc[3][8];
    for (int g = 0; g < nq; g++)
        for (int j = 0; j < vecs; j++) acc[g][j] = _mm256_setzero_ps();
    for (int c = 0; c < columns; c++) {
        const char *v = column(job->values, job->v_row, job->v_head, job->v_col, row, head, c, job->shared, bf16)
                        + (d0 << log_bytes);
        __m256 w[3];
        for (int g = 0; g < nq; g++) w[g] = _mm256_broadcast_ss(weights + g * stride + c);
        for (int j = 0; j < vecs; j++) {
            const __m256 x = load8(v + (8 * j << log_bytes), bf16);
            for (int g = 0; g < nq; g++) acc[g][j] = _mm256_fmadd_ps(w[g], x, acc[g][j]);
        }
    }
    for (int g = 0; g < nq; g++)
        for (int j = 0; j < vecs; j++)
            _mm256_storeu_ps(outs[g] + d0 + 8 * j, _mm256_mul_ps(acc[g][j], _mm256_set1_ps(inverse[g])));
}

/* Tokens a task takes: as many as keep its queries within MAX_QUERIES (one for a decode step). */
static inline int block_tokens(int group, int tokens) {
    const int most = MAX_QUERIES / group;
    return tokens < most ? tokens : most;
}

/* The scores of `queries` queries (`scores` [queries, padded(columns)], scaled and masked) and each
 * one's maximum (`top`), eight columns at a time, every query while the block's keys are in L1 (a
 * bfloat16 block widened once into `wide`, not once per query). */
static inline __attribute__((always_inline)) void widened_scores(const Job *job, int row, int head,
                                                                 const float *const *query,
                                                                 const float *const *mask, int queries,
                                                                 float *scores, float *top, const int bf16) {
    const int dim = job->dim, columns = job->columns, stride = padded(columns);
    const __m256 scale = _mm256_set1_ps(job->scale);
    __m256 top8[MAX_QUERIES];
    for (int i = 0; i < queries; i++) top8[i] = _mm256_set1_ps(-INFINITY);
    float wide[8][128];
    const int blocked = columns / 8 * 8;
    for (int c = 0; c < blocked; c += 8) {
        const float *keys[8];
        for (int k8 = 0; k8 < 8; k8++) {
            const char *k = column(job->keys, job->k_row, job->k_head, job->k_col, row, head, c + k8, job->shared,
                                   bf16);
            if (bf16) {
                for (int d = 0; d < dim; d += 8) _mm256_storeu_ps(wide[k8] + d, load8(k + (d << 1), 1));
                keys[k8] = wide[k8];
            } else {
                keys[k8] = (const float *)k;
            }
            prefetch_values(job, row, head, c + k8, bf16);
        }
        for (int i = 0; i < queries; i++) {
            __m256 acc[8];
            for (int k8 = 0; k8 < 8; k8++) acc[k8] = _mm256_setzero_ps();
            for (int d = 0; d < dim; d += 8) {
                const __m256 qd = _mm256_loadu_ps(query[i] + d);
                for (int k8 = 0; k8 < 8; k8++) acc[k8] = _mm256_fmadd_ps(_mm256_loadu_ps(keys[k8] + d), qd, acc[k8]);
            }
            const __m256 scores8 = _mm256_fmadd_ps(sums_of_8(acc), scale, _mm256_loadu_ps(mask[i] + c));
            _mm256_storeu_ps(scores + i * stride + c, scores8);
            top8[i] = _mm256_max_ps(top8[i], scores8);
        }
    }
    for (int i = 0; i < queries; i++) {
        float *s = scores + i * stride;
        top[i] = -INFINITY;
        for (int k8 = 0; k8 < 8; k8++) top[i] = fmaxf(top[i], top8[i][k8]);
        for (int c = blocked; c < columns; c++) {
            const char *k = column(job->keys, job->k_row, job->k_head, job->k_col, row, head, c, job->shared, bf16);
            float dot = 0.0f;
            for (int d = 0; d < dim; d++) dot += query[i][d] * element_at(k, d, bf16);
            s[c] = dot * job->scale + mask[i][c];
            top[i] = fmaxf(top[i], s[c]);
        }
    }
}

#ifdef SPA_BF16_DOTS
#define BF16_DOTS_TARGET __attribute__((target("avx512f,avx512bw,avx512dq,avx512bf16")))

/* Sixteen dot products at once: lane k of the result is sum(acc[k]), by halving the vectors and
 * their lanes in four rounds of shuffles and additions. */
static inline BF16_DOTS_TARGET __m512 sums_of_16(const __m512 acc[16]) {
    __m512 pairs[8], quads[4], halves[2];
    for (int j = 0; j < 8; j++)  /* keys 2j, 2j+1 interleaved: two partial sums each per 128 bits */
        pairs[j] = _mm512_add_ps(_mm512_unpacklo_ps(acc[2 * j], acc[2 * j + 1]),
                                 _mm512_unpackhi_ps(acc[2 * j], acc[2 * j + 1]));
    for (int j = 0; j < 4; j++)  /* keys 4j..4j+3, one partial sum each per 128 bits */
        quads[j] = _mm512_add_ps(_mm512_shuffle_ps(pairs[2 * j], pairs[2 * j + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                                 _mm512_shuffle_ps(pairs[2 * j], pairs[2 * j + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    for (int j = 0; j < 2; j++)  /* 128-bit blocks: quad 2j's two halves' sums, then quad 2j + 1's */
        halves[j] = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2 * j], quads[2 * j + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                                  _mm512_shuffle_f32x4(quads[2 * j], quads[2 * j + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(halves[0], halves[1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(halves[0], halves[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

/* `keys` (n of them, n <= 16) dotted with one query's `q` (`pairs` vectors of 32 bfloat16) into
 * 16 lanes, the keys beyond n as 0. */
static inline __attribute__((always_inline)) BF16_DOTS_TARGET __m512
dots_of_16(const uint16_t *const *keys, const __m512bh *q, const int n, const int pairs) {
    __m512 acc[16];
    for (int k = 0; k < 16; k++) {
        acc[k] = _mm512_setzero_ps();
        if (k < n)
            for (int p = 0; p < pairs; p++)
                acc[k] = _mm512_dpbf16_ps(acc[k], q[p], (__m512bh)_mm512_loadu_si512(keys[k] + 32 * p));
    }
    return sums_of_16(acc);
}

/* weighted_values in AVX512 registers over a bfloat16 cache, all `dim` dimensions at once: nq * vecs
 * accumulators of 16 floats within AVX512's 32 registers (6 x 4 for a head of 64, 3 x 8 of 128). */
static inline __attribute__((always_inline)) BF16_DOTS_TARGET void
weighted_values_16(const Job *job, int row, int head, const float *weights, const float *inverse,
                   float *const *outs, const int nq, const int vecs) {
    const int columns = job->columns, stride = padded(columns);
    __m512 acc[6][8];
    for (int g = 0; g < nq; g++)
        for (int j = 0; j < vecs; j++) acc[g][j] = _mm512_setzero_ps();
    for (int c = 0; c < columns; c++) {
        const char *v = column(job->values, job->v_row, job->v_head, job->v_col, row, head, c, job->shared, 1);
        __m512 w[6];
        for (int g = 0; g < nq; g++) w[g] = _mm512_set1_ps(weights[g * stride + c]);
        for (int j = 0; j < vecs; j++) {
            const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(v + 32 * j)));
            const __m512 x = _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
            for (int g = 0; g < nq; g++) acc[g][j] = _mm512_fmadd_ps(w[g], x, acc[g][j]);
        }
    }
    for (int g = 0; g < nq; g++)
        for (int j = 0; j < vecs; j++)
            _mm512_storeu_ps(outs[g] + 16 * j, _mm512_mul_ps(acc[g][j], _mm512_set1_ps(inverse[g])));
}

/* All queries' weighted sums by weighted_values_16, up to 6 (head of 64) or 3 (128) at a time. */
static BF16_DOTS_TARGET void values_by_16(const Job *job, int row, int head, const float *scores,
                                          const float *inverse, float *const *outs, int queries) {
    const int stride = padded(job->columns), most = job->dim == 64 ? 6 : 3;
    for (int i = 0; i < queries; i += most) {
        const int nq = queries - i < most ? queries - i : most;
        const float *w = scores + i * stride;
        if (job->dim == 128) {
            if (nq == 3) weighted_values_16(job, row, head, w, inverse + i, outs + i, 3, 8);
            else if (nq == 2) weighted_values_16(job, row, head, w, inverse + i, outs + i, 2, 8);
            else weighted_values_16(job, row, head, w, inverse + i, outs + i, 1, 8);
        } else {
            switch (nq) {
            case 6: weighted_values_16(job, row, head, w, inverse + i, outs + i, 6, 4); break;
            case 5: weighted_values_16(job, row, head, w, inverse + i, outs + i, 5, 4); break;
            case 4: weighted_values_16(job, row, head, w, inverse + i, outs + i, 4, 4); break;
            case 3: weighted_values_16(job, row, head, w, inverse + i, outs + i, 3, 4); break;
            case 2: weighted_values_16(job, row, head, w, inverse + i, outs + i, 2, 4); break;
            default: weighted_values_16(job, row, head, w, inverse + i, outs + i, 1, 4);
            }
        }
    }
}

/* widened_scores over a bfloat16 cache with bfloat16 queries (read as they are), by AVX512-BF16's
 * dot products: each instruction multiplies 32 pairs of bfloat16 exactly and adds them into 16
 * float32 sums, so a key is neither widened nor stored, and the sums are float32 as
 * widened_scores' are (up to the order of additions; denormal inputs count as 0). Sixteen columns
 * at a time. */
static BF16_DOTS_TARGET void scores_by_bf16_dots(const Job *job, int row, int head, const char *const *query,
                                                 const float *const *mask, int queries, float *scores,
                                                 float *top) {
    const int columns = job->columns, stride = padded(columns), pairs = job->dim / 32;
    __m512bh q[MAX_QUERIES][4];
    __m512 top16[MAX_QUERIES];
    for (int i = 0; i < queries; i++) {
        for (int p = 0; p < pairs; p++) q[i][p] = (__m512bh)_mm512_loadu_si512(query[i] + 64 * p);
        top16[i] = _mm512_set1_ps(-INFINITY);
    }
    const __m512 scale = _mm512_set1_ps(job->scale), minus_infinity = _mm512_set1_ps(-INFINITY);
    for (int c = 0; c < columns; c += 16) {
        const int n = columns - c < 16 ? columns - c : 16;
        const __mmask16 valid = (__mmask16)((1u << n) - 1);
        const uint16_t *keys[16];
        for (int k = 0; k < n; k++) {
            keys[k] = (const uint16_t *)column(job->keys, job->k_row, job->k_head, job->k_col, row, head, c + k,
                                               job->shared, 1);
            prefetch_values(job, row, head, c + k, 1);
        }
        for (int i = 0; i < queries; i++) {
            const __m512 sums = n == 16 ? (pairs == 2 ? dots_of_16(keys, q[i], 16, 2) : dots_of_16(keys, q[i], 16, 4))
                                        : (pairs == 2 ? dots_of_16(keys, q[i], n, 2) : dots_of_16(keys, q[i], n, 4));
            const __m512 s = _mm512_mask_blend_ps(
                valid, minus_infinity, _mm512_fmadd_ps(sums, scale, _mm512_maskz_loadu_ps(valid, mask[i] + c)));
            _mm512_mask_storeu_ps(scores + i * stride + c, valid, s);
            top16[i] = _mm512_max_ps(top16[i], s);
        }
    }
    for (int i = 0; i < queries; i++) top[i] = _mm512_reduce_max_ps(top16[i]);
}
#endif

/* A task's outputs, query i's float32 sums in sums[i], stored at [row, token, head, :] in the
 * query's dtype. */
static inline void store_outputs(const Job *job, int row, int head, int first, int count, float sums[][128]) {
    const int heads = job->kv_heads * job->group, dim = job->dim;
    for (int i = 0; i < job->group * count; i++) {
        const int h = head * job->group + i / count, token = first + i % count;
        const int64_t at = (((int64_t)row * job->tokens + token) * heads + h) * dim;
        if (job->bf16_io) {
            for (int d = 0; d < dim; d += 8)
                _mm_storeu_si128((__m128i *)((uint16_t *)job->out + at + d),
                                 rounded_to_bf16(_mm256_loadu_ps(sums[i] + d)));
        } else {
            memcpy((float *)job->out + at, sums[i], sizeof(float) * dim);
        }
    }
}

/* Token `token` of row `row`'s mask row as additive float32: the caller's, or (a bfloat16 or bool
 * mask) its conversion into `to`. */
static inline const float *additive_mask(const Job *job, int row, int token, float *to) {
    const int64_t at = row * job->mask_row + token * job->mask_token;
    if (job->mask_dtype == 0) return (const float *)job->mask + at;
    for (int c = 0; c < job->columns; c++)
        to[c] = job->mask_dtype == 2 ? (((const uint8_t *)job->mask)[at + c] ? 0.0f : -INFINITY)
                                     : element_at(job->mask + (at << 1), c, 1);
    return to;
}

/* One (row, head, block of tokens): its queries' scores into `scores` [queries, columns],
 * exponentiated in place, then the values' weighted sums, up to three queries at a time. Inlined
 * into each call with a constant `bf16`, so each element type gets its own loops; `dots` (with
 * bf16) takes the scores by bfloat16 dot products. */
static inline __attribute__((always_inline)) void run_task(const Job *job, int task, float *scores, float *masks,
                                                           const int bf16, const int dots) {
    const int per_block = block_tokens(job->group, job->tokens);
    const int blocks = (job->tokens + per_block - 1) / per_block;
    const int block = task % blocks, row = task / blocks % job->rows, head = task / blocks / job->rows;
    const int first = block * per_block;
    const int count = job->tokens - first < per_block ? job->tokens - first : per_block;
    const int group = job->group, dim = job->dim, columns = job->columns, stride = padded(columns);
    const int queries = group * count;
    /* Query i is head g = i / count's, token first + i % count, as the caller holds it (`given`)
     * and in float32 (bfloat16 ones widened into `wide_query`, but for the dot products, which take
     * them as they are); its weighted sums go into `sums` before they are stored in the query's dtype. */
    const char *given[MAX_QUERIES];
    const float *query[MAX_QUERIES], *mask[MAX_QUERIES];
    float *out[MAX_QUERIES];
    float wide_query[MAX_QUERIES][128], sums[MAX_QUERIES][128];
    for (int i = 0; i < queries; i++) {
        const int g = i / count, token = first + i % count, h = head * group + g;
        const int64_t at = row * job->q_row + h * job->q_head + token * job->q_token;
        given[i] = job->query + (at << (job->bf16_io ? 1 : 2));
        if (job->bf16_io && !dots) {
            for (int d = 0; d < dim; d += 8) _mm256_storeu_ps(wide_query[i] + d, load8(given[i] + (d << 1), 1));
            query[i] = wide_query[i];
        } else {
            query[i] = (const float *)given[i];
        }
        out[i] = sums[i];
        /* each token's mask row once for the group's heads (and once for all tokens if they share it) */
        mask[i] = i >= count ? mask[i % count]
                  : i > 0 && job->mask_token == 0 ? mask[0] : additive_mask(job, row, token, masks + i * columns);
    }
    float top[MAX_QUERIES], inverse[MAX_QUERIES];
#ifdef SPA_BF16_DOTS
    if (dots)
        scores_by_bf16_dots(job, row, head, given, mask, queries, scores, top);
    else
#endif
        widened_scores(job, row, head, query, mask, queries, scores, top, bf16);
    for (int i = 0; i < queries; i++) {
        float *s = scores + i * stride;
        for (int c = columns; c < stride; c++) s[c] = -INFINITY;  /* the row's padding to whole vectors: weight 0 */
        /* exp(score - top), and their sum */
        const __m256 shift = _mm256_set1_ps(top[i] == -INFINITY ? 0.0f : top[i]);
        __m256 total8 = _mm256_setzero_ps();
        for (int c = 0; c < stride; c += 8) {
            const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + c), shift));
            _mm256_storeu_ps(s + c, e);
            total8 = _mm256_add_ps(total8, e);
        }
        const float total = sum8(total8);
        inverse[i] = total > 0.0f ? 1.0f / total : 0.0f;
    }
#ifdef SPA_BF16_DOTS
    if (dots) {
        values_by_16(job, row, head, scores, inverse, out, queries);
        store_outputs(job, row, head, first, count, sums);
        return;
    }
#endif
    for (int i = 0; i < queries; i += 3) {
        const float *w = scores + i * stride;
        for (int d0 = 0; d0 < dim; d0 += 64) {
            if (queries - i >= 3) {
                weighted_values(job, row, head, w, inverse + i, out + i, d0, 3, 4, bf16);
                weighted_values(job, row, head, w, inverse + i, out + i, d0 + 32, 3, 4, bf16);
            } else if (queries - i == 2) {
                weighted_values(job, row, head, w, inverse + i, out + i, d0, 2, 4, bf16);
                weighted_values(job, row, head, w, inverse + i, out + i, d0 + 32, 2, 4, bf16);
            } else {
                weighted_values(job, row, head, w, inverse + i, out + i, d0, 1, 8, bf16);
            }
        }
    }
    store_outputs(job, row, head, first, count, sums);
}

/* Whether this CPU computes bfloat16 dot products (AVX512-BF16) and this compiler emits them. */
int spa_bf16_dots(void) {
#ifdef SPA_BF16_DOTS
    return __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512bw")
           && __builtin_cpu_supports("avx512dq");
#else
    return 0;
#endif
}

/* Returns 0, or -1 for shapes it does not take (the caller keeps its other path), or -2 when it
 * could not allocate. The (row, head, block of tokens) tasks are ordered head-major and split in
 * contiguous blocks over `threads` threads of OpenMP: the same runtime as PyTorch's (the library
 * links libgomp.so.1, which PyTorch has loaded already), so its threads are the ones PyTorch's
 * operators just ran on, not a second pool competing with them for the cores. */
int spa_attention(const void *query, const void *keys, const void *values, const void *mask, void *out,
                  int64_t q_row, int64_t q_head, int64_t q_token, int64_t k_row, int64_t k_head, int64_t k_col,
                  int64_t v_row, int64_t v_head, int64_t v_col, int64_t mask_row, int64_t mask_token, int rows,
                  int kv_heads, int group, int tokens, int dim, int columns, int shared, int mask_dtype, int bf16,
                  int bf16_io, int bf16_dots, float scale, int threads) {
    if (dim % 64 || dim > 128 || group < 1 || group > MAX_GROUP || rows < 1 || tokens < 1 || columns < 1
            || (bf16 & ~1) || (bf16_io & ~1) || mask_dtype < 0 || mask_dtype > 2)
        return -1;
    const Job job = {query, keys, values, mask, out, q_row, q_head, q_token, k_row, k_head, k_col, v_row, v_head,
                     v_col, mask_row, mask_token, rows, kv_heads, group, tokens, dim, columns, shared, mask_dtype,
                     bf16_io, scale};
    const int per_block = block_tokens(group, tokens);
    const int tasks = rows * kv_heads * ((tokens + per_block - 1) / per_block);
    const int dots = bf16 && bf16_io && bf16_dots && spa_bf16_dots();
    int failed = 0;
#pragma omp parallel num_threads(threads < 1 ? 1 : threads) reduction(| : failed)
    {
        float *scores = malloc(sizeof(float) * group * per_block * padded(columns));
        float *masks = malloc(sizeof(float) * per_block * columns);  /* a task's mask rows, converted */
        failed = scores == NULL || masks == NULL;
#pragma omp for schedule(static)
        for (int task = 0; task < tasks; task++)
            if (failed) continue;
            else if (dots) run_task(&job, task, scores, masks, 1, 1);
            else if (bf16) run_task(&job, task, scores, masks, 1, 0);
            else run_task(&job, task, scores, masks, 0, 0);
        free(scores);
        free(masks);
    }
    return failed ? -2 : 0;
}
