/* One decode row's small steps between the big matmuls, each one call where torch took several operators.

   Why: in a decode step every operator between two native matmuls starts cold (the matmul streamed tens of MB
   through the caches), so each costs tens of microseconds in place of one or two; a MoE layer's expert sum alone was
   seven of them (docs/cpu-profile.md). Each function here gives the bits of the torch operators it replaces, which
   the tests check against them:

   fe_moe_combine: a MoE layer's routed experts and shared expert added into the residual, as
   layer_step.add_routed / add_shared / add_moe compute them: a float32 sum (the residual itself in a float32 model,
   else from zero), each expert a fused multiply-add by its weight in the order given (torch's add_ with alpha and
   addcmul_ are fused multiply-adds), the shared expert times its gate (or plus it, without a gate), then, for a bf16
   residual, the sum added to it and rounded once to nearest even.

   fe_embed_int8_row: one row of an int8 embedding table read from the store's file and dequantized, as
   QuantizedEmbedding's gather (FileRows) and its codes.float() * scale.float() then .to(dtype) compute it.

   fe_kv_append: one decode position's keys and values copied into their caches.

   fe_add_bf16: two bf16 rows added, as torch's bf16 add rounds.

   fe_head_norm_bf16: Qwen3's per-head q and k norm on a decode row's projection, each head as fe_rms_norm_bf16.

   fe_argmax_bf16: the first index of the largest of n bf16 values, a NaN counting as largest, as torch.argmax.

   fe_rope_bf16: rotary embedding of bf16 rows by bf16 cos and signed sin, as the rotation matrix of
   decode_step.rope_matrix multiplies them in float32: x_j cos_j + x_{(j + d/2) mod d} sin_j. Both products are exact
   in float32 (8-bit mantissas), so their sum rounds once, then once more to bf16: the matmul's bits. */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <unistd.h>

enum { F32 = 0, BF16 = 1 };

#define T256 __attribute__((target("avx2,fma")))
#define INLINE static inline __attribute__((always_inline))

static float bf16_value(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* to nearest even, a NaN a quiet NaN (as torch's .to() rounds) */
static uint16_t bf16_round(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

T256 INLINE __m256 load8(const void *p, int dtype, int64_t i) {
    if (dtype == BF16)
        return _mm256_castsi256_ps(
            _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)p + i))), 16));
    return _mm256_loadu_ps((const float *)p + i);
}

INLINE float load1(const void *p, int dtype, int64_t i) {
    return dtype == BF16 ? bf16_value(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

T256 INLINE __m128i to_bf16_8(__m256 x) {
    const __m256i u = _mm256_castps_si256(x), top = _mm256_srli_epi32(u, 16);
    const __m256i odd = _mm256_and_si256(top, _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff))), 16);
    r = _mm256_blendv_epi8(r, _mm256_or_si256(top, _mm256_set1_epi32(0x40)),
                           _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q)));
    const __m256i packed = _mm256_packus_epi32(r, r);
    return _mm256_castsi256_si128(_mm256_permute4x64_epi64(packed, 0x08));
}

/* 1 where this CPU runs these functions (AVX2 and FMA), else 0. */
int fe_row_ops_supported(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

/* x [n] (dtype x_dtype) += the experts ys[e] [n] (y_dtype) times ws[e], e = 0..k-1 in that order, then the shared
   expert z [n] (z_dtype; NULL: none) times *gate (gate_dtype; NULL: plus z). A float32 x is the sum itself.
   ``sigmoid``: NULL, or torch's bf16 sigmoid of every bf16 value, indexed by its bits; then *gate is Qwen's bf16
   gate logit and the factor is its sigmoid from the table (torch's bits by construction), where the caller would
   otherwise run torch.sigmoid on it first. */
T256 void fe_moe_combine(void *x, int x_dtype, int64_t n, int k, const int64_t *ys, int y_dtype, const float *ws,
                         const void *z, int z_dtype, const void *gate, int gate_dtype, const uint16_t *sigmoid) {
    const float g = !gate ? 1.f : sigmoid ? bf16_value(sigmoid[*(const uint16_t *)gate]) : load1(gate, gate_dtype, 0);
    const __m256 gv = _mm256_set1_ps(g);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 acc = x_dtype == F32 ? _mm256_loadu_ps((const float *)x + i) : _mm256_setzero_ps();
        for (int e = 0; e < k; e++)
            acc = _mm256_fmadd_ps(_mm256_set1_ps(ws[e]), load8((const void *)(intptr_t)ys[e], y_dtype, i), acc);
        if (z) {
            const __m256 zv = load8(z, z_dtype, i);
            acc = gate ? _mm256_fmadd_ps(gv, zv, acc) : _mm256_add_ps(acc, zv);
        }
        if (x_dtype == F32)
            _mm256_storeu_ps((float *)x + i, acc);
        else
            _mm_storeu_si128((__m128i *)((uint16_t *)x + i), to_bf16_8(_mm256_add_ps(load8(x, BF16, i), acc)));
    }
    for (; i < n; i++) {
        float acc = x_dtype == F32 ? ((const float *)x)[i] : 0.f;
        for (int e = 0; e < k; e++) acc = fmaf(ws[e], load1((const void *)(intptr_t)ys[e], y_dtype, i), acc);
        if (z) acc = gate ? fmaf(g, load1(z, z_dtype, i), acc) : acc + load1(z, z_dtype, i);
        if (x_dtype == F32)
            ((float *)x)[i] = acc;
        else
            ((uint16_t *)x)[i] = bf16_round(bf16_value(((const uint16_t *)x)[i]) + acc);
    }
}

