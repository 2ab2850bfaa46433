/* One decode row through a whole decoder layer in one call: the steps decode_step takes from Python, one native call
   each (attention_row's six, the post-attention norm, native_router's router, grouped_experts' fused experts call and
   row_ops' sum into the residual), made here in the same order on the same kernels, so the bits are theirs.

   Why: the Python between those calls took a sixth of a decode token on a 2-core host at two threads, and while it
   runs the memory streams nothing (docs/measured-choices.md). This file has no arithmetic of its own: it calls the
   other kernels through the addresses fe_decode_layer_bind was given (each lives in its own library, with its own
   state: the int4 kernel's instruction set, the attention's cap), in the argument order each one's Python wrapper
   uses.

   A layer's constant part is an int64 program (the L_* fields below; floats as their float32 bits) that
   fate_edge.model.decode_layer builds once per layer plan and expert set; a token passes its row, its rope, its
   cache position and the buffers to write. */
#include <stdint.h>
#include <string.h>
#include <time.h>

typedef int (*gemm_fn)(const uint8_t *, const void *, const void *, int, int, int, int, const void *, int, int, int,
                       void *, int, int, int);
typedef int (*glu_fn)(int, const int64_t *, int, const int64_t *, int, const int64_t *, const uint16_t *, int, int);
typedef int (*rms_fn)(const void *, int64_t, const void *, float, void *);
typedef int (*rope_fn)(void *, int, int, const void *, const void *, const void *, int64_t);
typedef void (*kv_fn)(const void *, const void *, int64_t, int64_t, void *, int64_t, void *, int64_t);
typedef void (*add_fn)(const void *, const void *, int64_t, void *);
typedef void (*combine_fn)(void *, int, int64_t, int, const int64_t *, int, const float *, const void *, int,
                           const void *, int, const uint16_t *);
typedef int (*attention_fn)(const void *, int, const void *, const void *, int, int64_t, int64_t, int64_t, int64_t,
                            int64_t, int64_t, const int64_t *, const int64_t *, int64_t, int, int, int, int, int, float,
                            void *, int, const float *);
typedef int (*route_fn)(const void *, int, int64_t, int64_t, const float *, int, int, int, float *, int64_t *, int);
typedef int (*head_norm_fn)(void *, int, int, int64_t, const void *, const void *, float);

static struct {
    gemm_fn gemm;
    glu_fn glu;
    rms_fn rms;
    rope_fn rope;
    kv_fn kv;
    add_fn add;
    combine_fn combine;
    attention_fn attention;
    route_fn route;
    head_norm_fn head_norm;
} k;

/* The kernels' entry points, in this order: fe_int4_gemm, fe_int4_glu_grouped, fe_rms_norm_bf16, fe_rope_bf16,
   fe_kv_append, fe_add_bf16, fe_moe_combine, fe_decode_attention, fe_route_softmax, fe_head_norm_bf16. */
void fe_decode_layer_bind(const int64_t *fns) {
    k.gemm = (gemm_fn)(intptr_t)fns[0];
    k.glu = (glu_fn)(intptr_t)fns[1];
    k.rms = (rms_fn)(intptr_t)fns[2];
    k.rope = (rope_fn)(intptr_t)fns[3];
    k.kv = (kv_fn)(intptr_t)fns[4];
    k.add = (add_fn)(intptr_t)fns[5];
    k.combine = (combine_fn)(intptr_t)fns[6];
    k.attention = (attention_fn)(intptr_t)fns[7];
    k.route = (route_fn)(intptr_t)fns[8];
    k.head_norm = (head_norm_fn)(intptr_t)fns[9];
}

enum { BF16 = 1, MAT = 8 }; /* a matrix: fe_int4_gemm's seven fields of its own (codes .. g), then K of x */

