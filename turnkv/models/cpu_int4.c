/* turnkv: the CPU matmul over 4-bit weights, y = x @ W.T, for up to a few hundred rows.
 *
 * Weights: P planes of values u in 0..15 with a scale s and a zero z per column and group of 32
 * inputs; W[n, k] = sum_p u_p[n, k] * s_p[n, g] + z_p[n, g] (g = k / 32). GGUF Q4_0, Q4_1 and
 * Q8_0 map onto this exactly (cpu_int4.py); s and z are stored as fp16, as the GGUF stores them.
 *
 * Layout (built by cpu_int4.py): tiles of 16 columns; per tile and group, per plane, 320 bytes:
 *   16 fp16 scales | 16 fp16 zeros | 16 units of 16 bytes,
 * unit j's byte c holding u[c, 2j] in its low nibble and u[c, 2j + 1] in its high nibble.
 * Order [tile][group][plane][320]: a tile's weights are one run of memory.
 *
 * Arithmetic, per row m, column n, group g, plane p (x as bf16, as the step hands it):
 *   t  = sum_j (x[2j] * w[2j] + x[2j+1] * w[2j+1])   16 unit steps in order, fp32
 *   acc = fma(s, t, acc);  acc = fma(zc, xs[m, g], acc)
 * where xs[m, g] is the group's sum of x (fp32, in order). With AVX512-BF16, w = 128 + u as
 * bf16 (exact: 128..143 need 8 significant bits) and one vdpbf16ps does both products of 16
 * columns (each product exact in fp32); the 128 is taken back through zc = z - 128 s. Without
 * it, w = u in fp32 FMAs and zc = z.
 *
 * Q8_0 matrices (int8 values q times one fp16 scale per group) have a layout of their own, one
 * plane of 576 bytes per tile and group: 16 fp16 scales | 32 bytes unused | 16 units of 32 bytes,
 * unit j holding (q[c, 2j], q[c, 2j + 1]) for columns c = 0..7, then for c = 8..15 (int8 each).
 * With AVX512-BF16 the values become bf16 exactly (|q| <= 128 needs 8 significant bits) and the
 * same dot instruction runs; acc = fma(s, t, acc) per group.
 *
 * Exactness: a row's result is the same instructions in the same order whatever rows share the
 * call, however the rows are blocked and the columns cut over threads (each (row, column) sum
 * runs over k in order in one lane of one register). So a conversation's logits do not depend
 * on the other conversations in its step.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define TKV_DOT 1
#define W_OFFSET 128.0f
#else
#define TKV_DOT 0
#define W_OFFSET 0.0f
typedef float v16f __attribute__((vector_size(64)));
typedef uint32_t v16u __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef _Float16 v16h __attribute__((vector_size(32)));
typedef uint8_t v16b __attribute__((vector_size(16)));
#endif

#define TILE 16
#define UNITS 16
#define GROUP 32
#define PLANE_BYTES 320
#define MAX_ROWS 10 /* rows per block: a call of up to 10 rows is one block, more go 8 at a time */
#define BIG_BLOCK 8

static inline float bf16_to_f32(uint16_t h) {
    uint32_t b = (uint32_t)h << 16;
    float f;
    memcpy(&f, &b, 4);
    return f;
}

#if TKV_DOT
/* tmp[r * T + t] += both products of the unit at input k (a bf16 pair of row r's x) and tile t */
static inline __attribute__((always_inline)) void dot_rows(const int R, const int T, const uint16_t *x,
                                                           int64_t x_stride, int64_t k, const __m512i *wv,
                                                           __m512 *tmp) {
    for (int r = 0; r < R; r++) {
        uint32_t pair;
        memcpy(&pair, x + r * x_stride + k, 4);
        __m512bh xv = (__m512bh)_mm512_set1_epi32((int)pair);
        for (int t = 0; t < T; t++) tmp[r * T + t] = _mm512_dpbf16_ps(tmp[r * T + t], (__m512bh)wv[t], xv);
    }
}
#else
/* as above in fp32: the unit's values u as floats, even inputs in lo, odd in hi */
static inline __attribute__((always_inline)) void dot_rows(const int R, const int T, const uint16_t *x,
                                                           int64_t x_stride, int64_t k, const v16f *lo,
                                                           const v16f *hi, v16f *tmp) {
    for (int r = 0; r < R; r++) {
        const uint16_t *xr = x + r * x_stride + k;
        float x0 = bf16_to_f32(xr[0]), x1 = bf16_to_f32(xr[1]);
        for (int t = 0; t < T; t++) {
            tmp[r * T + t] += x0 * lo[t];
            tmp[r * T + t] += x1 * hi[t];
        }
    }
}
#endif

/* One block: rows r0..r0+R of x, tiles t0..t0+T of the weights, every group and plane. R and T
 * are constants where it is inlined, so the running sums stay in registers. */
