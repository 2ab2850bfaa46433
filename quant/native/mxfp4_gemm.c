/* y[M, N] = x[M, K] @ W.T for an MXFP4 W (OCP Microscaling), computed on its blocks: no dequantized copy.

   W: blocks uint8 [N, K/2], byte j of a row = E2M1 code of k = 2j (low nibble) | code of k = 2j + 1 << 4 (the byte
   order of Hugging Face's gpt-oss ``*_blocks`` tensors); scales uint8 [N, K/32], one E8M0 exponent per 32 k:
   w[n, k] = e2m1(code) * 2^(scale - 127). Every such product has at most two significant bits, so decoding is exact
   in fp32 (and bf16). x is NOT quantized (unlike the int4 kernel's int8 activations): every product of a weight and
   an activation is exact and the sums are fp32, so y differs from dequantize-then-matmul in fp32 by summation order
   only, on every path:
   - AVX-512 BF16 (isa 3): ``vdpbf16ps`` on codes looked up as bf16 words and x as bf16 (a bf16 x as it is, an fp32
     x split into three bf16 parts that sum to it exactly), 32 products an instruction;
   - AVX-512 (2) and AVX2 (1): codes looked up as doubled integers (0, 1, 2, 3, 4, 6, 8, 12 and their negatives, as
     ggml's kvalues_mxfp4), widened to fp32 and multiplied by half the block's scale (a power of two: exact);
   - portable C (0): any x86-64.
   E8M0 255 is NaN in the OCP format and decodes to NaN here (the converters refuse it).
   fe_mxfp4_gemm_grouped runs a MoE layer's experts (many small matrices) in one parallel region. */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#define QB 32    /* values per block (and per scale) */
#define ROWS 16  /* weight rows per parallel task */
#define T256 __attribute__((target("avx2,fma")))

static const int8_t KVALUES[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

/* Half of 2^(e - 127) as fp32 bits: exact for every e but 255 (NaN in OCP MX); e = 0 and 1 are fp32 subnormals. */
static inline float e8m0_half(uint8_t e) {
    uint32_t bits = e == 255 ? 0x7fc00000u : e >= 2 ? (uint32_t)(e - 1) << 23 : 0x00200000u << e;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

typedef struct {
    void *p;
    int bf16;
} yout;

/* fp32 -> bf16: round to nearest even, NaN kept a quiet NaN, as torch's .to() does (and the int4 kernel). */
static inline uint16_t bf16_of(float v) {
    uint32_t bits;
    memcpy(&bits, &v, 4);
    return (bits & 0x7fffffff) > 0x7f800000 ? (uint16_t)((bits >> 16) | 0x40)
                                            : (uint16_t)((bits + 0x7fff + ((bits >> 16) & 1)) >> 16);
}

static inline void y_put(yout y, size_t at, float v) {
    if (y.bf16)
        ((uint16_t *)y.p)[at] = bf16_of(v);
    else
        ((float *)y.p)[at] = v;
}

/* ---- portable C: any x86-64 (and the reference for the vector path's decoding) ---------------------------------- */

static void decode_row(const uint8_t *q, const uint8_t *sc, int K, float *w) {
    for (int b = 0; b < K / QB; b++) {
        float s = e8m0_half(sc[b]);
        for (int j = 0; j < QB / 2; j++) {
            uint8_t v = q[b * (QB / 2) + j];
            w[b * QB + 2 * j] = (float)KVALUES[v & 0x0F] * s;
            w[b * QB + 2 * j + 1] = (float)KVALUES[v >> 4] * s;
        }
    }
}

static void rows_c(const uint8_t *blocks, const uint8_t *scales, int n0, int n1, int N, int K, const float *x, int M,
                   yout y, float *w) {
    for (int n = n0; n < n1; n++) {
        decode_row(blocks + (size_t)n * (K / 2), scales + (size_t)n * (K / QB), K, w);
        for (int m = 0; m < M; m++) {
            const float *xm = x + (size_t)m * K;
            float acc = 0.f;
            for (int k = 0; k < K; k++) acc += w[k] * xm[k];
            y_put(y, (size_t)m * N + n, acc);
        }
    }
}

/* ---- AVX2 + FMA ------------------------------------------------------------------------------------------------ */

/* One block's 32 weights as four fp32 vectors (k 0-7, 8-15, 16-23, 24-31), scaled exactly. */
T256 static inline void decode_block(const uint8_t *q, uint8_t e, __m128i lut, __m256 *w) {
    const __m128i mask = _mm_set1_epi8(0x0F);
    __m128i bytes = _mm_loadu_si128((const __m128i *)q);
    __m128i lo = _mm_shuffle_epi8(lut, _mm_and_si128(bytes, mask));                     /* even k */
    __m128i hi = _mm_shuffle_epi8(lut, _mm_and_si128(_mm_srli_epi16(bytes, 4), mask));  /* odd k */
    __m128i a = _mm_unpacklo_epi8(lo, hi), b = _mm_unpackhi_epi8(lo, hi);               /* k 0-15, 16-31 */
    __m256 s = _mm256_set1_ps(e8m0_half(e));
    w[0] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(a)), s);
    w[1] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(a, 8))), s);
    w[2] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)), s);
    w[3] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8))), s);
}

