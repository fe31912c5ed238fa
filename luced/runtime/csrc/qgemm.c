/* Integer-dot kernels for luced's packed weights: y[m, n] = sum_k x[m, k] * w[n, k].
 *
 * Activations are quantized per row and per 32-wide block to int8 (scale absmax / 127) with
 * each block's sum of codes, or to two int8 levels acting as one 16-bit code (levels = 2,
 * see quantize_row); weights stay int4 (per-group scale and zero) or int8 (per-row scale).
 * Each 32-wide block is an exact integer dot product, scaled in float32.
 *
 * Weight layout (built by luced/runtime/native.py): output rows in blocks of NR = 16, each
 * block a run of K / 32 group records, so one vector load holds 16 rows x 4 inputs and a
 * 4-byte activation broadcast feeds them all (no horizontal sums):
 *
 *   int4 codes [N / 16][K / 32][256] bytes: byte v*64 + r*4 + i (v 0..3, row r 0..15,
 *        i 0..3) holds code(r, 4v + i) in its low nibble and code(r, 16 + 4v + i) in its high
 *        nibble; sz [N / 16][K / 32][2][16] bf16: the 16 rows' scales, then their zeros.
 *        w = (q - 8) * scale + zero, so a group's dot is
 *        dx * (scale * (sum q*xq - 8 * sum xq) + zero * sum xq).
 *   int8 codes [N / 16][K / 32][512] int8 (K zero-padded to 32): byte j*64 + r*4 + i holds
 *        code(r, 4j + i); scale [N padded to 16] float32 per row.
 *
 * A call may transform its input rows before quantizing them (an RMSNorm, or a gated
 * activation act(gate) * up over rows [gate | up]) and add a residual to its outputs, so a
 * decoder layer's small ops ride along with its matrix products (`PackedLinear.fused`).
 *
 * Variants: AVX512-VNNI, AVX2 (+FMA) and portable C, all built into one library with a
 * target attribute per function; the caller picks one by CPU flags. Batch invariance: each
 * output is computed by one thread, over the groups in order, with the same instructions
 * whatever M is, whichever tile of rows it sits in and however many threads run, so a row's
 * result never depends on the rows that came with it.
 */

#if defined(__x86_64__)
#include <immintrin.h>
#define HAVE_X86 1
#endif
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "fastmath.h"

#define NR 16 /* output rows per weight block */
#define G 32  /* inputs per group */
#define MR 4  /* activation rows sharing one weight load */

enum { ISA_SCALAR = 0, ISA_AVX2 = 1, ISA_AVX512_VNNI = 2 }; /* `isa` arguments (native.ISAS) */

/* One activation row, quantized: codes [kp] (and q2, the second level), then per group the
 * scale d of the combined code, its sum s and d * s (the zero point's factor). */
typedef struct {
    const int8_t *q, *q2;
    const float *d;
    const int32_t *s;
    const float *ds;
} xrow;

/* ------------------------------------------------------------------ activation quantization */

/* What a call does to each input row before quantizing it (`input` arguments). */
enum { IN_PLAIN = 0, IN_RMS_NORM = 1, IN_SILU_GATE = 2, IN_GELU_GATE = 3 };

typedef struct {
    int kind;
    const float *norm; /* IN_RMS_NORM: the weight [k], or NULL for none */
    float eps;
} input_op;

/* The row the products see: x itself, x * rsqrt(mean(x^2) + eps) * norm, or act(x[:k]) *
 * x[k:2k] for a gate; written to buf (k floats) unless plain. Per row and in a fixed order,
 * so a row's values never depend on the rows beside it. */
