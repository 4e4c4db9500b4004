/* CPU kernels for small-batch decode on AVX2 + FMA, loaded with ctypes by
   engine/kernels/__init__.py (which documents each entry point's contract).

   sluice_bf16_linear: y = x @ W^T (+ bias) (or y +=) for bf16 W [N, K], fp32 x [M, K], M <= 4.

   The small-batch decode GEMVs of a bf16 model on a CPU without native bf16 (AVX2 only):
   each bf16 weight is widened to fp32 exactly (bf16 is the top half of an fp32) and
   accumulated in fp32, so W is streamed once per call for all M rows. Output rows are
   split statically across OpenMP threads (torch's own libgomp, already loaded by `import
   torch`, so there is one pool). Built and loaded by engine/kernels/__init__.py.

   M == 1 with K % 16 == 0 (every real model) takes the fast path: 16 weights per 256-bit
   load, widened by interleaving with zeros (one unpack per 8 weights instead of a widen
   and a shift), against a copy of x permuted to the same in-lane order, four rows at a
   time with the next four rows prefetched. Measured on the 2-core AVX2 EPYC streaming
   the bench model's 78 MB of projections: ~15-20 % faster than the generic path. */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <math.h>
#include <stdlib.h>

static inline __m256 widen8(const uint16_t *p) {
    __m128i v = _mm_loadu_si128((const __m128i *)p);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
}

static inline float widen1(uint16_t b) {
    union { uint32_t u; float f; } c = {(uint32_t)b << 16};
    return c.f;
}

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline float dot_tail(const uint16_t *w, const float *x, int64_t k0, int64_t K) {
    float s = 0.0f;
    for (int64_t k = k0; k < K; k++) s += widen1(w[k]) * x[k];
    return s;
}

/* M == 1, K % 16 == 0. xp: x with each 16-block reordered [0-3, 8-11, 4-7, 12-15], the
   order unpacklo/unpackhi produce from 16 consecutive bf16 values. */
#define STORE(dst, val) (dst) = acc ? (dst) + (val) : (val)

static void gemv_rows(const uint16_t *W, const float *xp, const float *x, const float *bias,
                      float *y, int64_t n0, int64_t n1, int64_t K, int acc) {
    const __m256i z = _mm256_setzero_si256();
    int64_t n = n0;
    for (; n + 4 <= n1; n += 4) {
        const uint16_t *w0 = W + n * K, *w1 = w0 + K, *w2 = w1 + K, *w3 = w2 + K;
        const int64_t ahead = 4 * K;
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        __m256 b0 = a0, b1 = a0, b2 = a0, b3 = a0;
        for (int64_t k = 0; k < K; k += 16) {
            _mm_prefetch((const char *)(w0 + k + ahead), _MM_HINT_T0);
            _mm_prefetch((const char *)(w1 + k + ahead), _MM_HINT_T0);
            _mm_prefetch((const char *)(w2 + k + ahead), _MM_HINT_T0);
            _mm_prefetch((const char *)(w3 + k + ahead), _MM_HINT_T0);
            __m256 xl = _mm256_loadu_ps(xp + k), xh = _mm256_loadu_ps(xp + k + 8);
            __m256i v0 = _mm256_loadu_si256((const __m256i *)(w0 + k));
            __m256i v1 = _mm256_loadu_si256((const __m256i *)(w1 + k));
            __m256i v2 = _mm256_loadu_si256((const __m256i *)(w2 + k));
            __m256i v3 = _mm256_loadu_si256((const __m256i *)(w3 + k));
#define ACC(a, b, v)                                                                   \
    a = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_unpacklo_epi16(z, v)), xl, a);      \
    b = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_unpackhi_epi16(z, v)), xh, b)
            ACC(a0, b0, v0);
            ACC(a1, b1, v1);
            ACC(a2, b2, v2);
            ACC(a3, b3, v3);
#undef ACC
        }
        STORE(y[n], hsum(_mm256_add_ps(a0, b0)) + (bias ? bias[n] : 0.0f));
        STORE(y[n + 1], hsum(_mm256_add_ps(a1, b1)) + (bias ? bias[n + 1] : 0.0f));
        STORE(y[n + 2], hsum(_mm256_add_ps(a2, b2)) + (bias ? bias[n + 2] : 0.0f));
        STORE(y[n + 3], hsum(_mm256_add_ps(a3, b3)) + (bias ? bias[n + 3] : 0.0f));
    }
    for (; n < n1; n++) STORE(y[n], dot_tail(W + n * K, x, 0, K) + (bias ? bias[n] : 0.0f));
}