T256 static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* Few x rows (the decode case): x comes deinterleaved per block (``deinterleave``: its 16 even k, then its 16 odd k),
   so a block's low nibbles pair with the first half and its high nibbles with the second, no byte interleaving; each
   weight row's block scales are widened once into ``sb`` (fp32, exact); even and odd blocks go to separate
   accumulators (independent FMA chains) kept in named registers. */
static void deinterleave(const float *x, int M, int K, float *xd) {
    for (size_t i = 0; i < (size_t)M * K; i += QB)
        for (int j = 0; j < QB / 2; j++) {
            xd[i + j] = x[i + 2 * j];
            xd[i + QB / 2 + j] = x[i + 2 * j + 1];
        }
}

static void row_scales(const uint8_t *sc, int nb, float *sb) {
    for (int b = 0; b < nb; b++) sb[b] = e8m0_half(sc[b]);
}

/* A block's codes as doubled E2M1 integers in fp32: even k (low nibbles) in w[0..1], odd k in w[2..3]. */
T256 static inline void block_ints(const uint8_t *q, __m128i lut, __m256 *w) {
    const __m128i mask = _mm_set1_epi8(0x0F);
    __m128i bytes = _mm_loadu_si128((const __m128i *)q);
    __m128i lo = _mm_shuffle_epi8(lut, _mm_and_si128(bytes, mask));
    __m128i hi = _mm_shuffle_epi8(lut, _mm_and_si128(_mm_srli_epi16(bytes, 4), mask));
    w[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo));
    w[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8)));
    w[2] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi));
    w[3] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8)));
}

T256 static inline __m256 block_dot(const __m256 *w, const float *xd) {
    __m256 p = _mm256_mul_ps(w[0], _mm256_loadu_ps(xd));
    p = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(xd + 8), p);
    p = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(xd + 16), p);
    return _mm256_fmadd_ps(w[3], _mm256_loadu_ps(xd + 24), p);
}

