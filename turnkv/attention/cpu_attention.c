/* turnkv's CPU decode attention: the rows of many windows over their own KV views, in one call.
 *
 * Built at first use by turnkv/attention/cpu_native.py (`cc -O3 -march=native -fopenmp`) and called
 * through ctypes once per layer; the step's work items are cut into slices that run on the OpenMP
 * threads torch uses.
 *
 * Why C and not torch ops: a CPU decode step of 8 conversations spent most of its time in ~25
 * small torch ops per window and layer, and in upcasting each view's bf16 rows to fp32 before a
 * matmul (torch has no CPU matmul from bf16 inputs to an fp32 result). Here the rows are read once,
 * as stored (fp32 or bf16), straight from the views; every sum is fp32.
 *
 * Exactness: a query row's result is computed by the same instructions in the same order whatever
 * else is in the call: which rows share its window, which windows share the step, which thread
 * runs it. Dot products and sums keep 16 partial sums (lane l takes elements l, l + 16, ...) that
 * are added in a fixed tree; nothing is reassociated (no -ffast-math). The compiler may fuse a
 * multiply and an add into an FMA (-ffp-contract=fast: 20.5 -> 17.8 ms a step for 8 conversations
 * at 1K keys on the 2-core VM), but it decides that once, in the one code path every row takes.
 * A row sees keys [0, ws + i] of its window (ws: the window's first row, i: the row's index in it),
 * and only those keys enter its sums, so a verify window's row i is bit-identical to the same row
 * decoded alone.
 *
 * Layouts (strides in elements):
 *   q    fp32, row r, head h at q[r * q_rs + h * q_hs + e], e < d (last dim contiguous)
 *   out  fp32 [N, Hq, D] contiguous; the call writes only its windows' rows
 *   wins int64 [W, 5]: q_row0, rows m, ws, first view, view count
 *   views int64 [V, 9]: k_ptr, v_ptr, k_layer_stride, k_head_stride, k_row_stride,
 *                       v_layer_stride, v_head_stride, v_row_stride, rows T
 *   work item = window w * hkv + kv head h; slice t: items [cuts[t], cuts[t + 1]), t < parts
 *   scratch: parts x scratch_stride floats, scratch_stride >= pairs * (keys + 2 * d) + 16,
 *            pairs = m * (hq / hkv) of the largest window, keys = ws + m of the longest
 */
#include <stdint.h>
#include <string.h>

/* GCC/Clang vector extensions: 16 fp32 lanes, lowered to whatever this CPU has (AVX-512, AVX2,
 * NEON); every operation is lane-wise IEEE arithmetic (a multiply and an add fused where the
 * compiler contracts them, the same in every row's path) */
typedef float v16 __attribute__((vector_size(64)));
typedef float v8 __attribute__((vector_size(32)));
typedef float v4 __attribute__((vector_size(16)));
typedef uint32_t v16u __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef uint16_t v16h __attribute__((vector_size(32)));
#define MAXC 16 /* head dim up to 256 */

