/* turnkv's CPU attention: the rows of many windows over their own KV views, in one call.
 *
 * Built at first use by turnkv/attention/cpu_native.py (`cc -O3 -march=native -fopenmp`) and called
 * through ctypes once per layer; the step's work items are cut into slices that run on the OpenMP
 * threads torch uses. Every CPU window takes it, prefill chunks included: a row's bits must not
 * depend on the window it came in (cached == uncached), and torch's flash kernel, which prefill
 * took before, sums differently from this kernel and by the window's key count.
 *
 * Why C and not torch ops: a CPU decode step of 8 conversations spent most of its time in ~25
 * small torch ops per window and layer, and in upcasting each view's bf16 rows to fp32 before a
 * matmul (torch has no CPU matmul from bf16 inputs to an fp32 result). Here the rows are read once,
 * as stored (fp32 or bf16), straight from the views; every sum is fp32.
 *
 * Exactness: a query row's result is computed by the same instructions in the same order whatever
 * else is in the call: which rows share its window or its row block, which windows share the step,
 * which thread runs it, how its keys are cut into views. Dot products and sums keep 16 partial
 * sums (lane l takes elements l, l + 16, ...) that are added in a fixed tree; nothing is
 * reassociated (no -ffast-math). The compiler may fuse a multiply and an add into an FMA
 * (-ffp-contract=fast, faster: docs/BENCHMARKS.md, 'CPU decode attention in C'),
 * but it decides that once, in the one code path every row takes. A row sees keys [0, ws + i] of
 * its window (ws: the window's first row, i: the row's index in it), and only those keys enter its
 * sums, key after key from key 0 (softmax lanes by key index, values in key order), so row i of
 * a prefill chunk or a verify window is bit-identical to the same row decoded alone.
 *
 * Layouts (strides in elements):
 *   q    fp32, row r, head h at q[r * q_rs + h * q_hs + e], e < d (last dim contiguous)
 *   out  fp32 [N, Hq, D] contiguous; the call writes only its windows' rows
 *   wins int64 [W, 5]: q_row0, rows m, ws, first view, view count
 *   views int64 [V, 9]: k_ptr, v_ptr, k_layer_stride, k_head_stride, k_row_stride,
 *                       v_layer_stride, v_head_stride, v_row_stride, rows T
 *   items int64 [I, 4]: window, kv head, rows [r0, r1) of the window (a row block)
 *   slice t: items [cuts[t], cuts[t + 1]), t < parts
 *   scratch: parts x scratch_stride floats, scratch_stride >= pairs * (keys + 2 * d) + 16,
 *            pairs = (r1 - r0) * (hq / hkv) of the largest block, keys = ws + r1 of the longest
 */
#include <stdint.h>
#include <string.h>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

/* GCC/Clang vector extensions; every operation is lane-wise IEEE arithmetic (a multiply and an
 * add fused where the compiler contracts them, the same in every row's path). The arithmetic is
 * that of 16 fp32 lanes (lane l of a dot product takes elements l, l + 16, ...), held in vectors
 * of this CPU's width: one of 16 lanes with AVX-512, two of 8 else (VP pieces). 16-lane vectors
 * compiled for AVX2 went through memory (a scalar broadcast as 16 stores), many times slower
 * (docs/BENCHMARKS.md, 'Cached == uncached on the CPU'). */
#if defined(__AVX512F__)
#define VL 16
#else
#define VL 8
#endif
#define VP (16 / VL)
typedef float vn __attribute__((vector_size(VL * 4)));
typedef int32_t vni __attribute__((vector_size(VL * 4)));
typedef uint32_t vnu __attribute__((vector_size(VL * 4)));
typedef uint16_t vnh __attribute__((vector_size(VL * 2)));
typedef float v16 __attribute__((vector_size(64)));
typedef float v8 __attribute__((vector_size(32)));
typedef float v4 __attribute__((vector_size(16)));
#define MAXC 16 /* head dim up to 256: 16-lane groups per row */