static inline __attribute__((always_inline)) const float *input_row(const float *x, int64_t k,
                                                                   const input_op *op,
                                                                   float *buf) {
    switch (op->kind) {
        case IN_RMS_NORM: {
            float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
            for (int64_t i = 0; i < k; i++) ss += x[i] * x[i];
            const float r = 1.0f / sqrtf(ss / (float)k + op->eps);
            if (op->norm)
#pragma omp simd
                for (int64_t i = 0; i < k; i++) buf[i] = x[i] * r * op->norm[i];
            else
#pragma omp simd
                for (int64_t i = 0; i < k; i++) buf[i] = x[i] * r;
            return buf;
        }
        case IN_SILU_GATE:
#pragma omp simd
            for (int64_t i = 0; i < k; i++) buf[i] = silu(x[i]) * x[k + i];
            return buf;
        case IN_GELU_GATE:
#pragma omp simd
            for (int64_t i = 0; i < k; i++) buf[i] = gelu_tanh(x[i]) * x[k + i];
            return buf;
        default:
            return x;
    }
}

/* Shared by every variant (inlined into each, so the compiler vectorizes it for that ISA):
 * max, rint and integer sums are exact in any order, so all variants give the same codes.
 * With q2 (two levels) the residual x - d*q, at most d/2, is quantized again with step d/256,
 * and the pair stands for the 16-bit code 256*q + q2 with scale d/256: a dot product becomes
 * (dot(q) << 8) + dot(q2), still exact in int32. (A residual past 127.5 fine steps clamps to
 * 127: one fine step off, rarely.) */
static inline __attribute__((always_inline)) void quantize_row(const float *x, int64_t k,
                                                                int64_t kp, int8_t *q,
                                                                int8_t *q2, float *d, int32_t *s,
                                                                float *ds) {
    for (int64_t g = 0; g < kp / G; g++) {
        float blk[G], v[G];
        int32_t qi[G];
        int64_t n = k - g * G < G ? k - g * G : G;
        if (n == G)
            memcpy(blk, x + g * G, sizeof blk);
        else
            for (int i = 0; i < G; i++) blk[i] = i < n ? x[g * G + i] : 0.0f;
        /* simple loops over 32 lanes, so each variant's compiler vectorizes them; ternaries,
         * not fmaxf/fminf, which keep NaN rules and stay library calls */
        float amax = 0.0f;
        for (int i = 0; i < G; i++) amax = fabsf(blk[i]) > amax ? fabsf(blk[i]) : amax;
        const float dg = amax / 127.0f;
        const float id = dg > 0.0f ? 1.0f / dg : 0.0f;
        int32_t sum = 0, sum2 = 0;
        for (int i = 0; i < G; i++) {
            float t = rintf(blk[i] * id);
            v[i] = t > 127.0f ? 127.0f : t < -127.0f ? -127.0f : t;
            qi[i] = (int32_t)v[i];
        }
        for (int i = 0; i < G; i++) {
            q[g * G + i] = (int8_t)qi[i];
            sum += qi[i];
        }
        if (q2) {
            const float id2 = id * 256.0f;
            for (int i = 0; i < G; i++) {
                float t = rintf((blk[i] - v[i] * dg) * id2);
                qi[i] = (int32_t)(t > 127.0f ? 127.0f : t < -127.0f ? -127.0f : t);
            }
            for (int i = 0; i < G; i++) {
                q2[g * G + i] = (int8_t)qi[i];
                sum2 += qi[i];
            }
        }
        const float dc = q2 ? dg * (1.0f / 256.0f) : dg;
        const int32_t sc = q2 ? sum * 256 + sum2 : sum;
        d[g] = dc;
        s[g] = sc;
        ds[g] = dc * (float)sc;
    }
}

static inline int32_t load_i32(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return v;
}

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* Where a block's 16 outputs go: straight into y unless the block runs past N. */
static inline void store_block(float *y, const float *acc, int64_t nvalid) {
    memcpy(y, acc, (size_t)(nvalid < NR ? nvalid : NR) * sizeof(float));
}

/* ------------------------------------------------------------------ portable C */