/* Any M <= 4 and K: output rows [n0, n1), two rows of W at a time; M is a constant at
   each call site so the loops over m unroll. */
static inline void rows(const uint16_t *W, const float *x, const float *bias, float *y,
                        int64_t n0, int64_t n1, int64_t N, int64_t K, const int M, int acc) {
    const int64_t K8 = K & ~(int64_t)7;
    int64_t n = n0;
    for (; n + 2 <= n1; n += 2) {
        const uint16_t *w0 = W + n * K, *w1 = w0 + K;
        __m256 a0[4], a1[4];
        for (int m = 0; m < M; m++) a0[m] = a1[m] = _mm256_setzero_ps();
        for (int64_t k = 0; k < K8; k += 8) {
            __m256 v0 = widen8(w0 + k), v1 = widen8(w1 + k);
            for (int m = 0; m < M; m++) {
                __m256 xv = _mm256_loadu_ps(x + m * K + k);
                a0[m] = _mm256_fmadd_ps(v0, xv, a0[m]);
                a1[m] = _mm256_fmadd_ps(v1, xv, a1[m]);
            }
        }
        for (int m = 0; m < M; m++) {
            const float *xm = x + m * K;
            STORE(y[m * N + n], hsum(a0[m]) + dot_tail(w0, xm, K8, K) + (bias ? bias[n] : 0.0f));
            STORE(y[m * N + n + 1],
                  hsum(a1[m]) + dot_tail(w1, xm, K8, K) + (bias ? bias[n + 1] : 0.0f));
        }
    }
    for (; n < n1; n++)
        for (int m = 0; m < M; m++)
            STORE(y[m * N + n], dot_tail(W + n * K, x + m * K, 0, K) + (bias ? bias[n] : 0.0f));
}

int sluice_bf16_linear(const uint16_t *W, const float *x, const float *bias, float *y,
                       int64_t M, int64_t N, int64_t K, int threads, int acc) {
    if (M < 1 || M > 4 || threads < 1) return -1;
    float *xp = NULL;
    if (M == 1 && K % 16 == 0) {
        xp = malloc(K * sizeof(float));
        if (!xp) return -2;
        for (int64_t k = 0; k < K; k += 16)
            for (int i = 0; i < 4; i++) {
                xp[k + i] = x[k + i];
                xp[k + 4 + i] = x[k + 8 + i];
                xp[k + 8 + i] = x[k + 4 + i];
                xp[k + 12 + i] = x[k + 12 + i];
            }
    }
    #pragma omp parallel num_threads(threads)
    {
        int t = omp_get_thread_num(), nt = omp_get_num_threads();
        /* even split in units of 16 output rows */
        int64_t units = (N + 15) / 16;
        int64_t u0 = units * t / nt, u1 = units * (t + 1) / nt;
        int64_t n0 = u0 * 16, n1 = u1 * 16 < N ? u1 * 16 : N;
        if (xp) {
            gemv_rows(W, xp, x, bias, y, n0, n1, K, acc);
        } else {
            switch (M) {
                case 1: rows(W, x, bias, y, n0, n1, N, K, 1, acc); break;
                case 2: rows(W, x, bias, y, n0, n1, N, K, 2, acc); break;
                case 3: rows(W, x, bias, y, n0, n1, N, K, 3, acc); break;
                default: rows(W, x, bias, y, n0, n1, N, K, 4, acc); break;
            }
        }
    }
    free(xp);
    return 0;
}

/* ---- the small ops around the projections (one call instead of 3-6 torch ops each) ---- */

static inline float dot(const float *a, const float *b, int64_t n) {
    int64_t n8 = n & ~(int64_t)7, i = 0;
    __m256 s = _mm256_setzero_ps();
    for (; i < n8; i += 8) s = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s);
    float t = hsum(s);
    for (; i < n; i++) t += a[i] * b[i];
    return t;
}