static inline vn loadn(const float *p) {
    vn v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void storen(float *p, vn v) { memcpy(p, &v, sizeof v); }

static inline vn widen(const uint16_t *p) { /* VL bf16 values as fp32 (exact) */
#if VL == 8 && defined(__AVX2__)
    /* one zero-extension of 8 values (GCC's generic form took two of 4 and an insert) */
    const __m256i u = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16);
    vn f;
    memcpy(&f, &u, sizeof f);
    return f;
#else
    vnh h;
    memcpy(&h, p, sizeof h);
    vnu u = __builtin_convertvector(h, vnu) << 16;
    vn f;
    memcpy(&f, &u, sizeof f);
    return f;
#endif
}

/* one 16-lane group (lanes 0-7 in lo, 8-15 in hi; with AVX-512 both in lo) -> 8 lanes:
 * l + (l + 8), the first round of every tree below */
static inline v8 halve(vn lo, vn hi) {
#if VL == 16
    (void)hi;
    v8 a, b;
    memcpy(&a, &lo, sizeof a);
    memcpy(&b, (const char *)&lo + sizeof a, sizeof b);
    return a + b;
#else
    return lo + hi;
#endif
}

static inline float hsum16(vn lo, vn hi) { /* the fixed tree: halves, quarters, pairs */
    v8 b = halve(lo, hi);
    v4 c0, c1;
    memcpy(&c0, &b, sizeof c0);
    memcpy(&c1, (const char *)&b + sizeof c0, sizeof c1);
    v4 c = c0 + c1;
    return (c[0] + c[2]) + (c[1] + c[3]);
}

static inline vn selectn(vni mask, vn a, vn b) { /* mask lanes -1: a, 0: b */
    vni ia, ib;
    memcpy(&ia, &a, sizeof ia);
    memcpy(&ib, &b, sizeof ib);
    vni r = (ia & mask) | (ib & ~mask);
    vn f;
    memcpy(&f, &r, sizeof f);
    return f;
}

/* exp(x) for x <= 0, lane-wise (Cephes' expf polynomial, within 2 ulp of expf; 0 below -87);
 * n is rounded to nearest by adding and subtracting 1.5 * 2^23 */