static void int4_block_scalar(const uint8_t *w, const uint16_t *sz, int64_t groups,
                              const xrow *xs, int mr, float *y, int64_t ldy, int64_t nvalid) {
    for (int m = 0; m < mr; m++) {
        float acc[NR] = {0};
        for (int64_t g = 0; g < groups; g++) {
            const uint8_t *b = w + g * 256;
            const int8_t *xq = xs[m].q + g * G, *xq2 = xs[m].q2 ? xs[m].q2 + g * G : NULL;
            for (int r = 0; r < NR; r++) {
                int32_t dot = 0, dot2 = 0;
                for (int v = 0; v < 4; v++)
                    for (int i = 0; i < 4; i++) {
                        uint8_t byte = b[v * 64 + r * 4 + i];
                        int lo = byte & 15, hi = byte >> 4;
                        dot += lo * xq[4 * v + i] + hi * xq[16 + 4 * v + i];
                        if (xq2) dot2 += lo * xq2[4 * v + i] + hi * xq2[16 + 4 * v + i];
                    }
                if (xq2) dot = dot * 256 + dot2;
                float f = (float)(dot - 8 * xs[m].s[g]) * bf16_to_f32(sz[g * 32 + r]);
                acc[r] += f * xs[m].d[g];
                acc[r] += bf16_to_f32(sz[g * 32 + 16 + r]) * xs[m].ds[g];
            }
        }
        store_block(y + m * ldy, acc, nvalid);
    }
}

static void int8_block_scalar(const int8_t *w, const float *scale, int64_t groups,
                              const xrow *xs, int mr, float *y, int64_t ldy, int64_t nvalid) {
    for (int m = 0; m < mr; m++) {
        float acc[NR] = {0};
        for (int64_t g = 0; g < groups; g++) {
            const int8_t *b = w + g * 512;
            const int8_t *xq = xs[m].q + g * G, *xq2 = xs[m].q2 ? xs[m].q2 + g * G : NULL;
            for (int r = 0; r < NR; r++) {
                int32_t dot = 0, dot2 = 0;
                for (int j = 0; j < 8; j++)
                    for (int i = 0; i < 4; i++) {
                        dot += b[j * 64 + r * 4 + i] * xq[4 * j + i];
                        if (xq2) dot2 += b[j * 64 + r * 4 + i] * xq2[4 * j + i];
                    }
                if (xq2) dot = dot * 256 + dot2;
                acc[r] += (float)dot * xs[m].d[g];
            }
        }
        for (int r = 0; r < NR; r++) acc[r] *= scale[r];
        store_block(y + m * ldy, acc, nvalid);
    }
}

static void quantize_scalar(const float *x, int64_t k, int64_t kp, int8_t *q, int8_t *q2,
                          float *d, int32_t *s, float *ds, const input_op *op, float *buf) {
    quantize_row(input_row(x, k, op, buf), k, kp, q, q2, d, s, ds);
}

#ifdef HAVE_X86
/* ------------------------------------------------------------------ AVX2 */

#define AVX2 __attribute__((target("avx2,fma,f16c")))

/* 8 rows per ymm: the block's two halves run one after the other over all groups (the
 * block's codes stay in L1 between them); mr rows of activations share each load. The 16-bit
 * sums of eight vpmaddubsw cannot overflow for int4 (8 * 2 * 15 * 127 < 32768). */