T256 static void rows_fused(const uint8_t *blocks, const uint8_t *scales, int n0, int n1, int N, int K,
                            const float *xd, int M, yout y, float *sb) {
    const __m128i lut = _mm_loadu_si128((const __m128i *)KVALUES);
    const int nb = K / QB;
    for (int n = n0; n < n1; n++) {
        const uint8_t *q = blocks + (size_t)n * (K / 2);
        row_scales(scales + (size_t)n * nb, nb, sb);
        for (int m0 = 0; m0 < M; m0 += 2) {
            const float *x0 = xd + (size_t)m0 * K, *x1 = m0 + 1 < M ? x0 + K : NULL;
            __m256 a00 = _mm256_setzero_ps(), a01 = a00, a10 = a00, a11 = a00, w[4];
            int b = 0;
            for (; b + 2 <= nb; b += 2) {
                __m256 s0 = _mm256_broadcast_ss(sb + b), s1 = _mm256_broadcast_ss(sb + b + 1);
                block_ints(q + b * (QB / 2), lut, w);
                a00 = _mm256_fmadd_ps(block_dot(w, x0 + b * QB), s0, a00);
                if (x1) a10 = _mm256_fmadd_ps(block_dot(w, x1 + b * QB), s0, a10);
                block_ints(q + (b + 1) * (QB / 2), lut, w);
                a01 = _mm256_fmadd_ps(block_dot(w, x0 + (b + 1) * QB), s1, a01);
                if (x1) a11 = _mm256_fmadd_ps(block_dot(w, x1 + (b + 1) * QB), s1, a11);
            }
            if (b < nb) {
                __m256 s0 = _mm256_broadcast_ss(sb + b);
                block_ints(q + b * (QB / 2), lut, w);
                a00 = _mm256_fmadd_ps(block_dot(w, x0 + b * QB), s0, a00);
                if (x1) a10 = _mm256_fmadd_ps(block_dot(w, x1 + b * QB), s0, a10);
            }
            y_put(y, (size_t)m0 * N + n, hsum(_mm256_add_ps(a00, a01)));
            if (x1) y_put(y, (size_t)(m0 + 1) * N + n, hsum(_mm256_add_ps(a10, a11)));
        }
    }
}

/* ---- AVX-512 (F, BW, VL): sixteen weights a vector ------------------------------------------------------------- */
#define T512 __attribute__((target("avx512f,avx512bw,avx512vl,fma")))

/* A block's codes as doubled E2M1 integers in fp32: even k in w0, odd k in w1, each code widened to a 32-bit index
   and looked up in a table of floats (``lut``: a permute, off the FP pipes a conversion would take). */
T512 static inline void block_ints_512(const uint8_t *q, __m512 lut, __m512 *w0, __m512 *w1) {
    __m512i codes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)q));
    *w0 = _mm512_permutexvar_ps(codes, lut);                         /* index bits past the fourth are ignored */
    *w1 = _mm512_permutexvar_ps(_mm512_srli_epi32(codes, 4), lut);
}

T512 static inline __m512 block_dot_512(__m512 w0, __m512 w1, const float *xd) {
    return _mm512_fmadd_ps(w1, _mm512_loadu_ps(xd + 16), _mm512_mul_ps(w0, _mm512_loadu_ps(xd)));
}

T512 static void rows_fused_512(const uint8_t *blocks, const uint8_t *scales, int n0, int n1, int N, int K,
                                const float *xd, int M, yout y, float *sb) {
    const __m512 lut = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)KVALUES)));
    const int nb = K / QB;
    for (int n = n0; n < n1; n++) {
        const uint8_t *q = blocks + (size_t)n * (K / 2);
        row_scales(scales + (size_t)n * nb, nb, sb);
        for (int m0 = 0; m0 < M; m0 += 2) {
            const float *x0 = xd + (size_t)m0 * K, *x1 = m0 + 1 < M ? x0 + K : NULL;
            __m512 a00 = _mm512_setzero_ps(), a01 = a00, a10 = a00, a11 = a00, w0, w1;
            int b = 0;
            for (; b + 2 <= nb; b += 2) {
                __m512 s0 = _mm512_set1_ps(sb[b]), s1 = _mm512_set1_ps(sb[b + 1]);
                block_ints_512(q + b * (QB / 2), lut, &w0, &w1);
                a00 = _mm512_fmadd_ps(block_dot_512(w0, w1, x0 + b * QB), s0, a00);
                if (x1) a10 = _mm512_fmadd_ps(block_dot_512(w0, w1, x1 + b * QB), s0, a10);
                block_ints_512(q + (b + 1) * (QB / 2), lut, &w0, &w1);
                a01 = _mm512_fmadd_ps(block_dot_512(w0, w1, x0 + (b + 1) * QB), s1, a01);
                if (x1) a11 = _mm512_fmadd_ps(block_dot_512(w0, w1, x1 + (b + 1) * QB), s1, a11);
            }
            if (b < nb) {
                __m512 s0 = _mm512_set1_ps(sb[b]);
                block_ints_512(q + b * (QB / 2), lut, &w0, &w1);
                a00 = _mm512_fmadd_ps(block_dot_512(w0, w1, x0 + b * QB), s0, a00);
                if (x1) a10 = _mm512_fmadd_ps(block_dot_512(w0, w1, x1 + b * QB), s0, a10);
            }
            y_put(y, (size_t)m0 * N + n, _mm512_reduce_add_ps(_mm512_add_ps(a00, a01)));
            if (x1) y_put(y, (size_t)(m0 + 1) * N + n, _mm512_reduce_add_ps(_mm512_add_ps(a10, a11)));
        }
    }
}

