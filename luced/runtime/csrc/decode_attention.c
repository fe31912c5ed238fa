/* Decode attention: one query per sequence over its own float32 K/V rows, for every
 * sequence of a step in one call (luced/runtime/native_attention.py).
 *
 * Each (sequence, KV head) is one task: it stores the token's new K/V row, then scores the
 * head's G grouped queries against rows [lo, pos] (reading each K row once for all G),
 * softmaxes and sums the V rows (each V row read once). A task's arithmetic depends only on
 * its own inputs, never on how many sequences share the call or on the thread count, so a
 * sequence decoded in a batch gets exactly the outputs it gets alone. */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
/* One build for every x86-64 machine: the loader picks the widest vectors the CPU has. */
#define VECTOR_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define VECTOR_CLONES
#endif

/* exp(x) for the softmax's x <= 0, in plain arithmetic the compiler vectorizes (libm's expf
 * does not, without -ffast-math, which would change the whole process's float modes):
 * 2^n * 2^f with n = round(x log2 e), |f| <= 1/2, 2^f by its degree-7 Taylor polynomial
 * (truncation error ~5e-9, below float32 rounding). */
static inline float exp_nonpositive(float x)
{
    x = x < -87.0f ? -87.0f : x;  /* below this exp underflows float32 anyway */
    const float y = x * 1.44269504088896341f;
    const float n = rintf(y);
    const float f = (y - n) * 0.693147180559945309f;  /* 2^(y - n) = e^f */
    float p = 1.98412698e-4f;
    p = p * f + 1.38888889e-3f;
    p = p * f + 8.33333333e-3f;
    p = p * f + 4.16666667e-2f;
    p = p * f + 1.66666667e-1f;
    p = p * f + 0.5f;
    p = p * f + 1.0f;
    p = p * f + 1.0f;
    union { int32_t i; float f; } two_n = {.i = ((int32_t)n + 127) << 23};
    return p * two_n.f;
}

typedef struct {
    float *k, *v;          /* the layer's K and V storage of this sequence: [Hkv, rows, D] */
    const int64_t *rows;   /* the storage row of each position (a paged pool), or NULL:
                              position i in row i */
    int64_t head_stride;   /* elements between heads (rows * D) */
    int64_t pos;           /* the query's position: the last one attended (and its K/V row
                              is written first when new rows are given) */
    int64_t lo;            /* the first position attended (a sliding window's start) */
} SequenceKV;

VECTOR_CLONES
static void attend_head(int G, int D, int64_t lo, int64_t pos, const int64_t *rows,
                        const float *q, const float *k, const float *v, float scale,
                        float *scores, float *out)
{
    const int64_t L = pos - lo + 1;
    for (int64_t t = 0; t < L; t++) {
        const float *kt = k + (rows ? rows[lo + t] : lo + t) * D;
        for (int g = 0; g < G; g++) {
            const float *qg = q + (int64_t)g * D;
            float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
            for (int d = 0; d < D; d++) acc += qg[d] * kt[d];
            scores[g * L + t] = acc * scale;
        }
    }
    for (int g = 0; g < G; g++) {
        float *s = scores + g * L;
        float top = s[0];
#pragma omp simd reduction(max : top)
        for (int64_t t = 1; t < L; t++) top = s[t] > top ? s[t] : top;
        float total = 0.0f;
#pragma omp simd reduction(+ : total)
        for (int64_t t = 0; t < L; t++) {
            s[t] = exp_nonpositive(s[t] - top);
            total += s[t];
        }
        const float inv = 1.0f / total;
#pragma omp simd
        for (int64_t t = 0; t < L; t++) s[t] *= inv;
    }
    memset(out, 0, sizeof(float) * (size_t)G * D);
    for (int64_t t = 0; t < L; t++) {
        const float *vt = v + (rows ? rows[lo + t] : lo + t) * D;
        for (int g = 0; g < G; g++) {
            const float p = scores[g * L + t];
            float *og = out + (int64_t)g * D;
#pragma omp simd
            for (int d = 0; d < D; d++) og[d] += p * vt[d];
        }
    }
}

/* q, out: [B, Hkv * G, D]; k_new, v_new: [B, Hkv, D], or NULL for a layer that reads
 * another layer's rows (KV sharing) and stores none. Returns 0, or -1 if scratch memory
 * could not be had. */
int decode_attention(int B, int Hkv, int G, int D, const float *q, const float *k_new,
                     const float *v_new, const SequenceKV *seqs, float scale, float *out,
                     int threads)
{
    int64_t longest = 1;
    for (int b = 0; b < B; b++) {
        const int64_t L = seqs[b].pos - seqs[b].lo + 1;
        longest = L > longest ? L : longest;
    }
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        float *scores = malloc(sizeof(float) * (size_t)G * (size_t)longest);
        if (scores == NULL) failed = 1;
#pragma omp for schedule(static)
        for (int task = 0; task < B * Hkv; task++) {
            if (scores == NULL) continue;
            const int b = task / Hkv, h = task % Hkv;
            const SequenceKV *s = &seqs[b];
            float *k = s->k + h * s->head_stride, *v = s->v + h * s->head_stride;
            if (k_new != NULL) {
                const int64_t from = ((int64_t)b * Hkv + h) * D;
                const int64_t to = (s->rows ? s->rows[s->pos] : s->pos) * D;
                memcpy(k + to, k_new + from, sizeof(float) * D);
                memcpy(v + to, v_new + from, sizeof(float) * D);
            }
            const int64_t first = ((int64_t)b * Hkv + h) * G * D;
            attend_head(G, D, s->lo, s->pos, s->rows, q + first, k, v, scale, scores,
                        out + first);
        }
        free(scores);
    }
    return failed ? -1 : 0;
}