static inline vn expn(vn x) {
    const vn zero = {0};
    const vni tiny = x < -87.0f; /* lanes -1 where x < -87 */
    vn xc = selectn(tiny, zero - 87.0f, x);
    vn n = (xc * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    vn r = xc - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    vn p = zero + 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    vni bits = (__builtin_convertvector(n, vni) + 127) << 23;
    vn scale;
    memcpy(&scale, &bits, sizeof scale);
    return selectn(tiny, zero, p * scale);
}

/* row t of a view as fp32 vectors into dst[j] (elements VL j ..., j < nw = d / VL) */
static inline void load_row(const char *base, int64_t off, int64_t dtype, int64_t nw, vn *dst) {
    if (dtype == 0) {
        const float *s = (const float *)base + off;
        for (int64_t j = 0; j < nw; j++) dst[j] = loadn(s + VL * j);
    } else {
        const uint16_t *s = (const uint16_t *)base + off;
        for (int64_t j = 0; j < nw; j++) dst[j] = widen(s + VL * j);
    }
}

/* sixteen keys' dot-product accumulators -> their sixteen sums into out[0, 16), each by hsum16's
 * tree (l + (l + 8), l + (l + 4), l + (l + 2), l + (l + 1)), in shuffles of whole vectors: with
 * AVX-512 the 16 accumulators' four rounds of 16 lanes; else each key's first round as soon as
 * its accumulator is done (``halve``: AVX2's 16 registers do not hold 16 accumulators) and the
 * other three in 8-lane vectors within 128-bit halves (AVX2's shuffles) */
#define SH __builtin_shufflevector
#if VL == 16
typedef v16 acc16; /* a key's accumulator, as reduce16 takes it */
static inline acc16 finish(const vn *a) { return a[0]; }
static inline void reduce16(const acc16 *a, float *out) {
    v16 x[8], y[4], z[2];
    for (int i = 0; i < 8; i++)
        x[i] = SH(a[2 * i], a[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
               SH(a[2 * i], a[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    for (int i = 0; i < 4; i++)
        y[i] = SH(x[2 * i], x[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
               SH(x[2 * i], x[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
    for (int i = 0; i < 2; i++)
        z[i] = SH(y[2 * i], y[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
               SH(y[2 * i], y[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
    storen(out, SH(z[0], z[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
                    SH(z[0], z[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31));
}
#else
typedef v8 acc16;
static inline acc16 finish(const vn *a) { return halve(a[0], a[1]); }
static inline void reduce16(const acc16 *x, float *out) {
    v8 y[8], z[4];
    for (int i = 0; i < 8; i++) /* [keys 2i | 2i + 1], 4 lanes each */
        y[i] = SH(x[2 * i], x[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11) +
               SH(x[2 * i], x[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15);
    for (int i = 0; i < 4; i++) /* [4i, 4i + 2 | 4i + 1, 4i + 3], 2 lanes each */
        z[i] = SH(y[2 * i], y[2 * i + 1], 0, 1, 8, 9, 4, 5, 12, 13) +
               SH(y[2 * i], y[2 * i + 1], 2, 3, 10, 11, 6, 7, 14, 15);
    for (int i = 0; i < 2; i++) { /* [8i, 8i + 2, 8i + 4, 8i + 6 | 8i + 1, ...], then in order */
        const v8 e = SH(z[2 * i], z[2 * i + 1], 0, 2, 8, 10, 4, 6, 12, 14) +
                     SH(z[2 * i], z[2 * i + 1], 1, 3, 9, 11, 5, 7, 13, 15);
        const v8 r = SH(e, e, 0, 4, 1, 5, 2, 6, 3, 7);
        memcpy(out + 8 * i, &r, sizeof r);
    }
}
#endif

/* softmax weights in place over s[0, n) (fp32 scores); returns their sum */
static float softmax_row(float *s, int64_t n) {
    /* the max (exact in any order) in VL lanes, then the tail */
    vn mv = (vn){0} + s[0];
    int64_t t = 0;
    for (; t + VL <= n; t += VL) {
        const vn x = loadn(s + t);
        mv = selectn(x > mv, x, mv);
    }
    float mx = mv[0];
    for (int l = 1; l < VL; l++) mx = mv[l] > mx ? mv[l] : mx;
    for (; t < n; t++) mx = s[t] > mx ? s[t] : mx;
    vn lo = {0}, hi = {0}; /* 16 lanes: key t + l into lane l */
    t = 0;
    for (; t + 16 <= n; t += 16) {
        vn e = expn(loadn(s + t) - mx);
        storen(s + t, e);
        lo += e;
#if VL == 8
        e = expn(loadn(s + t + 8) - mx);
        storen(s + t + 8, e);
        hi += e;
#endif
    }
    if (t < n) { /* the tail: zero-padded lanes, the same arithmetic */
        float buf[16] = {0};
        const int64_t rest = n - t;
        memcpy(buf, s + t, rest * sizeof(float));
        for (int u = 0; u < VP; u++) {
            vn e = expn(loadn(buf + VL * u) - mx);
            vni keep = {0};
            for (int l = 0; l < VL; l++) keep[l] = VL * u + l < rest ? -1 : 0;
            e = selectn(keep, e, (vn){0});
            storen(buf + VL * u, e);
            if (u == 0)
                lo += e;
            else
                hi += e;
        }
        memcpy(s + t, buf, rest * sizeof(float));
    }
    return hsum16(lo, hi);
}

typedef struct {
    int64_t layer, h, dtype, esize, ws, keys, v0, nv; /* keys: those of the block's last row */
    const int64_t *views;
} item_t;

/* scores s[p, g] = q_p . k_g for every pair and key of the item, sixteen keys at a time; a key's
 * score is the same arithmetic in any block and lane */
static inline __attribute__((always_inline)) void scores(const item_t *it, const float *qs, int64_t pairs,
                                                         float *s, const int64_t nc) {
    const int64_t nw = nc * VP;
    vn kblk[16][MAXC * VP];
    int64_t g = 0;
    for (int64_t j = 0; j < it->nv && g < it->keys; j++) {
        const int64_t *v = it->views + (it->v0 + j) * 9;
        const char *kb = (const char *)(intptr_t)v[0] + (it->layer * v[2] + it->h * v[3]) * it->esize;
        const int64_t t_end = v[8] < it->keys - g ? v[8] : it->keys - g;
        for (int64_t t0 = 0; t0 < t_end; t0 += 16, g += 16) {
            const int64_t nb = t_end - t0 < 16 ? t_end - t0 : 16;
            for (int64_t i = 0; i < nb; i++) {
                /* the next block's keys: rows a row stride apart, which the hardware prefetcher
                   follows too late from memory (prefetches never fault, past the view included) */
                const char *next = kb + (t0 + 16 + i) * v[4] * it->esize;
                for (int64_t l = 0; l < nw * VL * it->esize; l += 64) __builtin_prefetch(next + l, 0, 3);
                load_row(kb, (t0 + i) * v[4], it->dtype, nw, kblk[i]);
            }
            for (int64_t i = nb; i < 16; i++)
                for (int64_t c = 0; c < nw; c++) kblk[i][c] = (vn){0};
            for (int64_t p = 0; p < pairs; p++) {
                const float *qp = qs + p * nc * 16;
                vn qv[MAXC * VP];
                acc16 x[16];
                for (int64_t c = 0; c < nw; c++) qv[c] = loadn(qp + VL * c);
                for (int i = 0; i < 16; i++) { /* 16 lanes: lane l sums elements l, l + 16, ... */
                    vn a[VP];
                    for (int u = 0; u < VP; u++) a[u] = qv[u] * kblk[i][u];
                    for (int64_t c = 1; c < nc; c++)
                        for (int u = 0; u < VP; u++) a[u] += qv[c * VP + u] * kblk[i][c * VP + u];
                    x[i] = finish(a);
                }
                if (nb == 16) {
                    reduce16(x, s + p * it->keys + g);
                } else {
                    float r[16];
                    reduce16(x, r);
                    memcpy(s + p * it->keys + g, r, nb * sizeof(float));
                }
            }
        }
        g -= (16 - (t_end % 16)) % 16; /* the last block's padding */
    }
}

/* acc[p] = sum over keys [0, n) of w[p, g] * v_g for pairs [p0, p0 + np) (np <= NP), which all see
 * the same n keys, over elements [VL c0, VL (c0 + CW)) of the head: AVX2 has half the registers of
 * AVX-512, at half the width, so a 64-wide head takes two passes of half the row there. The
 * accumulators stay in registers and each sums its keys in order, so a pair's sum is the same
 * bits whichever pairs and elements share the pass. */
#if VL == 16
#define NP 4
#define CW MAXC
#else
#define NP 2
#define CW 4
#endif
static inline int64_t width(int64_t nw) { return nw < CW ? nw : CW; }
static inline __attribute__((always_inline)) void values(const item_t *it, const float *s, int64_t p0, int64_t np,
                                                         int64_t n, float *acc, const int64_t nc, int64_t c0) {
    const int64_t cw = width(nc * VP);
    vn a[NP][CW], vr[CW];
    for (int pp = 0; pp < NP; pp++)
        for (int64_t c = 0; c < cw; c++) a[pp][c] = (vn){0};
    int64_t g = 0;
    for (int64_t j = 0; j < it->nv && g < n; j++) {
        const int64_t *v = it->views + (it->v0 + j) * 9;
        const int64_t off = it->layer * v[5] + it->h * v[6] + VL * c0;
        const char *vb = (const char *)(intptr_t)v[1] + off * it->esize;
        const int64_t t_end = v[8] < n - g ? v[8] : n - g;
        for (int64_t t = 0; t < t_end; t++, g++) {
            for (int64_t l = 0; l < cw * VL * it->esize; l += 64) __builtin_prefetch(vb + ((t + 16) * v[7]) * it->esize + l, 0, 3);
            load_row(vb, t * v[7], it->dtype, cw, vr);
            for (int pp = 0; pp < np; pp++) {
                const float wt = s[(p0 + pp) * it->keys + g];
                for (int64_t c = 0; c < cw; c++) a[pp][c] += wt * vr[c];
            }
        }
    }
    for (int pp = 0; pp < np; pp++)
        for (int64_t c = 0; c < cw; c++) storen(acc + (p0 + pp) * nc * 16 + VL * (c0 + c), a[pp][c]);
}

/* rows [r0, r1) of a window (q rows row0 + r0 ...) for one KV head: their scores over the keys
 * the last of them sees, then per row its softmax and values over its own keys */
static inline __attribute__((always_inline)) void attend_item(const item_t *it, const float *q, int64_t q_rs,
                                                              int64_t q_hs, float *out, int64_t hq, int64_t group,
                                                              int64_t row0, int64_t r0, int64_t r1, float scale,
                                                              float *scratch, const int64_t nc) {
    const int64_t d = nc * 16, pairs = (r1 - r0) * group, keys = it->keys;
    float *s = scratch;                /* [pairs, keys] scores, then weights (+16 floats spare) */
    float *qs = s + pairs * keys + 16; /* [pairs, d] scaled queries */
    float *acc = qs + pairs * d;       /* [pairs, d] weighted values */
    float total[pairs];                /* softmax sums */
    for (int64_t p = 0; p < pairs; p++) { /* pair p = (row r0 + p / group, head p % group) */
        const float *src = q + (row0 + r0 + p / group) * q_rs + (it->h * group + p % group) * q_hs;
        for (int64_t e = 0; e < d; e++) qs[p * d + e] = src[e] * scale;
    }
    scores(it, qs, pairs, s, nc);
    const int64_t nw = nc * VP, cw = width(nw);
    for (int64_t i = 0; i < r1 - r0; i++) { /* row r0 + i sees keys [0, ws + r0 + i] */
        const int64_t n = it->ws + r0 + i + 1;
        for (int64_t p = i * group; p < (i + 1) * group; p++) total[p] = softmax_row(s + p * keys, n);
        for (int64_t c0 = 0; c0 < nw; c0 += cw)
            for (int64_t jj = 0; jj < group; jj += NP)
                values(it, s, i * group + jj, group - jj < NP ? group - jj : NP, n, acc, nc, c0);
    }
    for (int64_t p = 0; p < pairs; p++) {
        float *o = out + ((row0 + r0 + p / group) * hq + it->h * group + p % group) * d;
        const float *a = acc + p * d;
        for (int64_t e = 0; e < d; e++) o[e] = a[e] / total[p];
    }
}

/* items [begin, end) on this thread (not inlined into the OpenMP region: outlined there, the same
 * loops compiled slower; docs/BENCHMARKS.md, 'CPU decode attention in C') */
static __attribute__((noinline)) void run_slice(int64_t layer, const float *q, int64_t q_rs, int64_t q_hs,
                                                float *out, int64_t hq, int64_t hkv, float scale,
                                                const int64_t *wins, const int64_t *views,
                                                const int64_t *items, int64_t dtype, int64_t begin, int64_t end,
                                                float *sc, int64_t nc) {
    const int64_t group = hq / hkv;
    for (int64_t item = begin; item < end; item++) {
        const int64_t *b = items + item * 4;
        const int64_t *w = wins + b[0] * 5;
        const int64_t r0 = b[2], r1 = b[3];
        item_t it = {layer, b[1], dtype, dtype == 0 ? 4 : 2, w[2], w[2] + r1, w[3], w[4], views};
        if (nc == 4)
            attend_item(&it, q, q_rs, q_hs, out, hq, group, w[0], r0, r1, scale, sc, 4);
        else if (nc == 8)
            attend_item(&it, q, q_rs, q_hs, out, hq, group, w[0], r0, r1, scale, sc, 8);
        else
            attend_item(&it, q, q_rs, q_hs, out, hq, group, w[0], r0, r1, scale, sc, nc);
    }
}

int turnkv_attend(int64_t layer, const float *q, int64_t q_rs, int64_t q_hs, float *out, int64_t hq,
                  int64_t hkv, int64_t d, float scale, const int64_t *wins, const int64_t *views,
                  const int64_t *items, int64_t dtype, const int64_t *cuts, int64_t parts, float *scratch,
                  int64_t scratch_stride) {
    const int64_t nc = d / 16;
    if (d % 16 || nc > MAXC) return 1;
    if (parts <= 1) {
        run_slice(layer, q, q_rs, q_hs, out, hq, hkv, scale, wins, views, items, dtype, cuts[0], cuts[1],
                  scratch, nc);
        return 0;
    }
    /* slice t (items [cuts[t], cuts[t + 1])) on thread t of the OpenMP team: torch's own, as this
     * library links the libgomp that torch loaded (same soname), so its threads are awake */
#pragma omp parallel for num_threads(parts) schedule(static, 1)
    for (int64_t t = 0; t < parts; t++)
        run_slice(layer, q, q_rs, q_hs, out, hq, hkv, scale, wins, views, items, dtype, cuts[t], cuts[t + 1],
                  scratch + t * scratch_stride, nc);
    return 0;
}

/* Slice t of turnkv_attend's items alone, on the calling thread: the decoder's OpenMP region
 * (models/cpu_decoder.c) runs slice t on its thread t, the same code as turnkv_attend's. */
int turnkv_attend_slice(int64_t layer, const float *q, int64_t q_rs, int64_t q_hs, float *out, int64_t hq,
                        int64_t hkv, int64_t d, float scale, const int64_t *wins, const int64_t *views,
                        const int64_t *items, int64_t dtype, const int64_t *cuts, int64_t t, float *scratch) {
    const int64_t nc = d / 16;
    if (d % 16 || nc > MAXC) return 1;
    run_slice(layer, q, q_rs, q_hs, out, hq, hkv, scale, wins, views, items, dtype, cuts[t], cuts[t + 1], scratch,
              nc);
    return 0;
}

/* fp32 -> bf16, round to nearest even (torch's conversion, NaN aside) */
static inline uint16_t to_bf16(float x) {
    uint32_t u;
    memcpy(&u, &x, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0; /* NaN */
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* The step's new K and V rows into each window's last view (its last m rows), as stored: a window
 * of m rows takes rows [row0, row0 + m) of k and v (fp32, row r head h at r * rs + h * hs) */
int turnkv_store(int64_t layer, const float *k, int64_t k_rs, int64_t k_hs, const float *v, int64_t v_rs,
                 int64_t v_hs, int64_t hkv, int64_t d, const int64_t *wins, int64_t nwins, const int64_t *views,
                 int64_t dtype) {
    for (int64_t wi = 0; wi < nwins; wi++) {
        const int64_t *w = wins + wi * 5;
        const int64_t row0 = w[0], m = w[1];
        const int64_t *lv = views + (w[3] + w[4] - 1) * 9; /* the last view holds the window */
        const int64_t first = lv[8] - m;
        for (int64_t r = 0; r < m; r++)
            for (int64_t h = 0; h < hkv; h++) {
                const float *src[2] = {k + (row0 + r) * k_rs + h * k_hs, v + (row0 + r) * v_rs + h * v_hs};
                const int64_t off[2] = {layer * lv[2] + h * lv[3] + (first + r) * lv[4],
                                        layer * lv[5] + h * lv[6] + (first + r) * lv[7]};
                for (int kv = 0; kv < 2; kv++) {
                    if (dtype == 0) {
                        memcpy((float *)(intptr_t)lv[kv] + off[kv], src[kv], d * sizeof(float));
                    } else {
                        uint16_t *dst = (uint16_t *)(intptr_t)lv[kv] + off[kv];
                        for (int64_t e = 0; e < d; e++) dst[e] = to_bf16(src[kv][e]);
                    }
                }
            }
    }
    return 0;
}
