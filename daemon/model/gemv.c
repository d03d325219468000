/* A few rows by a weight matrix kept [out, in], streamed once at the memory's speed (daemon/model/native.py).
 *
 * A decode step multiplies one row (a batch of sessions: a few) by every weight matrix. Each output is a dot
 * product of one weight row with each input row: the threads share the weight rows out in contiguous blocks, so
 * each streams its part of the matrix from memory exactly once, and every input row reuses the weight row while
 * it is in the first-level cache. Each dot product sums in float32 over LANES partial sums (vectorised by the
 * compiler for whatever this machine has), reduced pairwise in a fixed order: a product's result does not
 * depend on the thread count.
 *
 * Weights are float32, bfloat16 (converted exactly to float32) or int8 with one bfloat16 scale per output row,
 * whose inputs are quantized to int8 too (below); inputs, bias and outputs are float32 or bfloat16 (outputs rounded
 * to nearest even, as torch rounds).
 * Built on the machine that runs it with its own compiler's -O3 -march=native -fopenmp, and linked to the
 * OpenMP runtime torch has already loaded, so its threads are torch's.
 */
#include <stdint.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <limits.h>
#include <poll.h>
#include <errno.h>
#include <sys/socket.h>
#ifdef __linux__
#include <unistd.h>
#endif

#define LANES 32

/* what a weight matrix holds: float32, bfloat16, int8 with one bfloat16 scale per row, or 4-bit values with one
 * float16 scale per block of 32 (4-bit rows are in / 2 bytes long) */
enum { W_F32 = 0, W_BF16 = 1, W_INT8 = 2, W_Q4 = 3 };

/* how far ahead of the dot product reading them (bytes) each kind's weights are asked for, 0 for not at all (the
 * hardware's prefetchers alone). What pays depends on the CPU. On a 2-core Xeon (AVX-512, AMX) 2 KiB took one row by
 * bfloat16 experts 21-23 -> 26-28 GB/s and made the built-in model's int8 node 7% faster than 1 KiB; on a 2-core
 * Zen 4 VM the built-in model's float32 steps took 0.87-0.96 of the time without it, int8 ones 0.94, 4-bit ones
 * 1.07 (it pays there). A node times its own weights each way when it plans its kernels (daemon/model/prefetch.py,
 * docs/adr/0050) and sets it with meshnet_set_ahead; until then, 2 KiB. */
static long ahead[4] = {2048, 2048, 2048, 2048};

void meshnet_set_ahead(int kind, long bytes) {
    if (kind >= W_F32 && kind <= W_Q4) ahead[kind] = bytes > 0 ? bytes : 0;
}

long meshnet_ahead(int kind) { return kind >= W_F32 && kind <= W_Q4 ? ahead[kind] : -1; }

#define PREFETCH(kind, p) (ahead[kind] ? __builtin_prefetch((const char *)(p) + ahead[kind], 0, 3) : (void)0)

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

#if defined(__AVX512F__) && LANES == 32
#define REGISTER_SUMS 1
/* reduce() of the 32 partial sums held as two vectors (lanes 0-15, 16-31), in registers: the same pairs added */
static inline float reduce_pair(__m512 a0, __m512 a1) {
    const __m512 s16 = _mm512_add_ps(a0, a1);
    const __m256 s8 = _mm256_add_ps(_mm512_castps512_ps256(s16),  /* AVX-512F alone: no 32-bit extract */
                                    _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(s16), 1)));
    const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
    const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    return _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2)));
}
#else
#define REGISTER_SUMS 0
#endif

/* float32 rows: each 128-byte step asks for its two cache lines 2 KiB ahead; on the 2-core Xeon the built-in
 * model's float32 node made 43.2-46.3 tok/s with it, 40.1-41.8 without (on a Zen 4 the hardware's prefetchers
 * alone had kept float32 rows at their best) */
static inline float dot_f32(const float *restrict w, const float *restrict x, long n) {
    long k = 0;
#if REGISTER_SUMS
    /* the loop below as the compiler vectorises it, with its partial sums reduced in registers rather than memory */
    __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
    for (; k + LANES <= n; k += LANES) {
        PREFETCH(W_F32, w + k), PREFETCH(W_F32, (const char *)(w + k) + 64);
        a0 = _mm512_fmadd_ps(_mm512_loadu_ps(w + k), _mm512_loadu_ps(x + k), a0);
        a1 = _mm512_fmadd_ps(_mm512_loadu_ps(w + k + 16), _mm512_loadu_ps(x + k + 16), a1);
    }
#else
    float acc[LANES] = {0};
    for (; k + LANES <= n; k += LANES) {
        PREFETCH(W_F32, w + k), PREFETCH(W_F32, (const char *)(w + k) + 64);
        for (int j = 0; j < LANES; j++) acc[j] += w[k + j] * x[k + j];
    }
#endif
    float tail = 0.f;
    for (; k < n; k++) tail += w[k] * x[k];
#if REGISTER_SUMS
    return reduce_pair(a0, a1) + tail;
#else
    return reduce(acc) + tail;
#endif
}

#define AS_IS(v) (v)
DOT4(dot4_f32, float, AS_IS)

#if REGISTER_SUMS
/* 32 bfloat16 weights from w as two float32 vectors (lanes 0-15, 16-31): each value's bits moved up 16 */
static inline void widen_bf16(const uint16_t *restrict w, __m512 *lo, __m512 *hi) {
    const __m512i h = _mm512_loadu_si512(w);
    *lo = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(h)), 16));
    *hi = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(h, 1)), 16));
}

/* bfloat16 weights by a float32 row where the CPU has no AVX-512 BF16 (no dpbf16ps): DOT's sums, lane for lane and
 * in its order (bit for bit the same outputs), held in registers and with the weights asked for ahead as dot_f32's
 * are. As the compiler wrote it from DOT, with nothing asked ahead, one row by a 14336x4096 matrix streamed at
 * 18.7-19.3 GB/s; this way 27.7-28.2, float32 weights 27.3 (a Xeon VM, 2 threads, no AVX-512 BF16). There the
 * Qwen3.5-MoE-shaped bfloat16 step went from 0.58 to 0.70 of the read-bandwidth floor */
static inline float dot_bf16(const uint16_t *restrict w, const float *restrict x, long n) {
    __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps(), lo, hi;
    long k = 0;
    for (; k + LANES <= n; k += LANES) {
        PREFETCH(W_BF16, w + k);
        widen_bf16(w + k, &lo, &hi);
        a0 = _mm512_fmadd_ps(lo, _mm512_loadu_ps(x + k), a0);
        a1 = _mm512_fmadd_ps(hi, _mm512_loadu_ps(x + k + 16), a1);
    }
    float tail = 0.f;
    for (; k < n; k++) tail += from_bf16(w[k]) * x[k];
    return reduce_pair(a0, a1) + tail;
}

/* four rows `stride` apart by one float32 row: each row's sum exactly as dot_bf16's */
static inline void dot4_bf16(const uint16_t *restrict w, long stride, const float *restrict x, long n, float *out) {
    __m512 a[4][2], lo, hi;
    for (int r = 0; r < 4; r++) a[r][0] = a[r][1] = _mm512_setzero_ps();
    long k = 0;
    for (; k + LANES <= n; k += LANES) {
        const __m512 x0 = _mm512_loadu_ps(x + k), x1 = _mm512_loadu_ps(x + k + 16);
        for (int r = 0; r < 4; r++) {
            PREFETCH(W_BF16, w + r * stride + k);
            widen_bf16(w + r * stride + k, &lo, &hi);
            a[r][0] = _mm512_fmadd_ps(lo, x0, a[r][0]);
            a[r][1] = _mm512_fmadd_ps(hi, x1, a[r][1]);
        }
    }
    for (int r = 0; r < 4; r++) {
        float tail = 0.f;
        for (long t = k; t < n; t++) tail += from_bf16(w[r * stride + t]) * x[t];
        out[r] = reduce_pair(a[r][0], a[r][1]) + tail;
    }
}
#else
DOT(dot_bf16, uint16_t, from_bf16)
DOT4(dot4_bf16, uint16_t, from_bf16)
#endif

#if defined(__AVX512BF16__)
#include <immintrin.h>
#define BF16_PAIRS 1
/* bfloat16 weights by bfloat16 inputs (a bfloat16 node's own activations, exact as they are): one AVX-512 BF16
 * instruction multiplies 32 pairs exactly and adds each pair's sum into 16 float32 lanes */
static inline float dot_bf16_pairs(const uint16_t *restrict w, const uint16_t *restrict x, long n) {
    __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
    long k = 0;
    for (; k + 64 <= n; k += 64) {
        PREFETCH(W_BF16, w + k), PREFETCH(W_BF16, w + k + 32);
        a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_loadu_si512(w + k), (__m512bh)_mm512_loadu_si512(x + k));
        a1 = _mm512_dpbf16_ps(a1, (__m512bh)_mm512_loadu_si512(w + k + 32), (__m512bh)_mm512_loadu_si512(x + k + 32));
    }
    if (k + 32 <= n) {
        a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_loadu_si512(w + k), (__m512bh)_mm512_loadu_si512(x + k));
        k += 32;
    }
    float tail = 0.f;
    for (; k < n; k++) tail += from_bf16(w[k]) * from_bf16(x[k]);
    return _mm512_reduce_add_ps(_mm512_add_ps(a0, a1)) + tail;
}

/* four weight rows `stride` apart by one bfloat16 input row, the input read once for the four (long rows): each
 * row's sums exactly as dot_bf16_pairs's */
