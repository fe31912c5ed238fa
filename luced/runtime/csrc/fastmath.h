/* Vectorizable float32 math for luced's kernels: plain arithmetic the compiler vectorizes
 * for each function's target (libm's expf does not, without -ffast-math, which would change
 * the whole process's float modes). Every kernel is built with -std=c11, so no product is
 * contracted into an FMA: an expression here rounds exactly as written. */
#ifndef LUCED_FASTMATH_H
#define LUCED_FASTMATH_H

#include <math.h>
#include <stdint.h>

/* exp(x) for x <= 0: 2^n * 2^f with n = round(x log2 e), |f| <= 1/2, 2^f by its degree-7
 * Taylor polynomial (truncation error ~5e-9, below float32 rounding). */
static inline float exp_nonpositive(float x)
{
    x = x < -87.0f ? -87.0f : x; /* below this exp underflows float32 anyway */
    const float y = x * 1.44269504088896341f;
    const float n = rintf(y);
    const float f = (y - n) * 0.693147180559945309f; /* 2^(y - n) = e^f */
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

/* x * sigmoid(x): SiLU, from exp(-|x|) so no exp overflows. */
static inline float silu(float x)
{
    const float e = exp_nonpositive(x < 0.0f ? x : -x);
    const float p = 1.0f / (1.0f + e);
    return x * (x < 0.0f ? e * p : p);
}

/* GELU with the tanh approximation: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), tanh
 * from exp(-2|u|). */
static inline float gelu_tanh(float x)
{
    const float u = 0.797884560802865356f * (x + 0.044715f * x * x * x);
    const float e = exp_nonpositive(-2.0f * (u < 0.0f ? -u : u));
    const float t = (1.0f - e) / (1.0f + e);
    return 0.5f * x * (1.0f + (u < 0.0f ? -t : t));
}

#endif
