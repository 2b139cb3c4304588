/* turnkv: the CPU matmul over 4-bit weights, y = x @ W.T, for any number of rows.
 *
 * Weights: P planes of values u in 0..15 with a scale s and a zero z per column and group of 32
 * inputs; W[n, k] = sum_p u_p[n, k] * s_p[n, g] + z_p[n, g] (g = k / 32). GGUF Q4_0, Q4_1 and
 * Q8_0 map onto this exactly (cpu_int4.py); s and z are stored as fp16, as the GGUF stores them.
 *
 * Layout (built by cpu_int4.py): tiles of 16 columns; per tile and group, per plane, 320 bytes:
 *   16 fp16 scales | 16 fp16 zeros | 8 quads of 32 bytes,
 * quad i's byte 2c + h holding u[c, 4i + 2h] in its low nibble and u[c, 4i + 2h + 1] in its high
 * one, so that widening the quad's bytes to 16 bits and splitting the nibbles gives, in 32-bit
 * lane c, the four bytes u[c, 4i .. 4i + 3]. Order [tile][group][plane][320].
 *
 * Q8_0 matrices (int8 values q times one fp16 scale per group) have a layout of their own, one
 * plane of 576 bytes per tile and group: 16 fp16 scales | 16 int16 column sums of q over the
 * group | 8 quads of 64 bytes, quad i's bytes 4c .. 4c + 3 holding q[c, 4i .. 4i + 3].
 *
 * Activations are quantized per row and group of 32, as llama.cpp does for these formats (its
 * Q8_0 activations): d = max|x| / 127, q = round(x * (127 / max|x|)) (ties to even), so x ~ q d
 * within d / 2. Then, per row m, column n, group g, plane p, in fp32:
 *   t   = sum_k u[n, k] q[m, k]                  integer, exact (AVX512-VNNI: 64 products an op)
 *   acc = fma((float)t, s * d[m, g], acc);  acc = fma(z, d[m, g] * sum_k q[m, k], acc)
 * and for the int8 form, the activations offset to unsigned (q + 128) for the instruction:
 *   t   = sum_k (q[m, k] + 128) q_w[n, k] - 128 * colsum[n, g];  acc = fma((float)t, s * d, acc)
 *
 * Exactness: a row's result is the same instructions in the same order whatever rows share the
 * call, however the rows are blocked and the columns cut over threads (each (row, column) sum
 * runs over k in order in one lane of one register; the integer sums are exact). So a
 * conversation's logits do not depend on the other conversations in its step.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#include <immintrin.h>
#define TKV_VNNI 1
#define TKV_AVX2 0
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
/* AVX2 without VNNI: u8 x s8 pairs in 16 bits (vpmaddubsw, which cannot saturate here: 4-bit
 * values times |q| <= 127, or |q_w| <= 128 times |q| <= 127 for the int8 form through the sign
 * trick), then pairs of pairs into int32 (vpmaddwd by ones): the same exact integer sums. */
#include <immintrin.h>
#define TKV_VNNI 0
#define TKV_AVX2 1
#else
#define TKV_VNNI 0
#define TKV_AVX2 0
#endif

#define TILE 16
#define QUADS 8
#define GROUP 32
#define PLANE_BYTES 320
#define Q8_BYTES 576
#define MAX_ROWS 10 /* rows per block at most */
#ifndef TKV_ONE_BLOCK /* a call of up to this many rows is one block, more go BIG_BLOCK at a time */
#define TKV_ONE_BLOCK MAX_ROWS
#endif
#define BIG_BLOCK 4

/* Ask for the next block's bytes of this group (the T tiles after these, of which `ahead` exist): a
 * block reads T streams 5760+ bytes apart, which the hardware prefetcher follows too late from
 * memory (a decode step's weights never stay in cache). Only tiles of the matrix: a prefetch past
 * its end does not fault, but on a Zen 1 VM each one into an unmapped page cost ~150 cycles (a
 * failed page walk), ~20 us a call. Measured: docs/BENCHMARKS.md, 'AVX2 kernels on their own ISA'
 * and 'turnkv on a real AVX2-only CPU'. */
static inline __attribute__((always_inline)) void prefetch_next(const int T, const uint8_t *w, int64_t tile_bytes,
                                                                int64_t off, int bytes, int64_t ahead) {
    for (int t = 0; t < T && t < ahead; t++)
        for (int l = 0; l < bytes; l += 64) __builtin_prefetch(w + (T + t) * tile_bytes + off + l, 0, 3);
}

static inline float bf16_to_f32(uint16_t h) {
    uint32_t b = (uint32_t)h << 16;
    float f;
    memcpy(&f, &b, 4);
    return f;
}

#if !TKV_VNNI && !TKV_AVX2
/* Plain C, both kernels: sum[r * T + t][c] += one quad's values v (4 inputs x 16 columns,
 * input-major, unpacked once for all rows) times row r's 4 activations at qr + r * K. */
static inline __attribute__((always_inline)) void quad_rows(const int R, const int T, int t, const int32_t v[4][TILE],
                                                            const int8_t *qr, int64_t K, int32_t sum[][TILE]) {
    for (int r = 0; r < R; r++, qr += K)
        for (int c = 0; c < TILE; c++)
            sum[r * T + t][c] += v[0][c] * qr[0] + v[1][c] * qr[1] + v[2][c] * qr[2] + v[3][c] * qr[3];
}
#endif