static inline void dot4_bf16_pairs(const uint16_t *restrict w, long stride, const uint16_t *restrict x, long n,
                                   float *out) {
    __m512 a[4][2];
    for (int r = 0; r < 4; r++) a[r][0] = a[r][1] = _mm512_setzero_ps();
    long k = 0;
    for (; k + 32 <= n; k += 32) {
        const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + k);
        const int half = (k / 32) & 1;
        for (int r = 0; r < 4; r++)
            a[r][half] = _mm512_dpbf16_ps(a[r][half], (__m512bh)_mm512_loadu_si512(w + r * stride + k), xv);
    }
    for (int r = 0; r < 4; r++) {
        float tail = 0.f;
        for (long t = k; t < n; t++) tail += from_bf16(w[r * stride + t]) * from_bf16(x[t]);
        out[r] = _mm512_reduce_add_ps(_mm512_add_ps(a[r][0], a[r][1])) + tail;
    }
}
#else
#define BF16_PAIRS 0
#endif

/* ---- int8 weights by int8 inputs -------------------------------------------------------------------------
 *
 * An int8 product's float32 input row is quantized first, much as llama.cpp quantizes a row for its Q8_0 weights:
 * in blocks of Q8_BLOCK values, each block's values round(x / d) with d = max|x| / 127. A weight row r then gives
 * scale[r] * (sum over blocks of d * the block's integer dot product). With AVX-512 VNNI one instruction takes 64
 * int8 products, summed four by four into 16 exact 32-bit lanes, but it wants its weights unsigned: they go in
 * with their sign bit flipped (w + 128), and the row's sum is corrected by `shift`, -128 * sum over blocks of
 * d * the block's sum of values, once for every weight row. */
#define Q8_BLOCK 64

struct q8row {
    int8_t *q;     /* [n] the quantized values */
    float *d;      /* [blocks] each block's scale */
    float shift;   /* -128 * sum over the whole blocks of d * the sum of their values */
    int32_t *neg8; /* [whole blocks, 16] -8 * the sum of each four values in a block (4-bit weights, below) */
};

#define Q8_BLOCKS(n) (((n) + Q8_BLOCK - 1) / Q8_BLOCK)
#define Q8_FLOATS(n) (Q8_BLOCKS(n) * (Q8_BLOCK / 4 + 1 + Q8_BLOCK / 4))
/* a q8row for `n` values in `memory`, which holds Q8_FLOATS(n) floats */
static struct q8row q8_at(float *memory, long n) {
    struct q8row r = {(int8_t *)(memory + Q8_BLOCKS(n)), memory, 0.f,
                      (int32_t *)(memory + Q8_BLOCKS(n) * (Q8_BLOCK / 4 + 1))};
    return r;
}

#if defined(__AVX512F__) && defined(__AVX512VNNI__)
#include <immintrin.h>
/* acc + the block at k: its 64 products in 16 exact lanes, times the block's scale */
static inline __m512 q8_block(const int8_t *restrict w, const struct q8row *x, long k, __m512 acc) {
    const __m512i unsigned_w = _mm512_xor_si512(_mm512_loadu_si512(w + k), _mm512_set1_epi8((char)0x80));
    const __m512i sums = _mm512_dpbusd_epi32(_mm512_setzero_si512(), unsigned_w, _mm512_loadu_si512(x->q + k));
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), _mm512_set1_ps(x->d[k / Q8_BLOCK]), acc);
}

/* a row's sum from its two accumulators (even blocks, odd blocks) and its last partial block from k, signed as it is;
 * that block's scaled sum added in one rounding, whatever the compiler would fuse where this is inlined */
static inline float q8_end(__m512 a0, __m512 a1, const int8_t *restrict w, const struct q8row *x, long k, long n) {
    const float sum = _mm512_reduce_add_ps(_mm512_add_ps(a0, a1)) + x->shift;
    if (k == n) return sum;
    int32_t tail = 0;
    for (long t = k; t < n; t++) tail += w[t] * x->q[t];
    return fmaf((float)tail, x->d[k / Q8_BLOCK], sum);
}

static inline float dot_q8(const int8_t *restrict w, const struct q8row *x, long n) {
    __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
    long k = 0;
    for (; k + 2 * Q8_BLOCK <= n; k += 2 * Q8_BLOCK) {
        PREFETCH(W_INT8, w + k), PREFETCH(W_INT8, w + k + Q8_BLOCK);
        a0 = q8_block(w, x, k, a0);
        a1 = q8_block(w, x, k + Q8_BLOCK, a1);
    }
    if (k + Q8_BLOCK <= n) {
        a0 = q8_block(w, x, k, a0);
        k += Q8_BLOCK;
    }
    return q8_end(a0, a1, w, x, k, n);
}
#define Q8_SHIFTED 1
#else
/* without VNNI: each block's exact integer sum of signed products, times its scale */
static inline float dot_q8(const int8_t *restrict w, const struct q8row *x, long n) {
    float acc = 0.f;
    for (long b = 0; b < n; b += Q8_BLOCK) {
        const long end = b + Q8_BLOCK < n ? b + Q8_BLOCK : n;
        int32_t s = 0;
        for (long t = b; t < end; t++) s += w[t] * x->q[t];
        acc += (float)s * x->d[b / Q8_BLOCK];
    }
    return acc;
}
#define Q8_SHIFTED 0
#endif

static inline float load(const void *p, long i, int dtype) {
    return dtype == F32 ? ((const float *)p)[i] : from_bf16(((const uint16_t *)p)[i]);
}

/* one block of `count` float32 values quantized into q: returns its scale d, and the sum of its values in *sum */
static inline float quantize_block(const float *restrict x, long count, int8_t *restrict q, int32_t *sum) {
#ifdef __AVX512F__
    if (count == 64) {
        __m512 v[4], top = _mm512_setzero_ps();
        for (int j = 0; j < 4; j++) top = _mm512_max_ps(top, _mm512_abs_ps(v[j] = _mm512_loadu_ps(x + 16 * j)));
        const float d = _mm512_reduce_max_ps(top) / 127.f, inverse = d > 0.f ? 1.f / d : 0.f;
        __m512i total = _mm512_setzero_si512();
        for (int j = 0; j < 4; j++) {  /* rounded to nearest even, as rintf */
            __m512i i = _mm512_cvtps_epi32(_mm512_mul_ps(v[j], _mm512_set1_ps(inverse)));
            total = _mm512_add_epi32(total, i);
            _mm_storeu_si128((__m128i *)(q + 16 * j), _mm512_cvtsepi32_epi8(i));
        }
        *sum = _mm512_reduce_add_epi32(total);
        return d;
    }
#endif
    float top = 0.f;
    for (long i = 0; i < count; i++) top = fmaxf(top, fabsf(x[i]));
    const float d = top / 127.f, inverse = d > 0.f ? 1.f / d : 0.f;
    int32_t s = 0;
    for (long i = 0; i < count; i++) {
        q[i] = (int8_t)rintf(x[i] * inverse);
        s += q[i];
    }
    *sum = s;
    return d;
}

/* x[0..n) (float32 or bfloat16) quantized into r, block by block */
static void quantize_q8(const void *x, long n, int dtype, struct q8row *r) {
    float converted[Q8_BLOCK];
    r->shift = 0.f;
    for (long b = 0; b < n; b += Q8_BLOCK) {
        const long count = b + Q8_BLOCK < n ? Q8_BLOCK : n - b;
        const float *values = (const float *)x + b;
        if (dtype != F32) {
            for (long i = 0; i < count; i++) converted[i] = load(x, b + i, dtype);
            values = converted;
        }
        int32_t sum;
        const float d = r->d[b / Q8_BLOCK] = quantize_block(values, count, r->q + b, &sum);
        if (Q8_SHIFTED && count == Q8_BLOCK) r->shift += d * (float)(-128 * sum);
        if (count == Q8_BLOCK)
            for (int lane = 0; lane < Q8_BLOCK / 4; lane++) {
                const int8_t *four = r->q + b + 4 * lane;
                r->neg8[b / 4 + lane] = -8 * (four[0] + four[1] + four[2] + four[3]);
            }
    }
}

/* ---- 4-bit weights by int8 inputs ------------------------------------------------------------------------------
 *
 * A 4-bit matrix keeps each row as blocks of 32 values d * (q - 8), q in 0..15, with one float16 scale d per block,
 * as llama.cpp's Q4_0 does (4.5 bits a value). Its bytes pair the values up in runs of 128 (four blocks): byte j of a
 * run holds value j in its low half and value j + 64 in its high half, so one 64-byte load and two masks give two
 * runs of 64 values in order; what is left of a row after its runs of 128 is a run of 64 (j with j + 32) and then
 * of 32 (j with j + 16), where it fits. The input row is quantized as for int8 weights (blocks of 64, one scale
 * each), so one AVX-512 VNNI instruction multiplies 64 unsigned 4-bit values by 64 int8 inputs into 16 exact lanes,
 * which start from the row's -8 * sum of each lane's four inputs (`neg8`): lanes 0-7 then hold one block's exact
 * sum of (q - 8) * x, lanes 8-15 the next's. Each lane is scaled by its block's d times the input block's scale, in
 * float32. */

