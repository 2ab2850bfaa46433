/* Attention of decode queries (one position each) over key/value caches on the CPU, for caches in bf16, fp16 or fp32.

   Why: torch's CPU attention runs a bf16 decode query through bf16 GEMMs, which CPUs without AVX512-BF16 emulate
   (a 2-vCPU AVX2 EPYC, one thread: 16 heads x 128 over 512 cached positions 2.9 ms in bf16 against 0.4 ms in fp32;
   a Qwen1.5-MoE decode token at a 2,048-token context spent ~9 ms a layer there). Here the cache is read once, in
   its own dtype, and everything is computed in fp32: the cost should be the cache's bytes.

   How, per (row, kv head): cached positions go in blocks of 8. A block's keys are widened to fp32 once into a tile
   that stays in L1 (a shift for bf16, F16C for fp16) and every query head of the group takes its 8 scores from it
   with 8 independent FMA chains, reduced to one vector at the end (no horizontal sum per position). The softmax is
   vectorized (exp: Cephes' polynomial, within 2 ulp of libm's expf). Then each block's values are widened the same
   way and added, weighted, into each head's accumulator. AVX-512 (F, BW) runs the widening and both products 16
   floats at a time where Dk and Dv are multiples of 16; otherwise, and on AVX2 hosts, 8 at a time.

   Row r of ``q`` ([R][Hq][Dk], contiguous) attends to positions starts[r] .. starts[r] + lengths[r] - 1 of
   sequence r's caches (element strides: per sequence kb/vb, 0 where every row reads one cache; per kv head kh/vh;
   per position kp/vp; the last dimension contiguous), or to positions 0 .. length - 1 where starts is NULL; query
   head h reads kv head h / (Hq / Hkv). The output [R][Hq][Dv] is rounded once to q's dtype. Dk and Dv: multiples
   of 8. A row's arithmetic does not depend on the other rows. */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

enum { F32 = 0, BF16 = 1, F16 = 2 };

#define T256 __attribute__((target("avx2,fma,f16c")))
#define T512 __attribute__((target("avx512f,avx512bw,avx2,fma,f16c")))
#define INLINE static inline __attribute__((always_inline))
#define BLOCK 8 /* cached positions per tile */
/* The AVX-512 direct paths (MHA, bf16) ask for the rows two blocks ahead: each kv head's cache is its own run of 4 KB pages,
   which the hardware prefetcher starts over at every page; a Qwen1.5-MoE decode token at ~128 positions spent 0.56-0.59
   ms a token in this kernel over 8 layers without the prefetch, 0.50 with it (Zen 5, one thread). */
#define PF_ROWS 16

/* The block of split bf16 rows PF_ROWS rows past ``src`` (row j at ``src + 2 * j * stride``, D elements each). */
INLINE void prefetch_rows_ahead(const char *src, int64_t stride, int D) {
    for (int j = PF_ROWS; j < PF_ROWS + BLOCK; j++)
        for (int i = 0; i < 2 * D; i += 64) _mm_prefetch(src + 2 * j * stride + i, _MM_HINT_T0);
}

/* ---- 8 floats a vector (AVX2) ---------------------------------------------------------------------------------- */

T256 INLINE __m256 load8(const void *p, int dtype) {
    if (dtype == BF16)
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
    if (dtype == F16) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
    return _mm256_loadu_ps((const float *)p);
}

/* Lane i = the sum of a[i]'s lanes. */
T256 INLINE __m256 sum8x8(const __m256 *a) {
    __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
    __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
    __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

/* e^x: 2^n e^r with n = round(x log2 e) and |r| <= ln 2 / 2, e^r by Cephes' expf polynomial. Below -87.33 (fp32's
   denormal tail) it is 0, so -inf gives 0; a NaN stays NaN (max/min return their second operand for a NaN). */
T256 INLINE __m256 exp8(__m256 x) {
    const __m256 lo = _mm256_set1_ps(-87.33654f);
    __m256 xc = _mm256_min_ps(_mm256_set1_ps(88.0f), _mm256_max_ps(lo, x));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(xc, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), xc);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    y = _mm256_mul_ps(y, _mm256_castsi256_ps(e));
    return _mm256_blendv_ps(y, _mm256_setzero_ps(), _mm256_cmp_ps(x, lo, _CMP_LT_OQ));
}

