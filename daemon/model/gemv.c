/* A few rows by a weight matrix kept [out, in], streamed once at the memory's speed (daemon/model/native.py).
 *
 * A decode step multiplies one row (a batch of sessions: a few) by every weight matrix. Each output is a dot
 * product of one weight row with each input row: the threads share the weight rows out in contiguous blocks, so
 * each streams its part of the matrix from memory exactly once, and every input row reuses the weight row while
 * it is in the first-level cache. Each dot product sums in float32 over LANES partial sums (vectorised by the
 * compiler for whatever this machine has), reduced pairwise in a fixed order: a product's result does not
 * depend on the thread count.
 *
 * Weights are float32, bfloat16 (converted exactly to float32) or int8 with one bfloat16 scale per output row;
 * inputs, bias and outputs are float32 or bfloat16 (outputs rounded to nearest even, as torch rounds).
 * Built on the machine that runs it with its own compiler's -O3 -march=native -fopenmp, and linked to the
 * OpenMP runtime torch has already loaded, so its threads are torch's.
 */
#include <stdint.h>
#include <string.h>

#define LANES 32

enum { F32 = 0, BF16 = 1 };

static inline float from_bf16(uint16_t v) {
    uint32_t u = (uint32_t)v << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);  /* NaN stays NaN */
    u += 0x7fffu + ((u >> 16) & 1u);  /* round to nearest, ties to even */
    return (uint16_t)(u >> 16);
}

static inline float reduce(float *acc) {
    for (int s = LANES / 2; s > 0; s /= 2)
        for (int j = 0; j < s; j++) acc[j] += acc[j + s];
    return acc[0];
}

/* dot products of one weight row (type WT, converted by WCONV) with one float32 input row */
#define DOT(NAME, WT, WCONV)                                                        \
    static inline float NAME(const WT *restrict w, const float *restrict x, long n) { \
        float acc[LANES] = {0};                                                     \
        long k = 0;                                                                 \
        for (; k + LANES <= n; k += LANES)                                          \
            for (int j = 0; j < LANES; j++) acc[j] += WCONV(w[k + j]) * x[k + j];   \
        float tail = 0.f;                                                           \
        for (; k < n; k++) tail += WCONV(w[k]) * x[k];                              \
        return reduce(acc) + tail;                                                  \
    }

#define AS_IS(v) (v)
#define INT8(v) ((float)(v))
DOT(dot_f32, float, AS_IS)
DOT(dot_bf16, uint16_t, from_bf16)
DOT(dot_int8, int8_t, INT8)

static inline float load(const void *p, long i, int dtype) {
    return dtype == F32 ? ((const float *)p)[i] : from_bf16(((const uint16_t *)p)[i]);
}

static inline void store(void *p, long i, float v, int dtype) {
    if (dtype == F32) ((float *)p)[i] = v;
    else ((uint16_t *)p)[i] = to_bf16(v);
}

/* the input rows as float32: the caller's own memory when they already are, else converted into `scratch` */
static const float *inputs(const void *x, long count, int dtype, float *scratch) {
    if (dtype == F32) return (const float *)x;
    for (long i = 0; i < count; i++) scratch[i] = from_bf16(((const uint16_t *)x)[i]);
    return scratch;
}

/* y[m, r] = sum_k w[r, k] * x[m, k] (+ bias[r]) for rows m < `rows`, outputs r < `out`; w, x, bias and y all in
 * `dtype`; `scratch` holds rows * in floats when dtype is bfloat16 */
void meshnet_gemv(const void *w, const void *x, const void *bias, void *y, long rows, long out, long in, int dtype,
                  float *scratch) {
    const float *xs = inputs(x, rows * in, dtype, scratch);
#pragma omp parallel for schedule(static)
    for (long r = 0; r < out; r++) {
        for (long m = 0; m < rows; m++) {
            float v = dtype == F32 ? dot_f32((const float *)w + r * in, xs + m * in, in)
                                   : dot_bf16((const uint16_t *)w + r * in, xs + m * in, in);
            if (bias) v += load(bias, r, dtype);
            store(y, m * out + r, v, dtype);
        }
    }
}

/* as meshnet_gemv, for int8 weights `w` whose row r stands for w[r, :] * scale[r] (scale in bfloat16) */
void meshnet_gemv_int8(const int8_t *w, const uint16_t *scale, const void *x, const void *bias, void *y, long rows,
                       long out, long in, int dtype, float *scratch) {
    const float *xs = inputs(x, rows * in, dtype, scratch);
#pragma omp parallel for schedule(static)
    for (long r = 0; r < out; r++) {
        float s = from_bf16(scale[r]);
        for (long m = 0; m < rows; m++) {
            float v = dot_int8(w + r * in, xs + m * in, in) * s;
            if (bias) v += load(bias, r, dtype);
            store(y, m * out + r, v, dtype);
        }
    }
}