static inline float from_f16(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
    if (e == 0) return (sign ? -1.f : 1.f) * ldexpf((float)m, -24);
    const uint32_t u = sign | (e == 31 ? 0x7f800000u | (m << 13) : ((e + 112) << 23) | (m << 13));
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* the run of a 4-bit row of n values that value k is in: its first value, and half its length */
static inline long run_of(long k, long n, long *half) {
    long start = k / 128 * 128;
    if (start + 128 <= n) return *half = 64, start;
    start = k / 64 * 64;
    if (start + 64 <= n) return *half = 32, start;
    return *half = 16, k / 32 * 32;
}

/* value k (0 <= k < n) of a 4-bit row of n values, as its q in 0..15 */
static inline int nibble(const uint8_t *w, long k, long n) {
    long half;
    const long run = run_of(k, n, &half), j = k - run;
    const uint8_t byte = w[run / 2 + j % half];
    return j < half ? byte & 15 : byte >> 4;
}

/* the blocks of 32 from `k` on, one at a time: each block's exact integer sum, times its scales */
static inline float q4_blocks(const uint8_t *restrict w, const uint16_t *restrict d, const struct q8row *x, long k,
                              long n) {
    float acc = 0.f;
    for (; k < n; k += 32) {
        int32_t s = 0;
        for (long t = k; t < k + 32; t++) s += (nibble(w, t, n) - 8) * x->q[t];
        acc += (float)s * (from_f16(d[k / 32]) * x->d[k / Q8_BLOCK]);
    }
    return acc;
}

#if defined(__AVX512F__) && defined(__AVX512VNNI__)
/* the run of 128 values from k: its four blocks' sums, each lane times its block's scales, added into a[0] and a[1] */
static inline void q4_run(const uint8_t *restrict w, const uint16_t *restrict d, const struct q8row *x, long k,
                          __m512 *a) {
    const __m512i packed = _mm512_loadu_si512(w + k / 2), low = _mm512_set1_epi8(0x0f);
    const long b = k / Q8_BLOCK;
    const __m512i first = _mm512_dpbusd_epi32(_mm512_loadu_si512(x->neg8 + 16 * b), _mm512_and_si512(packed, low),
                                              _mm512_loadu_si512(x->q + k));
    const __m512i second = _mm512_dpbusd_epi32(_mm512_loadu_si512(x->neg8 + 16 * (b + 1)),
                                               _mm512_and_si512(_mm512_srli_epi16(packed, 4), low),
                                               _mm512_loadu_si512(x->q + k + Q8_BLOCK));
    const __m128 dx = _mm_castsi128_ps(_mm_loadl_epi64((const __m128i *)(x->d + b)));  /* [dx0, dx1, -, -] */
    const __m512 scales = _mm512_castps128_ps512(
        _mm_mul_ps(_mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)(d + k / 32))), _mm_unpacklo_ps(dx, dx)));
    a[0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(first),
                           _mm512_permutexvar_ps(_mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0), scales),
                           a[0]);
    a[1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(second),
                           _mm512_permutexvar_ps(_mm512_set_epi32(3, 3, 3, 3, 3, 3, 3, 3, 2, 2, 2, 2, 2, 2, 2, 2), scales),
                           a[1]);
}

/* the run of 64 values from k (after a row's runs of 128): its two blocks' sums, each lane times its block's scales */
static inline __m512 q4_run64(const uint8_t *restrict w, const uint16_t *restrict d, const struct q8row *x, long k,
                              __m512 acc) {
    const __m256i packed = _mm256_loadu_si256((const __m256i *)(w + k / 2)), low = _mm256_set1_epi8(0x0f);
    const __m512i q = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(packed, low)),
                                         _mm256_and_si256(_mm256_srli_epi16(packed, 4), low), 1);
    const __m512i sums = _mm512_dpbusd_epi32(_mm512_loadu_si512(x->neg8 + 16 * (k / Q8_BLOCK)), q,
                                             _mm512_loadu_si512(x->q + k));
    const __m512 scales = _mm512_castps128_ps512(_mm_mul_ps(_mm_cvtph_ps(_mm_cvtsi32_si128(*(const int *)(d + k / 32))),
                                                            _mm_set1_ps(x->d[k / Q8_BLOCK])));
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums),
                           _mm512_permutexvar_ps(_mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0), scales),
                           acc);
}

/* a row's sum from its runs of 128 summed into a[0] and a[1], k its first value after them */
static inline float q4_end(const uint8_t *restrict w, const uint16_t *restrict d, const struct q8row *x, long k, long n,
                           __m512 *a) {
    if (k + 64 <= n) a[0] = q4_run64(w, d, x, k, a[0]), k += 64;
    return _mm512_reduce_add_ps(_mm512_add_ps(a[0], a[1])) + (k < n ? q4_blocks(w, d, x, k, n) : 0.f);
}