/* More rows: each weight row decoded once into ``w`` (K floats, in L1/L2), then a plain fp32 dot per x row. */
T256 static void rows_buffered(const uint8_t *blocks, const uint8_t *scales, int n0, int n1, int N, int K,
                               const float *x, int M, yout y, float *w) {
    const __m128i lut = _mm_loadu_si128((const __m128i *)KVALUES);
    for (int n = n0; n < n1; n++) {
        const uint8_t *q = blocks + (size_t)n * (K / 2), *sc = scales + (size_t)n * (K / QB);
        for (int b = 0; b < K / QB; b++) {
            __m256 v[4];
            decode_block(q + b * (QB / 2), sc[b], lut, v);
            for (int i = 0; i < 4; i++) _mm256_storeu_ps(w + b * QB + 8 * i, v[i]);
        }
        for (int m = 0; m < M; m++) {
            const float *xm = x + (size_t)m * K;
            __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
            for (int k = 0; k < K; k += QB) {
                a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w + k), _mm256_loadu_ps(xm + k), a0);
                a1 = _mm256_fmadd_ps(_mm256_loadu_ps(w + k + 8), _mm256_loadu_ps(xm + k + 8), a1);
                a2 = _mm256_fmadd_ps(_mm256_loadu_ps(w + k + 16), _mm256_loadu_ps(xm + k + 16), a2);
                a3 = _mm256_fmadd_ps(_mm256_loadu_ps(w + k + 24), _mm256_loadu_ps(xm + k + 24), a3);
            }
            y_put(y, (size_t)m * N + n, hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3))));
        }
    }
}

/* ---- AVX-512 BF16: 32 weights a ``vdpbf16ps`` ----------------------------------------------------------------
   The doubled E2M1 values are small integers, exact in bf16: a block's 16 code bytes are widened to 32-bit lanes and
   each lane's two nibbles become two 16-bit indices (k = 2j in the low word, k = 2j + 1 in the high one: the pair
   order ``vdpbf16ps`` sums), looked up in a table of bf16 words (``vpermw``). x comes in bf16 "planes": a bf16 x is
   one plane, an fp32 x is split into three (hi + mid + lo == x exactly: each takes the next 8 bits of the 24-bit
   significand, rounding to nearest, and x - hi, hi's remainder - mid are exact in fp32). Each product of a code and a
   plane is exact in fp32 and summed in fp32, then times half the block's scale, as the fp32 path does; the
   instruction treats bf16 subnormals as zero and flushes subnormal results (|x| < 2^-126, or a plane's part of it
   below 2^-126: activations that small add nothing to these sums). */
#define TBF __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,fma")))

static const uint16_t KVALUES_BF16[32] = {0x0000, 0x3f80, 0x4000, 0x4040, 0x4080, 0x40c0, 0x4100, 0x4140,
                                          0x8000, 0xbf80, 0xc000, 0xc040, 0xc080, 0xc0c0, 0xc100, 0xc140};