AVX2 static inline __attribute__((always_inline)) void int4_half_avx2(
    const uint8_t *w, const uint16_t *sz, int64_t groups, const xrow *xs, const int mr,
    const int two, int h, float *y, int64_t ldy, int64_t nvalid) {
    const __m256i low = _mm256_set1_epi8(0x0F);
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[MR];
    for (int m = 0; m < MR; m++) acc[m] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *b = w + g * 256 + h * 32;
        __m256i sum[MR], sum2[MR];
#pragma GCC unroll 4
        for (int v = 0; v < 4; v++) {
            __m256i raw = _mm256_loadu_si256((const __m256i *)(b + v * 64));
            __m256i lo = _mm256_and_si256(raw, low);
            __m256i hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
#pragma GCC unroll 4
            for (int m = 0; m < mr; m++) {
                const int8_t *xq = xs[m].q + g * G;
                __m256i p = _mm256_maddubs_epi16(lo, _mm256_set1_epi32(load_i32(xq + 4 * v)));
                p = _mm256_add_epi16(
                    p, _mm256_maddubs_epi16(hi, _mm256_set1_epi32(load_i32(xq + 16 + 4 * v))));
                sum[m] = v == 0 ? p : _mm256_add_epi16(sum[m], p);
                if (two) {
                    const int8_t *xq2 = xs[m].q2 + g * G;
                    p = _mm256_maddubs_epi16(lo, _mm256_set1_epi32(load_i32(xq2 + 4 * v)));
                    p = _mm256_add_epi16(p, _mm256_maddubs_epi16(
                                                hi, _mm256_set1_epi32(load_i32(xq2 + 16 + 4 * v))));
                    sum2[m] = v == 0 ? p : _mm256_add_epi16(sum2[m], p);
                }
            }
        }
        const uint16_t *s = sz + g * 32 + h * 8;
        __m256 scale = _mm256_castsi256_ps(_mm256_slli_epi32(
            _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)s)), 16));
        __m256 zero = _mm256_castsi256_ps(_mm256_slli_epi32(
            _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(s + 16))), 16));
#pragma GCC unroll 4
        for (int m = 0; m < mr; m++) {
            __m256i dot = _mm256_madd_epi16(sum[m], ones);
            if (two)
                dot = _mm256_add_epi32(_mm256_slli_epi32(dot, 8), _mm256_madd_epi16(sum2[m], ones));
            dot = _mm256_sub_epi32(dot, _mm256_set1_epi32(8 * xs[m].s[g]));
            __m256 f = _mm256_mul_ps(_mm256_cvtepi32_ps(dot), scale);
            acc[m] = _mm256_fmadd_ps(f, _mm256_set1_ps(xs[m].d[g]), acc[m]);
            acc[m] = _mm256_fmadd_ps(zero, _mm256_set1_ps(xs[m].ds[g]), acc[m]);
        }
    }
    for (int m = 0; m < mr; m++) {
        float out[8];
        _mm256_storeu_ps(out, acc[m]);
        int64_t n = nvalid - h * 8;
        if (n > 0) memcpy(y + m * ldy + h * 8, out, (size_t)(n < 8 ? n : 8) * sizeof(float));
    }
}

/* int8 x int8 through vpmaddubsw (u8 x s8) with llama.cpp's sign trick: |w| * (x * sign(w))
 * equals w * x and keeps both operands within +-127, so a pair sum never saturates. */
AVX2 static inline __attribute__((always_inline)) void int8_half_avx2(
    const int8_t *w, const float *scale, int64_t groups, const xrow *xs, const int mr,
    const int two, int h, float *y, int64_t ldy, int64_t nvalid) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[MR];
    for (int m = 0; m < MR; m++) acc[m] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        const int8_t *b = w + g * 512 + h * 32;
        __m256i dot[MR], dot2[MR];
        for (int m = 0; m < MR; m++) dot[m] = dot2[m] = _mm256_setzero_si256();
#pragma GCC unroll 8
        for (int j = 0; j < 8; j++) {
            __m256i raw = _mm256_loadu_si256((const __m256i *)(b + j * 64));
            __m256i mag = _mm256_abs_epi8(raw);
#pragma GCC unroll 4
            for (int m = 0; m < mr; m++) {
                __m256i xb = _mm256_set1_epi32(load_i32(xs[m].q + g * G + 4 * j));
                __m256i p = _mm256_maddubs_epi16(mag, _mm256_sign_epi8(xb, raw));
                dot[m] = _mm256_add_epi32(dot[m], _mm256_madd_epi16(p, ones));
                if (two) {
                    xb = _mm256_set1_epi32(load_i32(xs[m].q2 + g * G + 4 * j));
                    p = _mm256_maddubs_epi16(mag, _mm256_sign_epi8(xb, raw));
                    dot2[m] = _mm256_add_epi32(dot2[m], _mm256_madd_epi16(p, ones));
                }
            }
        }