/* Rows 0..nb-1 (``src`` row j at ``src + size * j * stride``) widened into ``tile`` [nb][D] fp32; ``split``: bf16
   rows as chunks of 8 even then 8 odd elements (see "Split tiles"). */
T256 INLINE void widen_256(const char *src, int dtype, size_t size, int64_t stride, int nb, int D, int split,
                           float *tile) {
    const __m256i high = _mm256_set1_epi32((int)0xffff0000);
    for (int j = 0; j < nb; j++) {
        const char *row = src + size * j * stride;
        float *t = tile + j * D;
        if (split) /* bf16 pairs: even elements by a shift, odd ones by a mask (chunk order: 8 even, then 8 odd) */
            for (int i = 0; i < D; i += 16) {
                const __m256i x = _mm256_loadu_si256((const __m256i *)(row + 2 * i));
                _mm256_storeu_ps(t + i, _mm256_castsi256_ps(_mm256_slli_epi32(x, 16)));
                _mm256_storeu_ps(t + i + 8, _mm256_castsi256_ps(_mm256_and_si256(x, high)));
            }
        else
            for (int i = 0; i < D; i += 8) _mm256_storeu_ps(t + i, load8(row + size * i, dtype));
    }
}

/* out[j] = q . tile[j] for the block's 8 rows. */
T256 INLINE void scores_256(const float *q, const float *tile, int D, float *out) {
    __m256 a[BLOCK];
    for (int j = 0; j < BLOCK; j++) a[j] = _mm256_setzero_ps();
    for (int i = 0; i < D; i += 8) {
        const __m256 qv = _mm256_loadu_ps(q + i);
        for (int j = 0; j < BLOCK; j++) a[j] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(tile + j * D + i), a[j]);
    }
    _mm256_storeu_ps(out, sum8x8(a));
}

/* acc += sum_j p[j] tile[j] over the block's nb rows. */
T256 INLINE void values_256(const float *p, const float *tile, int nb, int D, float *acc) {
    __m256 w[BLOCK];
    for (int j = 0; j < BLOCK; j++) w[j] = _mm256_set1_ps(p[j]);
    if (nb == BLOCK) {
        for (int i = 0; i < D; i += 8) {
            __m256 a = _mm256_loadu_ps(acc + i);
            for (int j = 0; j < BLOCK; j++) a = _mm256_fmadd_ps(w[j], _mm256_loadu_ps(tile + j * D + i), a);
            _mm256_storeu_ps(acc + i, a);
        }
        return;
    }
    for (int i = 0; i < D; i += 8) {
        __m256 a = _mm256_loadu_ps(acc + i);
        for (int j = 0; j < nb; j++) a = _mm256_fmadd_ps(w[j], _mm256_loadu_ps(tile + j * D + i), a);
        _mm256_storeu_ps(acc + i, a);
    }
}

/* One query head (MHA): scores_256 and values_256 straight from split bf16 rows (``src`` row j at ``src + 2 * j *
   stride``), without a tile: each row is read once, so widening it into L1 first would only add stores. */
T256 INLINE void scores_direct_256(const float *q, const char *src, int64_t stride, int nb, int D, float *out) {
    const __m256i high = _mm256_set1_epi32((int)0xffff0000);
    const char *row[BLOCK];
    __m256 a[BLOCK];
    for (int j = 0; j < BLOCK; j++) {
        row[j] = src + 2 * (j < nb ? j : 0) * stride; /* rows past nb: row 0 again, their scores dropped */
        a[j] = _mm256_setzero_ps();
    }
    for (int i = 0; i < D; i += 16) {
        const __m256 qe = _mm256_loadu_ps(q + i), qo = _mm256_loadu_ps(q + i + 8);
        for (int j = 0; j < BLOCK; j++) {
            const __m256i x = _mm256_loadu_si256((const __m256i *)(row[j] + 2 * i));
            a[j] = _mm256_fmadd_ps(qe, _mm256_castsi256_ps(_mm256_slli_epi32(x, 16)), a[j]);
            a[j] = _mm256_fmadd_ps(qo, _mm256_castsi256_ps(_mm256_and_si256(x, high)), a[j]);
        }
    }
    _mm256_storeu_ps(out, sum8x8(a));
}

