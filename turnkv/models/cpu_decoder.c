/* turnkv: a CPU step's decoder layers in one call (cpu_decoder.py), one OpenMP region for all.
 *
 * Per layer: RMSNorm -> q|k|v matmul -> RoPE -> K/V store -> attention -> o matmul + residual ->
 * RMSNorm -> gate|up matmul -> silu(gate) * up -> down matmul + residual. The matmuls and the
 * attention are the code of models/cpu_int4.c and attention/cpu_attention.c, reached through
 * function pointers (turnkv_q4_prepare / turnkv_q4_part, turnkv_attend_slice / turnkv_store): a
 * matmul's part t and an attention slice t run on thread t of this call's team, as they do in
 * their own calls' regions. Between the phases the team meets at a barrier; the host work that a
 * torch op per norm, rope and product cost (~60 dispatches a layer) is gone.
 *
 * Bits: every pointwise op here computes what torch's CPU kernel for it computes (the model's
 * torch path, models/pointwise.py and attention/rope.py), element by element, so this call and
 * that path give the same bits (tests/test_cpu_decoder.py checks it for every variant):
 * - RMSNorm (_cpu_rms_norm): torch's vector_norm sums squares in 8 lanes (multiply, then add),
 *   folds the lanes left to right, adds the tail's squares (fused where torch's kernels use FMA)
 *   and takes the square root; then eps + (1/n * norm) * norm (addcmul: one FMA with FMA), one
 *   over its square root, x * r * w.
 * - RoPE (addcmul(x * cos, roll(x), signed_sin)): x * cos + roll(x) * sin (one FMA with FMA).
 * - silu: x / (1 + exp(-x)); torch takes blocks of 2 vectors (torch_vec floats) with SLEEF's
 *   expf_u10 (exp8, torch's own copy, the same bits at 8 and 16 lanes) and the rest with libm's
 *   expf; its DEFAULT kernels (torch_vec 0) take expf for all.
 * Which of these torch does is its CPU capability's (cpu_decoder.py reads it); this file is
 * compiled with -ffp-contract=off so that only the FMAs written here are fused.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__AVX__)
#include <immintrin.h>
typedef __m256 (*exp8_fn)(__m256);
#define TKV_EXP8 1
#else
#define TKV_EXP8 0
#endif

typedef void (*prepare_fn)(const void *mat, int64_t M, const void *x, int64_t x_stride, int64_t x_fp32, int8_t *q,
                           float *d, float *dq, uint16_t *bf16);
typedef void (*part_fn)(const void *mat, int64_t part, int64_t threads, int64_t M, const int8_t *q, const float *d,
                        const float *dq, float *out, const float *residual);
typedef int (*slice_fn)(int64_t layer, const float *q, int64_t q_rs, int64_t q_hs, float *out, int64_t hq,
                        int64_t hkv, int64_t d, float scale, const int64_t *wins, const int64_t *views,
                        const int64_t *items, int64_t dtype, const int64_t *cuts, int64_t t, float *scratch);
typedef int (*store_fn)(int64_t layer, const float *k, int64_t k_rs, int64_t k_hs, const float *v, int64_t v_rs,
                        int64_t v_hs, int64_t hkv, int64_t d, const int64_t *wins, int64_t nwins,
                        const int64_t *views, int64_t dtype);

/* one layer's weights: fp32 norm weights [hidden], bound matrices (cpu_int4's tkv_matrix) */
typedef struct {
    const float *attn_norm, *mlp_norm;
    const void *qkv, *o, *gate_up, *down;
} tkv_layer;

/* the model, bound once (cpu_decoder.Decoder) */
typedef struct {
    prepare_fn prepare;
    part_fn part;
    slice_fn slice;
    store_fn store;
    const void *exp8; /* SLEEF's expf_u10 over 8 floats, or NULL (torch_vec 0) */
    const tkv_layer *layer;
    int64_t layers, hidden, inter, hq, hkv, d;
    int64_t torch_fma; /* torch's kernels fuse a * b + c (its x86 capabilities) */
    int64_t torch_vec; /* floats per vector block of torch's silu loop: 32 AVX512, 16 AVX2, 0 DEFAULT */
    float eps, scale;
} tkv_model;