#pragma GCC unroll 4
        for (int m = 0; m < mr; m++) {
            __m256i t = two ? _mm256_add_epi32(_mm256_slli_epi32(dot[m], 8), dot2[m]) : dot[m];
            acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t), _mm256_set1_ps(xs[m].d[g]), acc[m]);
        }
    }
    __m256 sc = _mm256_loadu_ps(scale + h * 8);
    for (int m = 0; m < mr; m++) {
        float out[8];
        _mm256_storeu_ps(out, _mm256_mul_ps(acc[m], sc));
        int64_t n = nvalid - h * 8;
        if (n > 0) memcpy(y + m * ldy + h * 8, out, (size_t)(n < 8 ? n : 8) * sizeof(float));
    }
}

/* The tile functions take mr and two as constants, so each case compiles to its own
 * unrolled loop; a row's instructions are the same in every case. */
#define TILES(CALL)                                  \
    switch (mr * 2 + (xs[0].q2 != NULL)) {           \
        case 9: CALL(4, 1); break;                   \
        case 8: CALL(4, 0); break;                   \
        case 7: CALL(3, 1); break;                   \
        case 6: CALL(3, 0); break;                   \
        case 5: CALL(2, 1); break;                   \
        case 4: CALL(2, 0); break;                   \
        case 3: CALL(1, 1); break;                   \
        default: CALL(1, 0); break;                  \
    }

AVX2 static void int4_block_avx2(const uint8_t *w, const uint16_t *sz, int64_t groups,
                                 const xrow *xs, int mr, float *y, int64_t ldy, int64_t nvalid) {
#define CALL(MR_, TWO) int4_half_avx2(w, sz, groups, xs, MR_, TWO, h, y, ldy, nvalid)
    for (int h = 0; h < 2; h++) TILES(CALL)
#undef CALL
}

AVX2 static void int8_block_avx2(const int8_t *w, const float *scale, int64_t groups,
                                 const xrow *xs, int mr, float *y, int64_t ldy, int64_t nvalid) {
#define CALL(MR_, TWO) int8_half_avx2(w, scale, groups, xs, MR_, TWO, h, y, ldy, nvalid)
    for (int h = 0; h < 2; h++) TILES(CALL)
#undef CALL
}

AVX2 static void quantize_avx2(const float *x, int64_t k, int64_t kp, int8_t *q, int8_t *q2,
                          float *d, int32_t *s, float *ds, const input_op *op, float *buf) {
    quantize_row(input_row(x, k, op, buf), k, kp, q, q2, d, s, ds);
}

/* ------------------------------------------------------------------ AVX512-VNNI */

#define VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")))

static inline __attribute__((always_inline)) VNNI __m512 bf16x16(const uint16_t *p) {
    __m512i u = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(u, 16));
}

/* One group's dot for 16 rows: eight vpdpbusd in two chains (half the dependent latency at
 * M = 1); integer sums are exact in any order, so the split changes no bit. */
static inline __attribute__((always_inline)) VNNI __m512i dot_vnni(const __m512i *u,
                                                                    const int8_t *xq) {
    __m512i a = _mm512_setzero_si512(), b = _mm512_setzero_si512();
#pragma GCC unroll 4
    for (int j = 0; j < 4; j++) {
        a = _mm512_dpbusd_epi32(a, u[j], _mm512_set1_epi32(load_i32(xq + 4 * j)));
        b = _mm512_dpbusd_epi32(b, u[j + 4], _mm512_set1_epi32(load_i32(xq + 16 + 4 * j)));
    }
    return _mm512_add_epi32(a, b);
}