/* Row m's activations, group by group: q [M][K] int8, d [M][G] and dq = d * sum q [M][G]. AVX2
 * with swap (the 4-bit form): each quad's bytes stored q0 q2 q1 q3, block()'s two pairs. */
static void quantize_rows(int64_t M, int64_t K, const uint16_t *x, int64_t x_stride, int8_t *q, float *d,
                          float *dq, int swap) {
    (void)swap;
    const int64_t G = K / GROUP;
    for (int64_t m = 0; m < M; m++)
        for (int64_t g = 0; g < G; g++) {
            const uint16_t *xg = x + m * x_stride + g * GROUP;
            int8_t *qg = q + m * K + g * GROUP;
            int sum = 0;
#if TKV_VNNI
            const __m512 lo = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)xg)), 16));
            const __m512 hi = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(xg + 16))), 16));
            const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
            const __m512 inv = _mm512_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
            const __m512i lim = _mm512_set1_epi32(127);
            __m512i qlo = _mm512_cvt_roundps_epi32(_mm512_mul_ps(lo, inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            __m512i qhi = _mm512_cvt_roundps_epi32(_mm512_mul_ps(hi, inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            qlo = _mm512_max_epi32(_mm512_min_epi32(qlo, lim), _mm512_sub_epi32(_mm512_setzero_si512(), lim));
            qhi = _mm512_max_epi32(_mm512_min_epi32(qhi, lim), _mm512_sub_epi32(_mm512_setzero_si512(), lim));
            _mm_storeu_si128((__m128i *)qg, _mm512_cvtepi32_epi8(qlo));
            _mm_storeu_si128((__m128i *)(qg + 16), _mm512_cvtepi32_epi8(qhi));
            sum = _mm512_reduce_add_epi32(_mm512_add_epi32(qlo, qhi));
#elif TKV_AVX2
            __m256 v[4], mx = _mm256_setzero_ps();
            const __m256 sign = _mm256_set1_ps(-0.0f);
            for (int j = 0; j < 4; j++) {
                v[j] = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(xg + 8 * j))), 16));
                mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, v[j]));
            }
            __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
            m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
            m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
            const float amax = _mm_cvtss_f32(m4);
            const __m256 inv = _mm256_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
            const __m256i lim = _mm256_set1_epi32(127), nlim = _mm256_set1_epi32(-127);
            __m256i r[4], acc = _mm256_setzero_si256();
            for (int j = 0; j < 4; j++) { /* cvtps rounds to nearest, ties to even, as nearbyintf */
                r[j] = _mm256_max_epi32(_mm256_min_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(v[j], inv)), lim), nlim);
                acc = _mm256_add_epi32(acc, r[j]);
            }
            /* int32 -> int8 in order: packs work within 128-bit lanes, the permute puts them back */
            const __m256i p16 = _mm256_packs_epi32(r[0], r[1]), p16b = _mm256_packs_epi32(r[2], r[3]);
            __m256i p8 = _mm256_packs_epi16(p16, p16b);
            p8 = _mm256_permutevar8x32_epi32(p8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
            if (swap) /* each quad's bytes as q0 q2 q1 q3, the order block()'s pairs take */
                p8 = _mm256_shuffle_epi8(p8, _mm256_setr_epi8(0, 2, 1, 3, 4, 6, 5, 7, 8, 10, 9, 11, 12, 14, 13, 15,
                                                              0, 2, 1, 3, 4, 6, 5, 7, 8, 10, 9, 11, 12, 14, 13, 15));
            _mm256_storeu_si256((__m256i *)qg, p8);
            __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(acc), _mm256_extracti128_si256(acc, 1));
            s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
            s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
            sum = _mm_cvtsi128_si32(s4);
#else
            float v[GROUP], amax = 0.0f;
            for (int k = 0; k < GROUP; k++) {
                v[k] = bf16_to_f32(xg[k]);
                amax = fmaxf(amax, fabsf(v[k]));
            }
            const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
            for (int k = 0; k < GROUP; k++) {
                int r = (int)nearbyintf(v[k] * inv);
                r = r > 127 ? 127 : (r < -127 ? -127 : r);
                qg[k] = (int8_t)r;
                sum += r;
            }
#endif
            d[m * G + g] = amax / 127.0f;
            dq[m * G + g] = d[m * G + g] * (float)sum;
        }
}

#if TKV_AVX2
/* Quads i0 .. i0 + 3 of a group (16 inputs) for rows 0..R and tiles 0..T, into h[r * T + t]: in
 * 16-bit lane c, column c's sum (exact: |sum| <= 16 * 15 * 127). The sums live in registers of
 * this function's own (an array reached through a pointer chosen at run time stays in memory:
 * a load and a store per add); PASS_TILES says how many fit the 16 ymm registers. */