static inline float dot_q4(const uint8_t *restrict w, const uint16_t *restrict d, const struct q8row *x, long n) {
    __m512 a[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
    long k = 0;
    for (; k + 128 <= n; k += 128) {
        /* 2 KiB ahead rather than 1: a run of 4-bit weights is 64 bytes of more work than bfloat16's 128; on the
         * Xeon three alternations of each gave 4-12% more on 1024x2048, 8192x2048 and 2048x4096 (4 KiB: no more) */
        PREFETCH(W_Q4, w + k / 2);
        q4_run(w, d, x, k, a);
    }
    return q4_end(w, d, x, k, n, a);
}
#else
static inline float dot_q4(const uint8_t *restrict w, const uint16_t *restrict d, const struct q8row *x, long n) {
    return q4_blocks(w, d, x, 0, n);
}
#endif

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
/* and, where four_tall is set, bfloat16 matrices at least this tall by bfloat16 inputs, whatever their rows' length:
 * one row by a 49152x2048 LM head 23 -> 25 GB/s on a Zen 4 asking 1 KiB ahead, where the experts' 1024x2048 and
 * 2048x512 matrices gained nothing; on a Zen 4 VM asking nothing ahead, a row at a time took the Qwen3.5-MoE-shaped
 * step 20.6 -> 15.0 ms. A node times its LM head both ways (daemon/model/prefetch.py) and sets it with
 * meshnet_set_four_tall; until then, set */
#define TALL 16384
static int four_tall = 1;

void meshnet_set_four_tall(int on) { four_tall = on != 0; }

int meshnet_four_tall(void) { return four_tall; }

/* one input row of a product: float32 values, or for int8 weights their quantization */
struct row {
    const float *f;
    struct q8row q;
    const uint16_t *h; /* for bfloat16 weights where BF16_PAIRS: the bfloat16 inputs as given */
};

/* outputs r0..r0+count-1 (count <= 4) of a weight of `kind` kept [out, in] with one input row, into v; int8 one
 * row at a time */
static inline void block(int kind, const void *w, const uint16_t *scale, long r0, int count, const struct row *x,
                         long in, float *v, long long_row) {
    const int four = count == 4 && in >= long_row;
#if BF16_PAIRS
    if (kind == W_BF16 && x->h) {
        if (four) dot4_bf16_pairs((const uint16_t *)w + r0 * in, in, x->h, in, v);
        else for (int i = 0; i < count; i++) v[i] = dot_bf16_pairs((const uint16_t *)w + (r0 + i) * in, x->h, in);
        return;
    }
#endif
    if (kind == W_F32 && four) dot4_f32((const float *)w + r0 * in, in, x->f, in, v);
    else if (kind == W_BF16 && four) dot4_bf16((const uint16_t *)w + r0 * in, in, x->f, in, v);
    else
        for (int i = 0; i < count; i++) {
            const long r = r0 + i;
            v[i] = kind == W_F32    ? dot_f32((const float *)w + r * in, x->f, in)
                   : kind == W_BF16 ? dot_bf16((const uint16_t *)w + r * in, x->f, in)
                   : kind == W_INT8 ? dot_q8((const int8_t *)w + r * in, &x->q, in) * from_bf16(scale[r])
                                    : dot_q4((const uint8_t *)w + r * (in / 2), scale + r * (in / 32), &x->q, in);
        }
}

/* ---- a few input rows at once -------------------------------------------------------------------------------------
 *
 * Each of a batch's rows (or a verify step's) takes every weight row's dot product. One at a time, a dot product waits
 * on its own additions (a block's product is added to the one before it): on the 2-core Xeon eight rows by int8 or
 * 4-bit weights took 5-7x one row's time, by float32 ones 3-3.6x, where the weights are read once for all of them. A
 * tile of four weight rows by TILE input rows runs its sums' chains side by side, each sum exactly its single row's
 * (the same blocks into the same accumulators in the same order, the same ending): a row's outputs do not depend on
 * the rows beside it. */
#define TILE 2

static inline void tile_f32(const float *restrict w, long stride, const struct row *xs, long n, float *v) {
    long k = 0;
#if REGISTER_SUMS
    /* dot_f32's partial sums, two vectors for each of the eight (the compiler kept arrays of them in memory) */
    __m512 a[TILE][4][2];
    for (int m = 0; m < TILE; m++)
        for (int r = 0; r < 4; r++) a[m][r][0] = a[m][r][1] = _mm512_setzero_ps();
    for (; k + LANES <= n; k += LANES) {
        __m512 x[TILE][2];
        for (int m = 0; m < TILE; m++)
            x[m][0] = _mm512_loadu_ps(xs[m].f + k), x[m][1] = _mm512_loadu_ps(xs[m].f + k + 16);
        for (int r = 0; r < 4; r++) {
            const float *row = w + r * stride + k;
            PREFETCH(W_F32, row), PREFETCH(W_F32, (const char *)row + 64);
            const __m512 w0 = _mm512_loadu_ps(row), w1 = _mm512_loadu_ps(row + 16);
            for (int m = 0; m < TILE; m++) {
                a[m][r][0] = _mm512_fmadd_ps(w0, x[m][0], a[m][r][0]);
                a[m][r][1] = _mm512_fmadd_ps(w1, x[m][1], a[m][r][1]);
            }
        }
    }
    for (int m = 0; m < TILE; m++)
        for (int r = 0; r < 4; r++) {
            float tail = 0.f;
            for (long t = k; t < n; t++) tail += w[r * stride + t] * xs[m].f[t];
            v[m * 4 + r] = reduce_pair(a[m][r][0], a[m][r][1]) + tail;
        }
#else
    float acc[TILE][4][LANES] = {{{0}}};
    for (; k + LANES <= n; k += LANES) {
        for (int r = 0; r < 4; r++)
            PREFETCH(W_F32, w + r * stride + k), PREFETCH(W_F32, (const char *)(w + r * stride + k) + 64);
        for (int m = 0; m < TILE; m++)
            for (int r = 0; r < 4; r++)
                for (int j = 0; j < LANES; j++) acc[m][r][j] += w[r * stride + k + j] * xs[m].f[k + j];
    }
    for (int m = 0; m < TILE; m++)
        for (int r = 0; r < 4; r++) {
            float tail = 0.f;
            for (long t = k; t < n; t++) tail += w[r * stride + t] * xs[m].f[t];
            v[m * 4 + r] = reduce(acc[m][r]) + tail;
        }
#endif
}

#if defined(__AVX512F__) && defined(__AVX512VNNI__)
#define TILES_QUANTIZED 1
/* dot_q8's sums, before the weight rows' scales */
static inline void tile_q8(const int8_t *restrict w, long stride, const struct row *xs, long n, float *v) {
    __m512 a[2][TILE][4];
    for (int m = 0; m < TILE; m++)
        for (int r = 0; r < 4; r++) a[0][m][r] = a[1][m][r] = _mm512_setzero_ps();
    long k = 0;
    for (; k + 2 * Q8_BLOCK <= n; k += 2 * Q8_BLOCK) {
        for (int r = 0; r < 4; r++) PREFETCH(W_INT8, w + r * stride + k), PREFETCH(W_INT8, w + r * stride + k + Q8_BLOCK);
        for (int m = 0; m < TILE; m++)
            for (int r = 0; r < 4; r++) {
                a[0][m][r] = q8_block(w + r * stride, &xs[m].q, k, a[0][m][r]);
                a[1][m][r] = q8_block(w + r * stride, &xs[m].q, k + Q8_BLOCK, a[1][m][r]);
            }
    }
    if (k + Q8_BLOCK <= n) {
        for (int m = 0; m < TILE; m++)
            for (int r = 0; r < 4; r++) a[0][m][r] = q8_block(w + r * stride, &xs[m].q, k, a[0][m][r]);
        k += Q8_BLOCK;
    }
    for (int m = 0; m < TILE; m++)
        for (int r = 0; r < 4; r++) v[m * 4 + r] = q8_end(a[0][m][r], a[1][m][r], w + r * stride, &xs[m].q, k, n);
}

/* dot_q4's sums; `stride` bytes between weight rows, `scales` scales between their scale rows */
static inline void tile_q4(const uint8_t *restrict w, long stride, const uint16_t *restrict d, long scales,
                           const struct row *xs, long n, float *v) {
    __m512 a[TILE][4][2];
    for (int m = 0; m < TILE; m++)
        for (int r = 0; r < 4; r++) a[m][r][0] = a[m][r][1] = _mm512_setzero_ps();
    long k = 0;
    for (; k + 128 <= n; k += 128) {
        for (int r = 0; r < 4; r++) PREFETCH(W_Q4, w + r * stride + k / 2);
        for (int m = 0; m < TILE; m++)
            for (int r = 0; r < 4; r++) q4_run(w + r * stride, d + r * scales, &xs[m].q, k, a[m][r]);
    }
    for (int m = 0; m < TILE; m++)
        for (int r = 0; r < 4; r++) v[m * 4 + r] = q4_end(w + r * stride, d + r * scales, &xs[m].q, k, n, a[m][r]);
}
#else
#define TILES_QUANTIZED 0
#endif

/* block's outputs r0..r0+count-1 for each of the input rows xs[0..rows): row m's into v[m * 4..] */
static inline void block_rows(int kind, const void *w, const uint16_t *scale, long r0, int count, const struct row *xs,
                              long rows, long in, float *v, long long_row) {
    long m = 0;
    if (count == 4 && kind == W_F32 && in < long_row)
        for (; m + TILE <= rows; m += TILE) tile_f32((const float *)w + r0 * in, in, xs + m, in, v + m * 4);
#if TILES_QUANTIZED
    if (count == 4 && kind == W_INT8)
        for (; m + TILE <= rows; m += TILE) {
            tile_q8((const int8_t *)w + r0 * in, in, xs + m, in, v + m * 4);
            for (int i = 0; i < TILE * 4; i++) v[m * 4 + i] = v[m * 4 + i] * from_bf16(scale[r0 + i % 4]);
        }
    if (count == 4 && kind == W_Q4)
        for (; m + TILE <= rows; m += TILE)
            tile_q4((const uint8_t *)w + r0 * (in / 2), in / 2, scale + r0 * (in / 32), in / 32, xs + m, in, v + m * 4);
#endif
    for (; m < rows; m++) block(kind, w, scale, r0, count, &xs[m], in, v + m * 4, long_row);
}

#define MAX_ROWS 16

/* y[m, r] = sum_k w[r, k] * x[m, k] (+ bias[r]) for rows m < `rows` (at most MAX_ROWS), outputs r < `out`, four
 * outputs at a time; x, bias and y in `dtype`; `scratch` holds rows * in floats when dtype is bfloat16, and
 * rows * meshnet_q8_floats(in) for int8 weights */
static void rows_by(int kind, const void *w, const uint16_t *scale, const void *x, const void *bias, void *y,
                    long rows, long out, long in, int dtype, float *scratch) {
    struct row xs[MAX_ROWS];
    if (rows > MAX_ROWS) return;
    if (kind == W_INT8 || kind == W_Q4)
        for (long m = 0; m < rows; m++) {
            xs[m].q = q8_at(scratch + m * Q8_FLOATS(in), in);
            quantize_q8((const char *)x + m * in * (dtype == F32 ? 4 : 2), in, dtype, &xs[m].q);
        }
    else if (BF16_PAIRS && kind == W_BF16 && dtype == BF16)
        for (long m = 0; m < rows; m++) xs[m].h = (const uint16_t *)x + m * in;
    else {
        const float *f = inputs(x, rows * in, dtype, scratch);
        for (long m = 0; m < rows; m++) xs[m].f = f + m * in, xs[m].h = NULL;
    }
    const long long_row = BF16_PAIRS && kind == W_BF16 && dtype == BF16 && four_tall && out >= TALL ? 0 : LONG_ROW;
#pragma omp parallel for schedule(static)
    for (long b = 0; b < (out + 3) / 4; b++) {
        const long r0 = b * 4;
        const int count = out - r0 < 4 ? (int)(out - r0) : 4;
        float v[MAX_ROWS * 4];
        block_rows(kind, w, scale, r0, count, xs, rows, in, v, long_row);
        for (long m = 0; m < rows; m++)
            for (int i = 0; i < count; i++)
                store(y, m * out + r0 + i, bias ? v[m * 4 + i] + load(bias, r0 + i, dtype) : v[m * 4 + i], dtype);
    }
}

/* rows by a weight in `dtype` (float32 or bfloat16), as are x, bias and y */
void meshnet_gemv(const void *w, const void *x, const void *bias, void *y, long rows, long out, long in, int dtype,
                  float *scratch) {
    rows_by(dtype == F32 ? W_F32 : W_BF16, w, NULL, x, bias, y, rows, out, in, dtype, scratch);
}

/* y[p] = w[which[p]] xs[p] for each of `pairs` prepared input rows, matrix i of the stack `bytes` bytes after matrix 0
 * and its scales (where its kind has them) `scales` after scale 0: every pair's row by its own matrix, all of them
 * shared out among the threads in one parallel region, four outputs at a time */
static void pairs_by(int kind, const void *w, long bytes, const uint16_t *scale, long scales, const long *which,
                     long pairs, const struct row *xs, void *y, long out, long in, int dtype) {
    const long blocks = (out + 3) / 4;
#pragma omp parallel for schedule(static)
    for (long t = 0; t < pairs * blocks; t++) {
        const long m = t / blocks, r0 = (t % blocks) * 4;
        const int count = out - r0 < 4 ? (int)(out - r0) : 4;
        float v[4];
        block(kind, (const char *)w + which[m] * bytes, scale ? scale + which[m] * scales : NULL, r0, count, &xs[m],
              in, v, LONG_ROW);
        for (int i = 0; i < count; i++) store(y, m * out + r0 + i, v[i], dtype);
    }
}

/* y[p] = w[which[p]] x[p] for each of `pairs` (at most MAX_ROWS) input rows, where w is a stack of [out, in] matrices
 * `stride` elements apart (a mixture-of-experts layer's experts): every pair's row by its own matrix, all of them
 * shared out among the threads in one parallel region, four outputs at a time. Each output is the one rows_by
 * computes for that row and matrix, bit for bit; x and y in `dtype`, as are the weights; `scratch` as rows_by's */
void meshnet_gemv_pairs(const void *w, long stride, const long *which, long pairs, const void *x, void *y, long out,
                        long in, int dtype, float *scratch) {
    struct row xs[MAX_ROWS];
    const int kind = dtype == F32 ? W_F32 : W_BF16;
    const long size = dtype == F32 ? 4 : 2;
    if (pairs > MAX_ROWS) return;
    if (BF16_PAIRS && kind == W_BF16)
        for (long m = 0; m < pairs; m++) xs[m].h = (const uint16_t *)x + m * in;
    else {
        const float *f = inputs(x, pairs * in, dtype, scratch);
        for (long m = 0; m < pairs; m++) xs[m].f = f + m * in, xs[m].h = NULL;
    }
    pairs_by(kind, w, stride * size, NULL, 0, which, pairs, xs, y, out, in, dtype);
}

/* floats of scratch an int8 product's input row of `n` values takes */
long meshnet_q8_floats(long n) { return Q8_FLOATS(n); }

/* rows by int8 weights `w` whose row r stands for w[r, :] * scale[r] (scale in bfloat16), each input row quantized */
void meshnet_gemv_int8(const int8_t *w, const uint16_t *scale, const void *x, const void *bias, void *y, long rows,
                       long out, long in, int dtype, float *scratch) {
    rows_by(W_INT8, w, scale, x, bias, y, rows, out, in, dtype, scratch);
}

/* ---- a prompt's rows by int8 and 4-bit weights -------------------------------------------------------------------
 *
 * A prompt's rows (more than a decode step's) by one quantized matrix, in meshnet_gemm_int8 and meshnet_gemm_q4:
 * sixteen weights of each of four weight rows make one vector, and one VNNI instruction multiplies it by sixteen
 * values of one input row broadcast to its four 128-bit lanes, four weight rows' partial sums at once. The vectors
 * of a block of weights serve PROMPT_ROWS input rows before the next block is read, where a decode step's tile
 * reloads and rebuilds a weight row's block for every two input rows. Each lane's exact integer sum over a block is
 * scaled into a float32 lane, and a weight row's four lanes are added at the end: a decode step's sums, added in
 * another order (so within float32 rounding of its outputs, not bit for bit). */
#define PROMPT_ROWS 8
#define PROMPT_CACHE (256 << 10)

#if defined(__AVX512F__) && defined(__AVX512VNNI__)
#define PROMPT_TILES 1
/* the 16 bytes at byte `at` of each of four rows `stride` bytes apart, one row to each 128-bit lane */
static inline __m512i sixteen_of_each(const void *w, long stride, long at) {
    const char *p = (const char *)w + at;
    __m512i v = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)p));
    v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(p + stride)), 1);
    v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(p + 2 * stride)), 2);
    return _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(p + 3 * stride)), 3);
}