/* 16 rows per zmm; vpdpbusd multiplies u8 codes (0..15) by s8 activations directly. */
VNNI static inline __attribute__((always_inline)) void int4_tile_vnni(
    const uint8_t *w, const uint16_t *sz, int64_t groups, const xrow *xs, const int mr,
    const int two, float *y, int64_t ldy, int64_t nvalid) {
    const __m512i low = _mm512_set1_epi8(0x0F);
    __m512 acc[MR];
    for (int m = 0; m < MR; m++) acc[m] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *b = w + g * 256;
        __m512i q[8];  // q[j] holds inputs 4j..4j+3 of all 16 rows
#pragma GCC unroll 4
        for (int v = 0; v < 4; v++) {
            __m512i raw = _mm512_loadu_si512((const void *)(b + v * 64));
            q[v] = _mm512_and_si512(raw, low);
            q[v + 4] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low);
        }
        const __m512 scale = bf16x16(sz + g * 32), zero = bf16x16(sz + g * 32 + 16);
#pragma GCC unroll 4
        for (int m = 0; m < mr; m++) {
            __m512i dot = dot_vnni(q, xs[m].q + g * G);
            if (two)
                dot = _mm512_add_epi32(_mm512_slli_epi32(dot, 8), dot_vnni(q, xs[m].q2 + g * G));
            dot = _mm512_sub_epi32(dot, _mm512_set1_epi32(8 * xs[m].s[g]));
            __m512 f = _mm512_mul_ps(_mm512_cvtepi32_ps(dot), scale);
            acc[m] = _mm512_fmadd_ps(f, _mm512_set1_ps(xs[m].d[g]), acc[m]);
            acc[m] = _mm512_fmadd_ps(zero, _mm512_set1_ps(xs[m].ds[g]), acc[m]);
        }
    }
    const __mmask16 keep = nvalid >= NR ? 0xFFFF : (__mmask16)((1u << nvalid) - 1);
    for (int m = 0; m < mr; m++) _mm512_mask_storeu_ps(y + m * ldy, keep, acc[m]);
}

/* int8 weights are signed, and vpdpbusd wants one unsigned operand: flip the weight's sign
 * bit (w + 128 as u8, 1..255), then take 128 * sum(xq) back off each group's dot. */
VNNI static inline __attribute__((always_inline)) void int8_tile_vnni(
    const int8_t *w, const float *scale, int64_t groups, const xrow *xs, const int mr,
    const int two, float *y, int64_t ldy, int64_t nvalid) {
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    __m512 acc[MR];
    for (int m = 0; m < MR; m++) acc[m] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        const int8_t *b = w + g * 512;
        __m512i u[8];
#pragma GCC unroll 8
        for (int j = 0; j < 8; j++)
            u[j] = _mm512_xor_si512(_mm512_loadu_si512((const void *)(b + j * 64)), flip);
#pragma GCC unroll 4
        for (int m = 0; m < mr; m++) {
            __m512i dot = dot_vnni(u, xs[m].q + g * G);
            if (two)
                dot = _mm512_add_epi32(_mm512_slli_epi32(dot, 8), dot_vnni(u, xs[m].q2 + g * G));
            dot = _mm512_sub_epi32(dot, _mm512_set1_epi32(128 * xs[m].s[g]));
            acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_set1_ps(xs[m].d[g]),
                                     acc[m]);
        }
    }
    const __m512 sc = _mm512_loadu_ps(scale);
    const __mmask16 keep = nvalid >= NR ? 0xFFFF : (__mmask16)((1u << nvalid) - 1);
    for (int m = 0; m < mr; m++) _mm512_mask_storeu_ps(y + m * ldy, keep, _mm512_mul_ps(acc[m], sc));
}

VNNI static void int4_block_vnni(const uint8_t *w, const uint16_t *sz, int64_t groups,
                                 const xrow *xs, int mr, float *y, int64_t ldy, int64_t nvalid) {
#define CALL(MR_, TWO) int4_tile_vnni(w, sz, groups, xs, MR_, TWO, y, ldy, nvalid)
    TILES(CALL)
#undef CALL
}