static inline __attribute__((always_inline)) void half_sums(const int R, const int T, const int i0, const uint8_t *v,
                                                            int64_t tile_bytes, const int8_t *qg, int64_t K,
                                                            __m256i *out) {
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    __m256i h[MAX_ROWS * 4];
#pragma GCC unroll 4
    for (int i = i0; i < i0 + 4; i++) {
        __m256i lo[4], hi[4];
        for (int t = 0; t < T; t++) {
            const __m256i b = _mm256_loadu_si256((const __m256i *)(v + t * tile_bytes + i * 32));
            lo[t] = _mm256_and_si256(b, m4);
            hi[t] = _mm256_and_si256(_mm256_srli_epi16(b, 4), m4);
        }
        for (int r = 0; r < R; r++) {
            int16_t p02, p13; /* the quad as q0 q2 q1 q3 (quantize_rows' swap) */
            memcpy(&p02, qg + r * K + 4 * i, 2);
            memcpy(&p13, qg + r * K + 4 * i + 2, 2);
            const __m256i x02 = _mm256_set1_epi16(p02), x13 = _mm256_set1_epi16(p13);
            for (int t = 0; t < T; t++) {
                const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(lo[t], x02), _mm256_maddubs_epi16(hi[t], x13));
                h[r * T + t] = i == i0 ? p : _mm256_add_epi16(h[r * T + t], p);
                /* the sum in a register, quad by quad: left free, GCC computes every product of
                   the pass first and adds them at the end, spilling them all */
                __asm__("" : "+x"(h[r * T + t]));
            }
        }
    }
    for (int j = 0; j < R * T; j++) out[j] = h[j];
}

#ifndef PASS_ROWS /* rows a pass at most (rows_in_passes; -DPASS_ROWS=... for a tuning run) */
#define PASS_ROWS 2
#endif
#ifndef PASS8_ROWS /* the same for block8() */
#define PASS8_ROWS 4
#endif

/* One pass of block() for a group and plane at v: rows 0..R (q, d, dq, acc: the pass's first
 * row's; acc_stride floats a row), tiles 0..T, the running sums in registers (half_sums). */
static inline __attribute__((always_inline)) void pass4(const int R, const int T, int64_t G, int64_t g, const int8_t *q,
                                                        int64_t K, const float *d, const float *dq, const uint8_t *v,
                                                        int64_t tile_bytes, float *acc, int64_t acc_stride) {
    /* A quad's 32 bytes split into low and high nibbles give, in 16-bit lane c, the pairs
       (u0, u2) and (u1, u3) of column c: two vpmaddubsw by the row's (q0, q2) and (q1, q3)
       sum column c's four products in one lane, 16 columns a register. Four quads (16
       products of u <= 15 and |q| <= 127: |sum| <= 30480) stay exact in 16 bits; the two
       halves of the group are interleaved and summed into int32 by vpmaddwd. (32-bit
       broadcasts with the pairs blended per column were slower on Zen 4: two more
       instructions a quad and tile.) */
    __m256i h0[PASS_ROWS * 4], h1[PASS_ROWS * 4];
    const __m256i ones = _mm256_set1_epi16(1);
    half_sums(R, T, 0, v + 64, tile_bytes, q + g * GROUP, K, h0);
    half_sums(R, T, 4, v + 64, tile_bytes, q + g * GROUP, K, h1);
    /* The group's int32 sums come out of unpack + vpmaddwd in the column order 0-3 8-11 |
       4-7 12-15 (128-bit lanes); the scales and zeros are put in that order instead of the
       sums back in theirs (a vperm2i128 took 3.2 cycles on Zen 1), and emit4() restores the order
       once a call: each column's arithmetic is unchanged, only its lane. */
    for (int t = 0; t < T; t++) {
        const uint8_t *sz = v + t * tile_bytes;
        const __m128i sl = _mm_loadu_si128((const __m128i *)sz), sh = _mm_loadu_si128((const __m128i *)(sz + 16));
        const __m128i zl = _mm_loadu_si128((const __m128i *)(sz + 32)), zh = _mm_loadu_si128((const __m128i *)(sz + 48));
        const __m256 s0 = _mm256_cvtph_ps(_mm_unpacklo_epi64(sl, sh)), s1 = _mm256_cvtph_ps(_mm_unpackhi_epi64(sl, sh));
        const __m256 z0 = _mm256_cvtph_ps(_mm_unpacklo_epi64(zl, zh)), z1 = _mm256_cvtph_ps(_mm_unpackhi_epi64(zl, zh));
        for (int r = 0; r < R; r++) {
            const __m256 t0 = _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_unpacklo_epi16(h0[r * T + t], h1[r * T + t]), ones));
            const __m256 t1 = _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_unpackhi_epi16(h0[r * T + t], h1[r * T + t]), ones));
            const __m256 dr = _mm256_set1_ps(d[r * G + g]), dqr = _mm256_set1_ps(dq[r * G + g]);
            float *acc0 = acc + r * acc_stride + t * TILE;
            __m256 v0 = _mm256_fmadd_ps(t0, _mm256_mul_ps(s0, dr), _mm256_loadu_ps(acc0));
            __m256 v1 = _mm256_fmadd_ps(t1, _mm256_mul_ps(s1, dr), _mm256_loadu_ps(acc0 + 8));
            _mm256_storeu_ps(acc0, _mm256_fmadd_ps(z0, dqr, v0));
            _mm256_storeu_ps(acc0 + 8, _mm256_fmadd_ps(z1, dqr, v1));
        }
    }
}

/* Tiles a pass of R rows: the most whose sums, both halves' (2 R T), fit the 16 registers beside
 * the quad's nibbles (2 T), two broadcasts and the mask: 2 R T + 2 T + 3 <= 16. */