/* The program's fields. */
enum {
    L_HIDDEN,
    L_EPS,          /* float32 bits */
    L_INPUT_NORM,   /* bf16 [H] */
    L_POST_NORM,    /* bf16 [H] */
    L_QKV,          /* MAT fields: [q; k; v] */
    L_QKV_BIAS = L_QKV + MAT, /* bf16 [(nq + 2 nk) d], or 0 */
    L_O,            /* MAT fields */
    L_NQ = L_O + MAT,
    L_NK,
    L_HEAD_DIM,
    L_SCALE,        /* float32 bits: the attention's 1/sqrt(d) */
    L_ROUTER,       /* float32 [E][H] */
    L_EXPERTS,      /* E */
    L_TOP_K,
    L_RENORM,
    L_SHARED_FIRST, /* MAT fields: the shared expert's [gate; up(; gate row)]; all 0 without one */
    L_SHARED_DOWN = L_SHARED_FIRST + MAT,
    L_SHARED_I = L_SHARED_DOWN + MAT, /* 0: no shared expert */
    L_SHARED_GATED, /* 1: the first stage's last row is Qwen's shared-expert gate logit */
    L_EXPERT_I,     /* the routed experts' intermediate size */
    L_EXPERT_FIRST, /* their first stage: 1 matrix (gate_up, rows [gate | up]) or 2 (gate, up) */
    L_EXPERT_TABLE, /* int64 [E][(first + 1) MAT]: each expert's first-stage matrices, then its down */
    L_SILU,         /* int4_gemm's silu table */
    L_SIGMOID,      /* row_ops' sigmoid table */
    L_Q_NORM,       /* Qwen3's per-head q norm, bf16 [d], before rope (0: none; then no q/k/v bias) */
    L_K_NORM,       /* its k norm */
    L_FIELDS
};

#define MAX_K 64

/* The program's length: the Python side checks its layout against it. */
int fe_decode_layer_fields(void) { return L_FIELDS; }

static int64_t align32(int64_t n) { return (n + 31) / 32 * 32; } /* bf16 elements: 64-byte segments */