VNNI static void int8_block_vnni(const int8_t *w, const float *scale, int64_t groups,
                                 const xrow *xs, int mr, float *y, int64_t ldy, int64_t nvalid) {
#define CALL(MR_, TWO) int8_tile_vnni(w, scale, groups, xs, MR_, TWO, y, ldy, nvalid)
    TILES(CALL)
#undef CALL
}

VNNI static void quantize_vnni(const float *x, int64_t k, int64_t kp, int8_t *q, int8_t *q2,
                          float *d, int32_t *s, float *ds, const input_op *op, float *buf) {
    quantize_row(input_row(x, k, op, buf), k, kp, q, q2, d, s, ds);
}

#endif /* HAVE_X86 */

/* ------------------------------------------------------------------ drivers */

typedef void (*quantize_fn)(const float *, int64_t, int64_t, int8_t *, int8_t *, float *,
                            int32_t *, float *, const input_op *, float *);
typedef void (*int4_fn)(const uint8_t *, const uint16_t *, int64_t, const xrow *, int, float *,
                        int64_t, int64_t);
typedef void (*int8_fn)(const int8_t *, const float *, int64_t, const xrow *, int, float *,
                        int64_t, int64_t);

#ifdef HAVE_X86
static const quantize_fn QUANTIZE[] = {quantize_scalar, quantize_avx2, quantize_vnni};
static const int4_fn INT4[] = {int4_block_scalar, int4_block_avx2, int4_block_vnni};
static const int8_fn INT8[] = {int8_block_scalar, int8_block_avx2, int8_block_vnni};
#else /* other architectures build the portable variant only (the caller asks for no other) */
static const quantize_fn QUANTIZE[] = {quantize_scalar, quantize_scalar, quantize_scalar};
static const int4_fn INT4[] = {int4_block_scalar, int4_block_scalar, int4_block_scalar};
static const int8_fn INT8[] = {int8_block_scalar, int8_block_scalar, int8_block_scalar};
#endif

/* Quantized activations of one call: one allocation, rows of codes (and second-level codes)
 * then the group tables. */
typedef struct {
    void *mem;
    int8_t *q, *q2;
    float *d, *ds;
    int32_t *s;
    int64_t kp, groups;
} xquant;

/* x: m rows of k inputs, ldx floats apart (2k for a gate's [gate | up] rows). */
static int xquant_make(xquant *xq, int isa, const float *x, int64_t m, int64_t k, int64_t ldx,
                       int levels, const input_op *op) {
    xq->groups = (k + G - 1) / G;
    xq->kp = xq->groups * G;
    size_t codes = (size_t)(m * xq->kp + 63) / 64 * 64;
    size_t table = (size_t)(m * xq->groups) * 4;
    size_t row = (size_t)k * 4; /* one transformed input row */
    xq->mem = aligned_alloc(64, (levels * codes + 3 * table + row + 63) / 64 * 64 + 64);
    if (!xq->mem) return -1;
    char *at = (char *)xq->mem;
    xq->q = (int8_t *)at;
    xq->q2 = levels == 2 ? (int8_t *)(at += codes) : NULL;
    xq->d = (float *)(at += codes);
    xq->ds = (float *)(at += table);
    xq->s = (int32_t *)(at += table);
    float *buf = (float *)(at + table);
    for (int64_t r = 0; r < m; r++)
        QUANTIZE[isa](x + r * ldx, k, xq->kp, xq->q + r * xq->kp,
                      xq->q2 ? xq->q2 + r * xq->kp : NULL, xq->d + r * xq->groups,
                      xq->s + r * xq->groups, xq->ds + r * xq->groups, op, buf);
    return 0;
}

/* y += residual, elementwise: the same single rounding as the torch add it replaces. */
static void add_residual(float *y, const float *residual, int64_t count) {
    if (residual)
        for (int64_t i = 0; i < count; i++) y[i] = residual[i] + y[i];
}