#define PASS_TILES(R) (13 / (2 * (R) + 2) > 0 ? 13 / (2 * (R) + 2) : 1)

static inline __attribute__((always_inline)) void tiles_in_passes(const int R, const int T, int64_t G, int64_t g,
                                                                  const int8_t *q, int64_t K, const float *d,
                                                                  const float *dq, const uint8_t *v, int64_t tile_bytes,
                                                                  float *acc, int64_t acc_stride) {
    const int TP = PASS_TILES(R);
    int t = 0;
    for (; t + TP <= T; t += TP) pass4(R, TP, G, g, q, K, d, dq, v + t * tile_bytes, tile_bytes, acc + t * TILE, acc_stride);
    if (T % TP) pass4(R, T % TP, G, g, q, K, d, dq, v + t * tile_bytes, tile_bytes, acc + t * TILE, acc_stride);
}

/* block()'s rows in passes of up to PASS_ROWS rows, as even as they go (for a maximum of 4, 9 rows
 * are 3 + 3 + 3, not 4 + 4 + 1: a pass shares its unpacked weights among its rows only). The R x T
 * running sums of a whole block spill past a few rows and tiles (each add then a load and a
 * store); a pass's fit the registers, both halves of the group included, so nothing spills at 2
 * rows x 2 tiles. Each (row, column) gets the same operations in the same order as in one pass,
 * so the bits are those of every variant (docs/BENCHMARKS.md, 'The AVX2 rows in passes of 4'). */
#define PASSES(R, MAX) (((R) + (MAX) - 1) / (MAX))
static inline __attribute__((always_inline)) void rows_in_passes(const int R, const int T, int64_t G, int64_t g,
                                                                 const int8_t *q, int64_t K, const float *d,
                                                                 const float *dq, const uint8_t *v, int64_t tile_bytes,
                                                                 float *acc) {
    const int n = PASSES(R, PASS_ROWS), rp = R / n, more = R % n; /* `more` passes of rp + 1 rows */
    int r = 0;
    for (int i = 0; i < n; r += rp + (i < more), i++)
        if (i < more)
            tiles_in_passes(rp + 1, T, G, g, q + r * K, K, d + r * G, dq + r * G, v, tile_bytes, acc + r * T * TILE, T * TILE);
        else
            tiles_in_passes(rp, T, G, g, q + r * K, K, d + r * G, dq + r * G, v, tile_bytes, acc + r * T * TILE, T * TILE);
}
#endif

/* One block: rows 0..R of the quantized activations, tiles 0..T from w, every group and plane.
 * R and T are constants where it is inlined, so the running sums stay in registers. */
static inline __attribute__((always_inline)) void block(const int R, const int T, int64_t G, int64_t P,
                                                        const int8_t *q, int64_t K, const float *d,
                                                        const float *dq, const uint8_t *w, int64_t tile_bytes,
                                                        int64_t ahead, float *acc /* [R][T*16] */) {
    for (int64_t g = 0; g < G; g++) {
        for (int64_t p = 0; p < P; p++) {
            const int64_t off = (g * P + p) * PLANE_BYTES;
            prefetch_next(T, w, tile_bytes, off, PLANE_BYTES, ahead);
#if TKV_VNNI
            __m512i sum[MAX_ROWS * 8];
            for (int i = 0; i < R * T; i++) sum[i] = _mm512_setzero_si512();
            const __m512i lo4 = _mm512_set1_epi16(0x0F0F);
            for (int i = 0; i < QUADS; i++) {
                __m512i wv[8];
                for (int t = 0; t < T; t++) {
                    __m512i b = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(w + t * tile_bytes + off + 64 + i * 32)));
                    wv[t] = _mm512_ternarylogic_epi32(b, _mm512_slli_epi16(b, 4), lo4, 0xA8); /* (b | b << 4) & 0x0F0F */
                }
                for (int r = 0; r < R; r++) {
                    int32_t quad;
                    memcpy(&quad, q + r * K + g * GROUP + 4 * i, 4);
                    const __m512i xv = _mm512_set1_epi32(quad);
                    for (int t = 0; t < T; t++) sum[r * T + t] = _mm512_dpbusd_epi32(sum[r * T + t], wv[t], xv);
                }
            }
            for (int t = 0; t < T; t++) {
                const uint8_t *sz = w + t * tile_bytes + off;
                const __m512 s = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)sz));
                const __m512 z = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(sz + 32)));
                for (int r = 0; r < R; r++) {
                    float *a = acc + r * T * TILE + t * TILE;
                    __m512 av = _mm512_loadu_ps(a);
                    av = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[r * T + t]), _mm512_mul_ps(s, _mm512_set1_ps(d[r * G + g])), av);
                    av = _mm512_fmadd_ps(z, _mm512_set1_ps(dq[r * G + g]), av);
                    _mm512_storeu_ps(a, av);
                }
            }
#elif TKV_AVX2
            rows_in_passes(R, T, G, g, q, K, d, dq, w + off, tile_bytes, acc);
