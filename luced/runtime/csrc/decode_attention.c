/* Decode attention: one query per sequence over its own K/V rows (float32, bfloat16 or
 * float16; the arithmetic is float32 either way), for every sequence of a step in one call
 * (luced/runtime/native_attention.py).
 *
 * Each (sequence, KV head) is one task: it stores the token's new K/V row (rotated by RoPE
 * when asked), then scores the head's G grouped queries against rows [lo, pos] (reading each
 * K row once for all G), softmaxes and sums the V rows (each V row read once); a query past
 * one CHUNK of positions is a task per chunk, merged after (see CHUNK). A verify
 * block's queries (one sequence's consecutive positions, each attended as its own decode
 * step) share a task up to QUERY_BLOCK at a time, reading each K row once for all of them.
 * A query's arithmetic depends only on its own inputs, never on how many queries or
 * sequences share the call or on the thread count, so a sequence decoded in a batch gets
 * exactly the outputs it gets alone, and a verify block its decode steps' outputs. */

#include <math.h>
#include <omp.h>
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

/* Element types of the K/V storage (`kv_type` arguments; native_attention.KV_TYPES). */
enum { KV_F32 = 0, KV_BF16 = 1, KV_F16 = 2 };

typedef struct {
    void *k, *v;           /* the layer's K and V storage of this sequence: [Hkv, rows, D] */
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

typedef uint16_t u16x8 __attribute__((vector_size(16)));
typedef uint32_t u32x8 __attribute__((vector_size(32)));
typedef int32_t i32x8 __attribute__((vector_size(32)));

static inline v8 as_v8(u32x8 u)
{
    v8 x;
    memcpy(&x, &u, sizeof x);
    return x;
}

/* Eight K/V elements from row storage of type T (a constant in every inlined copy) as
 * float32, exactly: bfloat16 is the top half of a float32; a float16's exponent and
 * mantissa shifted into place and scaled by 2^112 give its value, subnormals too, and
 * infinities and NaNs keep an all-ones exponent (integer vector ops in every clone, no
 * F16C needed). */
static inline __attribute__((always_inline)) v8 load8_kv(const void *base, int64_t at,
                                                          const int T)
{
    if (T == KV_F32) return load8((const float *)base + at);
    u16x8 h;
    memcpy(&h, (const uint16_t *)base + at, sizeof h);
    const u32x8 u = __builtin_convertvector(h, u32x8);
    if (T == KV_BF16) return as_v8(u << 16);
    const u32x8 em = u & 0x7FFF, sign = (u & 0x8000) << 16;
    const v8 finite = as_v8(em << 13) * 0x1p112f;
    const i32x8 special = (i32x8)(em >= 0x7C00);  /* all ones where inf / NaN */
    u32x8 bits;
    memcpy(&bits, &finite, sizeof bits);
    bits = (bits & ~(u32x8)special) | ((em << 13 | 0x7F800000) & (u32x8)special);
    return as_v8(bits | sign);
}

/* x >> shift rounded to nearest, ties to even (1 <= shift <= 31). */
static inline uint32_t shift_round_even(uint32_t x, int shift)
{
    const uint32_t q = x >> shift, rem = x & ((1u << shift) - 1), half = 1u << (shift - 1);
    return q + (rem > half || (rem == half && (q & 1)));
}

/* float32 -> float16 bits, rounded to nearest even (NaN: a quiet NaN of its sign). */
static uint16_t half_bits(uint32_t u)
{
    const uint16_t sign = (uint16_t)(u >> 16 & 0x8000);
    const uint32_t a = u & 0x7FFFFFFF;
    if (a > 0x7F800000) return sign | 0x7E00;
    if (a >= 0x477FF000) return sign | 0x7C00; /* 65520 and up round to infinity */
    if (a >= 0x38800000) /* a normal half: rebias the exponent, round off 13 bits */
        return sign | (uint16_t)((shift_round_even(a, 13) - (0x38000000 >> 13)));
    /* a subnormal half: the value in units of 2^-24, the implicit bit made explicit */
    const int e = (int)(a >> 23);
    const uint32_t m = (a & 0x7FFFFF) | (e ? 0x800000 : 0);
    const int shift = (e ? 126 - e : 125);
    return sign | (uint16_t)(shift > 25 ? 0 : shift_round_even(m, shift));
}

/* One float32 row into storage of type T, rounded to nearest even as torch's `.to` rounds
 * (a NaN stays a quiet NaN). */
static void store_row(void *base, int64_t at, const float *x, int D, int T)
{
    if (T == KV_F32) {
        memcpy((float *)base + at, x, sizeof(float) * D);
        return;
    }
    uint16_t *out = (uint16_t *)base + at;
    for (int d = 0; d < D; d++) {
        uint32_t u;
        memcpy(&u, x + d, 4);
        if (T == KV_F16)
            out[d] = half_bits(u);
        else if ((u & 0x7FFFFFFFu) > 0x7F800000u)
            out[d] = (uint16_t)((u >> 16) | 0x40);
        else
            out[d] = (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
    }
}

/* The K rows of the task a thread runs next, which it asks the memory for while it weighs
 * this task's V rows (from the caches by then): the K pass of a task then finds its rows
 * arriving, and each pass overlaps one stream of DRAM reads with its arithmetic. */
typedef struct {
    const char *k;
    const int64_t *rows;
    int64_t first, count;
} Ahead;

/* The output rows of GN (1..4, a constant in each inlined copy) grouped queries, whose
 * weights are rows of p `stride` apart, 16 dimensions at a time: the accumulators stay in
 * registers over all L value rows. */
static inline __attribute__((always_inline)) void weigh_values(
    const int GN, const int T, int D, int64_t L, int64_t lo, const int64_t *rows,
    const void *v, const float *p, int64_t stride, float *out, const Ahead *ahead)
{
    const int64_t row_bytes = (T == KV_F32 ? 4 : 2) * (int64_t)D;
    for (int d = 0; d < D; d += 16) {
        v8 acc[4][2] = {{{0}}};
        for (int64_t t = 0; t < L; t++) {
            if (d == 0 && ahead && t < ahead->count) {
                const int64_t at = ahead->first + t;
                const char *row = ahead->k + (ahead->rows ? ahead->rows[at] : at) * row_bytes;
                for (int64_t c = 0; c < row_bytes; c += 64) __builtin_prefetch(row + c, 0, 2);
            }
            const int64_t vt = (rows ? rows[lo + t] : lo + t) * D + d;
            const v8 x0 = load8_kv(v, vt, T), x1 = load8_kv(v, vt + 8, T);
            for (int g = 0; g < GN; g++) {
                const float w = p[g * stride + t];
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

/* Up to this many queries of one sequence at consecutive positions (a verify block, each
 * query as its own decode step) share one task, so each K row is read once for all of
 * them. */
#define QUERY_BLOCK 4

typedef float v4 __attribute__((vector_size(16)));
typedef int32_t i32x4 __attribute__((vector_size(16)));

/* The lane sums of four accumulators, in one order for every dot product:
 * ((x0 + x4) + (x2 + x6)) + ((x1 + x5) + (x3 + x7)), by a transpose of partial sums rather
 * than four horizontal reductions. */
static inline v4 sum4x8(v8 a0, v8 a1, v8 a2, v8 a3)
{
    const v8 a[4] = {a0, a1, a2, a3};
    v4 h[4];
    for (int i = 0; i < 4; i++) {
        v4 lo, hi;
        memcpy(&lo, &a[i], sizeof lo);
        memcpy(&hi, (const char *)&a[i] + sizeof lo, sizeof hi);
        h[i] = lo + hi;  /* lane c: x_c + x_{c+4} */
    }
    const i32x4 even = {0, 4, 1, 5}, odd = {2, 6, 3, 7}, low = {0, 1, 4, 5}, high = {2, 3, 6, 7};
    /* q01 = [h0(0+2), h1(0+2), h0(1+3), h1(1+3)], likewise q23 for h2 and h3 */
    const v4 q01 = __builtin_shuffle(h[0], h[1], even) + __builtin_shuffle(h[0], h[1], odd);
    const v4 q23 = __builtin_shuffle(h[2], h[3], even) + __builtin_shuffle(h[2], h[3], odd);
    return __builtin_shuffle(q01, q23, low) + __builtin_shuffle(q01, q23, high);
}

/* The scaled dot products of GN (1..4, a constant in each inlined copy) query rows, each
 * `D` apart from q, with the four K rows at element offsets kt -> out[r][i]. Each K vector
 * is loaded once for the GN rows. The only way a score is computed, so a query scores a
 * key alike alone, in a block or with any GN. */
static inline __attribute__((always_inline)) void score_rows(
    const int GN, const int T, int D, const float *q, const void *k, const int64_t *kt,
    float scale, v4 *out)
{
    v8 acc[4][4] = {{{0}}};
    for (int d = 0; d < D; d += 8) {
        const v8 k0 = load8_kv(k, kt[0] + d, T), k1 = load8_kv(k, kt[1] + d, T);
        const v8 k2 = load8_kv(k, kt[2] + d, T), k3 = load8_kv(k, kt[3] + d, T);
        for (int r = 0; r < GN; r++) {
            const v8 x = load8(q + (int64_t)r * D + d);
            acc[r][0] += x * k0;
            acc[r][1] += x * k1;
            acc[r][2] += x * k2;
            acc[r][3] += x * k3;
        }
    }
    for (int r = 0; r < GN; r++) out[r] = sum4x8(acc[r][0], acc[r][1], acc[r][2], acc[r][3]) * scale;
}

/* One KV head of a block of n (1..QUERY_BLOCK) queries at consecutive positions: query j
 * (its G grouped heads at q[j]) scores rows [lo[j], pos[j]] into its own score rows
 * (stride `stride`), softmaxes them and sums the V rows into out[j]. When those rows are one
 * chunk of the query's (partial[j] set), the weights are left unnormalized and each head's
 * largest score and sum of weights go to partial[j] ([G] then [G]). Four keys are scored
 * together for up to four query heads at a time, so sixteen dot products' dependency
 * chains overlap, and each K row is read once for the whole block. Every query's
 * arithmetic is the one it gets alone (n = 1). */
static inline __attribute__((always_inline)) void attend_head_as(
    const int T, int G, int D, int n, const int64_t *lo, const int64_t *pos,
    const int64_t *rows, const float *const *q, const void *k, const void *v, float scale,
    float *scores, int64_t stride, float *const *out, float *const *partial, int64_t k_ready,
    const Ahead *ahead)
{
    const int64_t first = lo[0], last = pos[n - 1];
    const int64_t row_bytes = (T == KV_F32 ? 4 : 2) * (int64_t)D;
    for (int64_t a = first; a <= last; a += 4) {
        int64_t kt[4];  /* element offsets of the four rows */
        for (int i = 0; i < 4; i++) {  /* past the end: the last row again, not stored */
            const int64_t at = a + i <= last ? a + i : last;
            kt[i] = (rows ? rows[at] : at) * D;
            /* V rows (read after the softmax), and the K rows past the first k_ready, which
             * the previous task asked for already */
            if (a + i + PREFETCH <= last) {
                const int64_t row = (rows ? rows[at + PREFETCH] : at + PREFETCH) * row_bytes;
                const int fetch_k = at + PREFETCH - first >= k_ready;
                for (int64_t c = 0; c < row_bytes; c += 64) {
                    if (fetch_k) __builtin_prefetch((const char *)k + row + c);
                    __builtin_prefetch((const char *)v + row + c, 0, 2);
                }
            }
        }
        for (int j = 0; j < n; j++) {
            if (a + 3 < lo[j] || a > pos[j]) continue;  /* no key of the four it attends */
            for (int g = 0; g < G; g += 4) {
                v4 dots[4];
                const float *qg = q[j] + (int64_t)g * D;
                switch (G - g < 4 ? G - g : 4) {
                    case 4: score_rows(4, T, D, qg, k, kt, scale, dots); break;
                    case 3: score_rows(3, T, D, qg, k, kt, scale, dots); break;
                    case 2: score_rows(2, T, D, qg, k, kt, scale, dots); break;
                    default: score_rows(1, T, D, qg, k, kt, scale, dots); break;
                }
                for (int r = 0; r < 4 && g + r < G; r++)
                    for (int i = 0; i < 4; i++)
                        if (a + i >= lo[j] && a + i <= pos[j])
                            scores[(j * G + g + r) * stride + a + i - lo[j]] = dots[r][i];
            }
        }
    }
    for (int j = 0; j < n; j++) {
        const int64_t L = pos[j] - lo[j] + 1;
        for (int g = 0; g < G; g++) {
            float *s = scores + (j * G + g) * stride;
            float top = s[0];
#pragma omp simd reduction(max : top)
            for (int64_t t = 1; t < L; t++) top = s[t] > top ? s[t] : top;
            float total = 0.0f;
#pragma omp simd reduction(+ : total)
            for (int64_t t = 0; t < L; t++) {
                s[t] = exp_nonpositive(s[t] - top);
                total += s[t];
            }
            if (partial[j] != NULL) { /* one chunk of the query's rows: merged later */
                partial[j][g] = top;
                partial[j][G + g] = total;
                continue;
            }
            const float inv = 1.0f / total;
#pragma omp simd
            for (int64_t t = 0; t < L; t++) s[t] *= inv;
        }
        for (int g = 0; g < G; g += 4) {
            const float *p = scores + (j * G + g) * stride;
            float *o = out[j] + (int64_t)g * D;
            const Ahead *a = j == n - 1 && g == 0 ? ahead : NULL;
            switch (G - g < 4 ? G - g : 4) {
                case 4: weigh_values(4, T, D, L, lo[j], rows, v, p, stride, o, a); break;
                case 3: weigh_values(3, T, D, L, lo[j], rows, v, p, stride, o, a); break;
                case 2: weigh_values(2, T, D, L, lo[j], rows, v, p, stride, o, a); break;
                default: weigh_values(1, T, D, L, lo[j], rows, v, p, stride, o, a); break;
            }
        }
    }
}

/* attend_head_as compiled once per storage type. */
#define ATTEND_HEAD(NAME, T)                                                             \
    VECTOR_CLONES __attribute__((optimize("fp-contract=fast"))) static void NAME(         \
        int G, int D, int n, const int64_t *lo, const int64_t *pos, const int64_t *rows,  \
        const float *const *q, const void *k, const void *v, float scale, float *scores,  \
        int64_t stride, float *const *out, float *const *partial, int64_t k_ready,        \
        const Ahead *ahead)                                                              \
    {                                                                                    \
        attend_head_as(T, G, D, n, lo, pos, rows, q, k, v, scale, scores, stride, out,    \
                       partial, k_ready, ahead);                                         \
    }
ATTEND_HEAD(attend_head_f32, KV_F32)
ATTEND_HEAD(attend_head_bf16, KV_BF16)
ATTEND_HEAD(attend_head_f16, KV_F16)

/* The ABI luced/runtime/native_attention.py binds (its LIBRARY, checked at load by
 * native_build): bump both with any change to an exported signature or to SequenceKV. */
#define ABI_VERSION 1

int luced_abi_version(void)
{
    return ABI_VERSION;
}

/* The size of a struct the bindings mirror, by name; -1 for a name this build lacks. */
int64_t luced_sizeof(const char *name)
{
    return strcmp(name, "SequenceKV") == 0 ? (int64_t)sizeof(SequenceKV) : -1;
}

/* The storage types this build reads: bit t set for type t. */
int decode_attention_kv_types(void)
{
    return 1 << KV_F32 | 1 << KV_BF16 | 1 << KV_F16;
}

/* Whether entry b follows entry a as the same sequence's next query over rows stored
 * already: the two may share a task. */
static int continues(const SequenceKV *a, const SequenceKV *b)
{
    return a->k == b->k && a->v == b->v && a->rows == b->rows &&
           a->head_stride == b->head_stride && b->pos == a->pos + 1 && b->lo >= a->lo;
}

/* Rows per chunk of a long query. A query whose rows reach past one chunk is attended
 * chunk by chunk, each chunk a task of its own, and the chunks' partial softmaxes are merged
 * after (flash decoding): one long sequence then keeps every thread busy, where a task per
 * KV head left threads idle (SmolLM2 has 3 KV heads, Gemma 3 270M one). Chunks are fixed
 * ranges of positions, [c * CHUNK, (c + 1) * CHUNK), so how a query is cut depends on its
 * positions only, never on the batch, the block or the thread count. A query inside one
 * chunk is attended whole, as it always was. */
#define CHUNK 512

typedef struct {
    int block, head;
    int64_t chunk;
} Task;

/* Task t of the call (tasks [task0[i], task0[i + 1]) are block i's: its chunks in order, a
 * task per KV head each). */
static Task locate(int64_t t, const int64_t *task0, int blocks, const int64_t *chunk0,
                   const int *first, int Hkv)
{
    int lo = 0, hi = blocks; /* the block with task0[i] <= t < task0[i + 1] */
    while (hi - lo > 1) {
        const int mid = (lo + hi) / 2;
        if (task0[mid] <= t) lo = mid;
        else hi = mid;
    }
    const int64_t within = t - task0[lo];
    const Task task = {lo, (int)(within % Hkv), chunk0[first[lo]] + within / Hkv};
    return task;
}

/* One KV head's long query: its chunks' outputs o [n][G][D] (weighted by unnormalized
 * weights) with each head's largest score and weight sum, marks [n][2][G], merged into out
 * [G][D]; in chunk order, the same for every call. */
static void merge_chunks(int G, int D, int64_t n, const float *marks, const float *o,
                         float *out)
{
    for (int g = 0; g < G; g++) {
        float top = marks[g];
        for (int64_t c = 1; c < n; c++) top = marks[c * 2 * G + g] > top ? marks[c * 2 * G + g] : top;
        float total = 0.0f;
        float *acc = out + (int64_t)g * D;
        for (int d = 0; d < D; d++) acc[d] = 0.0f;
        for (int64_t c = 0; c < n; c++) {
            const float w = exp_nonpositive(marks[c * 2 * G + g] - top);
            total += w * marks[c * 2 * G + G + g];
            const float *oc = o + (c * G + g) * D;
            for (int d = 0; d < D; d++) acc[d] += w * oc[d];
        }
        const float inv = 1.0f / total;
        for (int d = 0; d < D; d++) acc[d] *= inv;
    }
}

/* q: sequence b's query heads [Hkv * G, D] at q + b * ldq; k_new, v_new: its new K/V rows
 * [Hkv, D] at k_new + b * ldkv (views into one Q/K/V projection output), or NULL for a layer
 * that reads another layer's rows (KV sharing) and stores none, or for rows stored already.
 * Without new rows, entries that are one sequence's consecutive queries (a verify block,
 * each query as its own decode step) share tasks, QUERY_BLOCK queries at a time.
 * rope_dims > 0: rotate the queries and the new keys first, by each sequence's cos/sin
 * rows. kv_type: the storage's element type (KV_F32, KV_BF16, KV_F16); new rows are
 * rounded to it as they are stored. out: [B, Hkv * G, D]. Returns 0, -1 if scratch memory
 * could not be had, or -2 for a storage type this build does not read
 * (decode_attention_kv_types). */
int decode_attention(int B, int Hkv, int G, int D, const float *q, int64_t ldq,
                     const float *k_new, const float *v_new, int64_t ldkv,
                     const SequenceKV *seqs, int rope_dims, float scale, float *out,
                     int threads, int kv_type)
{
    if (kv_type < 0 || kv_type > KV_F16 || !(decode_attention_kv_types() >> kv_type & 1))
        return -2;
    if (B <= 0) return 0;
    const size_t elem = kv_type == KV_F32 ? 4 : 2;
    /* per entry: its first chunk, its chunk count, and its first partial record (a record:
     * one head's G queries over one chunk) when it spans more than one chunk */
    int64_t *chunk0 = malloc(sizeof(int64_t) * 3 * ((size_t)B + 1));
    int *first = malloc(sizeof(int) * ((size_t)B + 1));
    if (chunk0 == NULL || first == NULL) {
        free(chunk0);
        free(first);
        return -1;
    }
    int64_t *chunks = chunk0 + B + 1, *record = chunks + B + 1;
    int64_t longest = 1, records = 0;
    for (int b = 0; b < B; b++) {
        const int64_t L = seqs[b].pos - seqs[b].lo + 1;
        longest = L > longest ? L : longest;
        chunk0[b] = seqs[b].lo / CHUNK;
        chunks[b] = seqs[b].pos / CHUNK - chunk0[b] + 1;
        record[b] = records;
        if (chunks[b] > 1) records += chunks[b] * Hkv;
    }
    const int64_t span = longest < CHUNK ? longest : CHUNK; /* rows a task scores at most */
    /* the tasks' blocks of entries: block i is entries [first[i], first[i + 1]) */
    int blocks = 0;
    for (int b = 0; b < B; b++) {
        const int joins = b > 0 && k_new == NULL && b - first[blocks - 1] < QUERY_BLOCK &&
                          continues(&seqs[b - 1], &seqs[b]);
        if (!joins) first[blocks++] = b;
    }
    first[blocks] = B;
    /* tasks: (block, chunk, head) for every chunk a block's rows touch; block i's are
     * [task0[i], task0[i + 1]) */
    int64_t *task0 = malloc(sizeof(int64_t) * ((size_t)blocks + 1));
    float *marks = records ? malloc(sizeof(float) * (size_t)(records * G * 2)) : NULL;
    float *partials = records ? malloc(sizeof(float) * (size_t)(records * G * D)) : NULL;
    if (task0 == NULL || (records && (marks == NULL || partials == NULL))) {
        free(task0), free(marks), free(partials), free(chunk0), free(first);
        return -1;
    }
    task0[0] = 0;
    for (int i = 0; i < blocks; i++) {
        const int64_t last_chunk = seqs[first[i + 1] - 1].pos / CHUNK;
        task0[i + 1] = task0[i] + (last_chunk - chunk0[first[i]] + 1) * Hkv;
    }
    const int64_t tasks = task0[blocks];
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        /* scores [QUERY_BLOCK * G, span], then rotated queries [QUERY_BLOCK * G, D], then
         * one row [D] */
        const size_t heads = (size_t)QUERY_BLOCK * (size_t)G;
        const size_t floats = heads * ((size_t)span + (size_t)D) + (size_t)D;
        float *scores = malloc(sizeof(float) * floats);
        if (scores == NULL) failed = 1;
        /* each thread a run of consecutive tasks (as schedule(static) would), so it knows
         * the task it runs next and can fetch its K rows ahead */
        const int team = omp_get_num_threads(), me = omp_get_thread_num();
        const int64_t begin = tasks * me / team, end = tasks * (me + 1) / team;
        int64_t k_ready = 0; /* leading K rows of this task the previous one asked for */
        Task at = locate(begin, task0, blocks, chunk0, first, Hkv);
        for (int64_t task = begin; task < end && scores != NULL; task++) {
            const Task next = locate(task + 1, task0, blocks, chunk0, first, Hkv);
            const int i = at.block, h = at.head;
            const int64_t c = at.chunk, row0 = c * CHUNK, row1 = row0 + CHUNK - 1;
            const SequenceKV *s0 = &seqs[first[i]];
            char *k = (char *)s0->k + h * s0->head_stride * elem;
            char *v = (char *)s0->v + h * s0->head_stride * elem;
            Ahead ahead = {NULL, NULL, 0, 0};
            if (task + 1 < end) {
                const SequenceKV *a = &seqs[first[next.block]];
                const int64_t lo = a->lo > next.chunk * CHUNK ? a->lo : next.chunk * CHUNK;
                const int64_t hi = seqs[first[next.block + 1] - 1].pos;
                const int64_t top = next.chunk * CHUNK + CHUNK - 1;
                ahead.k = (const char *)a->k + next.head * a->head_stride * elem;
                ahead.rows = a->rows;
                ahead.first = lo;
                ahead.count = (hi < top ? hi : top) - lo + 1;
            }
            float *rotated = scores + heads * (size_t)span;
            int64_t lo[QUERY_BLOCK], pos[QUERY_BLOCK];
            const float *qs[QUERY_BLOCK];
            float *outs[QUERY_BLOCK], *parts[QUERY_BLOCK];
            int n = 0; /* the block's queries with rows in this chunk */
            for (int b = first[i]; b < first[i + 1]; b++) {
                const SequenceKV *s = &seqs[b];
                if (s->lo > row1 || s->pos < row0) continue;
                const float *qh = q + b * ldq + (int64_t)h * G * D;
                if (rope_dims > 0) {
                    float *r = rotated + (size_t)n * G * D;
                    for (int g = 0; g < G; g++)
                        rope_row(D, rope_dims, qh + g * D, s->cos, s->sin, r + g * D);
                    qh = r;
                }
                /* a block of one stores its own row, in the task of the chunk that holds it */
                if (k_new != NULL && s->pos <= row1) {
                    const int64_t from = b * ldkv + (int64_t)h * D;
                    const int64_t to = (s->rows ? s->rows[s->pos] : s->pos) * D;
                    const float *key = k_new + from;
                    if (rope_dims > 0) {
                        float *row = rotated + heads * (size_t)D;
                        rope_row(D, rope_dims, key, s->cos, s->sin, row);
                        key = row;
                    }
                    store_row(k, to, key, D, kv_type);
                    store_row(v, to, v_new + from, D, kv_type);
                }
                lo[n] = s->lo > row0 ? s->lo : row0;
                pos[n] = s->pos < row1 ? s->pos : row1;
                qs[n] = qh;
                if (chunks[b] == 1) {
                    outs[n] = out + ((int64_t)b * Hkv + h) * G * D;
                    parts[n] = NULL;
                } else {
                    const int64_t r = record[b] + h * chunks[b] + c - chunk0[b];
                    outs[n] = partials + r * G * D;
                    parts[n] = marks + r * G * 2;
                }
                n++;
            }
            if (n == 0) { /* cannot happen: a block's rows are one run of positions */
                at = next;
                continue;
            }
            switch (kv_type) {
                case KV_F32:
                    attend_head_f32(G, D, n, lo, pos, s0->rows, qs, k, v, scale, scores, span,
                                    outs, parts, k_ready, &ahead);
                    break;
                case KV_BF16:
                    attend_head_bf16(G, D, n, lo, pos, s0->rows, qs, k, v, scale, scores, span,
                                     outs, parts, k_ready, &ahead);
                    break;
                default:
                    attend_head_f16(G, D, n, lo, pos, s0->rows, qs, k, v, scale, scores, span,
                                    outs, parts, k_ready, &ahead);
                    break;
            }
            /* the values pass of the last query covered its L rows, asking for as many */
            const int64_t covered = pos[n - 1] - lo[n - 1] + 1;
            k_ready = ahead.count < covered ? ahead.count : covered;
            at = next;
        }
        free(scores);
        if (records) {
            /* every chunk is attended: merge each long query's chunks, in chunk order */
#pragma omp barrier
            const int64_t pairs = (int64_t)B * Hkv;
            for (int64_t p = pairs * me / team; p < pairs * (me + 1) / team; p++) {
                const int b = (int)(p / Hkv), h = (int)(p % Hkv);
                if (chunks[b] > 1)
                    merge_chunks(G, D, chunks[b], marks + (record[b] + h * chunks[b]) * G * 2,
                                 partials + (record[b] + h * chunks[b]) * G * D,
                                 out + ((int64_t)b * Hkv + h) * G * D);
            }
        }
    }
    free(task0), free(marks), free(partials), free(chunk0), free(first);
    return failed ? -1 : 0;
}
