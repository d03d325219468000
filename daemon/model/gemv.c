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
#include <math.h>
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

/* four weight rows `stride` apart with one input row: each row's sum exactly as NAME's above (the same partial
 * sums in the same order), the input read once for the four: long rows' inputs outgrow the first-level cache */
#define DOT4(NAME, WT, WCONV)                                                                          \
    static inline void NAME(const WT *restrict w, long stride, const float *restrict x, long n, float *out) { \
        float acc[4][LANES] = {{0}};                                                                   \
        long k = 0;                                                                                    \
        for (; k + LANES <= n; k += LANES)                                                             \
            for (int r = 0; r < 4; r++)                                                                \
                for (int j = 0; j < LANES; j++) acc[r][j] += WCONV(w[r * stride + k + j]) * x[k + j];  \
        for (int r = 0; r < 4; r++) {                                                                  \
            float tail = 0.f;                                                                          \
            for (long t = k; t < n; t++) tail += WCONV(w[r * stride + t]) * x[t];                      \
            out[r] = reduce(acc[r]) + tail;                                                            \
        }                                                                                              \
    }

#define AS_IS(v) (v)
#define INT8(v) ((float)(v))
DOT(dot_f32, float, AS_IS)
DOT(dot_bf16, uint16_t, from_bf16)
DOT4(dot4_f32, float, AS_IS)
DOT4(dot4_bf16, uint16_t, from_bf16)

#ifdef __AVX512F__
#include <immintrin.h>
/* compilers widen int8 through int16 in 256-bit halves; AVX-512 takes 16 int8 to 16 floats in two instructions */
static inline float dot_int8(const int8_t *restrict w, const float *restrict x, long n) {
    __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
    long k = 0;
    for (; k + 32 <= n; k += 32) {
        __m512 w0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(w + k))));
        __m512 w1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(w + k + 16))));
        a0 = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x + k), a0);
        a1 = _mm512_fmadd_ps(w1, _mm512_loadu_ps(x + k + 16), a1);
    }
    float tail = 0.f;
    for (; k < n; k++) tail += (float)w[k] * x[k];
    return _mm512_reduce_add_ps(_mm512_add_ps(a0, a1)) + tail;
}
#else
DOT(dot_int8, int8_t, INT8)
#endif

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

/* rows at least this long take four at a time (their float32 input outgrows a 32 KiB first-level cache): one row by
 * a 4096x14336 bfloat16 matrix 20 -> 30 GB/s on a Zen 4; shorter rows ran slower so (the partial sums spill) */
#define LONG_ROW 8192

/* what a weight matrix holds: float32, bfloat16, or int8 with one bfloat16 scale per row */
enum { W_F32 = 0, W_BF16 = 1, W_INT8 = 2 };

/* outputs r0..r0+count-1 (count <= 4) of a weight of `kind` kept [out, in] with one float32 input row, into v;
 * int8 one row at a time: four at once measured slower (the conversions leave no room to share inputs) */
static inline void block(int kind, const void *w, const uint16_t *scale, long r0, int count, const float *x, long in,
                         float *v) {
    const int four = count == 4 && in >= LONG_ROW;
    if (kind == W_F32 && four) dot4_f32((const float *)w + r0 * in, in, x, in, v);
    else if (kind == W_BF16 && four) dot4_bf16((const uint16_t *)w + r0 * in, in, x, in, v);
    else
        for (int i = 0; i < count; i++) {
            const long r = r0 + i;
            v[i] = kind == W_F32    ? dot_f32((const float *)w + r * in, x, in)
                   : kind == W_BF16 ? dot_bf16((const uint16_t *)w + r * in, x, in)
                                    : dot_int8((const int8_t *)w + r * in, x, in) * from_bf16(scale[r]);
        }
}

/* y[m, r] = sum_k w[r, k] * x[m, k] (+ bias[r]) for rows m < `rows`, outputs r < `out`, four outputs at a time;
 * x, bias and y in `dtype`; `scratch` holds rows * in floats when dtype is bfloat16 */
static void rows_by(int kind, const void *w, const uint16_t *scale, const void *x, const void *bias, void *y,
                    long rows, long out, long in, int dtype, float *scratch) {
    const float *xs = inputs(x, rows * in, dtype, scratch);
#pragma omp parallel for schedule(static)
    for (long b = 0; b < (out + 3) / 4; b++) {
        const long r0 = b * 4;
        const int count = out - r0 < 4 ? (int)(out - r0) : 4;
        for (long m = 0; m < rows; m++) {
            float v[4];
            block(kind, w, scale, r0, count, xs + m * in, in, v);
            for (int i = 0; i < count; i++)
                store(y, m * out + r0 + i, bias ? v[i] + load(bias, r0 + i, dtype) : v[i], dtype);
        }
    }
}

/* rows by a weight in `dtype` (float32 or bfloat16), as are x, bias and y */
void meshnet_gemv(const void *w, const void *x, const void *bias, void *y, long rows, long out, long in, int dtype,
                  float *scratch) {
    rows_by(dtype == F32 ? W_F32 : W_BF16, w, NULL, x, bias, y, rows, out, in, dtype, scratch);
}

/* rows by int8 weights `w` whose row r stands for w[r, :] * scale[r] (scale in bfloat16) */
void meshnet_gemv_int8(const int8_t *w, const uint16_t *scale, const void *x, const void *bias, void *y, long rows,
                       long out, long in, int dtype, float *scratch) {
    rows_by(W_INT8, w, scale, x, bias, y, rows, out, in, dtype, scratch);
}