TBF static inline __m512i block_bf16(const uint8_t *q, __m512i table) {
    const __m512i mask = _mm512_set1_epi32(0x000F000F);
    __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)q));
    /* (v | v << 12) & mask in one ternary-logic op: the low nibble in bits 0-3, the high one in bits 16-19 */
    __m512i idx = _mm512_ternarylogic_epi32(v, _mm512_slli_epi32(v, 12), mask, 0xA8);
    return _mm512_permutexvar_epi16(idx, table);
}

/* R rows (1-4) of P planes each: ``xp`` plane p of row r at xp + (p * M + r) * K (bf16 bits). Even and odd blocks
   go to separate accumulators (independent FMA chains); R and P are constants, so the loops over them unroll. */
#define BF16_BLOCK(b, accs)                                                                                          \
    do {                                                                                                             \
        __m512bh w = (__m512bh)block_bf16(q + (b) * (QB / 2), table);                                                \
        __m512 s = _mm512_set1_ps(sb[b]);                                                                            \
        for (int r = 0; r < R; r++) {                                                                                \
            __m512 t = _mm512_setzero_ps();                                                                          \
            for (int p = 0; p < P; p++)                                                                              \
                t = _mm512_dpbf16_ps(                                                                                \
                    t, w, (__m512bh)_mm512_loadu_si512(xp + ((size_t)p * M + m0 + r) * K + (size_t)(b) * QB));       \
            accs[r] = _mm512_fmadd_ps(t, s, accs[r]);                                                                \
        }                                                                                                            \
    } while (0)
#define ROWS_BF16(R_, P_)                                                                                            \
    TBF static void rows_bf16_##R_##_##P_(const uint8_t *blocks, const uint8_t *scales, int n0, int n1, int N,      \
                                          int K, const uint16_t *xp, int M, int m0, yout y, float *sb) {             \
        enum { R = R_, P = P_ };                                                                                     \
        const __m512i table = _mm512_loadu_si512((const void *)KVALUES_BF16);                                        \
        const int nb = K / QB;                                                                                       \
        for (int n = n0; n < n1; n++) {                                                                              \
            const uint8_t *q = blocks + (size_t)n * (K / 2);                                                         \
            row_scales(scales + (size_t)n * nb, nb, sb);                                                             \
            __m512 even[R], odd[R];                                                                                  \
            for (int r = 0; r < R; r++) even[r] = odd[r] = _mm512_setzero_ps();                                      \
            int b = 0;                                                                                               \
            for (; b + 2 <= nb; b += 2) {                                                                            \
                BF16_BLOCK(b, even);                                                                                 \
                BF16_BLOCK(b + 1, odd);                                                                              \
            }                                                                                                        \
            if (b < nb) BF16_BLOCK(b, even);                                                                         \
            for (int r = 0; r < R; r++)                                                                              \
                y_put(y, (size_t)(m0 + r) * N + n, _mm512_reduce_add_ps(_mm512_add_ps(even[r], odd[r])));            \
        }                                                                                                            \
    }
ROWS_BF16(1, 1)
ROWS_BF16(2, 1)
ROWS_BF16(3, 1)
ROWS_BF16(4, 1)
ROWS_BF16(1, 3)
ROWS_BF16(2, 3)

typedef void (*rows_bf16_fn)(const uint8_t *, const uint8_t *, int, int, int, int, const uint16_t *, int, int, yout,
                             float *);

/* x's rows in chunks of four bf16 rows (two fp32 ones: three planes each), a weight row's blocks decoded once per
   chunk. */
static void rows_bf16(const uint8_t *blocks, const uint8_t *scales, int n0, int n1, int N, int K, const uint16_t *xp,
                      int M, int planes, yout y, float *sb) {
    static const rows_bf16_fn one[4] = {rows_bf16_1_1, rows_bf16_2_1, rows_bf16_3_1, rows_bf16_4_1};
    static const rows_bf16_fn three[2] = {rows_bf16_1_3, rows_bf16_2_3};
    const int step = planes == 1 ? 4 : 2;
    for (int m0 = 0; m0 < M; m0 += step) {
        int r = M - m0 < step ? M - m0 : step;
        (planes == 1 ? one : three)[r - 1](blocks, scales, n0, n1, N, K, xp, M, m0, y, sb);
    }
}