T256 INLINE void values_direct_256(const float *p, const char *src, int64_t stride, int nb, int D, float *acc) {
    const __m256i high = _mm256_set1_epi32((int)0xffff0000);
    for (int i = 0; i < D; i += 16) {
        __m256 e = _mm256_loadu_ps(acc + i), o = _mm256_loadu_ps(acc + i + 8);
        for (int j = 0; j < nb; j++) {
            const __m256i x = _mm256_loadu_si256((const __m256i *)(src + 2 * (j * stride + i)));
            const __m256 w = _mm256_set1_ps(p[j]);
            e = _mm256_fmadd_ps(w, _mm256_castsi256_ps(_mm256_slli_epi32(x, 16)), e);
            o = _mm256_fmadd_ps(w, _mm256_castsi256_ps(_mm256_and_si256(x, high)), o);
        }
        _mm256_storeu_ps(acc + i, e);
        _mm256_storeu_ps(acc + i + 8, o);
    }
}

/* A split row back in order: each chunk's 8 even and 8 odd elements interleaved. */
T256 INLINE void unsplit_256(const float *a, int D, float *o) {
    for (int i = 0; i < D; i += 16) {
        const __m256 e = _mm256_loadu_ps(a + i), d = _mm256_loadu_ps(a + i + 8);
        const __m256 lo = _mm256_unpacklo_ps(e, d), hi = _mm256_unpackhi_ps(e, d); /* per 128-bit lane */
        _mm256_storeu_ps(o + i, _mm256_permute2f128_ps(lo, hi, 0x20));
        _mm256_storeu_ps(o + i + 8, _mm256_permute2f128_ps(lo, hi, 0x31));
    }
}

/* ---- 16 floats a vector (AVX-512) ------------------------------------------------------------------------------ */

T512 INLINE __m512 load16(const void *p, int dtype) {
    if (dtype == BF16)
        return _mm512_castsi512_ps(
            _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
    if (dtype == F16) return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
    return _mm512_loadu_ps((const float *)p);
}

T512 INLINE void widen_512(const char *src, int dtype, size_t size, int64_t stride, int nb, int D, int split,
                           float *tile) {
    const __m512i high = _mm512_set1_epi32((int)0xffff0000);
    for (int j = 0; j < nb; j++) {
        const char *row = src + size * j * stride;
        float *t = tile + j * D;
        if (split) /* as widen_256, 16 even then 16 odd a chunk */
            for (int i = 0; i < D; i += 32) {
                const __m512i x = _mm512_loadu_si512(row + 2 * i);
                _mm512_storeu_ps(t + i, _mm512_castsi512_ps(_mm512_slli_epi32(x, 16)));
                _mm512_storeu_ps(t + i + 16, _mm512_castsi512_ps(_mm512_and_si512(x, high)));
            }
        else
            for (int i = 0; i < D; i += 16) _mm512_storeu_ps(t + i, load16(row + size * i, dtype));
    }
}

T512 INLINE void scores_512(const float *q, const float *tile, int D, float *out) {
    __m512 a[BLOCK];
    for (int j = 0; j < BLOCK; j++) a[j] = _mm512_setzero_ps();
    for (int i = 0; i < D; i += 16) {
        const __m512 qv = _mm512_loadu_ps(q + i);
        for (int j = 0; j < BLOCK; j++) a[j] = _mm512_fmadd_ps(qv, _mm512_loadu_ps(tile + j * D + i), a[j]);
    }
    __m256 h[BLOCK];
    for (int j = 0; j < BLOCK; j++)
        h[j] = _mm256_add_ps(_mm512_castps512_ps256(a[j]),
                             _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a[j]), 1)));
    _mm256_storeu_ps(out, sum8x8(h));
}