/* out [n] = a + b, bf16 (out may be a or b): both widened exactly, one float sum, rounded to nearest even, as torch's
   bf16 add rounds (the decode row's residual plus its attention's output, attention_row's ``x + y``). */
T256 void fe_add_bf16(const void *a, const void *b, int64_t n, void *out) {
    const uint16_t *x = (const uint16_t *)a, *y = (const uint16_t *)b;
    uint16_t *o = (uint16_t *)out;
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)(o + i), to_bf16_8(_mm256_add_ps(load8(x, BF16, i), load8(y, BF16, i))));
    for (; i < n; i++) o[i] = bf16_round(bf16_value(x[i]) + bf16_value(y[i]));
}

/* ---- one decode row's keys and values into its cache -------------------------------------------------------------- */

/* ``heads`` rows of ``row_bytes`` each from k and from v (each contiguous) to kd and vd, row h at h * k_stride and
   h * v_stride bytes: one position's keys and values written into [heads, positions, d] caches. */
void fe_kv_append(const void *k, const void *v, int64_t heads, int64_t row_bytes, void *kd, int64_t k_stride, void *vd,
                  int64_t v_stride) {
    for (int64_t h = 0; h < heads; h++) {
        memcpy((char *)kd + h * k_stride, (const char *)k + h * row_bytes, (size_t)row_bytes);
        memcpy((char *)vd + h * v_stride, (const char *)v + h * row_bytes, (size_t)row_bytes);
    }
}

/* ---- RMSNorm of one bf16 row, with torch's bits ------------------------------------------------------------------- */

/* Neither compiler may fuse a product into a following sum here: torch squares, then sums (two roundings). */
#pragma STDC FP_CONTRACT OFF
#define NO_FMA __attribute__((optimize("fp-contract=off")))

static int ceil_log2(int64_t v) {
    int r = 0;
    while (((int64_t)1 << r) < v) r++;
    return r;
}

/* The float32 sum of sq[0..n-1] in the order of torch's CPU sum over a contiguous last dimension (SumKernel.cpp's
   vectorized_inner_sum on 8-float vectors: four interleaved partial sums, each a cascade of up to four levels, then
   the scalar tail, then the lanes). The tests compare it with torch.sum on many lengths and scales. */
T256 NO_FMA static float torch_sum(const float *sq, int64_t n) {
    const int64_t vecs = n / 8, rows = vecs / 4;
    const int lp = ceil_log2(rows) / 4 > 4 ? ceil_log2(rows) / 4 : 4;
    const int64_t step = (int64_t)1 << lp, mask = step - 1;
    __m256 acc[4][4];
    for (int a = 0; a < 4; a++)
        for (int k = 0; k < 4; k++) acc[a][k] = _mm256_setzero_ps();
    int64_t i = 0;
    while (i + step <= rows) {
        for (int64_t j = 0; j < step; j++, i++)
            for (int k = 0; k < 4; k++) acc[0][k] = _mm256_add_ps(acc[0][k], _mm256_loadu_ps(sq + 8 * (4 * i + k)));
        for (int j = 1; j < 4; j++) {
            for (int k = 0; k < 4; k++) {
                acc[j][k] = _mm256_add_ps(acc[j][k], acc[j - 1][k]);
                acc[j - 1][k] = _mm256_setzero_ps();
            }
            if (i & (mask << (j * lp))) break;
        }
    }
    for (; i < rows; i++)
        for (int k = 0; k < 4; k++) acc[0][k] = _mm256_add_ps(acc[0][k], _mm256_loadu_ps(sq + 8 * (4 * i + k)));
    for (int j = 1; j < 4; j++)
        for (int k = 0; k < 4; k++) acc[0][k] = _mm256_add_ps(acc[0][k], acc[j][k]);
    __m256 part = acc[0][0];
    for (int64_t v = rows * 4; v < vecs; v++) part = _mm256_add_ps(part, _mm256_loadu_ps(sq + 8 * v));
    for (int k = 1; k < 4; k++) part = _mm256_add_ps(part, acc[0][k]);
    float total = 0.f, lanes[8];
    for (int64_t t = vecs * 8; t < n; t++) total += sq[t];
    _mm256_storeu_ps(lanes, part);
    for (int l = 0; l < 8; l++) total += lanes[l];
    return total;
}