/* out[m] = h[m] * w / sqrt(mean(h[m]^2) + eps), rows of H floats. */
void sluice_rms_norm(const float *h, const float *w, float eps, float *out, int64_t M, int64_t H) {
    for (int64_t m = 0; m < M; m++) {
        const float *x = h + m * H;
        float r = 1.0f / sqrtf(dot(x, x, H) / (float)H + eps);
        for (int64_t i = 0; i < H; i++) out[m * H + i] = x[i] * w[i] * r;
    }
}

/* In place on rows of `x` (row stride `stride` floats): the first `heads` heads of
   2*half floats, as (re, im) pairs times the complex table[pos[m]][i] (re, im). */
void sluice_rope(float *x, int64_t stride, int64_t M, const float *table, const int64_t *pos,
                 int64_t heads, int64_t half) {
    for (int64_t m = 0; m < M; m++) {
        const float *t = table + pos[m] * half * 2;
        for (int64_t h = 0; h < heads; h++) {
            float *v = x + m * stride + h * half * 2;
            for (int64_t i = 0; i < half; i++) {
                float a = v[2 * i], b = v[2 * i + 1], c = t[2 * i], s = t[2 * i + 1];
                v[2 * i] = a * c - b * s;
                v[2 * i + 1] = a * s + b * c;
            }
        }
    }
}

/* out[m, i] = silu(gu[m, i]) * gu[m, I + i]. */
void sluice_silu_mul(const float *gu, float *out, int64_t M, int64_t I) {
    for (int64_t m = 0; m < M; m++) {
        const float *g = gu + m * 2 * I, *u = g + I;
        for (int64_t i = 0; i < I; i++) out[m * I + i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
}

/* One decode step of P requests (one query token each) over the paged cache
   [blocks, bs, 2, Hkv, D] (K then V per slot). Row p of `qkv` (stride `qs` floats) holds
   the request's q (Hq*D) then its new K|V (2*Hkv*D), which is first written into slot
   slots[p]. Query head hq (KV head hq / (Hq / Hkv)) then attends to keys [start,
   num_keys[p]) found through table[p] (nblk blocks), start = num_keys - window when
   window > 0. Two-pass softmax in fp32. out: [P, Hq, D]. */
int sluice_attn_decode(const float *qkv, int64_t qs, float *cache, const int64_t *slots,
                       const int64_t *table, int64_t nblk, const int64_t *num_keys,
                       int64_t window, int64_t P, int64_t Hq, int64_t Hkv, int64_t D,
                       int64_t bs, float scale, float *out, int threads) {
    const int64_t row = 2 * Hkv * D;
    for (int64_t p = 0; p < P; p++) {
        float *dst = cache + slots[p] * row;
        const float *src = qkv + p * qs + Hq * D;
        for (int64_t i = 0; i < row; i++) dst[i] = src[i];
    }
    int64_t maxk = 0;
    for (int64_t p = 0; p < P; p++) maxk = num_keys[p] > maxk ? num_keys[p] : maxk;
    if (maxk > nblk * bs) return -1;
    const int64_t G = Hq / Hkv;
    int bad = 0;
    #pragma omp parallel for num_threads(threads) schedule(static) reduction(| : bad)
    for (int64_t task = 0; task < P * Hq; task++) {
        const int64_t p = task / Hq, hq = task % Hq, kvh = hq / G;
        const int64_t end = num_keys[p];
        const int64_t start = window > 0 && end > window ? end - window : 0;
        const float *qv = qkv + p * qs + hq * D;
        float *o = out + (p * Hq + hq) * D;
        float *s = malloc((size_t)(end - start + 1) * sizeof(float));
        if (!s) { bad = 1; continue; }
        float mx = -INFINITY;
        for (int64_t j = start; j < end; j++) {
            const float *k = cache + (table[p * nblk + j / bs] * bs + j % bs) * row + kvh * D;
            float v = dot(qv, k, D) * scale;
            s[j - start] = v;
            mx = v > mx ? v : mx;
        }
        float sum = 0.0f;
        for (int64_t j = start; j < end; j++) sum += (s[j - start] = expf(s[j - start] - mx));
        for (int64_t d = 0; d < D; d++) o[d] = 0.0f;
        for (int64_t j = start; j < end; j++) {
            const float *v = cache + (table[p * nblk + j / bs] * bs + j % bs) * row + (Hkv + kvh) * D;
            const float w = s[j - start] / sum;
            for (int64_t d = 0; d < D; d++) o[d] += w * v[d];
        }
        free(s);
    }
    return bad ? -2 : 0;
}