T512 INLINE void values_512(const float *p, const float *tile, int nb, int D, float *acc) {
    __m512 w[BLOCK];
    for (int j = 0; j < BLOCK; j++) w[j] = _mm512_set1_ps(p[j]);
    if (nb == BLOCK) {
        for (int i = 0; i < D; i += 16) {
            __m512 a = _mm512_loadu_ps(acc + i);
            for (int j = 0; j < BLOCK; j++) a = _mm512_fmadd_ps(w[j], _mm512_loadu_ps(tile + j * D + i), a);
            _mm512_storeu_ps(acc + i, a);
        }
        return;
    }
    for (int i = 0; i < D; i += 16) {
        __m512 a = _mm512_loadu_ps(acc + i);
        for (int j = 0; j < nb; j++) a = _mm512_fmadd_ps(w[j], _mm512_loadu_ps(tile + j * D + i), a);
        _mm512_storeu_ps(acc + i, a);
    }
}

T512 INLINE void scores_direct_512(const float *q, const char *src, int64_t stride, int nb, int D, float *out) {
    const __m512i high = _mm512_set1_epi32((int)0xffff0000);
    const char *row[BLOCK];
    __m512 a[BLOCK];
    for (int j = 0; j < BLOCK; j++) {
        row[j] = src + 2 * (j < nb ? j : 0) * stride;
        a[j] = _mm512_setzero_ps();
    }
    prefetch_rows_ahead(src, stride, D);
    for (int i = 0; i < D; i += 32) {
        const __m512 qe = _mm512_loadu_ps(q + i), qo = _mm512_loadu_ps(q + i + 16);
        for (int j = 0; j < BLOCK; j++) {
            const __m512i x = _mm512_loadu_si512(row[j] + 2 * i);
            a[j] = _mm512_fmadd_ps(qe, _mm512_castsi512_ps(_mm512_slli_epi32(x, 16)), a[j]);
            a[j] = _mm512_fmadd_ps(qo, _mm512_castsi512_ps(_mm512_and_si512(x, high)), a[j]);
        }
    }
    __m256 h[BLOCK];
    for (int j = 0; j < BLOCK; j++)
        h[j] = _mm256_add_ps(_mm512_castps512_ps256(a[j]),
                             _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a[j]), 1)));
    _mm256_storeu_ps(out, sum8x8(h));
}

T512 INLINE void values_direct_512(const float *p, const char *src, int64_t stride, int nb, int D, float *acc) {
    const __m512i high = _mm512_set1_epi32((int)0xffff0000);
    prefetch_rows_ahead(src, stride, D);
    for (int i = 0; i < D; i += 32) {
        __m512 e = _mm512_loadu_ps(acc + i), o = _mm512_loadu_ps(acc + i + 16);
        for (int j = 0; j < nb; j++) {
            const __m512i x = _mm512_loadu_si512(src + 2 * (j * stride + i));
            const __m512 w = _mm512_set1_ps(p[j]);
            e = _mm512_fmadd_ps(w, _mm512_castsi512_ps(_mm512_slli_epi32(x, 16)), e);
            o = _mm512_fmadd_ps(w, _mm512_castsi512_ps(_mm512_and_si512(x, high)), o);
        }
        _mm512_storeu_ps(acc + i, e);
        _mm512_storeu_ps(acc + i + 16, o);
    }
}

T512 INLINE void unsplit_512(const float *a, int D, float *o) {
    const __m512i lo = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
    const __m512i hi = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
    for (int i = 0; i < D; i += 32) {
        const __m512 e = _mm512_loadu_ps(a + i), d = _mm512_loadu_ps(a + i + 16);
        _mm512_storeu_ps(o + i, _mm512_permutex2var_ps(e, lo, d));
        _mm512_storeu_ps(o + i + 16, _mm512_permutex2var_ps(e, hi, d));
    }
}