/* values k..k+15 of four 4-bit rows of n values (k a multiple of 16), unsigned, one row to each 128-bit lane */
static inline __m512i sixteen_q4(const uint8_t *w, long stride, long k, long n) {
    long half;
    const long run = run_of(k, n, &half), j = k - run;
    const __m512i bytes = sixteen_of_each(w, stride, run / 2 + j % half), low = _mm512_set1_epi8(0x0f);
    return _mm512_and_si512(j < half ? bytes : _mm512_srli_epi16(bytes, 4), low);
}

static inline __m512i times_sixteen(__m512i sums, __m512i w, const int8_t *x) {
    return _mm512_dpbusd_epi32(sums, w, _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)x)));
}

/* a tile's four outputs for each input row: its accumulator's lanes for each weight row added */
static inline void prompt_sums(const __m512 *acc, float *v) {
    for (int m = 0; m < PROMPT_ROWS; m++) {
        float lanes[16];
        _mm512_storeu_ps(lanes, acc[m]);
        for (int r = 0; r < 4; r++)
            v[m * 4 + r] = (lanes[4 * r] + lanes[4 * r + 1]) + (lanes[4 * r + 2] + lanes[4 * r + 3]);
    }
}

/* int8 weight rows 0..3 of `w` by PROMPT_ROWS input rows xs: row m's four outputs, before the rows' scales, into v */
static void prompt_tile_q8(const int8_t *restrict w, long in, const struct q8row *const *xs, float *v) {
    __m512 acc[PROMPT_ROWS];
    for (int m = 0; m < PROMPT_ROWS; m++) acc[m] = _mm512_setzero_ps();
    const __m512i flip = _mm512_set1_epi8((char)0x80);  /* unsigned, as q8_block takes them; xs' shift corrects */
    long k = 0;
    for (; k + Q8_BLOCK <= in; k += Q8_BLOCK) {
        const __m512i w0 = _mm512_xor_si512(sixteen_of_each(w, in, k), flip),
                      w1 = _mm512_xor_si512(sixteen_of_each(w, in, k + 16), flip),
                      w2 = _mm512_xor_si512(sixteen_of_each(w, in, k + 32), flip),
                      w3 = _mm512_xor_si512(sixteen_of_each(w, in, k + 48), flip);
        for (int m = 0; m < PROMPT_ROWS; m++) {
            const int8_t *q = xs[m]->q + k;
            __m512i sums = times_sixteen(_mm512_setzero_si512(), w0, q);
            sums = times_sixteen(times_sixteen(times_sixteen(sums, w1, q + 16), w2, q + 32), w3, q + 48);
            acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), _mm512_set1_ps(xs[m]->d[k / Q8_BLOCK]), acc[m]);
        }
    }
    prompt_sums(acc, v);
    for (int m = 0; m < PROMPT_ROWS; m++)
        for (int r = 0; r < 4; r++) {
            float sum = v[m * 4 + r] + xs[m]->shift;
            if (k < in) {  /* the last block, short, signed as it is */
                int32_t tail = 0;
                for (long t = k; t < in; t++) tail += w[r * in + t] * xs[m]->q[t];
                sum = fmaf((float)tail, xs[m]->d[k / Q8_BLOCK], sum);
            }
            v[m * 4 + r] = sum;
        }
}

/* 4-bit weight rows 0..3 of `w` (`stride` bytes apart, their scales `scales` apart in d) by PROMPT_ROWS input rows
 * xs, whose blocks of 32 values sum to sums32[m][block]: row m's four outputs into v. A block's lanes start from
 * -2 times its inputs' sum, so that a row's four lanes take -8 times it, as (q - 8) asks */
static void prompt_tile_q4(const uint8_t *restrict w, long stride, const uint16_t *restrict d, long scales, long in,
                           const struct q8row *const *xs, const int32_t *const *sums32, float *v) {
    __m512 acc[PROMPT_ROWS];
    for (int m = 0; m < PROMPT_ROWS; m++) acc[m] = _mm512_setzero_ps();
    const __m512i spread = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
    for (long k = 0; k < in; k += 32) {
        const long b = k / 32;
        const __m512i first = sixteen_q4(w, stride, k, in), second = sixteen_q4(w, stride, k + 16, in);
        const __m128 dw = _mm_cvtph_ps(_mm_setr_epi16((short)d[b], (short)d[scales + b], (short)d[2 * scales + b],
                                                      (short)d[3 * scales + b], 0, 0, 0, 0));
        const __m512 rows_d = _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(dw));
        for (int m = 0; m < PROMPT_ROWS; m++) {
            const int8_t *q = xs[m]->q + k;
            __m512i sums = times_sixteen(_mm512_set1_epi32(-2 * sums32[m][b]), first, q);
            sums = times_sixteen(sums, second, q + 16);
            acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums),
                                     _mm512_mul_ps(rows_d, _mm512_set1_ps(xs[m]->d[k / Q8_BLOCK])), acc[m]);
        }
    }
    prompt_sums(acc, v);
}
#else
#define PROMPT_TILES 0
#endif

#if PROMPT_TILES
/* input rows c0..c1-1 of xs (quantized, with the sums of their blocks of 32 for 4-bit weights) by every weight row,
 * four weight rows to a thread's turn; the rows that do not fill a tile of four one at a time */
static void prompt_chunk(int kind, const void *w, const uint16_t *scale, const struct row *xs, const int32_t *sums,
                         const void *bias, void *y, long c0, long c1, long out, long in, int dtype) {
    const long tiles = out / 4;
#pragma omp parallel for schedule(static)
    for (long r0 = 0; r0 < out; r0 += 4) {
        float v[PROMPT_ROWS * 4];
        for (long m0 = c0; m0 < c1; m0 += PROMPT_ROWS) {
            const long count = c1 - m0 < PROMPT_ROWS ? c1 - m0 : PROMPT_ROWS;
            const struct q8row *tile[PROMPT_ROWS];
            const int32_t *tile_sums[PROMPT_ROWS];
            for (int m = 0; m < PROMPT_ROWS; m++) {  /* a short last tile repeats its last row */
                const long row = m0 + (m < count ? m : count - 1);
                tile[m] = &xs[row].q, tile_sums[m] = sums + row * (in / 32);
            }
            if (r0 / 4 < tiles && kind == W_INT8) prompt_tile_q8((const int8_t *)w + r0 * in, in, tile, v);
            else if (r0 / 4 < tiles)
                prompt_tile_q4((const uint8_t *)w + r0 * (in / 2), in / 2, scale + r0 * (in / 32), in / 32, in, tile,
                               tile_sums, v);
            else
                for (long m = 0; m < count; m++)
                    for (long r = r0; r < out; r++)
                        v[m * 4 + r - r0] = kind == W_INT8 ? dot_q8((const int8_t *)w + r * in, tile[m], in)
                                                           : dot_q4((const uint8_t *)w + r * (in / 2),
                                                                    scale + r * (in / 32), tile[m], in);
            for (long m = 0; m < count; m++)
                for (long r = r0; r < out && r < r0 + 4; r++) {
                    const float value = kind == W_INT8 ? v[m * 4 + r - r0] * from_bf16(scale[r]) : v[m * 4 + r - r0];
                    store(y, (m0 + m) * out + r, bias ? value + load(bias, r, dtype) : value, dtype);
                }
        }
    }
}
#endif