/* fp32 -> three bf16 planes [3][count] whose sum is x exactly (non-finite x: the first plane alone, so the sums
   see x's inf or NaN). */
static void split_bf16(const float *x, size_t count, uint16_t *planes) {
    for (size_t i = 0; i < count; i++) {
        float v = x[i], rest = 0.f;
        uint16_t hi = bf16_of(v), parts[2] = {0, 0};
        uint32_t bits = (uint32_t)hi << 16;
        float h;
        memcpy(&h, &bits, 4);
        if (v - v == 0.f) { /* finite */
            rest = v - h;
            for (int p = 0; p < 2; p++) {
                parts[p] = bf16_of(rest);
                bits = (uint32_t)parts[p] << 16;
                memcpy(&h, &bits, 4);
                rest -= h;
            }
        }
        planes[i] = hi, planes[count + i] = parts[0], planes[2 * count + i] = parts[1];
    }
}

/* 3: AVX-512 BF16 too, 2: AVX-512 (F, BW, VL), 1: AVX2 + FMA, 0: portable C only. */
int fe_mxfp4_isa(void) {
    __builtin_cpu_init();
    if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma")) return 0;
    if (!__builtin_cpu_supports("avx512f") || !__builtin_cpu_supports("avx512bw") ||
        !__builtin_cpu_supports("avx512vl"))
        return 1;
    return __builtin_cpu_supports("avx512bf16") ? 3 : 2;
}

/* bf16 -> fp32 is exact. */
static void bf16_to_f32(const uint16_t *in, size_t count, float *out) {
    for (size_t i = 0; i < count; i++) {
        uint32_t bits = (uint32_t)in[i] << 16;
        memcpy(out + i, &bits, 4);
    }
}

/* The AVX-512 BF16 path: x as bf16 planes (a bf16 x as it is, an fp32 one split in three). */
static int gemm_bf16(const uint8_t *blocks, const uint8_t *scales, int N, int K, const void *x, int x_bf16, int M,
                     yout yo, int threads) {
    const int planes = x_bf16 ? 1 : 3, tasks = (N + ROWS - 1) / ROWS;
    uint16_t *xp = x_bf16 ? (uint16_t *)x : malloc(sizeof(uint16_t) * 3 * (size_t)M * K);
    if (!xp) return -1;
    if (!x_bf16) split_bf16((const float *)x, (size_t)M * K, xp);
    int failed = 0;
#pragma omp parallel num_threads(threads) if (threads > 1 && tasks > 1) reduction(| : failed)
    {
        float *sb = malloc(sizeof(float) * (size_t)(K / QB)); /* a weight row's block scales */
        if (!sb) failed = 1;
#pragma omp for schedule(static)
        for (int t = 0; t < tasks; t++) {
            int n0 = t * ROWS, n1 = n0 + ROWS < N ? n0 + ROWS : N;
            if (sb) rows_bf16(blocks, scales, n0, n1, N, K, xp, M, planes, yo, sb);
        }
        free(sb);
    }
    if (!x_bf16) free(xp);
    return failed ? -1 : 0;
}

/* y[M, N] = x[M, K] @ W.T; x and y fp32, or bf16 where x_bf16 / y_bf16 say so (widened here in one pass, y written
   by the kernels). ``isa``: 3 AVX-512 BF16 (any rows), 2 AVX-512 (its own path at one or two rows), 1 AVX2, 0
   portable C. Returns 0, or -1 for a shape it does not take (K % 32) or an allocation failure. */