/* ---- one (row, kv head) ---------------------------------------------------------------------------------------- */

/* fp32 -> bf16 to nearest even, a NaN a quiet NaN (as torch's .to() rounds), 8 at a time. */
T256 INLINE __m128i to_bf16_8(__m256 x) {
    const __m256i u = _mm256_castps_si256(x), top = _mm256_srli_epi32(u, 16);
    const __m256i odd = _mm256_and_si256(top, _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff))), 16);
    r = _mm256_blendv_epi8(r, _mm256_or_si256(top, _mm256_set1_epi32(0x40)),
                           _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q)));
    const __m256i packed = _mm256_packus_epi32(r, r); /* per 128-bit lane: lanes 0-3 and 4-7 in the low halves */
    return _mm256_castsi256_si128(_mm256_permute4x64_epi64(packed, 0x08));
}

T256 static void store(const float *in, int n, int dtype, void *out) {
    for (int i = 0; i < n; i += 8) {
        const __m256 x = _mm256_loadu_ps(in + i);
        if (dtype == F32)
            _mm256_storeu_ps((float *)out + i, x);
        else
            _mm_storeu_si128((__m128i *)((uint16_t *)out + i),
                             dtype == F16 ? _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT) : to_bf16_8(x));
    }
}

/* Each head's scores s [len8] (len8: length rounded up to 8; the pad holds -inf) → probabilities, in place. ``sink``:
   gpt-oss's attention sink, one more logit in the denominator that weighs no value (-inf: none). */
T256 static void softmax(float *s, int64_t len8, float sink) {
    __m256 mv = _mm256_set1_ps(-INFINITY);
    for (int64_t j = 0; j < len8; j += 8) mv = _mm256_max_ps(_mm256_loadu_ps(s + j), mv); /* a NaN score: skipped */
    float lanes[8], m = sink;
    _mm256_storeu_ps(lanes, mv);
    for (int i = 0; i < 8; i++) m = lanes[i] > m ? lanes[i] : m;
    if (m == -INFINITY) m = 0.f; /* every score -inf: the sum is 0 and the output NaN, as torch's is */
    const __m256 mb = _mm256_set1_ps(m);
    __m256 sv = _mm256_setzero_ps();
    for (int64_t j = 0; j < len8; j += 8) {
        __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), mb));
        _mm256_storeu_ps(s + j, e);
        sv = _mm256_add_ps(sv, e);
    }
    _mm256_storeu_ps(lanes, sv);
    float sum = 0.f;
    for (int i = 0; i < 8; i++) sum += lanes[i];
    if (sink != -INFINITY) sum += expf(sink - m);
    const __m256 inv = _mm256_set1_ps(1.f / sum);
    for (int64_t j = 0; j < len8; j += 8) _mm256_storeu_ps(s + j, _mm256_mul_ps(_mm256_loadu_ps(s + j), inv));
}

/* Split tiles: bf16 rows whose size is a multiple of 2W (W: floats a vector) are widened in chunks of 2W elements,
   the even elements first, then the odd ones (a shift and a mask, no shuffle). q is widened the same way, so each dot
   product is unchanged, and the values' accumulators are put back in order before they are stored. */

