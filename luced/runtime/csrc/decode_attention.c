/* Decode attention: one query per sequence over its own float32 K/V rows, for every
 * sequence of a step in one call (luced/runtime/native_attention.py).
 *
 * Each (sequence, KV head) is one task: it stores the token's new K/V row (rotated by RoPE
 * when asked), then scores the head's G grouped queries against rows [lo, pos] (reading each
 * K row once for all G), softmaxes and sums the V rows (each V row read once). A task's arithmetic depends only on
 * its own inputs, never on how many sequences share the call or on the thread count, so a
 * sequence decoded in a batch gets exactly the outputs it gets alone. */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "fastmath.h"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
/* One build for every x86-64 machine: the loader picks the widest vectors the CPU has. */
#define VECTOR_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define VECTOR_CLONES
#endif

typedef struct {
    float *k, *v;          /* the layer's K and V storage of this sequence: [Hkv, rows, D] */
    const int64_t *rows;   /* the storage row of each position (a paged pool), or NULL:
                              position i in row i */
    int64_t head_stride;   /* elements between heads (rows * D) */
    int64_t pos;           /* the query's position: the last one attended (and its K/V row
                              is written first when new rows are given) */
    int64_t lo;            /* the first position attended (a sliding window's start) */
    const float *cos, *sin; /* RoPE table rows of position pos (rope_dims each; sin's first
                               half negated), when the call rotates q and the new k */
} SequenceKV;

/* Rotate-half RoPE of one head's row x [D] into out: the first rd dimensions rotate,
 * x * cos + roll(x, rd / 2) * sin, the rest are copied. Two rounded products and a
 * rounded sum per element, as the torch expression `layers.apply_rope` computes, so the
 * rows stored here equal the rows a torch-roped write stores, bit for bit. */
static void rope_row(int D, int rd, const float *x, const float *cos, const float *sin,
                     float *out)
{
    const int half = rd / 2;
    for (int d = 0; d < rd; d++) {
        const float a = x[d] * cos[d];
        const float b = x[d < half ? d + half : d - half] * sin[d];
        out[d] = a + b;
    }
    for (int d = rd; d < D; d++) out[d] = x[d];
}

/* Eight floats as one vector (GCC's vector extension): one ymm, or two xmm in the default
 * clone. Head dimensions are multiples of 16 (native_attention.supported). The helpers
 * below are inlined into each clone, so the ABI note GCC gives for vector returns in the
 * default target does not apply. */
typedef float v8 __attribute__((vector_size(32)));

/* Rows ahead that a loop over K or V rows asks the memory for (a step's K/V of every
 * layer is far larger than the caches, so the rows come from DRAM). */
#define PREFETCH 8
#pragma GCC diagnostic ignored "-Wpsabi"

static inline v8 load8(const float *p)
{
    v8 x;
    memcpy(&x, p, sizeof x);
    return x;
}

static inline float sum8(v8 x)
{
    return ((x[0] + x[4]) + (x[1] + x[5])) + ((x[2] + x[6]) + (x[3] + x[7]));
}

/* The output rows of GN (1..4, a constant in each inlined copy) grouped queries, 16
 * dimensions at a time: the accumulators stay in registers over all L value rows. */
static inline __attribute__((always_inline)) void weigh_values(
    const int GN, int D, int64_t L, int64_t lo, const int64_t *rows, const float *v,
    const float *p, float *out)
{
    for (int d = 0; d < D; d += 16) {
        v8 acc[4][2] = {{{0}}};
        for (int64_t t = 0; t < L; t++) {
            const float *vt = v + (rows ? rows[lo + t] : lo + t) * D + d;

            const v8 x0 = load8(vt), x1 = load8(vt + 8);
            for (int g = 0; g < GN; g++) {
                const float w = p[g * L + t];
                acc[g][0] += w * x0;
                acc[g][1] += w * x1;
            }
        }
        for (int g = 0; g < GN; g++) {
            memcpy(out + (int64_t)g * D + d, &acc[g][0], sizeof(v8));
            memcpy(out + (int64_t)g * D + d + 8, &acc[g][1], sizeof(v8));
        }
    }
}

/* One KV head: scores of G queries against rows [lo, pos], softmax, weighted sum of values.
 * Four keys are scored together, so four dot products' dependency chains overlap and each
 * K row is read once for all G queries. */