static inline __attribute__((always_inline)) void block(
    const int R, const int T, int64_t G, int64_t P, const uint16_t *x, int64_t xs_stride,
    const float *xsum, const uint8_t *w, int64_t tile_bytes, float *acc /* [R][T*16] */) {
    for (int64_t g = 0; g < G; g++) {
        for (int64_t p = 0; p < P; p++) {
#if TKV_DOT
            __m512 tmp[MAX_ROWS * 8];
            for (int i = 0; i < R * T; i++) tmp[i] = _mm512_setzero_ps();
            const __m512i lo4 = _mm512_set1_epi32(0x000F000F);
            const __m512i bias = _mm512_set1_epi32(0x43004300);
            for (int j = 0; j < UNITS; j++) {
                __m512i wv[8];
                for (int t = 0; t < T; t++) {
                    const uint8_t *u = w + t * tile_bytes + (g * P + p) * PLANE_BYTES + 64 + j * 16;
                    __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)u));
                    __m512i h = _mm512_slli_epi32(b, 12);
                    wv[t] = _mm512_or_si512(_mm512_ternarylogic_epi32(b, h, lo4, 0xA8), bias);
                }
                dot_rows(R, T, x, xs_stride, g * GROUP + 2 * j, wv, tmp);
            }
            for (int t = 0; t < T; t++) {
                const uint8_t *sz = w + t * tile_bytes + (g * P + p) * PLANE_BYTES;
                __m512 s = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)sz));
                __m512 z = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(sz + 32)));
                __m512 zc = _mm512_fmadd_ps(_mm512_set1_ps(-W_OFFSET), s, z);
                for (int r = 0; r < R; r++) {
                    float *a = acc + r * T * TILE + t * TILE;
                    __m512 av = _mm512_loadu_ps(a);
                    av = _mm512_fmadd_ps(s, tmp[r * T + t], av);
                    av = _mm512_fmadd_ps(zc, _mm512_set1_ps(xsum[r * G + g]), av);
                    _mm512_storeu_ps(a, av);
                }
            }
#else
            v16f tmp[MAX_ROWS * 8];
            for (int i = 0; i < R * T; i++) tmp[i] = (v16f){0};
            for (int j = 0; j < UNITS; j++) {
                v16f lo[8], hi[8];
                for (int t = 0; t < T; t++) {
                    v16b raw;
                    memcpy(&raw, w + t * tile_bytes + (g * P + p) * PLANE_BYTES + 64 + j * 16, 16);
                    v16u b = __builtin_convertvector(raw, v16u);
                    lo[t] = __builtin_convertvector((v16i)(b & 15u), v16f);
                    hi[t] = __builtin_convertvector((v16i)(b >> 4), v16f);
                }
                dot_rows(R, T, x, xs_stride, g * GROUP + 2 * j, lo, hi, tmp);
            }
            for (int t = 0; t < T; t++) {
                const uint8_t *sz = w + t * tile_bytes + (g * P + p) * PLANE_BYTES;
                v16h sh, zh;
                memcpy(&sh, sz, 32);
                memcpy(&zh, sz + 32, 32);
                v16f s = __builtin_convertvector(sh, v16f), zc = __builtin_convertvector(zh, v16f);
                for (int r = 0; r < R; r++) {
                    v16f av;
                    memcpy(&av, acc + r * T * TILE + t * TILE, 64);
                    av += s * tmp[r * T + t];
                    av += zc * xsum[r * G + g];
                    memcpy(acc + r * T * TILE + t * TILE, &av, 64);
                }
            }
#endif
        }
    }
}

/* The int8 form (Q8_0): as block(), one plane, values q in -128..127 and no zero. */
#define Q8_BYTES 576
static inline __attribute__((always_inline)) void block8(
    const int R, const int T, int64_t G, int64_t P, const uint16_t *x, int64_t xs_stride,
    const float *xsum, const uint8_t *w, int64_t tile_bytes, float *acc) {
    (void)P;
    (void)xsum;
    for (int64_t g = 0; g < G; g++) {
#if TKV_DOT
        __m512 tmp[MAX_ROWS * 8];
        for (int i = 0; i < R * T; i++) tmp[i] = _mm512_setzero_ps();
        for (int j = 0; j < UNITS; j++) {
            __m512i wv[8];
            for (int t = 0; t < T; t++) {
                const int8_t *q = (const int8_t *)(w + t * tile_bytes + g * Q8_BYTES + 64 + j * 32);
                __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)q)));
                __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + 16))));
                wv[t] = (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
            }
            dot_rows(R, T, x, xs_stride, g * GROUP + 2 * j, wv, tmp);
        }
        for (int t = 0; t < T; t++) {
            const uint8_t *sz = w + t * tile_bytes + g * Q8_BYTES;
            __m512 s = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)sz));
            for (int r = 0; r < R; r++) {
                float *a = acc + r * T * TILE + t * TILE;
                _mm512_storeu_ps(a, _mm512_fmadd_ps(s, tmp[r * T + t], _mm512_loadu_ps(a)));
            }
        }