static float f32(int64_t bits) {
    const uint32_t u = (uint32_t)bits;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* One fe_int4_gemm_grouped table row: a matrix's fields, then bf16 x [rows] at x, y at y. */
static int64_t *call_row(int64_t *row, const int64_t *mat, intptr_t x, int64_t rows, intptr_t y) {
    memcpy(row, mat, 7 * sizeof(int64_t));
    row[7] = x, row[8] = 1, row[9] = mat[7], row[10] = rows, row[11] = y, row[12] = 1;
    return row + 13;
}

static int gemm_row(const int64_t *mat, const void *x, void *y, int threads, int isa) {
    return k.gemm((const uint8_t *)(intptr_t)mat[0], (const void *)(intptr_t)mat[1], (const void *)(intptr_t)mat[2],
                  (int)mat[3], (int)mat[4], (int)mat[5], (int)mat[6], x, 1, (int)mat[7], 1, y, 1, threads, isa);
}

static int ids_valid(const int64_t *ids, int64_t k, int64_t experts) {
    for (int64_t j = 0; j < k; j++)
        if (ids[j] < 0 || ids[j] >= experts) return 0;
    return 1;
}

/* The scratch a program's call needs, in bytes. */
int64_t fe_decode_layer_scratch(const int64_t *p) {
    const int64_t H = p[L_HIDDEN], d = p[L_HEAD_DIM], nq = p[L_NQ], nk = p[L_NK], kk = p[L_TOP_K];
    const int64_t si = p[L_SHARED_I], width = p[L_SHARED_FIRST + 4], xi = p[L_EXPERT_I];
    const int64_t elements = align32(H) + align32((nq + 2 * nk) * d) + align32(nq * d) + align32(H) + align32(width) +
                             align32(si) + align32(H) + 2 * align32(kk * xi) + align32(kk * xi) + align32(kk * H);
    return 2 * elements;
}

/* x_out = the layer on x_in [H] (bf16; x_out may not be x_in): its key and value written at position ``at`` of the
   cache (bf16 [heads, positions, d] buffers kc / vc, element strides kh, kp / vh, vp), h_out the MoE block's input,
   ids_out / w_out the router's choice (largest first), *ns_out the routed experts' nanoseconds (the kernel call and
   the sum). Returns 0; 1 where the router declined (a tie in the top k: torch.topk decides it), with x_out and h_out
   the attention's residual and the MoE block's input, the rest left to the caller; -1 where a kernel refused a shape;
   -2 out of memory. ``phase`` 1 stops after the router (x_out, h_out, ids_out, w_out written, 0 or 1 as above), for a
   provider that must see the routing before it hands the experts out (a cache under a budget); phase 2 is the rest,
   on those four (x_out the attention's residual, the sum added into it; x_in, the rope and the cache unused), with
   the table's rows of the routed experts filled since; 0 both. */
int fe_decode_layer(const int64_t *p, const void *x_in, void *x_out, void *h_out, const void *cos, const void *sin,
                    void *kc, void *vc, int64_t kh, int64_t kp, int64_t vh, int64_t vp, int64_t at, void *scratch,
                    int64_t *ids_out, float *w_out, int64_t *ns_out, int threads, int isa, int phase) {
    const int64_t H = p[L_HIDDEN], d = p[L_HEAD_DIM], nq = p[L_NQ], nk = p[L_NK], kk = p[L_TOP_K];
    const int64_t si = p[L_SHARED_I], width = p[L_SHARED_FIRST + 4], xi = p[L_EXPERT_I], first = p[L_EXPERT_FIRST];
    const int64_t qkv_rows = (nq + 2 * nk) * d;
    const float eps = f32(p[L_EPS]);
    if (kk <= 0 || kk > MAX_K || (first != 1 && first != 2)) return -1;
    uint16_t *h = (uint16_t *)scratch, *qkv = h + align32(H), *att = qkv + align32(qkv_rows);
    uint16_t *oy = att + align32(nq * d), *s_first = oy + align32(H), *s_act = s_first + align32(width);
    uint16_t *s_y = s_act + align32(si), *x_first = s_y + align32(H), *x_act = x_first + 2 * align32(kk * xi);
    uint16_t *x_y = x_act + align32(kk * xi);

    int rc = 0;
    if (phase == 2) goto experts;

    /* attention_row.attend */
    if (k.rms(x_in, H, (const void *)(intptr_t)p[L_INPUT_NORM], eps, h) != 0) return -1;
    if (gemm_row(p + L_QKV, h, qkv, threads, isa) != 0) return -2; /* shapes were checked: its buffers */
    if (p[L_Q_NORM] && k.head_norm(qkv, (int)nq, (int)nk, d, (const void *)(intptr_t)p[L_Q_NORM],
                                   (const void *)(intptr_t)p[L_K_NORM], eps) != 0)
        return -1;
    const void *bias = (const void *)(intptr_t)p[L_QKV_BIAS];
    if (k.rope(qkv, (int)(nq + nk), (int)d, cos, sin, bias, bias ? qkv_rows : 0) != 0) return -1;
    k.kv(qkv + nq * d, qkv + (nq + nk) * d, nk, 2 * d, (char *)kc + 2 * at * kp, 2 * kh, (char *)vc + 2 * at * vp,
         2 * vh);
    rc = k.attention(qkv, BF16, kc, vc, BF16, 0, kh, kp, 0, vh, vp, NULL, NULL, at + 1, 1, (int)nq, (int)nk, (int)d,
                     (int)d, f32(p[L_SCALE]), att, threads, NULL);
    if (rc != 0) return rc;
    if (gemm_row(p + L_O, att, oy, threads, isa) != 0) return -2;
    k.add(x_in, oy, H, x_out);

    /* decoder_layer's post-attention norm, then router_block */
    if (k.rms(x_out, H, (const void *)(intptr_t)p[L_POST_NORM], eps, h_out) != 0) return -1;
    rc = k.route(h_out, BF16, 1, H, (const float *)(intptr_t)p[L_ROUTER], (int)p[L_EXPERTS], (int)kk,
                 (int)p[L_RENORM], w_out, ids_out, threads);
    if (rc != 0) return rc;
    if (phase == 1) return ids_valid(ids_out, kk, p[L_EXPERTS]) ? 0 : -1;

experts:; /* phase 2 starts here */
    if (!ids_valid(ids_out, kk, p[L_EXPERTS])) return -1;
    /* grouped_experts._fused_call for the row (a shared expert first in each stage), then add_fused_row (add_experts
       without a shared expert) */
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    int64_t order[MAX_K]; /* the experts by id: the order the sum adds them in */
    for (int j = 0; j < kk; j++) {
        int at_j = j;
        while (at_j > 0 && ids_out[order[at_j - 1]] > ids_out[j]) order[at_j] = order[at_j - 1], at_j--;
        order[at_j] = j;
    }
    int64_t first_rows[(1 + 2 * MAX_K) * 13], glu_rows[(1 + MAX_K) * 6], down_rows[(1 + MAX_K) * 13];
    int64_t ys[MAX_K];
    float ws[MAX_K];
    const int shared = si > 0;
    int64_t *f = first_rows, *g = glu_rows, *dn = down_rows;
    if (shared) {
        f = call_row(f, p + L_SHARED_FIRST, (intptr_t)h_out, 1, (intptr_t)s_first);
        dn = call_row(dn, p + L_SHARED_DOWN, (intptr_t)s_act, 1, (intptr_t)s_y);
        g[0] = (intptr_t)s_first, g[1] = (intptr_t)(s_first + si), g[2] = width, g[3] = si, g[4] = 1;
        g[5] = (intptr_t)s_act;
        g += 6;
    }
    const int64_t *table = (const int64_t *)(intptr_t)p[L_EXPERT_TABLE];
    uint16_t *gate_out = x_first, *up_out = x_first + align32(kk * xi); /* two matrices: gates, then ups */
    for (int j = 0; j < kk; j++) {
        const int64_t *e = table + ids_out[order[j]] * (first + 1) * MAT;
        uint16_t *act = x_act + j * xi, *y = x_y + j * H;
        if (first == 1) { /* each row [gate | up] */
            uint16_t *gu = x_first + j * 2 * xi;
            f = call_row(f, e, (intptr_t)h_out, 1, (intptr_t)gu);
            g[0] = (intptr_t)gu, g[1] = (intptr_t)(gu + xi), g[2] = 2 * xi;
        } else {
            f = call_row(f, e, (intptr_t)h_out, 1, (intptr_t)(gate_out + j * xi));
            f = call_row(f, e + MAT, (intptr_t)h_out, 1, (intptr_t)(up_out + j * xi));
            g[0] = (intptr_t)(gate_out + j * xi), g[1] = (intptr_t)(up_out + j * xi), g[2] = xi;
        }
        g[3] = xi, g[4] = 1, g[5] = (intptr_t)act;
        g += 6;
        dn = call_row(dn, e + first * MAT, (intptr_t)act, 1, (intptr_t)y);
        ys[j] = (intptr_t)y;
        ws[j] = w_out[order[j]];
    }
    const int n = shared + (int)kk;
    if (k.glu(shared + (int)(kk * first), first_rows, n, glu_rows, n, down_rows, (const uint16_t *)(intptr_t)p[L_SILU],
              threads, isa) != 0)
        return -2;
    const void *gate = shared && p[L_SHARED_GATED] ? (const void *)(s_first + 2 * si) : NULL;
    k.combine(x_out, BF16, H, (int)kk, ys, BF16, ws, shared ? s_y : NULL, BF16, gate, BF16,
              gate ? (const uint16_t *)(intptr_t)p[L_SIGMOID] : NULL);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    *ns_out = (int64_t)(t1.tv_sec - t0.tv_sec) * 1000000000 + (t1.tv_nsec - t0.tv_nsec);
    return 0;
}