static inline xrow xquant_row(const xquant *xq, int64_t r) {
    xrow row = {xq->q + r * xq->kp, xq->q2 ? xq->q2 + r * xq->kp : NULL, xq->d + r * xq->groups,
                xq->s + r * xq->groups, xq->ds + r * xq->groups};
    return row;
}

/* Output-row blocks are split over threads; every thread walks all M rows for its blocks. */
#define DRIVE(BODY)                                                                    \
    int64_t blocks = (n + NR - 1) / NR;                                                \
    _Pragma("omp parallel for schedule(static) num_threads(threads) if(threads > 1)") \
    for (int64_t nb = 0; nb < blocks; nb++) {                                          \
        int64_t nvalid = n - nb * NR;                                                  \
        for (int64_t m0 = 0; m0 < m; m0 += MR) {                                       \
            int mr = m - m0 < MR ? (int)(m - m0) : MR;                                 \
            xrow xs[MR];                                                               \
            for (int i = 0; i < mr; i++) xs[i] = xquant_row(&xq, m0 + i);              \
            BODY;                                                                      \
        }                                                                              \
    }

/* The ABI luced/runtime/native.py binds (its LIBRARY, checked at load by native_build):
 * bump both with any change to an exported signature. */
#define ABI_VERSION 1

int luced_abi_version(void) {
    return ABI_VERSION;
}

/* x [m, k] float32 ([m, 2k] for a gate input), y [m, n] float32; codes and sz in the layout
 * above (n padded to 16); levels 1 or 2: int8 activations, or two int8 levels (16-bit codes);
 * input, norm, eps: the input transform (input_op); residual [m, n] added to y, or NULL. */
int qg_int4(int isa, int levels, const uint8_t *codes, const uint16_t *sz, int64_t n,
            int64_t k, const float *x, int64_t m, float *y, int threads, int input,
            const float *norm, float eps, const float *residual) {
    xquant xq;
    const input_op op = {input, norm, eps};
    const int64_t ldx = input >= IN_SILU_GATE ? 2 * k : k;
    if (xquant_make(&xq, isa, x, m, k, ldx, levels, &op)) return -1;
    const int64_t groups = xq.groups;
    DRIVE(INT4[isa](codes + nb * groups * 256, sz + nb * groups * 32, groups, xs, mr,
                    y + m0 * n + nb * NR, n, nvalid))
    free(xq.mem);
    add_residual(y, residual, m * n);
    return 0;
}

/* k need not be a multiple of 32: codes are zero-padded to it, as the activations are. */
int qg_int8(int isa, int levels, const int8_t *codes, const float *scale, int64_t n,
            int64_t k, const float *x, int64_t m, float *y, int threads, int input,
            const float *norm, float eps, const float *residual) {
    xquant xq;
    const input_op op = {input, norm, eps};
    const int64_t ldx = input >= IN_SILU_GATE ? 2 * k : k;
    if (xquant_make(&xq, isa, x, m, k, ldx, levels, &op)) return -1;
    const int64_t groups = xq.groups;
    DRIVE(INT8[isa](codes + nb * groups * 512, scale + nb * NR, groups, xs, mr,
                    y + m0 * n + nb * NR, n, nvalid))
    free(xq.mem);
    add_residual(y, residual, m * n);
    return 0;
}

/* The activation quantization alone (for tests): q, q2 [m, kp] (q2 NULL: one level); d, s,
 * ds [m, kp / 32]. */
void qg_quantize(int isa, const float *x, int64_t m, int64_t k, int8_t *q, int8_t *q2,
                 float *d, int32_t *s, float *ds) {
    int64_t groups = (k + G - 1) / G;
    const input_op plain = {IN_PLAIN, NULL, 0.0f};
    for (int64_t r = 0; r < m; r++)
        QUANTIZE[isa](x + r * k, k, groups * G, q + r * groups * G,
                      q2 ? q2 + r * groups * G : NULL, d + r * groups, s + r * groups,
                      ds + r * groups, &plain, NULL);
}