/* out [n] = w * bf16(x * rsqrt(mean(x^2) + eps)), x, w, out bf16 [n]: what F.rms_norm without a weight and the
   weight's product compute (layer.rms_norm), bit for bit. n: at most 16384 (torch sums longer rows on several
   threads, in another order). Returns 0, or -1 for an n it does not take. */
T256 NO_FMA int fe_rms_norm_bf16(const void *x, int64_t n, const void *w, float eps, void *out) {
    if (n <= 0 || n > 16384) return -1;
    const uint16_t *xb = (const uint16_t *)x, *wb = (const uint16_t *)w;
    float sq[16384];
    for (int64_t i = 0; i < n; i++) {
        const float v = bf16_value(xb[i]);
        sq[i] = v * v;
    }
    const float var = torch_sum(sq, n) / (float)n + eps;
    const float r = 1.f / sqrtf(var);
    uint16_t *o = (uint16_t *)out;
    for (int64_t i = 0; i < n; i++) o[i] = bf16_round(bf16_value(wb[i]) * bf16_value(bf16_round(bf16_value(xb[i]) * r)));
    return 0;
}

/* Qwen3's per-head q and k norm, in place on a decode row's projection: its first nq rows of d (the query heads)
   each as fe_rms_norm_bf16 with qw [d], the next nk (the key heads) with kw [d]; torch's F.rms_norm normalizes each
   row of a [heads, d] tensor as it would the row alone, so these are attention.gqa_qkv's bits. Returns 0, or -1 for a
   d it does not take. */
T256 int fe_head_norm_bf16(void *x, int nq, int nk, int64_t d, const void *qw, const void *kw, float eps) {
    uint16_t *rows = (uint16_t *)x;
    for (int r = 0; r < nq + nk; r++)
        if (fe_rms_norm_bf16(rows + (size_t)r * d, d, r < nq ? qw : kw, eps, rows + (size_t)r * d) != 0) return -1;
    return 0;
}

/* rows x [rows][d] bf16 (contiguous), rotated in place by cos and signed sin [d] (bf16); first, where ``bias`` is
given, each of the ``total`` values from x on (the rotated rows, then what follows them: a fused q/k/v projection's v)
plus its bias [total] (bf16), rounded as torch's bf16 add rounds. d: even, at most 1024. Returns 0, or -1 for a d it
does not take. */
T256 NO_FMA int fe_rope_bf16(void *x, int rows, int d, const void *cos, const void *sin, const void *bias, int64_t total) {
    if (d <= 0 || d % 2 || d > 1024) return -1;
    const uint16_t *c = (const uint16_t *)cos, *s = (const uint16_t *)sin;
    if (bias) {
        uint16_t *xs = (uint16_t *)x;
        const uint16_t *b = (const uint16_t *)bias;
        int64_t i = 0;
        for (; i + 8 <= total; i += 8) /* both widened exactly, one float sum, rounded: torch's bf16 add */
            _mm_storeu_si128((__m128i *)(xs + i), to_bf16_8(_mm256_add_ps(load8(xs, BF16, i), load8(b, BF16, i))));
        for (; i < total; i++) xs[i] = bf16_round(bf16_value(xs[i]) + bf16_value(b[i]));
    }
    const int half = d / 2;
    if (half % 8 == 0) { /* out_j = x_j cos_j + x_partner sin_j: two exact products, one rounded sum, then bf16 */
        for (int r = 0; r < rows; r++) {
            uint16_t *xr = (uint16_t *)x + (size_t)r * d;
            for (int j = 0; j < half; j += 8) {
                const __m256 lo = load8(xr, BF16, j), hi = load8(xr, BF16, j + half);
                const __m256 a = _mm256_add_ps(_mm256_mul_ps(lo, load8(c, BF16, j)), _mm256_mul_ps(hi, load8(s, BF16, j)));
                const __m256 b = _mm256_add_ps(_mm256_mul_ps(hi, load8(c, BF16, j + half)),
                                               _mm256_mul_ps(lo, load8(s, BF16, j + half)));
                _mm_storeu_si128((__m128i *)(xr + j), to_bf16_8(a));
                _mm_storeu_si128((__m128i *)(xr + j + half), to_bf16_8(b));
            }
        }
        return 0;
    }
    float cf[1024], sf[1024], row[1024];
    for (int j = 0; j < d; j++) cf[j] = bf16_value(c[j]), sf[j] = bf16_value(s[j]);
    for (int r = 0; r < rows; r++) {
        uint16_t *xr = (uint16_t *)x + (size_t)r * d;
        for (int j = 0; j < d; j++) row[j] = bf16_value(xr[j]);
        for (int j = 0; j < d; j++) {
            const float a = row[j] * cf[j], b = row[(j + half) % d] * sf[j]; /* both exact */
            xr[j] = bf16_round(a + b);
        }
    }
    return 0;
}