/* `rows` input rows (any number) by an int8 (kind W_INT8) or 4-bit (W_Q4) matrix, as rows_by takes them; `scratch`
 * holds rows * (meshnet_q8_floats(in) + in / 32) floats. The input rows go against every weight row as many at a time
 * as keep their quantized values in a second-level cache (PROMPT_CACHE bytes), so that they are read from it, not
 * from memory, for each four weight rows */
static void prompt_by(int kind, const void *w, const uint16_t *scale, const void *x, const void *bias, void *y,
                      long rows, long out, long in, int dtype, float *scratch) {
    const long size = dtype == F32 ? 4 : 2;
    struct row *xs = PROMPT_TILES && rows > 0 ? malloc(rows * sizeof *xs) : NULL;
    if (!xs) {  /* no tiles here (no AVX-512 VNNI, or no memory for them): MAX_ROWS rows at a time by rows_by */
        for (long m = 0; m < rows; m += MAX_ROWS)
            rows_by(kind, w, scale, (const char *)x + m * in * size, bias, (char *)y + m * out * size,
                    rows - m < MAX_ROWS ? rows - m : MAX_ROWS, out, in, dtype, scratch);
        return;
    }
#if PROMPT_TILES
    int32_t *sums = (int32_t *)(scratch + rows * Q8_FLOATS(in));  /* each row's blocks of 32: their inputs' sums */
#pragma omp parallel for schedule(static)
    for (long m = 0; m < rows; m++) {
        xs[m].q = q8_at(scratch + m * Q8_FLOATS(in), in);
        quantize_q8((const char *)x + m * in * size, in, dtype, &xs[m].q);
        if (kind == W_Q4)
            for (long b = 0; b < in / 32; b++) {
                int32_t s = 0;
                for (int t = 0; t < 32; t++) s += xs[m].q.q[32 * b + t];
                sums[m * (in / 32) + b] = s;
            }
    }
    long chunk = PROMPT_CACHE / in / PROMPT_ROWS * PROMPT_ROWS;
    if (chunk < PROMPT_ROWS) chunk = PROMPT_ROWS;
    for (long c0 = 0; c0 < rows; c0 += chunk)
        prompt_chunk(kind, w, scale, xs, sums, bias, y, c0, rows - c0 < chunk ? rows : c0 + chunk, out, in, dtype);
    free(xs);
#endif
}

void meshnet_gemm_int8(const int8_t *w, const uint16_t *scale, const void *x, const void *bias, void *y, long rows,
                       long out, long in, int dtype, float *scratch) {
    prompt_by(W_INT8, w, scale, x, bias, y, rows, out, in, dtype, scratch);
}

void meshnet_gemm_q4(const uint8_t *w, const uint16_t *scale, const void *x, const void *bias, void *y, long rows,
                     long out, long in, int dtype, float *scratch) {
    prompt_by(W_Q4, w, scale, x, bias, y, rows, out, in, dtype, scratch);
}

/* rows by 4-bit weights `w` (in a multiple of 32) with float16 block scales `scale` [out, in / 32], each input row
 * quantized as for int8 weights */
void meshnet_gemv_q4(const uint8_t *w, const uint16_t *scale, const void *x, const void *bias, void *y, long rows,
                     long out, long in, int dtype, float *scratch) {
    rows_by(W_Q4, w, scale, x, bias, y, rows, out, in, dtype, scratch);
}

/* y[p] = w[which[p]] x[p] for each of `pairs` (at most MAX_ROWS) input rows by a stack of 4-bit [out, in] matrices
 * (meshnet_gemv_q4's, a mixture-of-experts layer's experts, `scale` stacked alike): every pair's row by its own
 * matrix in one parallel region, each output meshnet_gemv_q4's for that row and matrix, bit for bit; `scratch` holds
 * pairs * meshnet_q8_floats(in) floats */
void meshnet_gemv_pairs_q4(const uint8_t *w, const uint16_t *scale, const long *which, long pairs, const void *x,
                           void *y, long out, long in, int dtype, float *scratch) {
    struct row xs[MAX_ROWS];
    if (pairs > MAX_ROWS) return;
    for (long m = 0; m < pairs; m++) {
        xs[m].q = q8_at(scratch + m * Q8_FLOATS(in), in);
        quantize_q8((const char *)x + m * in * (dtype == F32 ? 4 : 2), in, dtype, &xs[m].q);
    }
    pairs_by(W_Q4, w, out * (in / 2), scale, out * (in / 32), which, pairs, xs, y, out, in, dtype);
}

/* rows r0..r0+count-1 of a 4-bit matrix as values in `dtype` into y [count, in]: d * (q - 8), exact in float32.
 * Sixteen values at a time (a run is at least 32 long, a block's scale covers 32): loops of a fixed 16 that the
 * compiler turns into a few vector instructions, where a value at a time had dequantized 0.4-0.65 G values a second */
void meshnet_dequantize_q4(const uint8_t *w, const uint16_t *scale, void *y, long r0, long count, long in, int dtype) {
#pragma omp parallel for schedule(static)
    for (long i = 0; i < count; i++) {
        const uint8_t *row = w + (r0 + i) * (in / 2);
        const uint16_t *d = scale + (r0 + i) * (in / 32);
        long half;
        for (long run = 0; run < in; run += 2 * half) {
            run_of(run, in, &half);
            for (long j = 0; j < half; j += 16) {
                const uint8_t *bytes = row + run / 2 + j;
                const float low = from_f16(d[(run + j) / 32]), high = from_f16(d[(run + half + j) / 32]);
                float a[16], b[16];
                for (int t = 0; t < 16; t++) {
                    a[t] = low * (float)((bytes[t] & 15) - 8);
                    b[t] = high * (float)((bytes[t] >> 4) - 8);
                }
                const long at = i * in + run + j;
                if (dtype == F32) {
                    memcpy((float *)y + at, a, sizeof a);
                    memcpy((float *)y + at + half, b, sizeof b);
                } else {
                    for (int t = 0; t < 16; t++) {
                        ((uint16_t *)y)[at + t] = to_bf16(a[t]);
                        ((uint16_t *)y)[at + half + t] = to_bf16(b[t]);
                    }
                }
            }
        }
    }
}

/* ---- one query's attention over bfloat16 keys and values (daemon/model/decode.py's attend_in_float32) --------
 *
 * What scaled_dot_product_attention computes in float32 for one query position of `heads` heads over `positions`
 * keys and values of `kv_heads` heads (each serving heads / kv_heads query heads), all bfloat16: scores
 * scale * q.k summed in float32 from exact bfloat16 products, a softmax in float32, the values weighed in float32,
 * the output rounded to bfloat16. Reads every key and value once, in the cache's own layout (rows of `dim`
 * values, `head_stride` and `row_stride` elements apart), where converting them to float32 first wrote twice
 * their bytes every step. Key/value heads share out among the threads; `scratch` holds heads * positions floats. */
void meshnet_attend_bf16(const uint16_t *q, const uint16_t *k, const uint16_t *v, uint16_t *out, long heads,
                         long kv_heads, long positions, long dim, long head_stride, long row_stride, float scale,
                         float *scratch) {
    const long group = heads / kv_heads;
#pragma omp parallel for schedule(static)
    for (long g = 0; g < kv_heads; g++) {
        float *scores = scratch + g * group * positions;
        const uint16_t *keys = k + g * head_stride, *values = v + g * head_stride;
        for (long i = 0; i < positions; i++)
            for (long h = 0; h < group; h++) {
                const uint16_t *query = q + (g * group + h) * dim;
#if BF16_PAIRS
                scores[h * positions + i] = scale * dot_bf16_pairs(keys + i * row_stride, query, dim);
#else
                float acc = 0.f;
                for (long j = 0; j < dim; j++) acc += from_bf16(keys[i * row_stride + j]) * from_bf16(query[j]);
                scores[h * positions + i] = scale * acc;
#endif
            }
        float acc[group][dim], total[group];
        for (long h = 0; h < group; h++) {
            float *s = scores + h * positions, top = s[0];
            for (long i = 1; i < positions; i++) top = s[i] > top ? s[i] : top;
            total[h] = 0.f;
            for (long i = 0; i < positions; i++) s[i] = expf(s[i] - top), total[h] += s[i];
            for (long j = 0; j < dim; j++) acc[h][j] = 0.f;
        }
        for (long i = 0; i < positions; i++) {
            float row[dim];
            for (long j = 0; j < dim; j++) row[j] = from_bf16(values[i * row_stride + j]);
            for (long h = 0; h < group; h++) {
                const float p = scores[h * positions + i];
                for (long j = 0; j < dim; j++) acc[h][j] += p * row[j];
            }
        }
        for (long h = 0; h < group; h++)
            for (long j = 0; j < dim; j++) out[(g * group + h) * dim + j] = to_bf16(acc[h][j] / total[h]);
    }
}