/* The g query heads of one kv head against ``length`` cached positions. ``work``: see fe_decode_attention. */
#define GROUP_BODY(WIDEN, SCORES, VALUES, SCORES_DIRECT, VALUES_DIRECT, UNSPLIT, W)                                                                         \
    const size_t qsize = q_dtype == F32 ? 4 : 2, kvsize = kv_dtype == F32 ? 4 : 2;                                   \
    const int kchunk = kv_dtype == BF16 && Dk % (2 * W) == 0 ? 2 * W : 0;                                            \
    const int vchunk = kv_dtype == BF16 && Dv % (2 * W) == 0 ? 2 * W : 0;                                            \
    const int64_t len8 = (length + BLOCK - 1) / BLOCK * BLOCK;                                                       \
    float *qf = work, *acc = qf + (size_t)g * Dk, *s = acc + (size_t)g * Dv, *tile = s + (size_t)g * len8;           \
    WIDEN(q, q_dtype, qsize, Dk, g, Dk, q_dtype == BF16 && kchunk, qf); /* q: the keys' layout, scaled */          \
    for (size_t i = 0; i < (size_t)g * Dk; i++) qf[i] *= scale;                                                      \
    for (int64_t j0 = 0; j0 < length; j0 += BLOCK) {                                                                 \
        const int nb = length - j0 < BLOCK ? (int)(length - j0) : BLOCK;                                             \
        if (g == 1 && kchunk) {                                                                                      \
            SCORES_DIRECT(qf, k + kvsize * (size_t)(j0 * kp), kp, nb, Dk, s + j0);                                   \
            continue;                                                                                                \
        }                                                                                                            \
        WIDEN(k + kvsize * (size_t)(j0 * kp), kv_dtype, kvsize, kp, nb, Dk, kchunk, tile);                           \
        if (nb < BLOCK) memset(tile + nb * Dk, 0, sizeof(float) * (size_t)(BLOCK - nb) * Dk); /* scores dropped */  \
        for (int h = 0; h < g; h++) SCORES(qf + (size_t)h * Dk, tile, Dk, s + (size_t)h * len8 + j0);                \
    }                                                                                                                \
    for (int h = 0; h < g; h++) {                                                                                    \
        for (int64_t j = length; j < len8; j++) s[(size_t)h * len8 + j] = -INFINITY;                                 \
        softmax(s + (size_t)h * len8, len8, sinks ? sinks[h] : -INFINITY);                                           \
        memset(acc + (size_t)h * Dv, 0, sizeof(float) * (size_t)Dv);                                                 \
    }                                                                                                                \
    for (int64_t j0 = 0; j0 < length; j0 += BLOCK) {                                                                 \
        const int nb = length - j0 < BLOCK ? (int)(length - j0) : BLOCK;                                             \
        if (g == 1 && vchunk) {                                                                                      \
            VALUES_DIRECT(s + j0, v + kvsize * (size_t)(j0 * vp), vp, nb, Dv, acc);                                  \
            continue;                                                                                                \
        }                                                                                                            \
        WIDEN(v + kvsize * (size_t)(j0 * vp), kv_dtype, kvsize, vp, nb, Dv, vchunk, tile);                           \
        for (int h = 0; h < g; h++) VALUES(s + (size_t)h * len8 + j0, tile, nb, Dv, acc + (size_t)h * Dv);           \
    }                                                                                                                \
    const size_t osize = q_dtype == F32 ? 4 : 2;                                                                     \
    for (int h = 0; h < g; h++) {                                                                                    \
        float *a = acc + (size_t)h * Dv;                                                                             \
        if (vchunk) UNSPLIT(a, Dv, tile);                                                                            \
        store(vchunk ? tile : a, Dv, q_dtype, out + osize * (size_t)h * Dv);                                         \
    }

#define GROUP_ARGS                                                                                                    \
    const char *q, int q_dtype, const char *k, const char *v, int kv_dtype, int64_t kp, int64_t vp, int64_t length, \
        int g, int Dk, int Dv, float scale, char *out, float *work, const float *sinks

T256 static void group_256(GROUP_ARGS) { GROUP_BODY(widen_256, scores_256, values_256, scores_direct_256, values_direct_256, unsplit_256, 8) }
T512 static void group_512(GROUP_ARGS) { GROUP_BODY(widen_512, scores_512, values_512, scores_direct_512, values_direct_512, unsplit_512, 16) }

/* ---- entry points ---------------------------------------------------------------------------------------------- */

