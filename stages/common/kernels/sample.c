/* Sampling a decode step's next tokens from its logits in one call, in C, instead of a chain
 * of PyTorch operators over [rows, vocabulary] tensors (a scaling, a log-softmax, exponentials, a
 * cumulative sum, a search, gathers). Built into one library with attention.c by
 * stages/common/kernels/native.py, which documents it. Logits in float32 or (bf16 = 1) bfloat16,
 * float32 arithmetic, the total in float64.
 */
#include <stdlib.h>

#include "vectors.h"

/* Probabilities are summed in blocks of this many tokens; a draw finds its block from the blocks'
 * sums, then its token inside the block. */
#define BLOCK 64

/* exp(x[i] * inv_t - shift) for the `count` (<= BLOCK) tokens at x, into e; their sum. The same
 * arithmetic whenever a block is computed, so a block's sum and its elements agree. */
static float block_exps(const char *x, int count, int bf16, float inv_t, float shift, float *e) {
    const __m256 scale = _mm256_set1_ps(inv_t), offset = _mm256_set1_ps(shift);
    __m256 acc = _mm256_setzero_ps();
    int i = 0;
    for (; i + 8 <= count; i += 8) {
        const __m256 v = exp8(_mm256_fmsub_ps(load8(x + ((int64_t)i << (bf16 ? 1 : 2)), bf16), scale, offset));
        _mm256_storeu_ps(e + i, v);
        acc = _mm256_add_ps(acc, v);
    }
    if (i < count) {  /* the vocabulary's last tokens: padded with -inf, whose exponential is 0 */
        float tail[8];
        for (int j = 0; j < 8; j++) tail[j] = i + j < count ? element_at(x, i + j, bf16) : -INFINITY;
        const __m256 v = exp8(_mm256_fmsub_ps(_mm256_loadu_ps(tail), scale, offset));
        float out[8];
        _mm256_storeu_ps(out, v);
        for (int j = 0; i + j < count; j++) e[i + j] = out[j];
        acc = _mm256_add_ps(acc, v);
    }
    return sum8(acc);
}

/* The largest of the `count` logits at x. */
static float maximum(const char *x, int count, int bf16) {
    __m256 best = _mm256_set1_ps(-INFINITY);
    int i = 0;
    for (; i + 8 <= count; i += 8) best = _mm256_max_ps(best, load8(x + ((int64_t)i << (bf16 ? 1 : 2)), bf16));
    float lanes[8], top = -INFINITY;
    _mm256_storeu_ps(lanes, best);
    for (int j = 0; j < 8; j++) top = lanes[j] > top ? lanes[j] : top;
    for (; i < count; i++) top = element_at(x, i, bf16) > top ? element_at(x, i, bf16) : top;
    return top;
}

/* The first index of `value` among the logits at x (as torch.argmax picks among equal maxima). */
static int first_index_of(const char *x, int count, int bf16, float value) {
    int i = 0;
    while (i < count - 1 && element_at(x, i, bf16) != value) i++;
    return i;
}

/* One row: its token (drawn at `uniform`, or the first maximum where uniform < 0) and log-prob. */
static void sample_row(const char *x, int vocab, int bf16, float inv_t, float uniform, float *sums, float *e,
                       int64_t *token, float *logprob) {
    const float top = maximum(x, vocab, bf16);
    if (uniform < 0) inv_t = 1.0f;  /* greedy: the log-prob under the untempered distribution */
    const float shift = top * inv_t;
    const int blocks = (vocab + BLOCK - 1) / BLOCK;
    double total = 0;
    for (int b = 0; b < blocks; b++) {
        const int first = b * BLOCK, count = vocab - first < BLOCK ? vocab - first : BLOCK;
        sums[b] = block_exps(x + ((int64_t)first << (bf16 ? 1 : 2)), count, bf16, inv_t, shift, e);
        total += sums[b];
    }
    int chosen = -1;
    if (uniform >= 0) {
        /* The first token whose cumulative probability exceeds uniform * total; where rounding
         * leaves none, the last token of positive probability. */
        const double target = uniform * total;
        double before = 0;
        int b = 0;
        while (b < blocks - 1 && before + sums[b] <= target) before += sums[b++];
        while (b > 0 && sums[b] == 0) before -= sums[--b];
        const int first = b * BLOCK, count = vocab - first < BLOCK ? vocab - first : BLOCK;
        block_exps(x + ((int64_t)first << (bf16 ? 1 : 2)), count, bf16, inv_t, shift, e);
        for (int i = 0; i < count; i++) {
            before += e[i];
            if (e[i] > 0) chosen = first + i;
            if (before > target && e[i] > 0) break;
        }
    }
    if (chosen < 0) chosen = first_index_of(x, vocab, bf16, top);
    *token = chosen;
    *logprob = (float)((double)element_at(x, chosen, bf16) * inv_t - shift - log(total));
}

/* Per row r of `logits` [rows, vocab] (rows row_stride elements apart): with `uniforms`, a token
 * drawn from softmax(logits * inv_temperature) at uniforms[r] in [0, 1), by inverting its cumulative
 * distribution; without (NULL), the first maximum. tokens[r] and logprobs[r] (under the
 * distribution drawn from; greedy: the untempered one). Rows split over `threads` OpenMP threads.
 * Returns 0, -1 for arguments it does not take, or -2 when it could not allocate. */
int spa_sample(const void *logits, int64_t row_stride, int rows, int vocab, int bf16, float inv_temperature,
               const float *uniforms, int64_t *tokens, float *logprobs, int threads) {
    if (vocab < 1 || rows < 0 || (bf16 & ~1)) return -1;
    int failed = 0;
#pragma omp parallel num_threads(threads < 1 ? 1 : threads) reduction(| : failed)
    {
        float *sums = malloc(sizeof(float) * ((vocab + BLOCK - 1) / BLOCK)), e[BLOCK];
        failed = sums == NULL;
#pragma omp for schedule(static)
        for (int r = 0; r < rows; r++)
            if (!failed)
                sample_row((const char *)logits + ((r * row_stride) << (bf16 ? 1 : 2)), vocab, bf16,
                           inv_temperature, uniforms ? uniforms[r] : -1.0f, sums, e, tokens + r, logprobs + r);
        free(sums);
    }
    return failed ? -2 : 0;
}