/* ---- one decode position through a Llama-family layer (daemon/model/decode.py's NativeDecoder) ---------------
 *
 * The arithmetic of LlamaDecoderLayer for one new position of one sequence, in float32: RMSNorm, the q/k/v
 * products (with biases where the layer has them), rotary embedding of queries and keys, the key and value
 * written into the cache's buffers at `pos`, attention of each query head over positions 0..pos of its key/value
 * head, the output product and residual, RMSNorm, the gated SiLU MLP and residual. Each product is a weight
 * matrix in one of the kinds below; every step of it runs in this one call, the products and the heads on the
 * OpenMP threads. */

struct matrix {
    const void *w;          /* [rows, cols] float32 or int8 */
    const uint16_t *scale;  /* int8: one bfloat16 scale per row */
    const float *bias;      /* [rows] or NULL */
    long rows, cols;
    int kind;
};

struct layer {
    struct matrix q, k, v, o, gate, up, down;
    const float *norm_in, *norm_post;
    float eps_in, eps_post, scaling;
    long hidden, heads, kv_heads, head_dim, inter;
};

/* y_i = m_i x for up to three matrices sharing the input x, their rows shared out among the threads together, four
 * at a time */
static void products(const struct matrix *const *ms, float *const *ys, int count, const float *x) {
    long total = 0;
    for (int i = 0; i < count; i++) total += (ms[i]->rows + 3) / 4;
#pragma omp parallel for schedule(static)
    for (long t = 0; t < total; t++) {
        long b = t;
        int i = 0;
        while (b >= (ms[i]->rows + 3) / 4) b -= (ms[i++]->rows + 3) / 4;
        const struct matrix *m = ms[i];
        const long r0 = b * 4;
        const int n = m->rows - r0 < 4 ? (int)(m->rows - r0) : 4;
        float v[4];
        block(m->kind, m->w, m->scale, r0, n, x, m->cols, v);
        for (int j = 0; j < n; j++) ys[i][r0 + j] = m->bias ? v[j] + m->bias[r0 + j] : v[j];
    }
}

static void rms_norm(const float *x, const float *weight, float eps, float *out, long n) {
    float acc[LANES] = {0};
    long k = 0;
    for (; k + LANES <= n; k += LANES)
        for (int j = 0; j < LANES; j++) acc[j] += x[k + j] * x[k + j];
    float tail = 0.f;
    for (; k < n; k++) tail += x[k] * x[k];
    float inv = 1.0f / sqrtf((reduce(acc) + tail) / (float)n + eps);
    for (long i = 0; i < n; i++) out[i] = weight[i] * (x[i] * inv);
}

/* x * cos + rotate_half(x) * sin for one head, rotate_half(x) = cat(-x2, x1) */
static void rotate(float *x, const float *cos, const float *sin, long d) {
    long half = d / 2;
    for (long i = 0; i < half; i++) {
        float a = x[i], b = x[i + half];
        x[i] = a * cos[i] - b * sin[i];
        x[i + half] = b * cos[i + half] + a * sin[i + half];
    }
}

/* `hidden` [L->hidden] in place; `keys`/`values` [kv_heads, capacity, head_dim]; `work` holds
 * hidden + 2 * heads * head_dim + 2 * kv_heads * head_dim + 2 * inter + heads * (pos + 1) floats */
void meshnet_llama_layer(const struct layer *L, float *hidden, const float *cos, const float *sin, float *keys,
                         float *values, long capacity, long pos, float *work) {
    const long H = L->hidden, D = L->head_dim, heads = L->heads, kvh = L->kv_heads, I = L->inter;
    float *x = work, *q = x + H, *k = q + heads * D, *v = k + kvh * D, *att = v + kvh * D, *g = att + heads * D;
    float *u = g + I, *scores = u + I;
    const long n = pos + 1, group = heads / kvh;

    rms_norm(hidden, L->norm_in, L->eps_in, x, H);
    const struct matrix *qkv[3] = {&L->q, &L->k, &L->v};
    float *qkv_out[3] = {q, k, v};
    products(qkv, qkv_out, 3, x);
    for (long h = 0; h < heads; h++) rotate(q + h * D, cos, sin, D);
    for (long h = 0; h < kvh; h++) {
        rotate(k + h * D, cos, sin, D);
        memcpy(keys + (h * capacity + pos) * D, k + h * D, D * sizeof(float));
        memcpy(values + (h * capacity + pos) * D, v + h * D, D * sizeof(float));
    }
#pragma omp parallel for schedule(static)
    for (long h = 0; h < heads; h++) {
        const float *qh = q + h * D, *K = keys + (h / group) * capacity * D, *V = values + (h / group) * capacity * D;
        float *s = scores + h * n, *out = att + h * D, top = -INFINITY, sum = 0.f;
        for (long t = 0; t < n; t++) {
            s[t] = dot_f32(K + t * D, qh, D) * L->scaling;
            if (s[t] > top) top = s[t];
        }
        for (long t = 0; t < n; t++) sum += (s[t] = expf(s[t] - top));
        for (long j = 0; j < D; j++) out[j] = 0.f;
        for (long t = 0; t < n; t++) {
            const float p = s[t] / sum, *vt = V + t * D;
            for (long j = 0; j < D; j++) out[j] += p * vt[j];
        }
    }
    const struct matrix *o[1] = {&L->o};
    float *o_out[1] = {x};
    products(o, o_out, 1, att);
    for (long i = 0; i < H; i++) hidden[i] += x[i];

    rms_norm(hidden, L->norm_post, L->eps_post, x, H);
    const struct matrix *gu[2] = {&L->gate, &L->up};
    float *gu_out[2] = {g, u};
    products(gu, gu_out, 2, x);
    for (long i = 0; i < I; i++) g[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    const struct matrix *down[1] = {&L->down};
    float *down_out[1] = {x};
    products(down, down_out, 1, g);
    for (long i = 0; i < H; i++) hidden[i] += x[i];
}