/* 2: AVX-512 (F, BW), 1: AVX2 with FMA and F16C, 0: neither. */
static int cpu_isa(void) {
    __builtin_cpu_init();
    if (!(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c")))
        return 0;
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") ? 2 : 1;
}

static int isa_cap = 2; /* the widest instruction set the kernel may use (tests compare the two paths) */

/* 1 where this CPU runs the kernel (AVX2, FMA and F16C), else 0. */
int fe_attention_supported(void) { return cpu_isa() > 0; }

/* The instruction set the kernel uses from now on, at most this CPU's: 2 AVX-512, 1 AVX2. Returns the one in use. */
int fe_attention_set_isa(int isa) {
    isa_cap = isa;
    const int have = cpu_isa();
    return isa < have ? isa : have;
}

/* Returns 0, -1 for shapes it does not take (the caller uses torch), -2 when out of memory. ``sinks``: float32 [Hq],
   each query head's attention sink (gpt-oss), or NULL. */
int fe_decode_attention(const void *q, int q_dtype, const void *k, const void *v, int kv_dtype, int64_t kb,
                        int64_t kh, int64_t kp, int64_t vb, int64_t vh, int64_t vp, const int64_t *starts,
                        const int64_t *lengths, int64_t length, int R, int Hq, int Hkv, int Dk, int Dv,
                        float scale, void *out, int threads, const float *sinks) {
    if (R <= 0 || Hkv <= 0 || Hq % Hkv || Dk % 8 || Dv % 8 || Dk <= 0 || Dv <= 0) return -1;
    const int g = Hq / Hkv, tasks = R * Hkv;
    int64_t longest = 0, work = 0;
    for (int r = 0; r < R; r++) {
        const int64_t first = starts ? starts[r] : 0, n = starts ? lengths[r] : length;
        if (n <= 0 || first < 0) return -1;
        longest = n > longest ? n : longest;
        work += n;
    }
    const int have = cpu_isa(), isa = isa_cap < have ? isa_cap : have;
    const int wide = isa >= 2 && Dk % 16 == 0 && Dv % 16 == 0;
    const size_t qsize = q_dtype == F32 ? 4 : 2, kvsize = kv_dtype == F32 ? 4 : 2;
    const int64_t len8 = (longest + BLOCK - 1) / BLOCK * BLOCK;
    /* query heads, accumulators, scores and one tile of BLOCK rows */
    const size_t scratch = (size_t)g * (Dk + Dv + len8) + (size_t)BLOCK * (Dk > Dv ? Dk : Dv);
    /* threads only where each gets enough cache to read: waking a team costs ~10 us */
    const int nt = threads > 1 && tasks > 1 && work * Hkv * (Dk + Dv) >= (1 << 16) ? threads : 1;
    int failed = 0;
#pragma omp parallel num_threads(nt) if (nt > 1) reduction(| : failed)
    {
        float *buf = malloc(sizeof(float) * scratch);
        failed |= !buf;
        /* guided: a late worker takes fewer (row, kv head) tasks instead of the first thread waiting for its half */
#pragma omp for schedule(guided)
        for (int t = 0; t < tasks; t++) { /* every thread reaches the loop's barrier, even one without scratch */
            if (buf) {
                const int r = t / Hkv, h = t % Hkv;
                const int64_t first = starts ? starts[r] : 0, n = starts ? lengths[r] : length;
                const char *qr = (const char *)q + qsize * ((size_t)r * Hq + (size_t)h * g) * Dk;
                const char *kr = (const char *)k + kvsize * (size_t)(r * kb + h * kh + first * kp);
                const char *vr = (const char *)v + kvsize * (size_t)(r * vb + h * vh + first * vp);
                char *o = (char *)out + qsize * ((size_t)r * Hq + (size_t)h * g) * Dv;
                const float *sk = sinks ? sinks + (size_t)h * g : NULL; /* this kv head's query heads' sinks */
                if (wide)
                    group_512(qr, q_dtype, kr, vr, kv_dtype, kp, vp, n, g, Dk, Dv, scale, o, buf, sk);
                else
                    group_256(qr, q_dtype, kr, vr, kv_dtype, kp, vp, n, g, Dk, Dv, scale, o, buf, sk);
            }
        }
        free(buf);
    }
    return failed ? -2 : 0;
}