/* one step: M rows, the buffers (cpu_decoder.Decoder sizes them) and the attention's tables */
typedef struct {
    int64_t M, threads;
    float *x, *x2;          /* [M, hidden]: the residual stream in and out of x; x2 between */
    const float *cos, *sin; /* [P, d]: the RoPE tables (sin's first half negated), P > every position */
    const int64_t *pos;     /* [M] the rows' positions */
    float *qkv, *qk, *att;  /* [M, (hq + 2 hkv) d], [M, (hq + hkv) d] after RoPE, [M, hq d] */
    float *gu;              /* [M, 2 inter] */
    /* `sets` buffer sets (rows_of) of: h [M, kmax] a norm's or silu's rows, their int8 form q
       [M, kmax] with steps qd, qdq [M, kmax / 32], and bf16 [M, kmax] */
    float *h;
    int8_t *q;
    float *qd, *qdq;
    uint16_t *bf16;
    int64_t kmax, sets, rope_rows; /* rope_rows: P */
    const int64_t *wins, *views, *items, *cuts;
    int64_t nwins, parts, dtype, scratch_stride;
    float *scratch; /* parts x scratch_stride */
} tkv_step;

static void rms_norm_row(const tkv_model *m, const float *x, const float *w, float *y) {
    const int64_t n = m->hidden;
    float lane[8] = {0};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int l = 0; l < 8; l++) lane[l] = lane[l] + x[i + l] * x[i + l];
    float s = lane[0];
    for (int l = 1; l < 8; l++) s = s + lane[l];
    for (; i < n; i++) s = m->torch_fma ? fmaf(x[i], x[i], s) : s + x[i] * x[i];
    const float norm = sqrtf(s), inv_n = (float)(1.0 / (double)n);
    const float a = m->torch_fma ? fmaf(inv_n * norm, norm, m->eps) : m->eps + inv_n * norm * norm;
    const float r = 1.0f / sqrtf(a);
    for (i = 0; i < n; i++) y[i] = x[i] * r * w[i];
}

/* q and k heads of row r, rotated: qk[r] = qkv[r][: (hq + hkv) d] * cos + roll(., d / 2) * sin */
static void rope_row(const tkv_model *m, const tkv_step *s, int64_t r) {
    const int64_t d = m->d, heads = m->hq + m->hkv, half = d / 2;
    const float *c = s->cos + s->pos[r] * d, *sn = s->sin + s->pos[r] * d;
    for (int64_t h = 0; h < heads; h++) {
        const float *x = s->qkv + r * (heads + m->hkv) * d + h * d;
        float *o = s->qk + (r * heads + h) * d;
        for (int64_t e = 0; e < d; e++) {
            const float rolled = x[(e + half) % d];
            o[e] = m->torch_fma ? fmaf(rolled, sn[e], x[e] * c[e]) : x[e] * c[e] + rolled * sn[e];
        }
    }
}