#else
            int32_t sum[MAX_ROWS * 8][TILE];
            memset(sum, 0, sizeof(int32_t) * R * T * TILE);
            for (int i = 0; i < QUADS; i++)
                for (int t = 0; t < T; t++) {
                    const uint8_t *u = w + t * tile_bytes + off + 64 + i * 32;
                    int32_t v[4][TILE]; /* the quad's values, input-major, unpacked once for all rows */
                    for (int c = 0; c < TILE; c++) {
                        v[0][c] = u[2 * c] & 15;
                        v[1][c] = u[2 * c] >> 4;
                        v[2][c] = u[2 * c + 1] & 15;
                        v[3][c] = u[2 * c + 1] >> 4;
                    }
                    quad_rows(R, T, t, v, q + g * GROUP + 4 * i, K, sum);
                }
            for (int t = 0; t < T; t++) {
                const _Float16 *sz = (const _Float16 *)(w + t * tile_bytes + off);
                for (int r = 0; r < R; r++)
                    for (int c = 0; c < TILE; c++) {
                        float *a = acc + r * T * TILE + t * TILE + c;
                        *a = fmaf((float)sum[r * T + t][c], (float)sz[c] * d[r * G + g], *a);
                        *a = fmaf((float)sz[TILE + c], dq[r * G + g], *a);
                    }
            }
#endif
        }
    }
}

#if TKV_AVX2
/* One pass of block8() for a group at v: rows 0..R (q, d, acc: the pass's first row's; acc_stride
 * floats a row), tiles 0..T; 2 R T running sums, 2 T weights and 2 T magnitudes. */
static inline __attribute__((always_inline)) void pass8(const int R, const int T, int64_t G, int64_t g, const int8_t *q,
                                                        int64_t K, const float *d, const uint8_t *v, int64_t tile_bytes,
                                                        float *acc, int64_t acc_stride) {
    __m256i sum[PASS8_ROWS * 2 * 2];
    for (int i = 0; i < R * T * 2; i++) sum[i] = _mm256_setzero_si256();
    const __m256i ones = _mm256_set1_epi16(1);
    for (int i = 0; i < QUADS; i++) {
        __m256i wv[2 * 2], wa[2 * 2];
        for (int j = 0; j < 2 * T; j++) {
            wv[j] = _mm256_loadu_si256((const __m256i *)(v + (j / 2) * tile_bytes + 64 + i * 64 + (j % 2) * 32));
            wa[j] = _mm256_sign_epi8(wv[j], wv[j]); /* |q_w|, read unsigned (-128 -> 128) */
        }
        for (int r = 0; r < R; r++) {
            int32_t quad;
            memcpy(&quad, q + r * K + g * GROUP + 4 * i, 4);
            const __m256i xv = _mm256_set1_epi32(quad);
            for (int j = 0; j < 2 * T; j++) /* |q_w| * (q carrying q_w's sign) = q_w q */
                sum[r * 2 * T + j] = _mm256_add_epi32(sum[r * 2 * T + j], _mm256_madd_epi16(_mm256_maddubs_epi16(wa[j], _mm256_sign_epi8(xv, wv[j])), ones));
        }
    }
    for (int j = 0; j < 2 * T; j++) {
        const __m256 s = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(v + (j / 2) * tile_bytes + (j % 2) * 16)));
        for (int r = 0; r < R; r++) {
            float *a = acc + r * acc_stride + j * 8;
            _mm256_storeu_ps(a, _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[r * 2 * T + j]), _mm256_mul_ps(s, _mm256_set1_ps(d[r * G + g])), _mm256_loadu_ps(a)));
        }
    }
}

/* Tiles a pass of R rows in block8(): 2 T R sums, 2 T weights, 2 T magnitudes, a broadcast, ones
 * and a product fit the 16 registers at 1 row x 2 tiles and 4 x 1; 2 rows x 2 tiles spill a few
 * but timed faster than two passes of 1 tile (docs/BENCHMARKS.md, as above). */
#define PASS8_TILES(R) ((R) <= 2 ? 2 : 1)

static inline __attribute__((always_inline)) void tiles_in_passes8(const int R, const int T, int64_t G, int64_t g,
                                                                   const int8_t *q, int64_t K, const float *d,
                                                                   const uint8_t *v, int64_t tile_bytes, float *acc,
                                                                   int64_t acc_stride) {
    const int TP = PASS8_TILES(R);
    int t = 0;
    for (; t + TP <= T; t += TP) pass8(R, TP, G, g, q, K, d, v + t * tile_bytes, tile_bytes, acc + t * TILE, acc_stride);
    if (T % TP) pass8(R, T % TP, G, g, q, K, d, v + t * tile_bytes, tile_bytes, acc + t * TILE, acc_stride);
}

/* block8()'s rows in passes of up to PASS8_ROWS, as rows_in_passes() for block(). */
static inline __attribute__((always_inline)) void rows_in_passes8(const int R, const int T, int64_t G, int64_t g,
                                                                  const int8_t *q, int64_t K, const float *d,
                                                                  const uint8_t *v, int64_t tile_bytes, float *acc) {
    const int n = PASSES(R, PASS8_ROWS), rp = R / n, more = R % n;
    int r = 0;
    for (int i = 0; i < n; r += rp + (i < more), i++)
        if (i < more)
            tiles_in_passes8(rp + 1, T, G, g, q + r * K, K, d + r * G, v, tile_bytes, acc + r * T * TILE, T * TILE);
        else
            tiles_in_passes8(rp, T, G, g, q + r * K, K, d + r * G, v, tile_bytes, acc + r * T * TILE, T * TILE);
}
#endif