/* ---- one decode position through a gated delta net (daemon/model/linear_attention.py) ---------------------
 *
 * Qwen3.5's linear-attention layer between its input and output products, for one new position of one sequence:
 * the causal depthwise convolution over the last `kernel` inputs (its state shifted in place) and SiLU; queries
 * and keys L2-normalised, queries scaled by 1/sqrt(dk); per value head the decay exp(g) with
 * g = -exp(A_log) * softplus(a + dt_bias) and the write strength sigmoid(b); the delta rule on the float32 state
 * [dk, dv] in place (decay, read kv = S^T k, delta = (v - kv) * beta, S += k delta^T, out = S^T q); then the gated
 * RMSNorm of each head's output, times SiLU of z. As transformers' reference (torch_causal_conv1d_update,
 * torch_recurrent_gated_delta_rule, RMSNormGated) computes it, with its roundings to the activation dtype where it
 * rounds; its sums run in another order, so results agree to float rounding, not bit for bit (the module's test
 * bounds it). Value heads share out among the threads. */

static inline float round_to(float v, int dtype) { return dtype == F32 ? v : from_bf16(to_bf16(v)); }
static inline float silu(float v) { return v / (1.f + expf(-v)); }

struct delta_net {
    const void *conv_w;      /* [channels, kernel] in dtype */
    const float *neg_a;      /* [v_heads] -exp(A_log) */
    const float *dt_bias;    /* [v_heads] */
    const void *norm_w;      /* [dv] in dtype */
    float eps;
    long k_heads, v_heads, dk, dv, kernel, state_len;
};

/* qkv [2 * k_heads * dk + v_heads * dv], z [v_heads * dv], a and b [v_heads], in dtype; conv_state [channels,
 * state_len] in dtype, updated; state [v_heads, dk, dv] float32, updated; out [v_heads * dv] in dtype;
 * scratch: channels + 2 * v_heads floats */