#else
        v16f tmp[MAX_ROWS * 8];
        for (int i = 0; i < R * T; i++) tmp[i] = (v16f){0};
        for (int j = 0; j < UNITS; j++) {
            v16f lo[8], hi[8];
            for (int t = 0; t < T; t++) {
                int8_t raw[32];
                memcpy(raw, w + t * tile_bytes + g * Q8_BYTES + 64 + j * 32, 32);
                for (int c = 0; c < 16; c++) {
                    lo[t][c] = (float)raw[2 * c];
                    hi[t][c] = (float)raw[2 * c + 1];
                }
            }
            dot_rows(R, T, x, xs_stride, g * GROUP + 2 * j, lo, hi, tmp);
        }
        for (int t = 0; t < T; t++) {
            v16h sh;
            memcpy(&sh, w + t * tile_bytes + g * Q8_BYTES, 32);
            v16f s = __builtin_convertvector(sh, v16f);
            for (int r = 0; r < R; r++) {
                v16f av;
                memcpy(&av, acc + r * T * TILE + t * TILE, 64);
                av += s * tmp[r * T + t];
                memcpy(acc + r * T * TILE + t * TILE, &av, 64);
            }
        }
#endif
    }
}

/* Rows r0..r0+R (R <= MAX_ROWS), tiles t0..t1 of the output: blocks of T tiles, then single tiles. */
#define BLOCK_CASE(BLOCK, RR, TT)                                                               \
    case RR:                                                                                    \
        for (; t + TT <= t1; t += TT) {                                                         \
            memset(acc, 0, sizeof(float) * RR * TT * TILE);                                     \
            BLOCK(RR, TT, G, P, xr, x_stride, xs, w + t * tile_bytes, tile_bytes, acc);         \
            emit(RR, TT, t, acc, out + r0 * out_stride, out_stride, n_out);                     \
        }                                                                                       \
        for (; t < t1; t++) {                                                                   \
            memset(acc, 0, sizeof(float) * RR * TILE);                                          \
            BLOCK(RR, 1, G, P, xr, x_stride, xs, w + t * tile_bytes, tile_bytes, acc);          \
            emit(RR, 1, t, acc, out + r0 * out_stride, out_stride, n_out);                      \
        }                                                                                       \
        break;

static inline void emit(int R, int T, int64_t t, const float *acc, float *out, int64_t out_stride,
                        int64_t n_out) {
    int64_t n0 = t * TILE, n = T * TILE;
    if (n0 + n > n_out) n = n_out - n0;
    for (int r = 0; r < R; r++) memcpy(out + r * out_stride + n0, acc + r * T * TILE, sizeof(float) * n);
}

#define RUN_ROWS(NAME, BLOCK)                                                                   \
    static __attribute__((noinline)) void NAME(int64_t R, int64_t t0, int64_t t1, int64_t G, int64_t P, \
                                               const uint16_t *xr, int64_t x_stride, const float *xs, \
                                               const uint8_t *w, int64_t tile_bytes, float *out,    \
                                               int64_t out_stride, int64_t n_out, int64_t r0) {     \
        float acc[MAX_ROWS * 8 * TILE];                                                         \
        int64_t t = t0;                                                                         \
        switch (R) {                                                                            \
            BLOCK_CASE(BLOCK, 1, 8)                                                             \
            BLOCK_CASE(BLOCK, 2, 8)                                                             \
            BLOCK_CASE(BLOCK, 3, 8)                                                             \
            BLOCK_CASE(BLOCK, 4, 6)                                                             \
            BLOCK_CASE(BLOCK, 5, 4)                                                             \
            BLOCK_CASE(BLOCK, 6, 4)                                                             \
            BLOCK_CASE(BLOCK, 7, 3)                                                             \
            BLOCK_CASE(BLOCK, 8, 3)                                                             \
            BLOCK_CASE(BLOCK, 9, 2)                                                             \
            BLOCK_CASE(BLOCK, 10, 2)                                                            \
        }                                                                                       \
    }
RUN_ROWS(run_rows4, block)
RUN_ROWS(run_rows8, block8)

/* y[M, n_out] (fp32, row stride out_stride) = x[M, K] (bf16, row stride x_stride) @ W.T.
 * w: the packed planes of N = tiles * 16 columns (n_out <= N real); P = 0: the int8 form.
 * threads: the column cut. */