/* The int8 form (Q8_0): as block(), one plane, signed values, no zero. */
static inline __attribute__((always_inline)) void block8(const int R, const int T, int64_t G, int64_t P,
                                                         const int8_t *q, int64_t K, const float *d,
                                                         const float *dq, const uint8_t *w, int64_t tile_bytes,
                                                         int64_t ahead, float *acc) {
    (void)P;
    (void)dq;
    for (int64_t g = 0; g < G; g++) {
        const int64_t off = g * Q8_BYTES;
        prefetch_next(T, w, tile_bytes, off, Q8_BYTES, ahead);
#if TKV_VNNI
        __m512i sum[MAX_ROWS * 8];
        for (int i = 0; i < R * T; i++) sum[i] = _mm512_setzero_si512();
        for (int i = 0; i < QUADS; i++) {
            __m512i wv[8];
            for (int t = 0; t < T; t++) wv[t] = _mm512_loadu_si512(w + t * tile_bytes + off + 64 + i * 64);
            for (int r = 0; r < R; r++) {
                int32_t quad;
                memcpy(&quad, q + r * K + g * GROUP + 4 * i, 4);
                const __m512i xv = _mm512_set1_epi32(quad ^ (int32_t)0x80808080); /* q + 128, unsigned */
                for (int t = 0; t < T; t++) sum[r * T + t] = _mm512_dpbusd_epi32(sum[r * T + t], xv, wv[t]);
            }
        }
        for (int t = 0; t < T; t++) {
            const uint8_t *sz = w + t * tile_bytes + off;
            const __m512 s = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)sz));
            const __m512i c128 = _mm512_slli_epi32(_mm512_cvtepi16_epi32(_mm256_loadu_si256((const __m256i *)(sz + 32))), 7);
            for (int r = 0; r < R; r++) {
                float *a = acc + r * T * TILE + t * TILE;
                const __m512 tv = _mm512_cvtepi32_ps(_mm512_sub_epi32(sum[r * T + t], c128));
                _mm512_storeu_ps(a, _mm512_fmadd_ps(tv, _mm512_mul_ps(s, _mm512_set1_ps(d[r * G + g])), _mm512_loadu_ps(a)));
            }
        }
#elif TKV_AVX2
        rows_in_passes8(R, T, G, g, q, K, d, w + off, tile_bytes, acc);
#else
        int32_t sum[MAX_ROWS * 8][TILE];
        memset(sum, 0, sizeof(int32_t) * R * T * TILE);
        for (int i = 0; i < QUADS; i++)
            for (int t = 0; t < T; t++) {
                const int8_t *b = (const int8_t *)(w + t * tile_bytes + off + 64 + i * 64);
                int32_t v[4][TILE];
                for (int c = 0; c < TILE; c++)
                    for (int j = 0; j < 4; j++) v[j][c] = b[4 * c + j];
                quad_rows(R, T, t, v, q + g * GROUP + 4 * i, K, sum);
            }
        for (int t = 0; t < T; t++) {
            const _Float16 *s = (const _Float16 *)(w + t * tile_bytes + off);
            for (int r = 0; r < R; r++)
                for (int c = 0; c < TILE; c++) {
                    float *a = acc + r * T * TILE + t * TILE + c;
                    *a = fmaf((float)sum[r * T + t][c], (float)s[c] * d[r * G + g], *a);
                }
        }
#endif
    }
}

/* Rows r0..r0+R (R <= MAX_ROWS), tiles t0..t1 of the output: blocks of T tiles, then single tiles. */
#define BLOCK_CASE(BLOCK, EMIT, RR, TT)                                                         \
    case RR:                                                                                    \
        for (; t + TT <= t1; t += TT) {                                                         \
            memset(acc, 0, sizeof(float) * RR * TT * TILE);                                     \
            BLOCK(RR, TT, G, P, q, K, d, dq, w + t * tile_bytes, tile_bytes, tiles - t - TT, acc); \
            EMIT(RR, TT, t, acc, out + r0 * out_stride, out_stride, n_out);                     \
        }                                                                                       \
        for (; t < t1; t++) {                                                                   \
            memset(acc, 0, sizeof(float) * RR * TILE);                                          \
            BLOCK(RR, 1, G, P, q, K, d, dq, w + t * tile_bytes, tile_bytes, tiles - t - 1, acc);   \
            EMIT(RR, 1, t, acc, out + r0 * out_stride, out_stride, n_out);                      \
        }                                                                                       \
        break;

static inline void emit(int R, int T, int64_t t, const float *acc, float *out, int64_t out_stride,
                        int64_t n_out) {
    int64_t n0 = t * TILE, n = T * TILE;
    if (n0 + n > n_out) n = n_out - n0;
    for (int r = 0; r < R; r++) memcpy(out + r * out_stride + n0, acc + r * T * TILE, sizeof(float) * n);
}

/* The 4-bit kernel's block: emit(), its columns back in order where the AVX2 sums left each
 * tile's as 0-3 8-11 4-7 12-15 (block()). */