VECTOR_CLONES __attribute__((optimize("fp-contract=fast")))
static void attend_head(int G, int D, int64_t lo, int64_t pos, const int64_t *rows,
                        const float *q, const float *k, const float *v, float scale,
                        float *scores, float *out)
{
    const int64_t L = pos - lo + 1;
    for (int64_t t = 0; t < L; t += 4) {
        const float *kt[4];
        for (int i = 0; i < 4; i++) {  /* past the end: the last row again, not stored */
            const int64_t at = lo + (t + i < L ? t + i : L - 1);
            kt[i] = k + (rows ? rows[at] : at) * D;
            if (t + i + PREFETCH < L) { /* V too: its rows are read after the softmax */
                const int64_t row = (rows ? rows[at + PREFETCH] : at + PREFETCH) * D;
                for (int c = 0; c < D; c += 16) {
                    __builtin_prefetch(k + row + c);
                    __builtin_prefetch(v + row + c, 0, 2);
                }
            }
        }
        for (int g = 0; g < G; g++) {
            const float *qg = q + (int64_t)g * D;
            v8 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
            for (int d = 0; d < D; d += 8) {
                const v8 x = load8(qg + d);
                a0 += x * load8(kt[0] + d);
                a1 += x * load8(kt[1] + d);
                a2 += x * load8(kt[2] + d);
                a3 += x * load8(kt[3] + d);
            }
            const float dots[4] = {sum8(a0), sum8(a1), sum8(a2), sum8(a3)};
            for (int i = 0; i < 4 && t + i < L; i++) scores[g * L + t + i] = dots[i] * scale;
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
    for (int g = 0; g < G; g += 4) {
        const float *p = scores + g * L;
        float *o = out + (int64_t)g * D;
        switch (G - g < 4 ? G - g : 4) {
            case 4: weigh_values(4, D, L, lo, rows, v, p, o); break;
            case 3: weigh_values(3, D, L, lo, rows, v, p, o); break;
            case 2: weigh_values(2, D, L, lo, rows, v, p, o); break;
            default: weigh_values(1, D, L, lo, rows, v, p, o); break;
        }
    }
}

/* q: sequence b's query heads [Hkv * G, D] at q + b * ldq; k_new, v_new: its new K/V rows
 * [Hkv, D] at k_new + b * ldkv (views into one Q/K/V projection output), or NULL for a layer
 * that reads another layer's rows (KV sharing) and stores none. rope_dims > 0: rotate the
 * queries and the new keys first, by each sequence's cos/sin rows. out: [B, Hkv * G, D].
 * Returns 0, or -1 if scratch memory could not be had. */
int decode_attention(int B, int Hkv, int G, int D, const float *q, int64_t ldq,
                     const float *k_new, const float *v_new, int64_t ldkv,
                     const SequenceKV *seqs, int rope_dims, float scale, float *out,
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
        /* scores [G, longest], then the task's rotated queries [G, D] */
        float *scores = malloc(sizeof(float) * (size_t)G * ((size_t)longest + (size_t)D));
        if (scores == NULL) failed = 1;
#pragma omp for schedule(static)
        for (int task = 0; task < B * Hkv; task++) {
            if (scores == NULL) continue;
            const int b = task / Hkv, h = task % Hkv;
            const SequenceKV *s = &seqs[b];
            float *k = s->k + h * s->head_stride, *v = s->v + h * s->head_stride;
            const float *qh = q + b * ldq + (int64_t)h * G * D;
            if (rope_dims > 0) {
                float *rotated = scores + (size_t)G * (size_t)longest;
                for (int g = 0; g < G; g++)
                    rope_row(D, rope_dims, qh + g * D, s->cos, s->sin, rotated + g * D);
                qh = rotated;
            }
            if (k_new != NULL) {
                const int64_t from = b * ldkv + (int64_t)h * D;
                const int64_t to = (s->rows ? s->rows[s->pos] : s->pos) * D;
                if (rope_dims > 0)
                    rope_row(D, rope_dims, k_new + from, s->cos, s->sin, k + to);
                else
                    memcpy(k + to, k_new + from, sizeof(float) * D);
                memcpy(v + to, v_new + from, sizeof(float) * D);
            }
            attend_head(G, D, s->lo, s->pos, s->rows, qh, k, v, scale, scores,
                        out + ((int64_t)b * Hkv + h) * G * D);
        }
        free(scores);
    }
    return failed ? -1 : 0;
}