static inline v16 load16(const float *p) {
    v16 v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void store16(float *p, v16 v) { memcpy(p, &v, sizeof v); }

static inline v16 widen16(const uint16_t *p) { /* 16 bf16 values as fp32 (exact) */
    v16h h;
    memcpy(&h, p, sizeof h);
    v16u u = __builtin_convertvector(h, v16u) << 16;
    v16 f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline float hsum16(v16 a) { /* the fixed tree: halves, quarters, pairs */
    v8 lo, hi;
    memcpy(&lo, &a, sizeof lo);
    memcpy(&hi, (const char *)&a + sizeof lo, sizeof hi);
    v8 b = lo + hi;
    v4 c0, c1;
    memcpy(&c0, &b, sizeof c0);
    memcpy(&c1, (const char *)&b + sizeof c0, sizeof c1);
    v4 c = c0 + c1;
    return (c[0] + c[2]) + (c[1] + c[3]);
}

static inline v16 select16(v16i mask, v16 a, v16 b) { /* mask lanes -1: a, 0: b */
    v16i ia, ib;
    memcpy(&ia, &a, sizeof ia);
    memcpy(&ib, &b, sizeof ib);
    v16i r = (ia & mask) | (ib & ~mask);
    v16 f;
    memcpy(&f, &r, sizeof f);
    return f;
}

/* exp(x) for x <= 0, lane-wise (Cephes' expf polynomial, within 2 ulp of expf; 0 below -87);
 * n is rounded to nearest by adding and subtracting 1.5 * 2^23 */
static inline v16 exp16(v16 x) {
    const v16 zero = {0};
    const v16i tiny = x < -87.0f; /* lanes -1 where x < -87 */
    v16 xc = select16(tiny, zero - 87.0f, x);
    v16 n = (xc * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    v16 r = xc - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    v16 p = zero + 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    v16i bits = (__builtin_convertvector(n, v16i) + 127) << 23;
    v16 scale;
    memcpy(&scale, &bits, sizeof scale);
    return select16(tiny, zero, p * scale);
}

/* row t of a view as fp32 vectors into dst[c] (c < d / 16) */
static inline void load_row(const char *base, int64_t off, int64_t dtype, int64_t nc, v16 *dst) {
    if (dtype == 0) {
        const float *s = (const float *)base + off;
        for (int64_t c = 0; c < nc; c++) dst[c] = load16(s + 16 * c);
    } else {
        const uint16_t *s = (const uint16_t *)base + off;
        for (int64_t c = 0; c < nc; c++) dst[c] = widen16(s + 16 * c);
    }
}

/* sixteen dot-product accumulators -> their sixteen sums, each by hsum16's tree (halves, then
 * quarters, then (c0 + c2) + (c1 + c3)), four rounds of shuffles instead of sixteen */
#define SH __builtin_shufflevector
static inline v16 reduce16(const v16 *a) {
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
    return SH(z[0], z[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
           SH(z[0], z[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}

/* softmax weights in place over s[0, n) (fp32 scores); returns their sum */
static float softmax_row(float *s, int64_t n) {
    /* the max (exact in any order) in 16 lanes, then the tail */
    v16 mv = (v16){0} + s[0];
    int64_t t = 0;
    for (; t + 16 <= n; t += 16) {
        const v16 x = load16(s + t);
        mv = select16(x > mv, x, mv);
    }
    float mx = mv[0];
    for (int l = 1; l < 16; l++) mx = mv[l] > mx ? mv[l] : mx;
    for (; t < n; t++) mx = s[t] > mx ? s[t] : mx;
    v16 lane = {0};
    t = 0;
    for (; t + 16 <= n; t += 16) {
        v16 e = exp16(load16(s + t) - mx);
        store16(s + t, e);
        lane += e;
    }
    if (t < n) { /* the tail: zero-padded lanes, the same arithmetic */
        float buf[16] = {0};
        int64_t rest = n - t;
        memcpy(buf, s + t, rest * sizeof(float));
        v16 e = exp16(load16(buf) - mx);
        v16i keep = {0};
        for (int l = 0; l < rest; l++) keep[l] = -1;
        e = select16(keep, e, (v16){0});
        store16(buf, e);
        memcpy(s + t, buf, rest * sizeof(float));
        lane += e;
    }
    return hsum16(lane);
}

typedef struct {
    int64_t layer, h, dtype, esize, ws, keys, v0, nv;
    const int64_t *views;
} item_t;

/* scores s[p, g] = q_p . k_g for every pair and key of the item, sixteen keys at a time; a key's
 * score is the same arithmetic in any block and lane */
static inline __attribute__((always_inline)) void scores(const item_t *it, const float *qs, int64_t pairs,
                                                         float *s, const int64_t nc) {
    v16 kblk[16][MAXC];
    int64_t g = 0;
    for (int64_t j = 0; j < it->nv && g < it->keys; j++) {
        const int64_t *v = it->views + (it->v0 + j) * 9;
        const char *kb = (const char *)(intptr_t)v[0] + (it->layer * v[2] + it->h * v[3]) * it->esize;
        const int64_t t_end = v[8] < it->keys - g ? v[8] : it->keys - g;
        for (int64_t t0 = 0; t0 < t_end; t0 += 16, g += 16) {
            const int64_t nb = t_end - t0 < 16 ? t_end - t0 : 16;
            for (int64_t i = 0; i < nb; i++) load_row(kb, (t0 + i) * v[4], it->dtype, nc, kblk[i]);
            for (int64_t i = nb; i < 16; i++)
                for (int64_t c = 0; c < nc; c++) kblk[i][c] = (v16){0};
            for (int64_t p = 0; p < pairs; p++) {
                const float *qp = qs + p * nc * 16;
                v16 qv[MAXC], a[16];
                for (int64_t c = 0; c < nc; c++) qv[c] = load16(qp + 16 * c);
                for (int i = 0; i < 16; i++) {
                    a[i] = qv[0] * kblk[i][0];
                    for (int64_t c = 1; c < nc; c++) a[i] += qv[c] * kblk[i][c];
                }
                v16 r = reduce16(a);
                if (nb == 16)
                    store16(s + p * it->keys + g, r);
                else
                    memcpy(s + p * it->keys + g, &r, nb * sizeof(float));
            }
        }
        g -= (16 - (t_end % 16)) % 16; /* the last block's padding */
    }
}

/* acc[p] = sum over keys [0, n) of w[p, g] * v_g for pairs [p0, p0 + np) (np <= 4), which all see
 * the same n keys; accumulators stay in registers, each sums its keys in order */
static inline __attribute__((always_inline)) void values(const item_t *it, const float *s, int64_t p0, int64_t np,
                                                         int64_t n, float *acc, const int64_t nc) {
    v16 a[4][MAXC], vr[MAXC];
    for (int pp = 0; pp < 4; pp++)
        for (int64_t c = 0; c < nc; c++) a[pp][c] = (v16){0};
    int64_t g = 0;
    for (int64_t j = 0; j < it->nv && g < n; j++) {
        const int64_t *v = it->views + (it->v0 + j) * 9;
        const char *vb = (const char *)(intptr_t)v[1] + (it->layer * v[5] + it->h * v[6]) * it->esize;
        const int64_t t_end = v[8] < n - g ? v[8] : n - g;
        for (int64_t t = 0; t < t_end; t++, g++) {
            load_row(vb, t * v[7], it->dtype, nc, vr);
            for (int pp = 0; pp < np; pp++) {
                const float wt = s[(p0 + pp) * it->keys + g];
                for (int64_t c = 0; c < nc; c++) a[pp][c] += wt * vr[c];
            }
        }
    }
    for (int pp = 0; pp < np; pp++)
        for (int64_t c = 0; c < nc; c++) store16(acc + (p0 + pp) * nc * 16 + 16 * c, a[pp][c]);
}

static inline __attribute__((always_inline)) void attend_item(const item_t *it, const float *q, int64_t q_rs,
                                                              int64_t q_hs, float *out, int64_t hq, int64_t group,
                                                              int64_t row0, int64_t m, float scale, float *scratch,
                                                              const int64_t nc) {
    const int64_t d = nc * 16, pairs = m * group, keys = it->keys;
    float *s = scratch;                /* [pairs, keys] scores, then weights (+16 floats spare) */
    float *qs = s + pairs * keys + 16; /* [pairs, d] scaled queries */
    float *acc = qs + pairs * d;       /* [pairs, d] weighted values */
    for (int64_t p = 0; p < pairs; p++) { /* pair p = (row p / group, head p % group) */
        const float *src = q + (row0 + p / group) * q_rs + (it->h * group + p % group) * q_hs;
        for (int64_t e = 0; e < d; e++) qs[p * d + e] = src[e] * scale;
    }
    scores(it, qs, pairs, s, nc);
    for (int64_t i = 0; i < m; i++) { /* row i sees keys [0, ws + i] */
        const int64_t n = it->ws + i + 1;
        float total[group];
        for (int64_t jj = 0; jj < group; jj++) total[jj] = softmax_row(s + (i * group + jj) * keys, n);
        for (int64_t jj = 0; jj < group; jj += 4)
            values(it, s, i * group + jj, group - jj < 4 ? group - jj : 4, n, acc, nc);
        for (int64_t jj = 0; jj < group; jj++) {
            float *o = out + ((row0 + i) * hq + it->h * group + jj) * d;
            const float *a = acc + (i * group + jj) * d;
            for (int64_t e = 0; e < d; e++) o[e] = a[e] / total[jj];
        }
    }
}

/* items [begin, end) on this thread (not inlined into the OpenMP region: outlined there, the same
 * loops compiled 25 % slower on the 2-core VM) */
static __attribute__((noinline)) void run_slice(int64_t layer, const float *q, int64_t q_rs, int64_t q_hs,
                                                float *out, int64_t hq, int64_t hkv, float scale,
                                                const int64_t *wins, const int64_t *views, int64_t dtype,
                                                int64_t begin, int64_t end, float *sc, int64_t nc) {
    const int64_t group = hq / hkv;
    for (int64_t item = begin; item < end; item++) {
        const int64_t *w = wins + (item / hkv) * 5;
        item_t it = {layer, item % hkv, dtype, dtype == 0 ? 4 : 2, w[2], w[2] + w[1], w[3], w[4], views};
        if (nc == 4)
            attend_item(&it, q, q_rs, q_hs, out, hq, group, w[0], w[1], scale, sc, 4);
        else if (nc == 8)
            attend_item(&it, q, q_rs, q_hs, out, hq, group, w[0], w[1], scale, sc, 8);
        else
            attend_item(&it, q, q_rs, q_hs, out, hq, group, w[0], w[1], scale, sc, nc);
    }
}

int turnkv_attend(int64_t layer, const float *q, int64_t q_rs, int64_t q_hs, float *out, int64_t hq,
                  int64_t hkv, int64_t d, float scale, const int64_t *wins, const int64_t *views,
                  int64_t dtype, const int64_t *cuts, int64_t parts, float *scratch, int64_t scratch_stride) {
    const int64_t nc = d / 16;
    if (d % 16 || nc > MAXC) return 1;
    if (parts <= 1) {
        run_slice(layer, q, q_rs, q_hs, out, hq, hkv, scale, wins, views, dtype, cuts[0], cuts[1], scratch, nc);
        return 0;
    }
    /* slice t (items [cuts[t], cuts[t + 1])) on thread t of the OpenMP team: torch's own, as this
     * library links the libgomp that torch loaded (same soname), so its threads are awake */
#pragma omp parallel for num_threads(parts) schedule(static, 1)
    for (int64_t t = 0; t < parts; t++)
        run_slice(layer, q, q_rs, q_hs, out, hq, hkv, scale, wins, views, dtype, cuts[t], cuts[t + 1],
                  scratch + t * scratch_stride, nc);
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