int fe_mxfp4_gemm(const uint8_t *blocks, const uint8_t *scales, int N, int K, const void *x, int x_bf16, int M,
                  void *y, int y_bf16, int threads, int isa) {
    if (K <= 0 || K % QB || M <= 0 || N <= 0) return -1;
    const yout yo = {y, y_bf16};
    if (isa >= 3) return gemm_bf16(blocks, scales, N, K, x, x_bf16, M, yo, threads);
    float *xf = x_bf16 ? malloc(sizeof(float) * (size_t)M * K) : (float *)x;
    if (!xf) return -1;
    if (x_bf16) bf16_to_f32((const uint16_t *)x, (size_t)M * K, xf);
    const int fused = isa >= 1 && M <= 2, tasks = (N + ROWS - 1) / ROWS;
    float *xd = fused ? malloc(sizeof(float) * (size_t)M * K) : NULL;
    int failed = fused && !xd;
    if (xd) deinterleave(xf, M, K, xd);
    if (!failed) {
#pragma omp parallel num_threads(threads) if (threads > 1 && tasks > 1) reduction(| : failed)
    {
        /* per thread: a weight row decoded (K floats), or a row's block scales (K / 32) */
        float *w = malloc(sizeof(float) * (size_t)(fused ? K / QB : K));
        if (!w) failed = 1;
#pragma omp for schedule(static)
        for (int t = 0; t < tasks; t++) {
            int n0 = t * ROWS, n1 = n0 + ROWS < N ? n0 + ROWS : N;
            if (!w)
                continue;
            else if (fused && isa >= 2)
                rows_fused_512(blocks, scales, n0, n1, N, K, xd, M, yo, w);
            else if (fused)
                rows_fused(blocks, scales, n0, n1, N, K, xd, M, yo, w);
            else if (isa >= 1)
                rows_buffered(blocks, scales, n0, n1, N, K, xf, M, yo, w);
            else
                rows_c(blocks, scales, n0, n1, N, K, xf, M, yo, w);
        }
        free(w);
    }
    }
    free(xd);
    if (x_bf16) free(xf);
    return failed ? -1 : 0;
}

/* ``G`` independent fe_mxfp4_gemm calls (a MoE layer's experts, each on its own rows) in one parallel region, the
   threads sharing out whole matrices (dynamic: rows per matrix differ) rather than splitting each, as
   fe_int4_gemm_grouped does. ``table``: per call, 9 int64 fields in fe_mxfp4_gemm's argument order (blocks, scales,
   N, K, x, x_bf16, M, y, y_bf16). Fewer calls than threads: each call is split across the threads instead. A
   matrix's result does not depend on the thread that computes it. Returns 0, or -1 if any call failed. */
int fe_mxfp4_gemm_grouped(int G, const int64_t *table, int threads, int isa) {
    int failed = 0;
    const int across = threads > 1 && G >= threads;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (across) reduction(| : failed)
    for (int i = 0; i < G; i++) {
        const int64_t *a = table + 9 * (size_t)i;
        failed |= fe_mxfp4_gemm((const uint8_t *)(intptr_t)a[0], (const uint8_t *)(intptr_t)a[1], (int)a[2], (int)a[3],
                                (const void *)(intptr_t)a[4], (int)a[5], (int)a[6], (void *)(intptr_t)a[7], (int)a[8],
                                across ? 1 : threads, isa) != 0;
    }
    return failed ? -1 : 0;
}

/* llama.cpp's block_mxfp4 (an E8M0 byte, then 16 bytes: k = j in the low nibble of byte j, k = j + 16 in its high
   one) → the layout above: the 16 code bytes of each of ``nblocks`` blocks (17 bytes each) into ``codes`` and its
   exponent into ``scales``. */
void fe_mxfp4_from_ggml(const uint8_t *in, int64_t nblocks, uint8_t *codes, uint8_t *scales) {
    for (int64_t b = 0; b < nblocks; b++) {
        const uint8_t *q = in + 17 * b + 1;
        uint8_t *o = codes + 16 * b;
        scales[b] = in[17 * b];
        for (int j = 0; j < 8; j++) {
            o[j] = (uint8_t)((q[2 * j] & 0x0F) | ((q[2 * j + 1] & 0x0F) << 4));
            o[8 + j] = (uint8_t)((q[2 * j] >> 4) | (q[2 * j + 1] & 0xF0));
        }
    }
}