static inline void emit4(int R, int T, int64_t t, const float *acc, float *out, int64_t out_stride,
                         int64_t n_out) {
#if TKV_AVX2
    for (int r = 0; r < R; r++)
        for (int j = 0; j < T; j++) {
            const int64_t n0 = (t + j) * TILE, n = n0 + TILE > n_out ? n_out - n0 : TILE;
            if (n <= 0) break;
            const float *a = acc + (r * T + j) * TILE;
            float tile[TILE];
            memcpy(tile, a, 4 * sizeof(float));
            memcpy(tile + 4, a + 8, 4 * sizeof(float));
            memcpy(tile + 8, a + 4, 4 * sizeof(float));
            memcpy(tile + 12, a + 12, 4 * sizeof(float));
            memcpy(out + r * out_stride + n0, tile, sizeof(float) * n);
        }
#else
    emit(R, T, t, acc, out, out_stride, n_out);
#endif
}

/* Tiles per block for 1..10 rows, per kernel: the fastest of 1-8 on the 2-core Zen 4 VM, one
 * thread (the default model's 1536 x 576 and 6144-column head slices). More tiles share each
 * activation broadcast, but past ~16 running sums the compiler spills them (docs/BENCHMARKS.md,
 * 'CPU matmuls with int8 activations'). */
#define RUN_ROWS(NAME, BLOCK, EMIT, T1, T2, T3, T4, T5, T6, T7, T8, T9, T10)                          \
    static __attribute__((noinline)) void NAME(int64_t R, int64_t t0, int64_t t1, int64_t G, int64_t P, \
                                               const int8_t *q, int64_t K, const float *d,          \
                                               const float *dq, const uint8_t *w, int64_t tile_bytes, \
                                               float *out, int64_t out_stride, int64_t n_out, int64_t r0) { \
        float acc[MAX_ROWS * 8 * TILE];                                                         \
        const int64_t tiles = (n_out + TILE - 1) / TILE; /* the matrix's, for the prefetch */   \
        int64_t t = t0;                                                                         \
        switch (R) {                                                                            \
            BLOCK_CASE(BLOCK, EMIT, 1, T1)                                                            \
            BLOCK_CASE(BLOCK, EMIT, 2, T2)                                                            \
            BLOCK_CASE(BLOCK, EMIT, 3, T3)                                                            \
            BLOCK_CASE(BLOCK, EMIT, 4, T4)                                                            \
            BLOCK_CASE(BLOCK, EMIT, 5, T5)                                                            \
            BLOCK_CASE(BLOCK, EMIT, 6, T6)                                                            \
            BLOCK_CASE(BLOCK, EMIT, 7, T7)                                                            \
            BLOCK_CASE(BLOCK, EMIT, 8, T8)                                                            \
            BLOCK_CASE(BLOCK, EMIT, 9, T9)                                                            \
            BLOCK_CASE(BLOCK, EMIT, 10, T10)                                                          \
        }                                                                                       \
    }
#if TKV_VNNI
#define TILES4 4, 3, 4, 3, 3, 2, 2, 1, 1, 1
#define TILES8 1, 4, 4, 3, 2, 2, 2, 2, 2, 1
#elif TKV_AVX2 /* blocks walked in passes of at most 2 rows (rows_in_passes), so more tiles a block no
                 longer spill; re-timed on the Zen 4 VM's AVX2 build, weights streaming
                 (docs/BENCHMARKS.md, 'The AVX2 rows in passes of 4') */
#define TILES4 3, 2, 2, 2, 2, 2, 2, 2, 2, 2
#define TILES8 1, 2, 1, 1, 1, 1, 1, 1, 1, 1
#else /* plain C */
#define TILES4 2, 2, 1, 1, 1, 1, 1, 4, 3, 3
#define TILES8 1, 2, 1, 1, 1, 1, 1, 1, 1, 4
#endif
#ifdef TKV_TILES4 /* a tuning run's choice (-DTKV_TILES4=...) */
#undef TILES4
#define TILES4 TKV_TILES4
#endif
#ifdef TKV_TILES8
#undef TILES8
#define TILES8 TKV_TILES8
#endif
#define RUN_ROWS_(NAME, BLOCK, EMIT, ...) RUN_ROWS(NAME, BLOCK, EMIT, __VA_ARGS__)
RUN_ROWS_(run_rows4, block, emit4, TILES4)
RUN_ROWS_(run_rows8, block8, emit, TILES8)

/* A matrix's constants, set once per packed matrix (cpu_int4.Matrix), so a call passes one
 * pointer for them: ctypes converts every argument of every call (~0.1 us each). */
typedef struct {
    int64_t K, tiles, P; /* P = 0: the int8 form */
    int64_t n_out;       /* real columns (<= tiles * 16) */
    const uint8_t *w;
} tkv_matrix;

/* Row m of fp32 activations rounded to bf16 (nearest, ties to even; NaN -> 0x7FC0), as torch's
 * .bfloat16() rounds: the kernel takes fp32 rows without a cast op of their own in between. */