/* y = silu(g) * u over one row of `inter` values */
static void silu_mul_row(const tkv_model *m, const float *g, const float *u, float *y) {
    const int64_t n = m->inter, nv = m->torch_vec ? n - n % m->torch_vec : 0;
    int64_t i = 0;
#if TKV_EXP8
    const exp8_fn e = (exp8_fn)m->exp8;
    const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
    for (; i < nv; i += 8) {
        const __m256 v = _mm256_loadu_ps(g + i);
        const __m256 sv = _mm256_div_ps(v, _mm256_add_ps(one, e(_mm256_xor_ps(sign, v))));
        _mm256_storeu_ps(y + i, _mm256_mul_ps(sv, _mm256_loadu_ps(u + i)));
    }
#endif
    for (; i < n; i++) y[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
}

/* A phase's rows: with one buffer set per thread (a decode step's few rows) every thread computes
 * every row's norm or silu and activations itself, in its own set, and needs no barrier before
 * the matmul; else the threads share set 0, thread t takes rows t, t + T, ..., and they meet. */
typedef struct {
    float *h;
    int8_t *q;
    float *qd, *qdq;
    uint16_t *bf16;
    int64_t r0, dr; /* rows r0, r0 + dr, ... */
    int own;        /* this thread's own set: no barrier before the matmul */
} rows_t;

static rows_t rows_of(const tkv_model *m, const tkv_step *s, int64_t t, int64_t T) {
    const int own = T > 1 && s->sets >= T;
    const int64_t set = own ? t : 0, k = s->M * s->kmax;
    rows_t r = {s->h + set * k, s->q + set * k, s->qd + set * (k / 32), s->qdq + set * (k / 32), s->bf16 + set * k,
                own ? 0 : t, own ? 1 : T, own};
    (void)m;
    return r;
}

/* every matmul's parts and attention slices t, t + T, ... of the T threads */
static void run(const tkv_model *m, const tkv_step *s, int64_t t, int64_t T) {
    const int64_t M = s->M, H = m->hidden, I = m->inter, d = m->d, hq = m->hq, hkv = m->hkv;
    const int64_t QKV = (hq + 2 * hkv) * d, QK = (hq + hkv) * d, O = hq * d;
    const rows_t b = rows_of(m, s, t, T);
#define SYNC()                     \
    do {                           \
        if (T > 1) {               \
            _Pragma("omp barrier") \
        }                          \
    } while (0)
#define ROWS_DONE()          \
    do {                     \
        if (!b.own) SYNC(); \
    } while (0)
/* row r of src [M, K] (fp32) -> the int8 activations of matrix MAT in this thread's set */
#define PREPARE(MAT, SRC, K) \
    m->prepare(MAT, 1, (SRC) + r * (K), K, 1, b.q + r * (K), b.qd + r * ((K) / 32), b.qdq + r * ((K) / 32), b.bf16 + r * (K))
#define MATMUL(MAT, OUT, RES) m->part(MAT, t, T, M, b.q, b.qd, b.qdq, OUT, RES)
    for (int64_t l = 0; l < m->layers; l++) {
        const tkv_layer *ly = m->layer + l;
        for (int64_t r = b.r0; r < M; r += b.dr) {
            rms_norm_row(m, s->x + r * H, ly->attn_norm, b.h + r * H);
            PREPARE(ly->qkv, b.h, H);
        }
        ROWS_DONE();
        MATMUL(ly->qkv, s->qkv, NULL);
        SYNC();
        if (t == 0) { /* (a few us for a prefill chunk: not worth a barrier more) */
            for (int64_t r = 0; r < M; r++) rope_row(m, s, r);
            m->store(l, s->qk + hq * d, QK, d, s->qkv + QK, QKV, d, hkv, d, s->wins, s->nwins, s->views, s->dtype);
        }
        SYNC();
        for (int64_t p = t; p < s->parts; p += T)
            m->slice(l, s->qk, QK, d, s->att, hq, hkv, d, m->scale, s->wins, s->views, s->items, s->dtype, s->cuts,
                     p, s->scratch + p * s->scratch_stride);
        SYNC();
        for (int64_t r = b.r0; r < M; r += b.dr) PREPARE(ly->o, s->att, O);
        ROWS_DONE();
        MATMUL(ly->o, s->x2, s->x);
        SYNC();
        for (int64_t r = b.r0; r < M; r += b.dr) {
            rms_norm_row(m, s->x2 + r * H, ly->mlp_norm, b.h + r * H);
            PREPARE(ly->gate_up, b.h, H);
        }
        ROWS_DONE();
        MATMUL(ly->gate_up, s->gu, NULL);
        SYNC();
        for (int64_t r = b.r0; r < M; r += b.dr) {
            silu_mul_row(m, s->gu + r * 2 * I, s->gu + r * 2 * I + I, b.h + r * I);
            PREPARE(ly->down, b.h, I);
        }
        ROWS_DONE();
        MATMUL(ly->down, s->x, s->x2);
        SYNC();
    }
#undef MATMUL
#undef PREPARE
#undef ROWS_DONE
#undef SYNC
}

/* The final norm of the rows `rows` [R] of x [., hidden] -> y [R, hidden] (fp32: the LM head's C
 * matmul rounds them to bf16 as the torch path's cast does) */
void turnkv_decoder_norm(const tkv_model *m, int64_t R, const float *x, const int64_t *rows, const float *w,
                         float *y) {
    for (int64_t r = 0; r < R; r++) rms_norm_row(m, x + rows[r] * m->hidden, w, y + r * m->hidden);
}

/* 1 where this build can run torch's silu for `torch_vec` (its SLEEF calls need AVX) */
int64_t turnkv_decoder_can(int64_t torch_vec) { return torch_vec == 0 || TKV_EXP8; }

/* Every layer of model m over step s: s->x [M, hidden] in, the residual stream after the last
 * layer out (in place). threads <= 1: no OpenMP region. */
int turnkv_decoder_layers(const tkv_model *m, const tkv_step *s) {
    if ((m->torch_vec && (!TKV_EXP8 || !m->exp8 || m->torch_vec % 8)) || m->d % 2 || m->hidden % 32 || m->inter % 32)
        return 1;
    for (int64_t r = 0; r < s->M; r++)
        if (s->pos[r] < 0 || s->pos[r] >= s->rope_rows) return 2; /* a position past the RoPE tables */
    if (s->threads <= 1) {
        run(m, s, 0, 1);
        return 0;
    }
#pragma omp parallel num_threads(s->threads)
    {
#ifdef _OPENMP
        run(m, s, omp_get_thread_num(), omp_get_num_threads());
#else
        run(m, s, 0, 1);
#endif
    }
    return 0;
}