void meshnet_delta_step(const struct delta_net *L, const void *qkv, const void *z, const void *a, const void *b,
                        void *conv_state, float *state, void *out, int dtype, float *scratch) {
    const long kd = L->k_heads * L->dk, channels = 2 * kd + L->v_heads * L->dv, K = L->kernel, S = L->state_len;
    float *mixed = scratch, *decay = scratch + channels, *beta = decay + L->v_heads;
    for (long c = 0; c < channels; c++) {  /* the convolution over [state, new] (the last K of them), then SiLU */
        float window[S + 1];
        for (long j = 0; j < S; j++) window[j] = load(conv_state, c * S + j, dtype);
        window[S] = load(qkv, c, dtype);
        float acc = 0.f;
        for (long j = 0; j < K; j++) acc += load(L->conv_w, c * K + j, dtype) * window[S + 1 - K + j];
        for (long j = 0; j < S; j++) store(conv_state, c * S + j, window[j + 1], dtype);
        mixed[c] = round_to(silu(round_to(acc, dtype)), dtype);
    }
    const float root = sqrtf((float)L->dk);
    for (long h = 0; h < L->k_heads; h++) {  /* L2-normalised queries (then scaled) and keys */
        for (int which = 0; which < 2; which++) {
            float *x = mixed + which * kd + h * L->dk, sum = 0.f;
            for (long i = 0; i < L->dk; i++) sum += x[i] * x[i];
            const float inv = 1.f / sqrtf(sum + 1e-6f);
            for (long i = 0; i < L->dk; i++) x[i] = which == 0 ? x[i] * inv / root : x[i] * inv;
        }
    }
    for (long h = 0; h < L->v_heads; h++) {
        const float x = load(a, h, dtype) + L->dt_bias[h];
        const float softplus = x > 20.f ? x : log1pf(expf(x));
        decay[h] = expf(L->neg_a[h] * softplus);
        beta[h] = round_to(1.f / (1.f + expf(-load(b, h, dtype))), dtype);
    }
    const long ratio = L->v_heads / L->k_heads, dk = L->dk, dv = L->dv;
#pragma omp parallel for schedule(static)
    for (long h = 0; h < L->v_heads; h++) {
        const float *q = mixed + (h / ratio) * dk, *k = mixed + kd + (h / ratio) * dk;
        const float *v = mixed + 2 * kd + h * dv;
        float *s = state + h * dk * dv;
        float kv[dv], o[dv];
        for (long j = 0; j < dv; j++) kv[j] = 0.f, o[j] = 0.f;
        for (long i = 0; i < dk; i++)
            for (long j = 0; j < dv; j++) {
                s[i * dv + j] *= decay[h];
                kv[j] += s[i * dv + j] * k[i];
            }
        for (long j = 0; j < dv; j++) kv[j] = (v[j] - kv[j]) * beta[h];  /* delta */
        for (long i = 0; i < dk; i++)
            for (long j = 0; j < dv; j++) {
                s[i * dv + j] += k[i] * kv[j];
                o[j] += s[i * dv + j] * q[i];
            }
        float sum = 0.f;  /* the gated RMSNorm of the head's output, rounded to dtype first as the reference hands it */
        for (long j = 0; j < dv; j++) o[j] = round_to(o[j], dtype), sum += o[j] * o[j];
        const float inv = 1.f / sqrtf(sum / (float)dv + L->eps);
        for (long j = 0; j < dv; j++) {
            const float normed = round_to(load(L->norm_w, j, dtype) * round_to(o[j] * inv, dtype), dtype);
            store(out, h * dv + j, normed * silu(load(z, h * dv + j, dtype)), dtype);
        }
    }
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
    const void *w;          /* [rows, cols] float32 or int8, or [rows, cols / 2] bytes of 4-bit values */
    const uint16_t *scale;  /* int8: one bfloat16 scale per row; 4-bit: one float16 scale per block of 32 */
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

/* y_i[m] = m_i x[m] for up to three matrices sharing the inputs x ([rows, cols]), their outputs shared out among
 * the threads together, four at a time, every input row against a block while it is in the cache; int8 and 4-bit
 * matrices take each row of x quantized into `q8` (rows * meshnet_q8_floats of the longest x) */
static void products(const struct matrix *const *ms, float *const *ys, int count, const float *x, long rows,
                     float *q8) {
    struct row xr[MAX_ROWS];
    int quantized = 0;
    const long cols = ms[0]->cols;
    for (int i = 0; i < count; i++) quantized |= ms[i]->kind == W_INT8 || ms[i]->kind == W_Q4;
    for (long m = 0; m < rows; m++) {
        xr[m].f = x + m * cols, xr[m].h = NULL;
        if (quantized) {
            xr[m].q = q8_at(q8 + m * Q8_FLOATS(cols), cols);
            quantize_q8(x + m * cols, cols, F32, &xr[m].q);
        }
    }
    long total = 0;
    for (int i = 0; i < count; i++) total += (ms[i]->rows + 3) / 4;
#pragma omp parallel for schedule(static)
    for (long t = 0; t < total; t++) {
        long b = t;
        int i = 0;
        while (b >= (ms[i]->rows + 3) / 4) b -= (ms[i++]->rows + 3) / 4;
        const struct matrix *mat = ms[i];
        const long r0 = b * 4, out = mat->rows;
        const int n = out - r0 < 4 ? (int)(out - r0) : 4;
        float v[MAX_ROWS * 4];
        block_rows(mat->kind, mat->w, mat->scale, r0, n, xr, rows, mat->cols, v, LONG_ROW);
        for (long m = 0; m < rows; m++)
            for (int j = 0; j < n; j++)
                ys[i][m * out + r0 + j] = mat->bias ? v[m * 4 + j] + mat->bias[r0 + j] : v[m * 4 + j];
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

/* out[j] = sum over t < n of (s[t] / sum) * v[t, j], j < d: a query's attention over its cache, after the scores.
 * Kept in `out` (which may alias the values, to the compiler), the sums were loaded and stored again at every
 * position: on the 2-core Xeon that, with dot_f32 then reducing its partial sums through memory, was half of a
 * batched step's attention. Here 64 outputs at a time stay in registers, each the same chain of fused multiply-adds
 * in the same order, bit for bit. */
static inline void weigh_values(const float *restrict v, const float *restrict s, float sum, long n, long d,
                                float *restrict out) {
#if defined(__AVX512F__)
    if (d % 64 == 0) {
        for (long c = 0; c < d; c += 64) {
            __m512 o0 = _mm512_setzero_ps(), o1 = o0, o2 = o0, o3 = o0;
            for (long t = 0; t < n; t++) {
                const __m512 p = _mm512_set1_ps(s[t] / sum);
                const float *vt = v + t * d + c;
                o0 = _mm512_fmadd_ps(p, _mm512_loadu_ps(vt), o0);
                o1 = _mm512_fmadd_ps(p, _mm512_loadu_ps(vt + 16), o1);
                o2 = _mm512_fmadd_ps(p, _mm512_loadu_ps(vt + 32), o2);
                o3 = _mm512_fmadd_ps(p, _mm512_loadu_ps(vt + 48), o3);
            }
            _mm512_storeu_ps(out + c, o0), _mm512_storeu_ps(out + c + 16, o1);
            _mm512_storeu_ps(out + c + 32, o2), _mm512_storeu_ps(out + c + 48, o3);
        }
        return;
    }
#endif
    for (long j = 0; j < d; j++) out[j] = 0.f;
    for (long t = 0; t < n; t++) {
        const float p = s[t] / sum, *vt = v + t * d;
        for (long j = 0; j < d; j++) out[j] += p * vt[j];
    }
}

/* `rows` new positions (at most MAX_ROWS), row m at position pos[m] of the sequence whose cache is keys[m] and
 * values[m] ([kv_heads, capacity[m], head_dim]), which holds its positions before pos[m]: `hidden` [rows, L->hidden]
 * in place, `cos`/`sin` [rows, head_dim]. Each row's key and value are written at pos[m] first, then each row
 * attends to the positions up to its own in its own cache: rows of one sequence (a verify step's) see the rows
 * before them. `work` holds rows * (hidden + 2 * heads * head_dim + 2 * kv_heads * head_dim + 2 * inter
 * + meshnet_q8_floats(max(hidden, inter))) + rows * heads * (max(pos) + 1) floats. Every product reads a weight once for all
 * the rows, and each row's outputs are the ones it would have alone. */
static void llama_rows(const struct layer *L, float *hidden, const float *cos, const float *sin, float *const *keys,
                       float *const *values, const long *capacity, const long *pos, long rows, float *work) {
    const long H = L->hidden, D = L->head_dim, heads = L->heads, kvh = L->kv_heads, I = L->inter, T = rows;
    float *x = work, *q = x + T * H, *k = q + T * heads * D, *v = k + T * kvh * D, *att = v + T * kvh * D;
    float *g = att + T * heads * D, *u = g + T * I, *q8 = u + T * I, *scores = q8 + T * Q8_FLOATS(H > I ? H : I);
    const long group = heads / kvh;
    long most = 0;
    if (T < 1 || T > MAX_ROWS) return;
    for (long m = 0; m < T; m++) most = pos[m] + 1 > most ? pos[m] + 1 : most;

    for (long m = 0; m < T; m++) rms_norm(hidden + m * H, L->norm_in, L->eps_in, x + m * H, H);
    const struct matrix *qkv[3] = {&L->q, &L->k, &L->v};
    float *qkv_out[3] = {q, k, v};
    products(qkv, qkv_out, 3, x, T, q8);
    for (long m = 0; m < T; m++) {
        const float *c = cos + m * D, *s = sin + m * D;
        for (long h = 0; h < heads; h++) rotate(q + (m * heads + h) * D, c, s, D);
        for (long h = 0; h < kvh; h++) {
            rotate(k + (m * kvh + h) * D, c, s, D);
            memcpy(keys[m] + (h * capacity[m] + pos[m]) * D, k + (m * kvh + h) * D, D * sizeof(float));
            memcpy(values[m] + (h * capacity[m] + pos[m]) * D, v + (m * kvh + h) * D, D * sizeof(float));
        }
    }
    /* each row's heads apart, every (row, head) its own scores: a batch's share out evenly among the threads */
#pragma omp parallel for collapse(2) schedule(static)
    for (long m = 0; m < T; m++)
        for (long h = 0; h < heads; h++) {
            float *s = scores + (m * heads + h) * most;
            const float *K = keys[m] + (h / group) * capacity[m] * D, *V = values[m] + (h / group) * capacity[m] * D;
            const float *qh = q + (m * heads + h) * D;
            float *out = att + (m * heads + h) * D, top = -INFINITY, sum = 0.f;
            const long n = pos[m] + 1;
            for (long t = 0; t < n; t++) {
                s[t] = dot_f32(K + t * D, qh, D) * L->scaling;
                if (s[t] > top) top = s[t];
            }
            for (long t = 0; t < n; t++) sum += (s[t] = expf(s[t] - top));
            weigh_values(V, s, sum, n, D, out);
        }
    const struct matrix *o[1] = {&L->o};
    float *o_out[1] = {x};
    products(o, o_out, 1, att, T, q8);
    for (long i = 0; i < T * H; i++) hidden[i] += x[i];

    for (long m = 0; m < T; m++) rms_norm(hidden + m * H, L->norm_post, L->eps_post, x + m * H, H);
    const struct matrix *gu[2] = {&L->gate, &L->up};
    float *gu_out[2] = {g, u};
    products(gu, gu_out, 2, x, T, q8);
    for (long i = 0; i < T * I; i++) g[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    const struct matrix *down[1] = {&L->down};
    float *down_out[1] = {x};
    products(down, down_out, 1, g, T, q8);
    for (long i = 0; i < T * H; i++) hidden[i] += x[i];
}

/* `rows` new positions pos..pos+rows-1 of one sequence (a decode step, or a verify step's rows), `keys`/`values`
 * [kv_heads, capacity, head_dim]; `work` as llama_rows's with rows * heads * (pos + rows) for the scores */
void meshnet_llama_layer(const struct layer *L, float *hidden, const float *cos, const float *sin, float *keys,
                         float *values, long capacity, long pos, long rows, float *work) {
    float *k[MAX_ROWS], *v[MAX_ROWS];
    long c[MAX_ROWS], p[MAX_ROWS];
    if (rows < 1 || rows > MAX_ROWS) return;
    for (long m = 0; m < rows; m++) k[m] = keys, v[m] = values, c[m] = capacity, p[m] = pos + m;
    llama_rows(L, hidden, cos, sin, k, v, c, p, rows, work);
}

/* one new position of each of `rows` sessions (a batch of decode steps): row m's cache keys[m]/values[m]
 * [kv_heads, capacity[m], head_dim] holds its pos[m] positions before it; `work` as llama_rows's */
void meshnet_llama_layer_batch(const struct layer *L, float *hidden, const float *cos, const float *sin,
                               float *const *keys, float *const *values, const long *capacity, const long *pos,
                               long rows, float *work) {
    llama_rows(L, hidden, cos, sin, keys, values, capacity, pos, rows, work);
}

/* ---- sleeping with the OpenMP team between steps (daemon/model/worker.py) -------------------------------------
 *
 * After a parallel region libgomp's workers spin (GOMP_SPINCOUNT) before they sleep, on a core that another daemon
 * on this host may be computing on. meshnet_send_and_wait(send_fd, buf, len, fds, n, team, timeout) first writes
 * buf to send_fd (none when send_fd < 0: a step's answer, or a step for the next node), then puts the calling
 * thread, and with team != 0 every thread of its team, to sleep in poll(2) until one of fds is readable (a
 * submission's eventfd, a step channel's socket) or the timeout (ms, -1 for none) passes: the bytes wake the whole
 * team at once, ready for the next step, without it being destroyed and made again.
 *
 * The write happens inside the region, after the workers are already asleep: bytes that wake another daemon on
 * this host, which then computes on every core, must not find this team's workers still spinning there (nor this
 * thread, woken later, still to park them). Answers poll's count (0: timed out), or -2 when the write failed. */

#define MESHNET_MAX_WAIT_FDS 64

static int send_all(int fd, const char *buf, long len, int timeout_ms) {
    while (len > 0) {
        ssize_t n = send(fd, buf, (size_t)len, MSG_NOSIGNAL);
        if (n > 0) {
            buf += n;
            len -= n;
        } else if (n < 0 && errno == EINTR) {
            continue;
        } else if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {  /* a full send buffer: wait for room */
            struct pollfd out = {fd, POLLOUT, 0};
            if (poll(&out, 1, timeout_ms) <= 0) return -1;
        } else {
            return -1;
        }
    }
    return 0;
}

int meshnet_send_and_wait(int send_fd, const char *buf, long len, const int *fds, int n, int team, int timeout_ms) {
    if (n < 0 || n > MESHNET_MAX_WAIT_FDS) return -1;
    int ready = 0, failed = 0;
    if (!team) {
        if (send_fd >= 0 && send_all(send_fd, buf, len, timeout_ms) != 0) return -2;
        struct pollfd p[MESHNET_MAX_WAIT_FDS];
        for (int i = 0; i < n; i++) p[i] = (struct pollfd){fds[i], POLLIN, 0};
        return poll(p, (nfds_t)n, timeout_ms);
    }
#pragma omp parallel
    {
        struct pollfd p[MESHNET_MAX_WAIT_FDS];
        for (int i = 0; i < n; i++) p[i] = (struct pollfd){fds[i], POLLIN, 0};
        int skip = 0;
#pragma omp master
        {
            if (send_fd >= 0 && send_all(send_fd, buf, len, timeout_ms) != 0) failed = skip = 1;
        }
        int got = skip ? 0 : poll(p, (nfds_t)n, timeout_ms);
#pragma omp master
        ready = got;
    }
    return failed ? -2 : ready;
}

#ifdef __AVX512F__
#include <immintrin.h>
#endif

/* A greedy pick: the index of the first largest of x[0..n), or -1 where any value is NaN or infinite (logits of
   activations no model makes). One thread, one read of the row: torch's sum (the finiteness check) and argmax read
   it twice, each in a parallel region, about 0.15 ms a token after the LM head. */
long meshnet_argmax(const float *x, long n) {
    if (n <= 0) return -1;
    float best = -INFINITY, spoilt = 0.f;  /* spoilt: the sum of v * 0, NaN once any v is NaN or infinite */
    long i = 0;
#ifdef __AVX512F__
    __m512 top = _mm512_set1_ps(-INFINITY), bad = _mm512_setzero_ps();
    for (; i + 16 <= n; i += 16) {
        const __m512 v = _mm512_loadu_ps(x + i);
        top = _mm512_max_ps(top, v);
        bad = _mm512_add_ps(bad, _mm512_mul_ps(v, _mm512_setzero_ps()));
    }
    best = _mm512_reduce_max_ps(top);
    spoilt = _mm512_reduce_add_ps(bad);
#endif
    for (; i < n; i++) {
        best = x[i] > best ? x[i] : best;
        spoilt += x[i] * 0.f;
    }
    if (spoilt != 0.f || !isfinite(best)) return -1;  /* NaN compares unequal to everything */
    i = 0;
#ifdef __AVX512F__
    const __m512 want = _mm512_set1_ps(best);
    for (; i + 16 <= n; i += 16) {
        const __mmask16 hit = _mm512_cmpeq_ps_mask(_mm512_loadu_ps(x + i), want);
        if (hit) return i + __builtin_ctz(hit);
    }
#endif
    for (; i < n; i++)
        if (x[i] == best) return i;
    return -1;
}