static void round_rows_bf16(int64_t M, int64_t K, const float *x, int64_t x_stride, uint16_t *out) {
    for (int64_t m = 0; m < M; m++) {
        const uint32_t *src = (const uint32_t *)(const void *)(x + m * x_stride);
        uint16_t *dst = out + m * K;
        for (int64_t k = 0; k < K; k++) {
            const uint32_t u = src[k];
            const uint16_t r = (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
            dst[k] = (u & 0x7FFFFFFFu) > 0x7F800000u ? (uint16_t)0x7FC0 : r;
        }
    }
}

static void run_part(const tkv_matrix *mat, int64_t part, int64_t threads, int64_t M, const int8_t *q,
                     const float *d, const float *dq, float *out, const float *residual) {
    const int64_t K = mat->K, G = K / GROUP, P = mat->P, tiles = mat->tiles, n_out = mat->n_out;
    const int64_t tile_bytes = P ? G * P * PLANE_BYTES : G * Q8_BYTES;
    /* equal shares of the tiles; every thread walks all rows of its tiles, so a block of tiles
       stays in cache across the row blocks. Up to 10 rows are one block (one unpack of the
       weights); more go 4 at a time, the fastest per row (docs/BENCHMARKS.md, 'Figures
       moved out of code comments'). */
    int64_t t0 = tiles * part / threads, t1 = tiles * (part + 1) / threads;
    for (int64_t tb = t0; tb < t1; tb += 24) {
        int64_t te = tb + 24 < t1 ? tb + 24 : t1;
        const int64_t rb = M <= TKV_ONE_BLOCK ? M : BIG_BLOCK;
        for (int64_t r0 = 0; r0 < M; r0 += rb) {
            int64_t R = M - r0 < rb ? M - r0 : rb;
            (P ? run_rows4 : run_rows8)(R, tb, te, G, P, q + r0 * K, K, d + r0 * G, dq + r0 * G, mat->w,
                                        tile_bytes, out, n_out, n_out, r0);
        }
    }
    if (residual) /* out += residual over this part's columns, after its sums (fp32 adds, as torch's) */
        for (int64_t m = 0; m < M; m++) {
            const int64_t n1 = t1 * TILE < n_out ? t1 * TILE : n_out;
            for (int64_t n = t0 * TILE; n < n1; n++) out[m * n_out + n] += residual[m * n_out + n];
        }
}

#define STACK_BYTES 32768 /* activations of a decode step's rows go on the stack, more to malloc */

/* Rows x[M, K] (row stride x_stride; bf16, or fp32 with x_fp32, then rounded to bf16 first into
 * bf16[M, K]) -> the activations' int8 form: q [M][K], d and dq [M][K/32] (quantize_rows), in
 * the order this matrix's kernel reads them. Row by row: rows quantized apart are the same. */
void turnkv_q4_prepare(const tkv_matrix *mat, int64_t M, const void *x, int64_t x_stride, int64_t x_fp32,
                       int8_t *q, float *d, float *dq, uint16_t *bf16) {
    const int64_t K = mat->K;
    const uint16_t *xb = (const uint16_t *)x;
    if (x_fp32) {
        round_rows_bf16(M, K, (const float *)x, x_stride, bf16);
        xb = bf16, x_stride = K;
    }
    quantize_rows(M, K, xb, x_stride, q, d, dq, TKV_AVX2 && mat->P > 0);
}

/* The columns of part `part` of `threads` (run_part) for rows prepared by turnkv_q4_prepare, on
 * the calling thread: the decoder's OpenMP region (models/cpu_decoder.c) runs part t on thread t. */
void turnkv_q4_part(const tkv_matrix *mat, int64_t part, int64_t threads, int64_t M, const int8_t *q,
                    const float *d, const float *dq, float *out, const float *residual) {
    if (threads > mat->tiles) threads = mat->tiles;
    if (part < threads) run_part(mat, part, threads, M, q, d, dq, out, residual);
}

/* y[M, n_out] (fp32, contiguous) = x[M, K] (row stride x_stride; bf16, or fp32 with x_fp32, then
 * rounded to bf16 first) @ W.T (+ residual[M, n_out], fp32 contiguous, or NULL). threads: the
 * column cut; one thread runs without an OpenMP region (its entry costs ~0.4 us a call). */
int turnkv_q4_mm(const tkv_matrix *mat, int64_t M, const void *x, int64_t x_stride, int64_t x_fp32, float *out,
                 const float *residual, int64_t threads) {
    const int64_t K = mat->K, tiles = mat->tiles;
    if (K % GROUP) return 1;
    const int64_t G = K / GROUP, rows = M > 0 ? M : 1;
    const size_t q_bytes = (size_t)((rows * K + 3) & ~(int64_t)3), need = q_bytes + (size_t)(2 * rows * G) * sizeof(float)
                           + (x_fp32 ? (size_t)(rows * K) * sizeof(uint16_t) : 0);
    _Alignas(64) uint8_t stack[STACK_BYTES];
    uint8_t *buf = need <= STACK_BYTES ? stack : (uint8_t *)malloc(need);
    if (!buf) return 2;
    int8_t *q = (int8_t *)buf;
    float *d = (float *)(void *)(buf + q_bytes), *dq = d + rows * G;
    turnkv_q4_prepare(mat, M, x, x_stride, x_fp32, q, d, dq, (uint16_t *)(void *)(dq + rows * G));
    if (threads > tiles) threads = tiles;
    if (threads <= 1) {
        run_part(mat, 0, 1, M, q, d, dq, out, residual);
    } else {
#pragma omp parallel for num_threads(threads) schedule(static, 1)
        for (int64_t part = 0; part < threads; part++) run_part(mat, part, threads, M, q, d, dq, out, residual);
    }
    if (buf != stack) free(buf);
    return 0;
}