/* ``count`` bytes at ``at`` of ``fd`` into ``buf``: 0, or -1 where the file ends first or the read fails. */
static int read_full(int fd, void *buf, size_t count, int64_t at) {
    size_t got = 0;
    while (got < count) {
        const ssize_t n = pread(fd, (char *)buf + got, count - got, (off_t)(at + (int64_t)got));
        if (n <= 0) return -1;
        got += (size_t)n;
    }
    return 0;
}

/* Row codes [h] int8 at byte ``codes_at`` and its scale (bf16) at ``scale_at`` of ``fd`` → out [h] in out_dtype
   (F32 or BF16): float(code) * float(scale), exact in float32 (8-bit by 8-bit), rounded once for bf16. Returns 0,
   -1 on a short read (a truncated store), -2 for an h it does not take. */
int fe_embed_int8_row(int fd, int64_t codes_at, int64_t scale_at, int64_t h, void *out, int out_dtype) {
    if (h <= 0 || h > 16384) return -2;
    int8_t codes[16384];
    uint16_t scale;
    if (read_full(fd, codes, (size_t)h, codes_at) || read_full(fd, &scale, sizeof scale, scale_at)) return -1;
    const float sv = bf16_value(scale);
    for (int64_t i = 0; i < h; i++) {
        const float v = (float)codes[i] * sv;
        if (out_dtype == F32)
            ((float *)out)[i] = v;
        else
            ((uint16_t *)out)[i] = bf16_round(v);
    }
    return 0;
}

/* A bf16 value's bits as a key whose unsigned order is the values' order (-0 as +0: they compare equal). */
static inline uint16_t order_key(uint16_t b) {
    if (b == 0x8000u) b = 0;
    return (b & 0x8000u) ? (uint16_t)~b : (uint16_t)(b | 0x8000u);
}

static inline int is_nan(uint16_t b) { return (b & 0x7fffu) > 0x7f80u; }

T256 int64_t fe_argmax_bf16(const void *x, int64_t n) {
    const uint16_t *v = (const uint16_t *)x;
    enum { CHUNK = 256 };
    uint16_t best = 0;
    int64_t best_chunk = -1;
    for (int64_t c = 0; c < n; c += CHUNK) { /* each chunk's largest key and any NaN, in a loop the compiler widens */
        const int64_t m = n - c < CHUNK ? n - c : CHUNK;
        uint16_t top = 0, nan = 0;
        for (int64_t i = 0; i < m; i++) {
            const uint16_t k = order_key(v[c + i]);
            top = k > top ? k : top;
            nan |= (uint16_t)is_nan(v[c + i]);
        }
        if (nan) { /* the first NaN is the answer */
            for (int64_t i = 0; i < m; i++)
                if (is_nan(v[c + i])) return c + i;
        }
        if (best_chunk < 0 || top > best) best = top, best_chunk = c;
    }
    if (best_chunk < 0) return -1;
    for (int64_t i = best_chunk; i < n; i++)
        if (order_key(v[i]) == best) return i;
    return -1;
}