int turnkv_q4_mm(int64_t M, int64_t K, int64_t tiles, int64_t P, const uint16_t *x, int64_t x_stride,
                 const uint8_t *w, float *out, int64_t out_stride, int64_t n_out, int64_t threads) {
    if (K % GROUP) return 1;
    const int64_t G = K / GROUP, tile_bytes = P ? G * P * PLANE_BYTES : G * Q8_BYTES;
    float *xs = (float *)malloc(sizeof(float) * (M > 0 ? M : 1) * G);
    if (!xs) return 2;
    for (int64_t m = 0; P && m < M; m++) /* the int8 form has no zeros to take back */
        for (int64_t g = 0; g < G; g++) {
            float s = 0.0f;
            for (int k = 0; k < GROUP; k++) s += bf16_to_f32(x[m * x_stride + g * GROUP + k]);
            xs[m * G + g] = s;
        }
    if (threads > tiles) threads = tiles;
    if (threads < 1) threads = 1;
#pragma omp parallel for num_threads(threads) schedule(static, 1) if (threads > 1)
    for (int64_t part = 0; part < threads; part++) {
        /* equal shares of the tiles; every thread walks all rows of its tiles, so a block of tiles
           stays in cache across the row blocks. Up to 10 rows are one block (one unpack of the
           weights); more go 8 at a time, where the 3 tiles a block holds in registers beat 1-2
           (2-core Zen 4, the default model's step: 9-10 rows as one block 0.82-0.86x the time of
           8 + 1 or 8 + 2; 12 rows as one block 0.99x, 16 rows 1.04x, 512 rows 1.12x). */
        int64_t t0 = tiles * part / threads, t1 = tiles * (part + 1) / threads;
        for (int64_t tb = t0; tb < t1; tb += 24) {
            int64_t te = tb + 24 < t1 ? tb + 24 : t1;
            const int64_t rb = M <= MAX_ROWS ? M : BIG_BLOCK;
            for (int64_t r0 = 0; r0 < M; r0 += rb) {
                int64_t R = M - r0 < rb ? M - r0 : rb;
                (P ? run_rows4 : run_rows8)(R, tb, te, G, P, x + r0 * x_stride, x_stride, xs + r0 * G, w,
                                            tile_bytes, out, out_stride, n_out, r0);
            }
        }
    }
    free(xs);
    return 0;
}

/* fp32 -> bf16, round to nearest even (torch's conversion; the values here are finite) */
static inline uint16_t to_bf16(float x) {
    uint32_t u;
    memcpy(&u, &x, 4);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* W.T as bf16 [K, n_out] (row k at out + k * n_out): each value sum_p u s + z (or q s), in fp32
 * (each product exact: a 4- or 8-bit value times an fp16 scale), rounded to bf16 once. For the
 * wide windows' GEMM (prefill chunks). P = 0: the int8 form. Columns cut over threads. */
int turnkv_q4_dequant(int64_t K, int64_t tiles, int64_t P, const uint8_t *w, uint16_t *out, int64_t n_out,
                      int64_t threads) {
    if (K % GROUP) return 1;
    const int64_t G = K / GROUP, tile_bytes = P ? G * P * PLANE_BYTES : G * Q8_BYTES;
    if (threads > tiles) threads = tiles;
    if (threads < 1) threads = 1;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int64_t t = 0; t < tiles; t++) {
        const int64_t n0 = t * TILE, nc = n0 + TILE <= n_out ? TILE : n_out - n0;
        for (int64_t g = 0; g < G; g++) {
            float v[GROUP][TILE];
            for (int64_t p = 0; p < (P ? P : 1); p++) {
                const uint8_t *blk = w + t * tile_bytes + (P ? (g * P + p) * PLANE_BYTES : g * Q8_BYTES);
                for (int c = 0; c < TILE; c++) {
                    float s = (float)((const _Float16 *)blk)[c];
                    float z = P ? (float)((const _Float16 *)(blk + 32))[c] : 0.0f;
                    for (int j = 0; j < UNITS; j++) {
                        float a, b;
                        if (P) {
                            const uint8_t byte = blk[64 + j * 16 + c];
                            a = (float)(byte & 15) * s + z;
                            b = (float)(byte >> 4) * s + z;
                        } else {
                            const int8_t *q = (const int8_t *)(blk + 64 + j * 32);
                            a = (float)q[2 * c] * s;
                            b = (float)q[2 * c + 1] * s;
                        }
                        v[2 * j][c] = p ? v[2 * j][c] + a : a;
                        v[2 * j + 1][c] = p ? v[2 * j + 1][c] + b : b;
                    }
                }
            }
            for (int k = 0; k < GROUP; k++)
                for (int64_t c = 0; c < nc; c++) out[(g * GROUP + k) * n_out + n0 + c] = to_bf16(v[k][c]);
        }
    }
    return 0;
}
