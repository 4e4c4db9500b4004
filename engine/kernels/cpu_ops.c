/* CPU kernels for small-batch decode on AVX2 + FMA, loaded with ctypes by
   engine/kernels/bindings.py (which documents each entry point's contract and checks
   every tensor's dtype, shape and layout before a call).

   sluice_bf16_linear: y = x @ W^T (+ bias) (or y +=) for bf16 W [N, K], fp32 x [M, K], M <= 4.
   sluice_int8_linear: the same for int8 W with a scale per row (its own section below).
   sluice_q_linear: the same for W in 4- or 8-bit blocks of 32, any M (its own section).
   sluice_lora_add: y += each row's LoRA adapter delta, by the row's slot (its own section,
   also run inside sluice_decode_layers).

   The small-batch decode GEMVs of a bf16 model on a CPU without native bf16 (AVX2 only):
   each bf16 weight is widened to fp32 exactly (bf16 is the top half of an fp32) and
   accumulated in fp32, so W is streamed once per call for all M rows. Output rows are
   shared out in chunks by `parallel_for` (below). Built and loaded by
   engine/kernels/build.py.

   M == 1 with K % 16 == 0 (every real model) takes the fast path: 16 weights per 256-bit
   load, widened by interleaving with zeros (one unpack per 8 weights instead of a widen
   and a shift), against a copy of x permuted to the same in-lane order, four rows at a
   time with the next four rows prefetched: faster than the generic path at streaming a
   model's projections from DRAM.

   With `round_x` (the model computes in bf16: its matmul inputs are bf16, as in torch's
   bf16 path) x is first rounded to bf16; on a CPU with AVX512-BF16 the dot products then
   run as VDPBF16PS on 32 weights (one cache line) per instruction, exact bf16 products
   accumulated in fp32: as fast as oneDNN's prepacked bf16 GEMV, and faster than the
   widening path (`sluice bench engine` measures both). */
#include <immintrin.h>
#include <linux/futex.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

/* What the entry points that can fail return; engine/kernels/checks.py (ERRORS) maps each
   to its message. The ids read from the caller's tensors (block ids, slots, request rows,
   positions) are checked against the sizes passed in before anything is written, once a
   row or a block rather than once a key, so a bad id raises instead of corrupting memory. */
enum {
    SLUICE_OK = 0,
    SLUICE_E_ARGS = -1,    /* a row count, mode or shape the kernel does not take */
    SLUICE_E_NOMEM = -2,   /* a scratch allocation failed */
    SLUICE_E_KEYS = -3,    /* a row's key count below 1 or past its block table row */
    SLUICE_E_BLOCK = -4,   /* a block id (of a block holding a row's keys) outside the cache */
    SLUICE_E_SLOT = -5,    /* a slot to write outside the cache */
    SLUICE_E_REQUEST = -6, /* a row's request outside the block table's rows */
    SLUICE_E_POS = -7,     /* a position outside the RoPE table */
    SLUICE_E_ADAPTER = -8, /* a row's adapter slot outside the slots */
};

/* unsigned compares: a negative id is out of range too */
static inline int in_range(int64_t v, int64_t n) { return (uint64_t)v < (uint64_t)n; }

static inline int64_t key_start(int64_t end, int64_t window) {
    return window > 0 && end > window ? end - window : 0;
}

/* The ids of the blocks holding keys [start, end) (end >= 1) of one block table row, once a
   block: the attention loops then index the cache with them unchecked. */
static int blocks_ok(const int64_t *row, int64_t start, int64_t end, int64_t bs, int64_t blocks) {
    for (int64_t b = start / bs; b <= (end - 1) / bs; b++)
        if (!in_range(row[b], blocks)) return 0;
    return 1;
}

static int positions_ok(const int64_t *pos, int64_t M, int64_t positions) {
    for (int64_t m = 0; m < M; m++)
        if (!in_range(pos[m], positions)) return 0;
    return 1;
}

/* ---- parallel_for: work sharing that never waits for a thread that has not started ----

   An OpenMP region ends in a barrier: when another process holds a core, every barrier
   waits out a scheduler slice, so a busy neighbour process can make a multi-threaded
   decode step many times slower than a single-threaded one. Here the caller and up to MAX_HELPERS persistent helper
   threads claim chunks from one atomic ticket; the caller runs every chunk nobody else
   claimed and then waits only for chunks a helper is running (a few µs each). A helper
   that is not on a core claims nothing and costs nothing.

   The ticket is (generation << 32) | next chunk. A job's fields live in jobs[gen & 1] and
   are written before its generation is published (release); a helper claims a chunk
   with a CAS that also checks the generation, so it never runs a chunk of a job whose
   fields it might have read torn (the slot is rewritten only two generations later).
   Helpers spin for SPIN_NS after their last chunk, then sleep on a futex. */
#define MAX_HELPERS 15
#define SPIN_NS 200000

typedef void (*chunk_fn)(void *ctx, int64_t chunk);
typedef struct {
    chunk_fn fn;
    void *ctx;
    int64_t n;
    atomic_long done;
} job_t;

static job_t jobs[2];
static _Atomic uint64_t ticket;
static atomic_int sleepers, wake_word, helpers_started;
static pthread_mutex_t start_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_mutex_t caller_lock = PTHREAD_MUTEX_INITIALIZER; /* one job at a time */
static uint32_t generation;

static inline int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

/* claim and run chunks of generation g until none are left or a newer job is published */
static void help(uint32_t g) {
    job_t *job = &jobs[g & 1];
    const int64_t n = job->n;
    chunk_fn fn = job->fn;
    void *ctx = job->ctx;
    uint64_t t = atomic_load_explicit(&ticket, memory_order_acquire);
    while ((uint32_t)(t >> 32) == g && (int64_t)(t & 0xffffffffu) < n) {
        if (atomic_compare_exchange_weak(&ticket, &t, t + 1)) {
            fn(ctx, (int64_t)(t & 0xffffffffu));
            atomic_fetch_add_explicit(&job->done, 1, memory_order_release);
            t = atomic_load_explicit(&ticket, memory_order_acquire);
        }
    }
}

static void *helper_main(void *arg) {
    (void)arg;
    uint32_t seen = (uint32_t)(atomic_load(&ticket) >> 32);
    for (;;) {
        int64_t idle_since = now_ns();
        uint32_t g;
        while ((g = (uint32_t)(atomic_load_explicit(&ticket, memory_order_acquire) >> 32)) == seen) {
            if (now_ns() - idle_since < SPIN_NS) {
                _mm_pause();
                continue;
            }
            int w = atomic_load(&wake_word);
            atomic_fetch_add(&sleepers, 1);
            if ((uint32_t)(atomic_load(&ticket) >> 32) == seen)
                syscall(SYS_futex, &wake_word, FUTEX_WAIT_PRIVATE, w, NULL, NULL, 0);
            atomic_fetch_sub(&sleepers, 1);
            idle_since = now_ns();
        }
        help(g);
        seen = g;
    }
    return NULL;
}

static void start_helpers(int want) {
    pthread_mutex_lock(&start_lock);
    while (atomic_load(&helpers_started) < want) {
        pthread_t th;
        if (pthread_create(&th, NULL, helper_main, NULL) != 0) break;
        pthread_detach(th);
        atomic_fetch_add(&helpers_started, 1);
    }
    pthread_mutex_unlock(&start_lock);
}

/* fn(ctx, c) for c in [0, n), on the calling thread and up to threads - 1 helpers */
static void parallel_for(chunk_fn fn, void *ctx, int64_t n, int threads) {
    if (threads <= 1 || n <= 1 || pthread_mutex_trylock(&caller_lock) != 0) {
        for (int64_t c = 0; c < n; c++) fn(ctx, c);  /* alone, or another caller is sharing */
        return;
    }
    int want = threads - 1 < MAX_HELPERS ? threads - 1 : MAX_HELPERS;
    if (atomic_load(&helpers_started) < want) start_helpers(want);
    uint32_t g = ++generation;
    job_t *job = &jobs[g & 1];
    job->fn = fn;
    job->ctx = ctx;
    job->n = n;
    atomic_store_explicit(&job->done, 0, memory_order_relaxed);
    atomic_store(&ticket, (uint64_t)g << 32); /* seq_cst: publishes the job, then sleepers */
    if (atomic_load(&sleepers) > 0) {
        atomic_fetch_add(&wake_word, 1);
        syscall(SYS_futex, &wake_word, FUTEX_WAKE_PRIVATE, MAX_HELPERS, NULL, NULL, 0);
    }
    for (;;) {
        uint64_t t = atomic_fetch_add(&ticket, 1);
        int64_t c = (int64_t)(t & 0xffffffffu);
        if (c >= n) break;
        fn(ctx, c);
        atomic_fetch_add_explicit(&job->done, 1, memory_order_release);
    }
    while (atomic_load_explicit(&job->done, memory_order_acquire) < n) _mm_pause();
    pthread_mutex_unlock(&caller_lock);
}

static inline __m256 widen8(const uint16_t *p) {
    __m128i v = _mm_loadu_si128((const __m128i *)p);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
}

static inline float widen1(uint16_t b) {
    union { uint32_t u; float f; } c = {(uint32_t)b << 16};
    return c.f;
}

/* fp32 -> bf16, round to nearest even (what torch's .to(torch.bfloat16) does; NaN aside) */
static inline uint16_t round_bf16(float f) {
    union { float f; uint32_t u; } c = {f};
    return (uint16_t)((c.u + 0x7fffu + ((c.u >> 16) & 1u)) >> 16);
}

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline float hmax(__m256 v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
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

/* VDPBF16PS path: rows [n0, n1) of W against M rows of bf16 x (each Kp = K rounded up to
   32 values, zero padded), a last partial 32-block masked. */
#define DP_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))

/* One row of W at a time, its values in order: a single forward stream, which the
   hardware prefetcher follows (rows read side by side, 1 KB apart, stream at about half
   the rate from DRAM); two accumulators per x
   row halve the VDPBF16PS latency chain */
DP_TARGET static inline void rows_dp(const uint16_t *W, const uint16_t *xb,
                                         const float *bias, float *y, int64_t n0, int64_t n1,
                                         int64_t N, int64_t K, const int M, int acc) {
    const int64_t Kp = (K + 31) & ~(int64_t)31, K64 = K & ~(int64_t)63;
    for (int64_t n = n0; n < n1; n++) {
        const uint16_t *w = W + n * K;
        __m512 a[4], b[4];
        for (int m = 0; m < M; m++) a[m] = b[m] = _mm512_setzero_ps();
        int64_t k = 0;
        for (; k < K64; k += 64) {
            __m512bh v0 = (__m512bh)_mm512_loadu_si512(w + k);
            __m512bh v1 = (__m512bh)_mm512_loadu_si512(w + k + 32);
            for (int m = 0; m < M; m++) {
                a[m] = _mm512_dpbf16_ps(a[m], v0, (__m512bh)_mm512_loadu_si512(xb + m * Kp + k));
                b[m] = _mm512_dpbf16_ps(b[m], v1,
                                        (__m512bh)_mm512_loadu_si512(xb + m * Kp + k + 32));
            }
        }
        for (; k < K; k += 32) {
            __mmask32 mk = k + 32 <= K ? (__mmask32)~0u : (__mmask32)((1ull << (K % 32)) - 1);
            __m512bh v = (__m512bh)_mm512_maskz_loadu_epi16(mk, w + k);
            for (int m = 0; m < M; m++)
                a[m] = _mm512_dpbf16_ps(a[m], v, (__m512bh)_mm512_loadu_si512(xb + m * Kp + k));
        }
        for (int m = 0; m < M; m++)
            STORE(y[m * N + n], _mm512_reduce_add_ps(_mm512_add_ps(a[m], b[m])) +
                                    (bias ? bias[n] : 0.0f));
    }
}

DP_TARGET static void linear_dp(const uint16_t *W, const uint16_t *xb, const float *bias,
                                float *y, int64_t n0, int64_t n1, int64_t N, int64_t K, int64_t M,
                                int acc) {
    switch (M) {
        case 1: rows_dp(W, xb, bias, y, n0, n1, N, K, 1, acc); break;
        case 2: rows_dp(W, xb, bias, y, n0, n1, N, K, 2, acc); break;
        case 3: rows_dp(W, xb, bias, y, n0, n1, N, K, 3, acc); break;
        default: rows_dp(W, xb, bias, y, n0, n1, N, K, 4, acc); break;
    }
}

typedef struct {
    const uint16_t *W;
    const float *x, *xp;
    const uint16_t *xb;
    const float *bias;
    float *y;
    int64_t M, N, K;
    int acc;
    int64_t rows; /* per chunk, a multiple of 16 */
} linear_job;

static void linear_chunk(void *ctx, int64_t c) {
    const linear_job *j = ctx;
    const int64_t n0 = c * j->rows, n1 = n0 + j->rows < j->N ? n0 + j->rows : j->N;
    if (j->xb) {
        linear_dp(j->W, j->xb, j->bias, j->y, n0, n1, j->N, j->K, j->M, j->acc);
    } else if (j->xp) {
        gemv_rows(j->W, j->xp, j->x, j->bias, j->y, n0, n1, j->K, j->acc);
    } else {
        switch (j->M) {
            case 1: rows(j->W, j->x, j->bias, j->y, n0, n1, j->N, j->K, 1, j->acc); break;
            case 2: rows(j->W, j->x, j->bias, j->y, n0, n1, j->N, j->K, 2, j->acc); break;
            case 3: rows(j->W, j->x, j->bias, j->y, n0, n1, j->N, j->K, 3, j->acc); break;
            default: rows(j->W, j->x, j->bias, j->y, n0, n1, j->N, j->K, 4, j->acc); break;
        }
    }
}

/* mode 0: exact fp32 x, widened weights (AVX2). mode 1: x rounded to bf16 first, dot
   products by VDPBF16PS. mode 2: x rounded to bf16, then the widening path (the same
   values as mode 1 on a CPU without AVX512-BF16). */
int sluice_bf16_linear(const uint16_t *W, const float *x, const float *bias, float *y,
                       int64_t M, int64_t N, int64_t K, int threads, int acc, int mode) {
    if (M < 1 || M > 4 || threads < 1 || mode < 0 || mode > 2) return SLUICE_E_ARGS;
    const int64_t Kp = (K + 31) & ~(int64_t)31;
    float *xp = NULL, *xr = NULL;
    uint16_t *xb = NULL;
    if (mode == 1) {
        xb = calloc(M * Kp, sizeof(uint16_t));
        if (!xb) return SLUICE_E_NOMEM;
        for (int64_t m = 0; m < M; m++)
            for (int64_t k = 0; k < K; k++) xb[m * Kp + k] = round_bf16(x[m * K + k]);
    } else if (mode == 2) {
        xr = malloc(M * K * sizeof(float));
        if (!xr) return SLUICE_E_NOMEM;
        for (int64_t i = 0; i < M * K; i++) xr[i] = widen1(round_bf16(x[i]));
        x = xr;
    }
    if (mode != 1 && M == 1 && K % 16 == 0) {
        xp = malloc(K * sizeof(float));
        if (!xp) { free(xr); return SLUICE_E_NOMEM; }
        for (int64_t k = 0; k < K; k += 16)
            for (int i = 0; i < 4; i++) {
                xp[k + i] = x[k + i];
                xp[k + 4 + i] = x[k + 8 + i];
                xp[k + 8 + i] = x[k + 4 + i];
                xp[k + 12 + i] = x[k + 12 + i];
            }
    }
    linear_job job = {W, x, xp, xb, bias, y, M, N, K, acc, 16};
    /* chunks of about 64 KB of weights (~3 µs from DRAM), whole 16-row units */
    while (job.rows < N && job.rows * K * 2 < 65536) job.rows += 16;
    parallel_for(linear_chunk, &job, (N + job.rows - 1) / job.rows, threads);
    free(xp);
    free(xr);
    free(xb);
    return 0;
}

/* ---- sluice_int8_linear: y = (x @ Wq^T) * scale (+ bias) (or y +=) for int8 Wq [N, K],
   one fp32 scale per output row, fp32 x [M, K], M <= 4 ----

   The small-batch decode GEMVs of an int8 weight-only model (engine/quantization.py), W
   streamed once per call at 1 byte a weight. Each x row is quantized to int16 with one
   scale (its absmax / 32767: finer than the bf16 activations of the torch path, rounded
   to 2^-9 relative), weights are sign-extended to int16, and VPMADDWD makes 16 exact
   products per instruction, summed in int32. The int32 sums move to fp32 every FLUSH_K
   inputs: each lane gains at most 2 * 32767 * 127 per VPMADDWD, below 2^31 for 2,048
   inputs (128 instructions). */
#define FLUSH_K 2048
#define I8_MAX_R 4

#define INLINE static inline __attribute__((always_inline)) /* M, R constant inside */

/* y rows n .. n+R-1 (of every x row) */
INLINE void group_i8(const int8_t *W, const int16_t *xq, int64_t Kp, const float *xs,
                     const float *scale, const float *bias, float *y, int64_t n, int64_t N,
                     int64_t K, const int M, const int R, int acc) {
    const int64_t K16 = K & ~(int64_t)15;
    const int8_t *w[I8_MAX_R];
    for (int r = 0; r < R; r++) w[r] = W + (n + r) * K;
    __m256 f[4][I8_MAX_R];
    for (int m = 0; m < M; m++)
        for (int r = 0; r < R; r++) f[m][r] = _mm256_setzero_ps();
    for (int64_t k0 = 0; k0 < K16; k0 += FLUSH_K) {
        const int64_t k1 = k0 + FLUSH_K < K16 ? k0 + FLUSH_K : K16;
        __m256i a[4][I8_MAX_R];
        for (int m = 0; m < M; m++)
            for (int r = 0; r < R; r++) a[m][r] = _mm256_setzero_si256();
        for (int64_t k = k0; k < k1; k += 16) {
            __m256i wv[I8_MAX_R];
            if ((k & 63) == 0) /* the next group's rows, a cache line at a time */
                for (int r = 0; r < R; r++) _mm_prefetch((const char *)(w[r] + R * K + k), _MM_HINT_T0);
            for (int r = 0; r < R; r++)
                wv[r] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(w[r] + k)));
            for (int m = 0; m < M; m++) {
                __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + m * Kp + k));
                for (int r = 0; r < R; r++)
                    a[m][r] = _mm256_add_epi32(a[m][r], _mm256_madd_epi16(wv[r], xv));
            }
        }
        for (int m = 0; m < M; m++)
            for (int r = 0; r < R; r++)
                f[m][r] = _mm256_add_ps(f[m][r], _mm256_cvtepi32_ps(a[m][r]));
    }
    for (int m = 0; m < M; m++)
        for (int r = 0; r < R; r++) {
            float s = hsum(f[m][r]);
            for (int64_t k = K16; k < K; k++) s += (float)w[r][k] * (float)xq[m * Kp + k];
            STORE(y[m * N + n + r], s * xs[m] * scale[n + r] + (bias ? bias[n + r] : 0.0f));
        }
}

/* rows [n0, n1): R rows of W at a time (sharing each x load), the rest one by one; M and
   R are constants at each call site so the loops over them unroll */
INLINE void rows_i8(const int8_t *W, const int16_t *xq, int64_t Kp, const float *xs,
                    const float *scale, const float *bias, float *y, int64_t n0, int64_t n1,
                    int64_t N, int64_t K, const int M, const int R, int acc) {
    int64_t n = n0;
    for (; n + R <= n1; n += R) group_i8(W, xq, Kp, xs, scale, bias, y, n, N, K, M, R, acc);
    for (; n < n1; n++) group_i8(W, xq, Kp, xs, scale, bias, y, n, N, K, M, 1, acc);
}

typedef struct {
    const int8_t *W;
    const int16_t *xq;
    const float *xs, *scale, *bias;
    float *y;
    int64_t M, N, K, Kp;
    int acc;
    int64_t rows; /* per chunk */
} int8_job;

static void int8_chunk(void *ctx, int64_t c) {
    const int8_job *j = ctx;
    const int64_t n0 = c * j->rows, n1 = n0 + j->rows < j->N ? n0 + j->rows : j->N;
#define I8_ROWS(M, R) rows_i8(j->W, j->xq, j->Kp, j->xs, j->scale, j->bias, j->y, n0, n1, \
                              j->N, j->K, M, R, j->acc)
    /* R = 1: one W row at a time, a single forward stream the hardware prefetcher follows
       (2 or 4 rows side by side stream slower from DRAM) */
    switch (j->M) {
        case 1: I8_ROWS(1, 1); break;
        case 2: I8_ROWS(2, 1); break;
        case 3: I8_ROWS(3, 1); break;
        default: I8_ROWS(4, 1); break;
    }
#undef I8_ROWS
}

/* q = round(x / scale) with scale = absmax(x) / 32767 (0 for a zero row); returns scale */
static float quantize_i16(const float *x, int64_t K, int16_t *q) {
    const int64_t K16 = K & ~(int64_t)15;
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 vmax = _mm256_setzero_ps();
    for (int64_t k = 0; k < K16; k += 8)
        vmax = _mm256_max_ps(vmax, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + k)));
    float amax = hmax(vmax);
    for (int64_t k = K16; k < K; k++) amax = fmaxf(amax, fabsf(x[k]));
    const float inv = amax > 0.0f ? 32767.0f / amax : 0.0f;
    const __m256 vinv = _mm256_set1_ps(inv);
    for (int64_t k = 0; k < K16; k += 16) {
        /* round to nearest even (MXCSR default); packs saturates at 32767 */
        __m256i a = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + k), vinv));
        __m256i b = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + k + 8), vinv));
        __m256i p = _mm256_permute4x64_epi64(_mm256_packs_epi32(a, b), 0xD8);
        _mm256_storeu_si256((__m256i *)(q + k), p);
    }
    for (int64_t k = K16; k < K; k++)
        q[k] = (int16_t)fminf(fmaxf(nearbyintf(x[k] * inv), -32767.0f), 32767.0f);
    return amax / 32767.0f;
}

int sluice_int8_linear(const int8_t *W, const float *scale, const float *x, const float *bias,
                       float *y, int64_t M, int64_t N, int64_t K, int threads, int acc) {
    if (M < 1 || M > 4 || threads < 1) return SLUICE_E_ARGS;
    const int64_t Kp = (K + 15) & ~(int64_t)15;
    int16_t *xq = calloc(M * Kp, sizeof(int16_t));
    if (!xq) return SLUICE_E_NOMEM;
    float xs[4];
    for (int64_t m = 0; m < M; m++) xs[m] = quantize_i16(x + m * K, K, xq + m * Kp);
    int8_job job = {W, xq, xs, scale, bias, y, M, N, K, Kp, acc, 16};
    /* chunks of about 64 KB of weights, whole 16-row units */
    while (job.rows < N && job.rows * K < 65536) job.rows += 16;
    parallel_for(int8_chunk, &job, (N + job.rows - 1) / job.rows, threads);
    free(xq);
    return 0;
}

/* ---- sluice_q_linear: y = x @ W^T (+ bias) (or y +=) for block-quantized W [N, K],
   x [M, K] fp32 or bf16, y fp32 or bf16 (rounded once, after any accumulation), any M,
   K a multiple of 32 ----

   The projections of a GGUF model kept in its quantized blocks (engine/block_quant.py):
   each W row is K/32 blocks of 32 weights, `bits` 4 (q4_block: w = d * q + m, q 0..15,
   two to a byte: byte j holds weight j low and j + 16 high, as GGML's Q4_0/Q4_1) or 8
   (q8_block: w = d * q, q signed). Each x row is quantized once a call to int8 per
   32-block (one scale, as llama.cpp's q8 activations), so a block's dot product is 32
   exact u8 x s8 products summed in int32: VPDPBUSD (AVX512-VNNI) or VPMADDUBSW +
   VPMADDWD (AVX2; 4-bit pairs reach 2 * 15 * 127 and 8-bit ones, taken as |w| and x
   signed by w, 2 * 128 * 127, both below int16 saturation). The min term of a 4-bit
   block is m * sum(x): the x block's sum times its scale, computed once a call.
   Output rows are shared out in chunks of about 64 KB of blocks; inside a chunk each
   unpacked weight block serves up to 4 x rows, so many rows (a batch, a prefill) reuse
   the chunk from cache instead of streaming W once per row. */
#define QK 32
#define Q_MAX_MT 4

typedef struct {
    float d, m;
    uint8_t q[QK / 2];
} q4_block;

typedef struct {
    float d;
    int8_t q[QK];
} q8_block;

#define VNNI_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni")))

typedef __m256i (*dot32_fn)(__m256i w, __m256i x); /* 8 int32 sums of 32 u8 x s8 products */

static inline __m256i dot32_avx2(__m256i w, __m256i x) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1));
}

VNNI_TARGET static inline __m256i dot32_vnni(__m256i w, __m256i x) {
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), w, x);
}

static inline __m256i unpack_q4(const uint8_t *q) {
    const __m128i raw = _mm_loadu_si128((const __m128i *)q), low = _mm_set1_epi8(15);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(raw, 4), low), _mm_and_si128(raw, low));
}

typedef struct {
    const uint8_t *W;
    const int8_t *xq;
    const float *xd, *xm, *bias; /* xd: x block scales [M, nb]; xm: xd * block sum */
    void *y;                     /* fp32, or bf16 with y_bf16 */
    int64_t M, N, K, nb, rows;   /* rows: output rows a chunk */
    int bits, acc, y_bf16;
} q_job;

/* s[m] = dot of W row n with x rows m0 .. m0+MT-1; two accumulators a row (even and odd
   blocks) so consecutive FMAs do not wait on each other */
INLINE void q_row(const q_job *j, int64_t n, int64_t m0, float *s, const int MT,
                  const int bits, dot32_fn dot) {
    const int64_t nb = j->nb, K = j->K;
    const size_t bsz = bits == 4 ? sizeof(q4_block) : sizeof(q8_block);
    const uint8_t *row = j->W + n * nb * bsz;
    const int8_t *xq = j->xq + m0 * K;
    const float *xd = j->xd + m0 * nb, *xm = j->xm + m0 * nb;
    __m256 acc[2][Q_MAX_MT];
    float macc[Q_MAX_MT];
    for (int m = 0; m < MT; m++) {
        acc[0][m] = acc[1][m] = _mm256_setzero_ps();
        macc[m] = 0.0f;
    }
    for (int64_t b = 0; b < nb; b++) {
        const int u = (int)(b & 1);
        if (bits == 4) {
            const q4_block *blk = (const q4_block *)(row + b * bsz);
            const __m256i wv = unpack_q4(blk->q);
            for (int m = 0; m < MT; m++) {
                const __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + m * K + b * QK));
                const __m256 p = _mm256_cvtepi32_ps(dot(wv, xv));
                acc[u][m] = _mm256_fmadd_ps(p, _mm256_set1_ps(blk->d * xd[m * nb + b]), acc[u][m]);
                macc[m] += blk->m * xm[m * nb + b];
            }
        } else {
            const q8_block *blk = (const q8_block *)(row + b * bsz);
            const __m256i wv = _mm256_loadu_si256((const __m256i *)blk->q);
            const __m256i wa = _mm256_sign_epi8(wv, wv);
            for (int m = 0; m < MT; m++) {
                const __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + m * K + b * QK));
                const __m256 p = _mm256_cvtepi32_ps(dot(wa, _mm256_sign_epi8(xv, wv)));
                acc[u][m] = _mm256_fmadd_ps(p, _mm256_set1_ps(blk->d * xd[m * nb + b]), acc[u][m]);
            }
        }
    }
    for (int m = 0; m < MT; m++) s[m] = hsum(_mm256_add_ps(acc[0][m], acc[1][m])) + macc[m];
}

INLINE void q_rows(const q_job *j, int64_t n0, int64_t n1, int64_t m0, const int MT,
                   const int bits, dot32_fn dot) {
    const int acc = j->acc;
    for (int64_t n = n0; n < n1; n++) {
        float s[Q_MAX_MT];
        q_row(j, n, m0, s, MT, bits, dot);
        const float b = j->bias ? j->bias[n] : 0.0f;
        for (int m = 0; m < MT; m++) {
            const int64_t i = (m0 + m) * j->N + n;
            if (j->y_bf16) {
                uint16_t *y = j->y;
                y[i] = round_bf16(s[m] + b + (acc ? widen1(y[i]) : 0.0f));
            } else {
                float *y = j->y;
                STORE(y[i], s[m] + b);
            }
        }
    }
}

/* MT and bits constant at each call site, so q_row's loops unroll */
#define Q_DISPATCH(DOT)                                                               \
    switch (mt * 16 + j->bits) {                                                      \
        case 16 + 4: q_rows(j, n0, n1, m0, 1, 4, DOT); break;                        \
        case 32 + 4: q_rows(j, n0, n1, m0, 2, 4, DOT); break;                        \
        case 48 + 4: q_rows(j, n0, n1, m0, 3, 4, DOT); break;                        \
        case 64 + 4: q_rows(j, n0, n1, m0, 4, 4, DOT); break;                        \
        case 16 + 8: q_rows(j, n0, n1, m0, 1, 8, DOT); break;                        \
        case 32 + 8: q_rows(j, n0, n1, m0, 2, 8, DOT); break;                        \
        case 48 + 8: q_rows(j, n0, n1, m0, 3, 8, DOT); break;                        \
        default: q_rows(j, n0, n1, m0, 4, 8, DOT); break;                            \
    }

VNNI_TARGET static void q_rows_vnni(const q_job *j, int64_t n0, int64_t n1, int64_t m0, int mt) {
    Q_DISPATCH(dot32_vnni)
}

static void q_rows_avx2(const q_job *j, int64_t n0, int64_t n1, int64_t m0, int mt) {
    Q_DISPATCH(dot32_avx2)
}
#undef Q_DISPATCH

static void q_chunk_vnni(void *ctx, int64_t c) {
    const q_job *j = ctx;
    const int64_t n0 = c * j->rows, n1 = n0 + j->rows < j->N ? n0 + j->rows : j->N;
    for (int64_t m0 = 0; m0 < j->M; m0 += Q_MAX_MT)
        q_rows_vnni(j, n0, n1, m0, (int)(j->M - m0 < Q_MAX_MT ? j->M - m0 : Q_MAX_MT));
}

static void q_chunk_avx2(void *ctx, int64_t c) {
    const q_job *j = ctx;
    const int64_t n0 = c * j->rows, n1 = n0 + j->rows < j->N ? n0 + j->rows : j->N;
    for (int64_t m0 = 0; m0 < j->M; m0 += Q_MAX_MT)
        q_rows_avx2(j, n0, n1, m0, (int)(j->M - m0 < Q_MAX_MT ? j->M - m0 : Q_MAX_MT));
}

static inline __m256 load8(const void *x, int64_t i, int bf16) {
    return bf16 ? widen8((const uint16_t *)x + i) : _mm256_loadu_ps((const float *)x + i);
}

/* x rows (fp32, or bf16 with x_bf16) -> int8 blocks: q = round(x / d), d = absmax / 127
   per 32 (0 for a zero block); xm = d * sum(q), the factor of a 4-bit block's min */
static void quantize_q8_rows(const void *x, int x_bf16, int64_t M, int64_t K, int8_t *xq,
                             float *xd, float *xm) {
    const int64_t nb = K / QK;
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int64_t i = 0; i < M * nb; i++) {
        __m256 v[4], vmax = _mm256_setzero_ps();
        for (int k = 0; k < 4; k++) {
            v[k] = load8(x, i * QK + 8 * k, x_bf16);
            vmax = _mm256_max_ps(vmax, _mm256_andnot_ps(sign, v[k]));
        }
        const float amax = hmax(vmax);
        const __m256 inv = _mm256_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
        __m256i q[4];
        for (int k = 0; k < 4; k++) q[k] = _mm256_cvtps_epi32(_mm256_mul_ps(v[k], inv));
        const __m256i sum = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
        const __m256i p16 = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]),
                                               _mm256_packs_epi32(q[2], q[3]));
        _mm256_storeu_si256((__m256i *)(xq + i * QK), _mm256_permutevar8x32_epi32(p16, order));
        xd[i] = amax / 127.0f;
        xm[i] = xd[i] * hsum(_mm256_cvtepi32_ps(sum));
    }
}

int sluice_q_linear(const uint8_t *W, int bits, const void *x, const float *bias, void *y,
                    int64_t M, int64_t N, int64_t K, int threads, int acc, int vnni,
                    int x_bf16, int y_bf16) {
    if (M < 1 || K < QK || K % QK || (bits != 4 && bits != 8) || threads < 1)
        return SLUICE_E_ARGS;
    const int64_t nb = K / QK;
    int8_t *xq = malloc((size_t)(M * K + 2 * M * nb * sizeof(float)));
    if (!xq) return SLUICE_E_NOMEM;
    float *xd = (float *)(xq + M * K), *xm = xd + M * nb;  /* K % 32 == 0: aligned */
    quantize_q8_rows(x, x_bf16, M, K, xq, xd, xm);
    q_job job = {W, xq, xd, xm, bias, y, M, N, K, nb, 16, bits, acc, y_bf16};
    const int64_t row_bytes = nb * (bits == 4 ? sizeof(q4_block) : sizeof(q8_block));
    while (job.rows < N && job.rows * row_bytes < 65536) job.rows += 16;
    parallel_for(vnni ? q_chunk_vnni : q_chunk_avx2, &job, (N + job.rows - 1) / job.rows, threads);
    free(xq);
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
static void rope_rows(float *x, int64_t stride, int64_t M, const float *table,
                      const int64_t *pos, int64_t heads, int64_t half) {
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

/* rope_rows, each pos[m] checked against the table's `positions` first */
int sluice_rope(float *x, int64_t stride, int64_t M, const float *table, const int64_t *pos,
                int64_t positions, int64_t heads, int64_t half) {
    if (!positions_ok(pos, M, positions)) return SLUICE_E_POS;
    rope_rows(x, stride, M, table, pos, heads, half);
    return SLUICE_OK;
}

/* out[m, i] = silu(gu[m, i]) * gu[m, I + i]. */
void sluice_silu_mul(const float *gu, float *out, int64_t M, int64_t I) {
    for (int64_t m = 0; m < M; m++) {
        const float *g = gu + m * 2 * I, *u = g + I;
        for (int64_t i = 0; i < I; i++) out[m * I + i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
}

static inline float dot_bf16(const float *a, const uint16_t *b, int64_t n) {
    int64_t n8 = n & ~(int64_t)7, i = 0;
    __m256 s = _mm256_setzero_ps();
    for (; i < n8; i += 8) s = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), widen8(b + i), s);
    float t = hsum(s);
    for (; i < n; i++) t += a[i] * widen1(b[i]);
    return t;
}

/* o += w * v for fp32 or bf16 v */
static inline void axpy(float *o, float w, const void *v, int64_t n, int bf16) {
    int64_t n8 = n & ~(int64_t)7, i = 0;
    const __m256 wv = _mm256_set1_ps(w);
    if (bf16) {
        const uint16_t *b = v;
        for (; i < n8; i += 8)
            _mm256_storeu_ps(o + i, _mm256_fmadd_ps(wv, widen8(b + i), _mm256_loadu_ps(o + i)));
        for (; i < n; i++) o[i] += w * widen1(b[i]);
    } else {
        const float *f = v;
        for (; i < n8; i += 8)
            _mm256_storeu_ps(o + i, _mm256_fmadd_ps(wv, _mm256_loadu_ps(f + i), _mm256_loadu_ps(o + i)));
        for (; i < n; i++) o[i] += w * f[i];
    }
}

typedef struct {
    const float *qkv;
    int64_t qs;
    const void *cache;
    const int64_t *table;
    int64_t nblk;
    const int64_t *num_keys;
    int64_t window, Hq, Hkv, D, bs;
    float scale;
    float *out;
    int cache_bf16;
    atomic_int bad;
} attn_job;

/* one (request, query head) of sluice_attn_decode */
static void attn_chunk(void *ctx, int64_t task) {
    attn_job *a = ctx;
    const int64_t Hq = a->Hq, Hkv = a->Hkv, D = a->D, bs = a->bs, nblk = a->nblk;
    const int64_t row = 2 * Hkv * D, G = Hq / Hkv;
    const int64_t p = task / Hq, hq = task % Hq, kvh = hq / G;
    const int64_t end = a->num_keys[p];
    const int64_t start = a->window > 0 && end > a->window ? end - a->window : 0;
    const float *qv = a->qkv + p * a->qs + hq * D;
    const int64_t *table = a->table;
    const size_t esize = a->cache_bf16 ? 2 : 4;
    float *o = a->out + (p * Hq + hq) * D;
    float *s = malloc((size_t)(end - start + 1) * sizeof(float));
    if (!s) {
        atomic_store(&a->bad, 1);
        return;
    }
    float mx = -INFINITY;
    for (int64_t j = start; j < end; j++) {
        const int64_t off = (table[p * nblk + j / bs] * bs + j % bs) * row + kvh * D;
        const char *k = (const char *)a->cache + off * esize;
        float v = (a->cache_bf16 ? dot_bf16(qv, (const uint16_t *)k, D)
                                 : dot(qv, (const float *)k, D)) * a->scale;
        s[j - start] = v;
        mx = v > mx ? v : mx;
    }
    float sum = 0.0f;
    for (int64_t j = start; j < end; j++) sum += (s[j - start] = expf(s[j - start] - mx));
    for (int64_t d = 0; d < D; d++) o[d] = 0.0f;
    for (int64_t j = start; j < end; j++) {
        const int64_t off = (table[p * nblk + j / bs] * bs + j % bs) * row + (Hkv + kvh) * D;
        axpy(o, s[j - start] / sum, (const char *)a->cache + off * esize, D, a->cache_bf16);
    }
    free(s);
}

/* one (request, KV head) of sluice_attn_decode: its G query heads together, so each key
   and value row is read once for all of them (a query head at a time streamed the
   request's keys G times) */
#define ATTN_MAX_G 16
static void attn_group_chunk(void *ctx, int64_t task) {
    attn_job *a = ctx;
    const int64_t Hq = a->Hq, Hkv = a->Hkv, D = a->D, bs = a->bs, nblk = a->nblk;
    const int64_t row = 2 * Hkv * D, G = Hq / Hkv;
    const int64_t p = task / Hkv, kvh = task % Hkv;
    const int64_t end = a->num_keys[p];
    const int64_t start = a->window > 0 && end > a->window ? end - a->window : 0;
    const int64_t n = end - start;
    const int64_t *table = a->table + p * nblk;
    const size_t esize = a->cache_bf16 ? 2 : 4;
    const float *q = a->qkv + p * a->qs + kvh * G * D;
    float *o = a->out + (p * Hq + kvh * G) * D;
    float mx[ATTN_MAX_G], sum[ATTN_MAX_G];
    float *s = malloc((size_t)(G * n + 1) * sizeof(float));
    if (!s) {
        atomic_store(&a->bad, 1);
        return;
    }
    for (int64_t g = 0; g < G; g++) mx[g] = -INFINITY;
    for (int64_t j = start; j < end; j++) {
        const int64_t off = (table[j / bs] * bs + j % bs) * row + kvh * D;
        const char *k = (const char *)a->cache + off * esize;
        for (int64_t g = 0; g < G; g++) {
            float v = (a->cache_bf16 ? dot_bf16(q + g * D, (const uint16_t *)k, D)
                                     : dot(q + g * D, (const float *)k, D)) * a->scale;
            s[g * n + j - start] = v;
            mx[g] = v > mx[g] ? v : mx[g];
        }
    }
    for (int64_t g = 0; g < G; g++) {
        float t = 0.0f;
        for (int64_t j = 0; j < n; j++) t += (s[g * n + j] = expf(s[g * n + j] - mx[g]));
        sum[g] = t;
    }
    for (int64_t i = 0; i < G * D; i++) o[i] = 0.0f;
    for (int64_t j = start; j < end; j++) {
        const int64_t off = (table[j / bs] * bs + j % bs) * row + (Hkv + kvh) * D;
        const char *v = (const char *)a->cache + off * esize;
        for (int64_t g = 0; g < G; g++)
            axpy(o + g * D, s[g * n + j - start] / sum[g], v, D, a->cache_bf16);
    }
    free(s);
}

/* One decode step of P requests (one query token each) over the paged cache
   [blocks, bs, 2, Hkv, D] (K then V per slot; fp32, or bf16 when cache_bf16). Row p of
   `qkv` (stride `qs` floats) holds the request's q (Hq*D) then its new K|V (2*Hkv*D),
   which is first written into slot slots[p] (rounded to nearest even for a bf16 cache).
   Query head hq (KV head hq / (Hq / Hkv)) then attends to keys [start, num_keys[p])
   found through table[p] (nblk blocks), start = num_keys - window when window > 0.
   Two-pass softmax in fp32. out: [P, Hq, D]. Runs after `decode_rows_ok`. */
static int attn_decode_run(const float *qkv, int64_t qs, void *cache, const int64_t *slots,
                           const int64_t *table, int64_t nblk, const int64_t *num_keys,
                           int64_t window, int64_t P, int64_t Hq, int64_t Hkv, int64_t D,
                           int64_t bs, float scale, float *out, int threads, int cache_bf16) {
    const int64_t row = 2 * Hkv * D;
    for (int64_t p = 0; p < P; p++) {
        const float *src = qkv + p * qs + Hq * D;
        if (cache_bf16) {
            uint16_t *dst = (uint16_t *)cache + slots[p] * row;
            for (int64_t i = 0; i < row; i++) dst[i] = round_bf16(src[i]);
        } else {
            float *dst = (float *)cache + slots[p] * row;
            for (int64_t i = 0; i < row; i++) dst[i] = src[i];
        }
    }
    attn_job job = {qkv, qs, cache, table, nblk, num_keys, window, Hq, Hkv, D, bs, scale,
                    out, cache_bf16, 0};
    if (Hq / Hkv <= ATTN_MAX_G && P * Hkv >= threads)  /* else a head per task: more of them */
        parallel_for(attn_group_chunk, &job, P * Hkv, threads);
    else
        parallel_for(attn_chunk, &job, P * Hq, threads);
    return atomic_load(&job.bad) ? SLUICE_E_NOMEM : SLUICE_OK;
}

/* What a decode step of P rows reads and writes in a cache of `blocks` blocks of bs slots,
   checked a row at a time before anything is written: its key count, the slot of its new
   K|V, and the blocks holding its keys. */
static int decode_rows_ok(const int64_t *slots, const int64_t *table, int64_t nblk,
                          const int64_t *num_keys, int64_t window, int64_t P, int64_t bs,
                          int64_t blocks) {
    for (int64_t p = 0; p < P; p++) {
        const int64_t end = num_keys[p];
        if (end < 1 || end > nblk * bs) return SLUICE_E_KEYS;
        if (!in_range(slots[p], blocks * bs)) return SLUICE_E_SLOT;
        if (!blocks_ok(table + p * nblk, key_start(end, window), end, bs, blocks))
            return SLUICE_E_BLOCK;
    }
    return SLUICE_OK;
}

static int attn_shape_ok(int64_t Hq, int64_t Hkv, int64_t D, int64_t bs, int64_t blocks) {
    return Hkv >= 1 && Hq >= Hkv && Hq % Hkv == 0 && D >= 1 && bs >= 1 && blocks >= 1;
}

/* attn_decode_run over a cache of `blocks` blocks, every id checked first */
int sluice_attn_decode(const float *qkv, int64_t qs, void *cache, int64_t blocks,
                       const int64_t *slots, const int64_t *table, int64_t nblk,
                       const int64_t *num_keys, int64_t window, int64_t P, int64_t Hq,
                       int64_t Hkv, int64_t D, int64_t bs, float scale, float *out, int threads,
                       int cache_bf16) {
    if (!attn_shape_ok(Hq, Hkv, D, bs, blocks) || threads < 1) return SLUICE_E_ARGS;
    const int rc = decode_rows_ok(slots, table, nblk, num_keys, window, P, bs, blocks);
    if (rc) return rc;
    return attn_decode_run(qkv, qs, cache, slots, table, nblk, num_keys, window, P, Hq, Hkv,
                           D, bs, scale, out, threads, cache_bf16);
}

/* ---- sluice_attn_paged: attention of many query rows over a bf16 paged cache ----
   The rows of a mixed or large step (engine/runner/attention.py): decoding requests, and
   prefill chunks' tokens, each its request's keys up to its position, where torch gathers
   every request's blocks into a padded copy and runs a masked SDPA over the padding too.
   Here each (row, KV head) reads its own keys and values in place: scores of the KV
   head's G query heads with VDPBF16PS (q and K are bf16 in a bf16 model: exact products,
   fp32 sums), 16 keys summed in one pass (`sum16`), a two-pass softmax in fp32 with a
   vectorized exp, and P.V on VDPBF16PS two keys at a time with the weights rounded to bf16
   as torch's are (fp32 FMAs for an fp32 q). Tasks run on OpenMP threads: the team torch's
   own ops run on (one libgomp in the process), so no second set of threads competes with
   it for the cores. In the model every layer's keys come from beyond L2 (the weights
   streamed between layers evict them): the next 16 keys' rows are prefetched, across
   blocks too. */

DP_TARGET static inline __m512 widen16(const uint16_t *p) {
    __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}

DP_TARGET static inline __m512 widen_pbh(__m256bh b) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)b), 16));
}

/* e^x, Cephes' expf polynomial: within 2 ulp; x clamped to [-87, 88.5] (no inf, no denormal) */
DP_TARGET static inline __m512 exp16(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.5f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}

#define PAGED_MAX_G 16
#define PAGED_MAX_D 256

typedef struct {
    const void *q;
    int64_t qs; /* elements between rows of q */
    int q_bf16; /* q and out are bf16, else fp32 */
    void *out;  /* [P, Hq, D], contiguous */
    const uint16_t *cache;
    const int64_t *table;
    int64_t nblk;
    const int64_t *req; /* row p's request (row of table); NULL: p */
    const int64_t *num_keys;
    int64_t window, Hq, Hkv, D, bs;
    float scale;
} paged_job;

/* sum16(v)[k] = _mm512_reduce_add_ps(v[sum16_key^-1(k)]): 16 horizontal sums in 15 vector
   adds, each pairing lanes as the reduction does (i with i+8, i+4, i+2, then i+1), so the
   sums are bit-equal to it. v[i] holds key sum16_key(i), which puts key k in lane k. */
static inline int sum16_key(int i) { return ((i & 3) << 2) | (i >> 2); }

DP_TARGET static inline __m512 sum16(const __m512 *v) {
    __m512 t[8], u[4], w[2];
    for (int i = 0; i < 8; i++) /* lanes i + i+8 of v[2i] (low half), of v[2i+1] (high) */
        t[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                             _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
    for (int i = 0; i < 4; i++) /* + lanes 4 on: a quarter a vector */
        u[i] = _mm512_add_ps(_mm512_shuffle_f32x4(t[2 * i], t[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(t[2 * i], t[2 * i + 1], 0xDD));
    for (int i = 0; i < 2; i++) /* + lanes 2 on */
        w[i] = _mm512_add_ps(_mm512_shuffle_ps(u[2 * i], u[2 * i + 1], 0x44),
                             _mm512_shuffle_ps(u[2 * i], u[2 * i + 1], 0xEE));
    return _mm512_add_ps(_mm512_shuffle_ps(w[0], w[1], 0x88), _mm512_shuffle_ps(w[0], w[1], 0xDD));
}

DP_TARGET static inline void store_bf16(uint16_t *p, __m512 v) {
    _mm256_storeu_si256((__m256i *)p, (__m256i)_mm512_cvtneps_pbh(v));
}

/* A task's scores and weights: this thread's buffer, grown as needed and kept (a prefill
   row of a long context would otherwise malloc, past the mmap threshold, every task). */
static void *paged_scratch(size_t bytes) {
    static __thread void *buf;
    static __thread size_t cap;
    if (bytes > cap) {
        free(buf);
        cap = (bytes + 4095) & ~(size_t)4095;
        buf = aligned_alloc(64, cap);
        if (!buf) cap = 0;
    }
    return buf;
}

/* The cache row of the key at block b, offset o of a request's table; steps (b, o) on to
   the next key (a division a key cost more than the rest of its work). */
static inline const uint16_t *next_key_row(const uint16_t *cache, const int64_t *table,
                                           int64_t *b, int64_t *o, int64_t bs, int64_t row) {
    const uint16_t *r = cache + (table[*b] * bs + *o) * row;
    if (++*o == bs) *o = 0, ++*b;
    return r;
}

/* P.V of `paged_task` for bf16 weights wb [G, n16] (keys start.., zero past the last):
   VDPBF16PS on two keys at a time, their V rows interleaved pair-wise (vpunpck*wd), so
   the accumulators hold D in the unpack's lane order until they are stored. */
DP_TARGET static inline __attribute__((always_inline)) void paged_pv_bf16(
    const paged_job *a, const int64_t *table, int64_t p, int64_t kvh, int64_t start,
    int64_t end, const int G, const int64_t D, const uint16_t *wb, int64_t n16, const float *inv) {
    const int64_t Hkv = a->Hkv, bs = a->bs, row = 2 * Hkv * D, vcol = (Hkv + kvh) * D;
    for (int64_t d0 = 0; d0 < D; d0 += 64) {
        const int Z = D - d0 >= 64 ? 2 : 1; /* 32-value vectors of V in this pass */
        __m512 acc[PAGED_MAX_G * 4];
        for (int i = 0; i < G * 4; i++) acc[i] = _mm512_setzero_ps();
        int64_t b = start / bs, o = start % bs;
        for (int64_t j = start; j < end; j += 2) {
            const uint16_t *v0 = next_key_row(a->cache, table, &b, &o, bs, row) + vcol + d0;
            /* a lone last key pairs with itself, at weight 0 */
            const uint16_t *v1 = j + 1 < end ? next_key_row(a->cache, table, &b, &o, bs, row) + vcol + d0 : v0;
            __m512bh lo[2], hi[2];
            for (int z = 0; z < Z; z++) {
                const __m512i x0 = _mm512_loadu_si512(v0 + z * 32), x1 = _mm512_loadu_si512(v1 + z * 32);
                lo[z] = (__m512bh)_mm512_unpacklo_epi16(x0, x1);
                hi[z] = (__m512bh)_mm512_unpackhi_epi16(x0, x1);
            }
            for (int g = 0; g < G; g++) {
                uint32_t pair;
                memcpy(&pair, wb + g * n16 + (j - start), sizeof pair);
                const __m512bh w = (__m512bh)_mm512_set1_epi32((int)pair);
                for (int z = 0; z < Z; z++) {
                    acc[g * 4 + 2 * z] = _mm512_dpbf16_ps(acc[g * 4 + 2 * z], lo[z], w);
                    acc[g * 4 + 2 * z + 1] = _mm512_dpbf16_ps(acc[g * 4 + 2 * z + 1], hi[z], w);
                }
            }
        }
        for (int g = 0; g < G; g++) {
            uint16_t *out = (uint16_t *)a->out + (p * a->Hq + kvh * G + g) * D + d0;
            const __m512 sc = _mm512_set1_ps(inv[g]);
            for (int z = 0; z < Z; z++) {
                /* lo holds values 0-3, 8-11, 16-19, 24-27 of these 32; hi the others */
                const __m512 l = acc[g * 4 + 2 * z], h = acc[g * 4 + 2 * z + 1];
                const __m512 first = _mm512_shuffle_f32x4(_mm512_shuffle_f32x4(l, h, 0x44), _mm512_shuffle_f32x4(l, h, 0x44), 0xD8);
                const __m512 second = _mm512_shuffle_f32x4(_mm512_shuffle_f32x4(l, h, 0xEE), _mm512_shuffle_f32x4(l, h, 0xEE), 0xD8);
                store_bf16(out + z * 32, _mm512_mul_ps(first, sc));
                store_bf16(out + z * 32 + 16, _mm512_mul_ps(second, sc));
            }
        }
    }
}

/* One (query row, KV head). G and D are constants where the caller dispatches on them, so
   the accumulators of the P.V loop stay in registers. */
DP_TARGET static inline __attribute__((always_inline)) int paged_task(const paged_job *a,
                                                                      int64_t task, const int G,
                                                                      const int64_t D) {
    const int64_t Hkv = a->Hkv, bs = a->bs, row = 2 * Hkv * D;
    const int64_t p = task / Hkv, kvh = task % Hkv;
    const int64_t end = a->num_keys[p];
    const int64_t start = a->window > 0 && end > a->window ? end - a->window : 0;
    const int64_t n = end - start, n16 = (n + 15) & ~(int64_t)15;
    const int64_t *table = a->table + (a->req ? a->req[p] : p) * a->nblk;
    const int C = (int)(D / 32); /* 32 bf16 per VDPBF16PS */
    __m512bh qv[PAGED_MAX_G * PAGED_MAX_D / 32];
    for (int g = 0; g < G; g++)
        for (int c = 0; c < C; c++) {
            const int64_t at = p * a->qs + (kvh * G + g) * D + c * 32;
            if (a->q_bf16) {
                qv[g * C + c] = (__m512bh)_mm512_loadu_si512((const uint16_t *)a->q + at);
            } else {
                const float *f = (const float *)a->q + at;
                qv[g * C + c] = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(f + 16), _mm512_loadu_ps(f));
            }
        }
    /* scores, then P.V weights: fp32 [G, n16], and the bf16 weights [G, n16] after */
    float *s = paged_scratch((size_t)(G * n16) * (sizeof(float) + sizeof(uint16_t)));
    if (!s) return 1;
    /* Q.K, 16 keys at a time: a (query head, key) dot is a 16-lane accumulator, and
       `sum16` folds 16 of them into one vector of 16 scores (each summed in
       _mm512_reduce_add_ps's order: the same scores as one reduction a key). */
    __m512 vmx[PAGED_MAX_G];
    for (int g = 0; g < G; g++) vmx[g] = _mm512_set1_ps(-INFINITY);
    const __m512 scale = _mm512_set1_ps(a->scale);
    /* the key rows of this chunk of 16 and of the next, which is prefetched (K to L1, V to
       L2: scattered blocks defeat the hardware prefetcher) */
    const uint16_t *key_rows[2][16];
    int64_t map_b = start / bs, map_o = start % bs; /* block and offset of the next key to map */
    int cur = 0;
    for (int i = 0; i < 16 && start + i < end; i++)
        key_rows[0][i] = next_key_row(a->cache, table, &map_b, &map_o, bs, row) + kvh * D;
    for (int64_t j0 = start; j0 < end; j0 += 16, cur ^= 1) {
        const int nk = end - j0 < 16 ? (int)(end - j0) : 16;
        const uint16_t **kp = key_rows[cur], **next = key_rows[cur ^ 1];
        for (int i = 0; i < 16 && j0 + 16 + i < end; i++) {
            const uint16_t *k = next[i] = next_key_row(a->cache, table, &map_b, &map_o, bs, row) + kvh * D;
            for (int64_t c = 0; c < D; c += 32) {
                _mm_prefetch((const char *)(k + c), _MM_HINT_T0);
                _mm_prefetch((const char *)(k + Hkv * D + c), _MM_HINT_T1);
            }
        }
        const __mmask16 live = nk == 16 ? (__mmask16)0xffff : (__mmask16)((1u << nk) - 1);
        for (int g = 0; g < G; g++) {
            __m512 acc[16];
            for (int i = 0; i < 16; i++) {
                const int key = sum16_key(i);
                __m512 x = _mm512_setzero_ps();
                if (key < nk)
                    for (int c = 0; c < C; c++)
                        x = _mm512_dpbf16_ps(x, qv[g * C + c], (__m512bh)_mm512_loadu_si512(kp[key] + c * 32));
                acc[i] = x;
            }
            const __m512 v = _mm512_mul_ps(sum16(acc), scale);
            _mm512_mask_storeu_ps(s + g * n16 + (j0 - start), live, v);
            vmx[g] = _mm512_mask_max_ps(vmx[g], live, vmx[g], v);
        }
    }
    float mx[PAGED_MAX_G];
    for (int g = 0; g < G; g++) mx[g] = _mm512_reduce_max_ps(vmx[g]);
    float inv[PAGED_MAX_G];
    uint16_t *wb = (uint16_t *)(s + G * n16);
    for (int g = 0; g < G; g++) {
        float *sg = s + g * n16;
        const __m512 m = _mm512_set1_ps(mx[g]);
        __m512 sum = _mm512_setzero_ps();
        for (int64_t i = 0; i < n16; i += 16) {
            const __mmask16 live = i + 16 <= n ? (__mmask16)0xffff : (__mmask16)((1u << (n - i)) - 1);
            __m512 e = _mm512_maskz_mov_ps(live, exp16(_mm512_sub_ps(_mm512_load_ps(sg + i), m)));
            sum = _mm512_add_ps(sum, e);
            if (a->q_bf16) /* P.V weights in bf16, as torch's */
                store_bf16(wb + g * n16 + i, e);
            else
                _mm512_store_ps(sg + i, e);
        }
        inv[g] = 1.0f / _mm512_reduce_add_ps(sum);
    }
    if (a->q_bf16) {
        paged_pv_bf16(a, table, p, kvh, start, end, G, D, wb, n16, inv);
        return 0;
    }
    /* fp32 q: P.V in fp32, 64 values of D at a time: G * 4 accumulators */
    for (int64_t d0 = 0; d0 < D; d0 += 64) {
        const int V = D - d0 >= 64 ? 4 : (int)((D - d0) / 16);
        __m512 acc[PAGED_MAX_G * 4];
        for (int i = 0; i < G * 4; i++) acc[i] = _mm512_setzero_ps();
        for (int64_t j = start; j < end;) {
            const int64_t b = j / bs, stop = (b + 1) * bs < end ? (b + 1) * bs : end;
            const uint16_t *v = a->cache + (table[b] * bs + (j - b * bs)) * row + (Hkv + kvh) * D + d0;
            for (; j < stop; j++, v += row) {
                __m512 vv[4];
                for (int c = 0; c < V; c++) vv[c] = widen16(v + c * 16);
                for (int g = 0; g < G; g++) {
                    const __m512 w = _mm512_set1_ps(s[g * n16 + (j - start)]);
                    for (int c = 0; c < V; c++)
                        acc[g * 4 + c] = _mm512_fmadd_ps(w, vv[c], acc[g * 4 + c]);
                }
            }
        }
        for (int g = 0; g < G; g++) {
            const int64_t at = (p * a->Hq + kvh * G + g) * D + d0;
            const __m512 sc = _mm512_set1_ps(inv[g]);
            for (int c = 0; c < V; c++)
                _mm512_storeu_ps((float *)a->out + at + c * 16, _mm512_mul_ps(acc[g * 4 + c], sc));
        }
    }
    return 0;
}

DP_TARGET static int paged_any(const paged_job *a, int64_t task) {
    const int G = (int)(a->Hq / a->Hkv);
    if (a->D == 64) {
        switch (G) {
            case 1: return paged_task(a, task, 1, 64);
            case 2: return paged_task(a, task, 2, 64);
            case 4: return paged_task(a, task, 4, 64);
            case 8: return paged_task(a, task, 8, 64);
        }
    } else if (a->D == 128) {
        switch (G) {
            case 1: return paged_task(a, task, 1, 128);
            case 4: return paged_task(a, task, 4, 128);
            case 8: return paged_task(a, task, 8, 128);
        }
    }
    return paged_task(a, task, G, a->D);
}

/* P query rows (row p of q, stride qs elements, Hq heads of D), each attending to keys
   [start, num_keys[p]) of the bf16 cache [blocks, bs, 2, Hkv, D] through table row
   req[p] (p when req is NULL; R rows of nblk blocks), start = num_keys - window when
   window > 0: a decoding request's one query, or a prefill chunk's rows, each its
   position + 1 keys. Their K|V are already written. out: [P, Hq, D] in q's dtype (bf16
   when q_bf16, else fp32). Needs AVX512-BF16 (the caller checks), D a multiple of 32 up
   to 256, Hq / Hkv <= 16. */
int sluice_attn_paged(const void *q, int64_t qs, int q_bf16, void *out, const uint16_t *cache,
                      int64_t blocks, const int64_t *table, int64_t R, int64_t nblk,
                      const int64_t *req, const int64_t *num_keys, int64_t window, int64_t P,
                      int64_t Hq, int64_t Hkv, int64_t D, int64_t bs, float scale,
                      int threads) {
    if (!attn_shape_ok(Hq, Hkv, D, bs, blocks) || D % 32 || D > PAGED_MAX_D ||
        Hq / Hkv > PAGED_MAX_G || threads < 1)
        return SLUICE_E_ARGS;
    for (int64_t p = 0; p < P; p++) {
        const int64_t r = req ? req[p] : p, end = num_keys[p];
        if (!in_range(r, R)) return SLUICE_E_REQUEST;
        if (end < 1 || end > nblk * bs) return SLUICE_E_KEYS;
        if (!blocks_ok(table + r * nblk, key_start(end, window), end, bs, blocks))
            return SLUICE_E_BLOCK;
    }
    paged_job job = {q, qs, q_bf16, out, cache, table, nblk, req, num_keys, window, Hq, Hkv, D, bs, scale};
    int bad = 0;
#pragma omp parallel for schedule(dynamic, 2) num_threads(threads) reduction(| : bad)
    for (int64_t task = 0; task < P * Hkv; task++) bad |= paged_any(&job, task);
    return bad ? SLUICE_E_NOMEM : SLUICE_OK;
}


/* ---- the small ops of a bf16 step (rows of a prefill or of many decodes) ----
   Each replaces several torch ops (each a pass over memory and a wake of torch's thread
   pool) with one pass, with torch's own roundings: RMSNorm of the fp32 residual to a bf16
   x, RoPE on bf16 q|k, SiLU(gate) * up. Rows are shared out on OpenMP threads. */

/* out[m] = bf16((h[m] * w) * r), r = 1 / sqrt(eps + (1/H) * |h[m]|^2) (H % 16 == 0) */
DP_TARGET void sluice_rms_norm_bf16(const float *h, const float *w, float eps, uint16_t *out,
                                    int64_t M, int64_t H, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t m = 0; m < M; m++) {
        const float *x = h + m * H;
        __m512 ss = _mm512_setzero_ps();
        for (int64_t i = 0; i < H; i += 16) {
            const __m512 v = _mm512_loadu_ps(x + i);
            ss = _mm512_fmadd_ps(v, v, ss);
        }
        const float n = sqrtf(_mm512_reduce_add_ps(ss));
        const __m512 r = _mm512_set1_ps(1.0f / sqrtf(eps + (1.0f / (float)H) * n * n));
        for (int64_t i = 0; i < H; i += 16)
            store_bf16(out + m * H + i,
                       _mm512_mul_ps(_mm512_mul_ps(_mm512_loadu_ps(x + i), _mm512_loadu_ps(w + i)), r));
    }
}

/* out[m, i] = bf16(bf16(silu(g)) * u), g = gu[m, i], u = gu[m, I + i] (I % 16 == 0) */
DP_TARGET void sluice_silu_mul_bf16(const uint16_t *gu, uint16_t *out, int64_t M, int64_t I,
                                    int threads) {
    const __m512 one = _mm512_set1_ps(1.0f);
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t m = 0; m < M; m++) {
        const uint16_t *g = gu + m * 2 * I, *u = g + I;
        for (int64_t i = 0; i < I; i += 16) {
            const __m512 x = widen16(g + i);
            const __m512 silu = _mm512_div_ps(x, _mm512_add_ps(one, exp16(_mm512_sub_ps(_mm512_setzero_ps(), x))));
            const __m512 rounded = widen_pbh(_mm512_cvtneps_pbh(silu));
            store_bf16(out + m * I + i, _mm512_mul_ps(rounded, widen16(u + i)));
        }
    }
}

/* h += y for fp32 h and bf16 y [M, H] (H % 16 == 0), y widened exactly: what torch's
   h.add_(y) computes, in one pass (torch converts y to a new fp32 tensor first) */
DP_TARGET void sluice_add_bf16(float *h, const uint16_t *y, int64_t M, int64_t H, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t m = 0; m < M; m++)
        for (int64_t i = 0; i < H; i += 16) {
            float *p = h + m * H + i;
            _mm512_storeu_ps(p, _mm512_add_ps(_mm512_loadu_ps(p), widen16(y + m * H + i)));
        }
}

/* out[m] = the index of the first maximum of bf16 row x[m] (N values), or of its first NaN:
   numpy's argmax of the row widened to fp32, without the fp32 copy. Per lane the first
   index of the lane's maximum, then the lowest index among the lanes that hold the row's. */
DP_TARGET void sluice_argmax_bf16(const uint16_t *x, int64_t M, int64_t N, int64_t *out,
                                  int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t m = 0; m < M; m++) {
        const uint16_t *r = x + m * N;
        /* four independent (max, index) chains: one is a compare's latency a vector */
        const int64_t n16 = N & ~(int64_t)15;
        __m512 best[4];
        __m512i at[4];
        for (int c = 0; c < 4; c++) best[c] = _mm512_set1_ps(-INFINITY), at[c] = _mm512_set1_epi32(-1);
        const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        __mmask16 nan = 0;
        for (int64_t i = 0; i < n16; i += 16) {
            const int c = (int)((i >> 4) & 3);
            const __m512 v = widen16(r + i);
            nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
            const __mmask16 up = _mm512_cmp_ps_mask(v, best[c], _CMP_GT_OQ);
            best[c] = _mm512_mask_mov_ps(best[c], up, v);
            at[c] = _mm512_mask_mov_epi32(at[c], up, _mm512_add_epi32(lane, _mm512_set1_epi32((int)i)));
        }
        for (int c = 1; c < 4; c++) { /* the greater, or the earlier of equals */
            const __mmask16 take = _mm512_cmp_ps_mask(best[c], best[0], _CMP_GT_OQ) |
                                   (_mm512_cmp_ps_mask(best[c], best[0], _CMP_EQ_OQ) &
                                    _mm512_cmp_epi32_mask(at[c], at[0], _MM_CMPINT_LT));
            best[0] = _mm512_mask_mov_ps(best[0], take, best[c]);
            at[0] = _mm512_mask_mov_epi32(at[0], take, at[c]);
        }
        float top = _mm512_reduce_max_ps(best[0]);
        int64_t arg = n16 ? 0 : -1; /* a row of -inf: its first value */
        if (top > -INFINITY) {
            const __mmask16 has = _mm512_cmp_ps_mask(best[0], _mm512_set1_ps(top), _CMP_EQ_OQ);
            arg = _mm512_mask_reduce_min_epi32(has, at[0]);
        }
        for (int64_t i = n16; i < N; i++) { /* the tail, after every full vector */
            const float v = widen1(r[i]);
            if (v != v) nan = 1;
            if (v > top || arg < 0) top = v, arg = i;
        }
        if (nan)
            for (int64_t i = 0; i < N; i++)
                if (widen1(r[i]) != widen1(r[i])) { arg = i; break; }
        out[m] = arg < 0 ? 0 : arg;
    }
}

/* RoPE in place on the first `heads` heads of each bf16 row of x (row stride `stride`,
   pairs (re, im)): v * table[pos[m]] (fp32 pairs, `half` per head), products rounded
   before the sum as torch's complex multiply does (half % 8 == 0); each pos[m] is checked
   against the table's `positions` first */
DP_TARGET int sluice_rope_bf16(uint16_t *x, int64_t stride, int64_t M, const float *table,
                               const int64_t *pos, int64_t positions, int64_t heads,
                               int64_t half, int threads) {
    if (!positions_ok(pos, M, positions)) return SLUICE_E_POS;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t m = 0; m < M; m++) {
        const float *t = table + pos[m] * half * 2;
        for (int64_t hd = 0; hd < heads; hd++) {
            uint16_t *v = x + m * stride + hd * half * 2;
            for (int64_t i = 0; i < 2 * half; i += 16) {
                const __m512 a = widen16(v + i), c = _mm512_loadu_ps(t + i);
                const __m512 p1 = _mm512_mul_ps(a, c); /* ac, bs */
                const __m512 p2 = _mm512_mul_ps(a, _mm512_permute_ps(c, 0xB1)); /* as, bc */
                const __m512 re = _mm512_sub_ps(p1, _mm512_permute_ps(p1, 0xB1));
                const __m512 im = _mm512_add_ps(p2, _mm512_permute_ps(p2, 0xB1));
                store_bf16(v + i, _mm512_mask_blend_ps((__mmask16)0xAAAA, re, im));
            }
        }
    }
    return SLUICE_OK;
}

/* ---- sluice_lora_add: LoRA adapters' deltas, y += (x . A_slot^T) . B_slot a row ----

   One fused projection's adapters, every slot, as engine/models/lora.py stacks them: A
   [P, R, S, K] and B [P, R, S, N] fp32, part p's B zero outside its columns [off[p],
   off[p] + width[p]) and the scale folded in. Each row has a slot (-1: the base model,
   no delta). Rows are taken in blocks of up to LORA_ROWS consecutive rows of one slot (the
   runner orders a step's rows by slot), each row of A and B read from memory once a block
   and from L1 for its rows four at a time; the low-rank
   products xa stay fp32, as torch's fp32 matmuls of the same tensors keep them. AVX2 + FMA
   (the library's baseline), or 16 lanes with `wide` on a CPU with AVX-512F.
   A bf16 x with bf16 copies `a16`/`b16` (a plan made for a CPU with AVX512-BF16) takes the
   `vdpbf16ps` form instead, twice the multiply-adds a cycle from half the bytes: x . A in
   pairs along K from x as it is, then xa rounded to bf16 pairs along the rank against B
   stored [P, R/2, S, N, 2] (an odd rank's last pair zero-padded); fp32 sums throughout, a
   bf16 y widened into them and rounded once, a block's rows read and written in place. */
#define LORA_COLS 1024 /* parts * rank at most (checked by the bindings) */
#define LORA_ROWS 16   /* rows a block: each weight row is read from L1 for all of them */
#define LORA_TARGET __attribute__((target("avx512f")))

typedef struct {
    const float *a, *b;
    const uint8_t *targeted; /* [S]: whether slot s's adapter has this projection */
    int64_t parts, rank, slots, K, N;
    int64_t off[4], width[4];
    int32_t wide;
    /* NULL, or bf16 A [P, R, S, K] and B pairs [P, (R + 1) / 2, S, N, 2] (AVX512-BF16) */
    const uint16_t *a16, *b16;
} dl_lora;

/* xa[m][0] = x[m] . w for MB rows of x (K apart) */
static inline void lora_dot(const float *w, const float *x, int64_t K, const int MB, float *xa) {
    const int64_t K8 = K & ~(int64_t)7;
    __m256 acc[4];
    for (int m = 0; m < MB; m++) acc[m] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K8; k += 8) {
        __m256 wv = _mm256_loadu_ps(w + k);
        for (int m = 0; m < MB; m++)
            acc[m] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + m * K + k), acc[m]);
    }
    for (int m = 0; m < MB; m++) {
        float s = hsum(acc[m]);
        for (int64_t k = K8; k < K; k++) s += w[k] * x[m * K + k];
        xa[m * LORA_COLS] = s;
    }
}

/* y[m][0:n] += sum_r xa[m][r] * B row r (rows `stride` apart), n <= 8, MB rows of y */
static inline void lora_axpy(const float *B, int64_t stride, int64_t R, const float *xa,
                             float *y, int64_t N, int64_t n, const int MB) {
    if (n == 8) {
        __m256 acc[4];
        for (int m = 0; m < MB; m++) acc[m] = _mm256_loadu_ps(y + m * N);
        for (int64_t r = 0; r < R; r++) {
            __m256 bv = _mm256_loadu_ps(B + r * stride);
            for (int m = 0; m < MB; m++)
                acc[m] = _mm256_fmadd_ps(_mm256_set1_ps(xa[m * LORA_COLS + r]), bv, acc[m]);
        }
        for (int m = 0; m < MB; m++) _mm256_storeu_ps(y + m * N, acc[m]);
        return;
    }
    for (int m = 0; m < MB; m++)
        for (int64_t j = 0; j < n; j++) {
            float s = y[m * N + j];
            for (int64_t r = 0; r < R; r++) s += xa[m * LORA_COLS + r] * B[r * stride + j];
            y[m * N + j] = s;
        }
}

LORA_TARGET static inline void lora_dot_wide(const float *w, const float *x, int64_t K,
                                             const int MB, float *xa) {
    __m512 acc[4];
    for (int m = 0; m < MB; m++) acc[m] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 16) {
        const __mmask16 mk = k + 16 <= K ? (__mmask16)0xffff : (__mmask16)((1u << (K % 16)) - 1);
        __m512 wv = _mm512_maskz_loadu_ps(mk, w + k);
        for (int m = 0; m < MB; m++)
            acc[m] = _mm512_fmadd_ps(wv, _mm512_maskz_loadu_ps(mk, x + m * K + k), acc[m]);
    }
    for (int m = 0; m < MB; m++) xa[m * LORA_COLS] = _mm512_reduce_add_ps(acc[m]);
}

/* lora_dot_wide of four rows of A (`stride` apart) at once: each x load feeds four FMAs */
LORA_TARGET static inline void lora_dot4_wide(const float *w, int64_t stride, const float *x,
                                              int64_t K, const int MB, float *xa) {
    __m512 acc[4][4];
    for (int j = 0; j < 4; j++)
        for (int m = 0; m < MB; m++) acc[j][m] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 16) {
        const __mmask16 mk = k + 16 <= K ? (__mmask16)0xffff : (__mmask16)((1u << (K % 16)) - 1);
        __m512 wv[4];
        for (int j = 0; j < 4; j++) wv[j] = _mm512_maskz_loadu_ps(mk, w + j * stride + k);
        for (int m = 0; m < MB; m++) {
            __m512 xv = _mm512_maskz_loadu_ps(mk, x + m * K + k);
            for (int j = 0; j < 4; j++) acc[j][m] = _mm512_fmadd_ps(wv[j], xv, acc[j][m]);
        }
    }
    for (int j = 0; j < 4; j++)
        for (int m = 0; m < MB; m++) xa[m * LORA_COLS + j] = _mm512_reduce_add_ps(acc[j][m]);
}

LORA_TARGET static inline void lora_axpy_wide(const float *B, int64_t stride, int64_t R,
                                              const float *xa, float *y, int64_t N, int64_t n,
                                              const int MB) {
    const __mmask16 mk = n == 16 ? (__mmask16)0xffff : (__mmask16)((1u << n) - 1);
    __m512 acc[4];
    for (int m = 0; m < MB; m++) acc[m] = _mm512_maskz_loadu_ps(mk, y + m * N);
    for (int64_t r = 0; r < R; r++) {
        __m512 bv = _mm512_maskz_loadu_ps(mk, B + r * stride);
        for (int m = 0; m < MB; m++)
            acc[m] = _mm512_fmadd_ps(_mm512_set1_ps(xa[m * LORA_COLS + r]), bv, acc[m]);
    }
    for (int m = 0; m < MB; m++) _mm512_mask_storeu_ps(y + m * N, mk, acc[m]);
}

/* MB a constant at each call, so the loops over m unroll */
#define LORA_BY_ROWS(call)            \
    switch (mb) {                     \
        case 1: call(1); break;       \
        case 2: call(2); break;       \
        case 3: call(3); break;       \
        default: call(4); break;      \
    }

/* lora_down_{avx2,wide}: xa[m][c] = x[m] . A row c for the block's rows, four rows of x
   at a time (four rows of A too where `four`); lora_up_{avx2,wide}: y[m] += xa[m] . B_s
   over each part's columns, `lanes` columns and four rows at a time. Defined once a form
   so the kernels inline into a function of their own target, MB a constant in each. */
#define LORA_PASSES(SUFFIX, TARGET, HAS4, LANES)                                            \
    TARGET static void lora_down_##SUFFIX(const dl_lora *L, const float *A, const float *x, \
                                          int64_t rows, float *xa) {                        \
        const int64_t K = L->K, stride = L->slots * K, cols = L->parts * L->rank;           \
        for (int64_t c = 0; c < cols;) {                                                    \
            const int four = HAS4 && c + 4 <= cols;                                         \
            for (int64_t m = 0; m < rows; m += 4) {                                         \
                const int mb = rows - m < 4 ? (int)(rows - m) : 4;                          \
                const float *w = A + c * stride, *xm = x + m * K;                           \
                float *out = xa + m * LORA_COLS + c;                                        \
                LORA_BY_ROWS(LORA_DOT_CALL)                                                 \
            }                                                                               \
            c += four ? 4 : 1;                                                              \
        }                                                                                   \
    }                                                                                       \
    TARGET static void lora_up_##SUFFIX(const dl_lora *L, int64_t s, const float *xa,       \
                                        float *y, int64_t rows) {                           \
        const int64_t N = L->N, R = L->rank, S = L->slots;                                  \
        for (int64_t p = 0; p < L->parts; p++) {                                            \
            const float *B = L->b + (p * R * S + s) * N + L->off[p];                        \
            const int64_t width = L->width[p];                                              \
            for (int64_t n = 0; n < width; n += LANES) {                                    \
                const int64_t w = width - n < LANES ? width - n : LANES;                    \
                for (int64_t m = 0; m < rows; m += 4) {                                     \
                    const int mb = rows - m < 4 ? (int)(rows - m) : 4;                      \
                    const float *xm = xa + m * LORA_COLS + p * R;                           \
                    float *ym = y + m * N + L->off[p] + n;                                  \
                    LORA_BY_ROWS(LORA_AXPY_CALL)                                            \
                }                                                                           \
            }                                                                               \
        }                                                                                   \
    }

#define LORA_DOT_CALL(MB) \
    (four ? LORA_DOT4(w, stride, xm, K, MB, out) : LORA_DOT(w, xm, K, MB, out))
#define LORA_AXPY_CALL(MB) LORA_AXPY(B + n, S * N, R, xm, ym, N, w, MB)

#define LORA_DOT lora_dot
#define LORA_DOT4(...) (void)0
#define LORA_AXPY lora_axpy
LORA_PASSES(avx2, , 0, 8)
#undef LORA_DOT
#undef LORA_DOT4
#undef LORA_AXPY
#define LORA_DOT lora_dot_wide
#define LORA_DOT4 lora_dot4_wide
#define LORA_AXPY lora_axpy_wide
LORA_PASSES(wide, LORA_TARGET, 1, 16)
#undef LORA_DOT
#undef LORA_DOT4
#undef LORA_AXPY
#undef LORA_DOT_CALL
#undef LORA_AXPY_CALL
#undef LORA_PASSES

/* ---- the vdpbf16ps form: a bf16 x against bf16 copies of A and B ---- */
#define LORA_BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
#define LORA_PAIRS (LORA_COLS / 2 + 4) /* bf16 pairs of xa a row: parts * ceil(rank / 2) */

/* xa[m][j] = x[m] . A row j for J rows of A (`stride` apart) and MB bf16 rows of x (K
   apart), 32 of K at a time: each x load feeds J dot-products of pairs */
LORA_BF16_TARGET static inline void lora_dot_bf16(const uint16_t *w, int64_t stride,
                                                  const uint16_t *x, int64_t K, const int J,
                                                  const int MB, float *xa) {
    __m512 acc[4][4];
    for (int j = 0; j < J; j++)
        for (int m = 0; m < MB; m++) acc[j][m] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 32) {
        const __mmask32 mk = k + 32 <= K ? ~(__mmask32)0 : (__mmask32)((1u << (K % 32)) - 1);
        __m512i wv[4];
        for (int j = 0; j < J; j++) wv[j] = _mm512_maskz_loadu_epi16(mk, w + j * stride + k);
        for (int m = 0; m < MB; m++) {
            const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(mk, x + m * K + k);
            for (int j = 0; j < J; j++)
                acc[j][m] = _mm512_dpbf16_ps(acc[j][m], (__m512bh)wv[j], xv);
        }
    }
    for (int j = 0; j < J; j++)
        for (int m = 0; m < MB; m++) xa[m * LORA_COLS + j] = _mm512_reduce_add_ps(acc[j][m]);
}

/* y[m][0:n] += sum over pairs of xp[m][r] . B pair r (16 columns of pairs, `stride`
   apart), n <= 16, MB rows of y: fp32, or bf16 (`y16`) widened, summed into in fp32 and
   rounded once to nearest even */
LORA_BF16_TARGET static inline void lora_axpy_bf16(const uint16_t *B, int64_t stride,
                                                   int64_t pairs, const uint32_t *xp, void *y,
                                                   int y16, int64_t N, int64_t n, const int MB) {
    const __mmask16 mk = n == 16 ? (__mmask16)0xffff : (__mmask16)((1u << n) - 1);
    const __mmask32 mk2 = n == 16 ? ~(__mmask32)0 : (__mmask32)((1u << (2 * n)) - 1);
    float *yf = y;
    uint16_t *yh = y;
    __m512 acc[4];
    for (int m = 0; m < MB; m++) {
        if (y16) {
            const __m512i h = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mk, yh + m * N));
            acc[m] = _mm512_castsi512_ps(_mm512_slli_epi32(h, 16));
        } else {
            acc[m] = _mm512_maskz_loadu_ps(mk, yf + m * N);
        }
    }
    for (int64_t r = 0; r < pairs; r++) {
        const __m512bh bv = (__m512bh)_mm512_maskz_loadu_epi16(mk2, B + r * stride);
        for (int m = 0; m < MB; m++) {
            const __m512i xv = _mm512_set1_epi32((int)xp[m * LORA_PAIRS + r]);
            acc[m] = _mm512_dpbf16_ps(acc[m], (__m512bh)xv, bv);
        }
    }
    for (int m = 0; m < MB; m++) {
        if (y16)
            _mm256_mask_storeu_epi16(yh + m * N, mk, (__m256i)_mm512_cvtneps_pbh(acc[m]));
        else
            _mm512_mask_storeu_ps(yf + m * N, mk, acc[m]);
    }
}

#define LORA_DOT4_BF16_CALL(MB) lora_dot_bf16(w, stride, xm, K, 4, MB, out)
#define LORA_DOT1_BF16_CALL(MB) lora_dot_bf16(w, stride, xm, K, 1, MB, out)
#define LORA_AXPY_BF16_CALL(MB) \
    lora_axpy_bf16(B + 2 * n, 2 * S * N, pairs, xm, ym, y16, N, w, MB)

LORA_BF16_TARGET static void lora_down_bf16(const dl_lora *L, const uint16_t *A,
                                            const uint16_t *x, int64_t rows, float *xa) {
    const int64_t K = L->K, stride = L->slots * K, cols = L->parts * L->rank;
    for (int64_t c = 0; c < cols;) {
        const int four = c + 4 <= cols;
        for (int64_t m = 0; m < rows; m += 4) {
            const int mb = rows - m < 4 ? (int)(rows - m) : 4;
            const uint16_t *w = A + c * stride, *xm = x + m * K;
            float *out = xa + m * LORA_COLS + c;
            if (four) {
                LORA_BY_ROWS(LORA_DOT4_BF16_CALL)
            } else {
                LORA_BY_ROWS(LORA_DOT1_BF16_CALL)
            }
        }
        c += four ? 4 : 1;
    }
}

/* xp[m][p * pairs + i] = bf16 pair (xa[m][p * R + 2i], xa[m][p * R + 2i + 1]), rounded
   to nearest even, an odd rank's last pair zero-padded as B's is */
static void lora_pairs(const dl_lora *L, const float *xa, int64_t rows, uint32_t *xp) {
    const int64_t R = L->rank, pairs = (R + 1) / 2;
    for (int64_t m = 0; m < rows; m++)
        for (int64_t p = 0; p < L->parts; p++) {
            const float *v = xa + m * LORA_COLS + p * R;
            uint32_t *out = xp + m * LORA_PAIRS + p * pairs;
            for (int64_t i = 0; i < pairs; i++) {
                const uint32_t hi = 2 * i + 1 < R ? round_bf16(v[2 * i + 1]) : 0;
                out[i] = (uint32_t)round_bf16(v[2 * i]) | hi << 16;
            }
        }
}

LORA_BF16_TARGET static void lora_up_bf16(const dl_lora *L, int64_t s, const uint32_t *xp,
                                          void *y, int y16, int64_t rows) {
    const int64_t N = L->N, S = L->slots, pairs = (L->rank + 1) / 2;
    for (int64_t p = 0; p < L->parts; p++) {
        const uint16_t *B = L->b16 + 2 * ((p * pairs * S + s) * N + L->off[p]);
        const int64_t width = L->width[p];
        for (int64_t n = 0; n < width; n += 16) {
            const int64_t w = width - n < 16 ? width - n : 16;
            for (int64_t m = 0; m < rows; m += 4) {
                const int mb = rows - m < 4 ? (int)(rows - m) : 4;
                const uint32_t *xm = xp + m * LORA_PAIRS + p * pairs;
                const int64_t at = m * N + L->off[p] + n;
                void *ym = y16 ? (void *)((uint16_t *)y + at) : (void *)((float *)y + at);
                LORA_BY_ROWS(LORA_AXPY_BF16_CALL)
            }
        }
    }
}
#undef LORA_DOT4_BF16_CALL
#undef LORA_DOT1_BF16_CALL
#undef LORA_AXPY_BF16_CALL
#undef LORA_BY_ROWS

/* n bf16 values widened to fp32 (exact) */
static void widen_n(const uint16_t *src, float *dst, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, widen8(src + i));
    for (; i < n; i++) dst[i] = widen1(src[i]);
}

/* y = bf16(y + d), rounded to nearest even (round_bf16 eight at a time) */
static void add_round_n(uint16_t *y, const float *d, int64_t n) {
    const __m256i half = _mm256_set1_epi32(0x7fff), one = _mm256_set1_epi32(1);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256i u = _mm256_castps_si256(_mm256_add_ps(widen8(y + i), _mm256_loadu_ps(d + i)));
        __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), one);
        u = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(half, odd)), 16);
        u = _mm256_permute4x64_epi64(_mm256_packus_epi32(u, u), 0x08);
        _mm_storeu_si128((__m128i *)(y + i), _mm256_castsi256_si128(u));
    }
    for (; i < n; i++) y[i] = round_bf16(widen1(y[i]) + d[i]);
}

typedef struct {
    const dl_lora *L;
    const void *x;
    void *y;
    int x_bf16, y_bf16;
    const int64_t *blocks; /* block b: rows [blocks[3b], blocks[3b + 1]) of slot blocks[3b + 2] */
    atomic_int failed;     /* a block's scratch allocation failed */
} lora_job;

/* the vdpbf16ps form of lora_rows: x and a bf16 y (`y16`) the block's rows as they are */
static void lora_rows_bf16(const dl_lora *L, const uint16_t *x, void *y, int y16,
                           int64_t rows, int64_t s) {
    float xa[LORA_ROWS * LORA_COLS];
    uint32_t xp[LORA_ROWS * LORA_PAIRS];
    lora_down_bf16(L, L->a16 + s * L->K, x, rows, xa);
    lora_pairs(L, xa, rows, xp);
    lora_up_bf16(L, s, xp, y, y16, rows);
}

static void lora_rows(const dl_lora *L, const float *x, float *y, int64_t rows, int64_t s) {
    float xa[LORA_ROWS * LORA_COLS];
    if (L->wide) {
        lora_down_wide(L, L->a + s * L->K, x, rows, xa);
        lora_up_wide(L, s, xa, y, rows);
    } else {
        lora_down_avx2(L, L->a + s * L->K, x, rows, xa);
        lora_up_avx2(L, s, xa, y, rows);
    }
}

/* one block: up to LORA_ROWS consecutive rows of one slot; bf16 rows are widened into a
   scratch of the block's own (a whole step's would be megabytes, faulted in every call),
   except in the vdpbf16ps form */
static void lora_chunk(void *ctx, int64_t c) {
    lora_job *j = ctx;
    const dl_lora *L = j->L;
    const int64_t *b = j->blocks + 3 * c, m0 = b[0], rows = b[1] - b[0], s = b[2];
    const int64_t K = L->K, N = L->N;
    if (j->x_bf16 && L->a16) { /* the vdpbf16ps form: x and y read as they are */
        uint16_t *yh = (uint16_t *)j->y + m0 * N;
        void *y = j->y_bf16 ? (void *)yh : (void *)((float *)j->y + m0 * N);
        lora_rows_bf16(L, (const uint16_t *)j->x + m0 * K, y, j->y_bf16, rows, s);
        return;
    }
    float *xf = j->x_bf16 ? malloc(rows * K * sizeof(float)) : (float *)j->x + m0 * K;
    float *yf = j->y_bf16 ? calloc(rows * N, sizeof(float)) : (float *)j->y + m0 * N;
    if (xf && yf) {
        if (j->x_bf16) widen_n((const uint16_t *)j->x + m0 * K, xf, rows * K);
        lora_rows(L, xf, yf, rows, s);
        if (j->y_bf16) add_round_n((uint16_t *)j->y + m0 * N, yf, rows * N);
    } else {
        atomic_store(&j->failed, 1);
    }
    if (j->x_bf16) free(xf);
    if (j->y_bf16) free(yf);
}

/* x [M, K], y [M, N] (fp32, or bf16 where flagged) += each row's delta: a bf16 x widened
   exactly, a bf16 y given the fp32 delta then rounded once, as torch adds an fp32 product
   into a bf16 tensor; SLUICE_E_ADAPTER for a slot outside -1..S-1 */
static int lora_apply(const dl_lora *L, const void *x, int x_bf16, void *y, int y_bf16,
                      int64_t M, const int64_t *row_slots, int threads) {
    for (int64_t m = 0; m < M; m++)
        if (row_slots[m] < -1 || row_slots[m] >= L->slots) return SLUICE_E_ADAPTER;
    if (!L->a) return SLUICE_OK;
    int64_t *blocks = malloc(3 * M * sizeof(int64_t)), n = 0;
    if (!blocks) return SLUICE_E_NOMEM;
    for (int64_t m = 0, e; m < M; m = e) {
        const int64_t s = row_slots[m];
        for (e = m + 1; e < M && e - m < LORA_ROWS && row_slots[e] == s;) e++;
        if (s >= 0 && L->targeted[s]) {
            blocks[3 * n] = m, blocks[3 * n + 1] = e, blocks[3 * n + 2] = s;
            n++;
        }
    }
    lora_job job = {L, x, y, x_bf16, y_bf16, blocks, 0};
    if (threads > 1 && n > 1) {
        parallel_for(lora_chunk, &job, n, threads);
    } else {
        for (int64_t c = 0; c < n; c++) lora_chunk(&job, c);
    }
    free(blocks);
    return atomic_load(&job.failed) ? SLUICE_E_NOMEM : SLUICE_OK;
}

int sluice_lora_add(const dl_lora *L, const void *x, int x_bf16, void *y, int y_bf16,
                    int64_t M, const int64_t *row_slots, int threads) {
    if (M < 1 || threads < 1 || L->parts < 1 || L->parts > 4 || L->parts * L->rank > LORA_COLS)
        return SLUICE_E_ARGS;
    return lora_apply(L, x, x_bf16, y, y_bf16, M, row_slots, threads);
}

/* ---- sluice_decode_layers: every decoder layer of a small decode step in one call ----

   What `DecoderLayer.forward_decode` does per layer, with the same kernels in the same
   order and the same thread counts, so the hidden states are bit-identical to it: the
   Python glue around ~10 kernel calls a layer (argument conversion, tensor allocation)
   cost about as much as the step's attention. The
   projections are (`kind`) 0 bf16 (`mode` as sluice_bf16_linear's), 1 int8 (`scale` per
   row), or 4 or 8 quantized blocks (sluice_q_linear's `bits`; `mode` its `vnni`). */
typedef struct {
    const void *w;
    const float *scale; /* int8 only */
    const float *bias;
    int64_t N, K;
    int32_t kind, mode;
} dl_proj;

typedef struct {
    const float *in_norm, *post_norm;
    dl_proj qkv, o, gate_up, down;
    void *cache;
    int64_t window;
} dl_layer;

typedef struct {
    int64_t layers, H, I, Hq, Hkv, D, bs;
    float eps, scale;
    const float *rope; /* [positions, D/2, 2] */
    int32_t cache_bf16, threads;
    int64_t min_work; /* a kernel's multiply-adds below which it runs on one thread */
    int64_t blocks, positions; /* of every layer's KV cache, of the RoPE table */
} dl_model;

static int dl_threads(const dl_model *m, int64_t work) {
    return work >= m->min_work ? m->threads : 1;
}

static int dl_linear(const dl_model *m, const dl_proj *p, const float *x, float *y, int64_t M,
                     int acc) {
    const int th = dl_threads(m, M * p->N * p->K);
    if (p->kind == 4 || p->kind == 8)
        return sluice_q_linear(p->w, p->kind, x, p->bias, y, M, p->N, p->K, th, acc, p->mode,
                               0, 0);
    if (p->kind == 1)
        return sluice_int8_linear(p->w, p->scale, x, p->bias, y, M, p->N, p->K, th, acc);
    return sluice_bf16_linear(p->w, x, p->bias, y, M, p->N, p->K, th, acc, p->mode);
}

/* lora: NULL, or per layer the qkv, o, gate_up and down adapters (`dl_lora`), with
   row_slots [M] each row's slot (-1: the base model) */
int sluice_decode_layers(const dl_model *m, const dl_layer *layers, float *h, int64_t M,
                         const int64_t *pos, const int64_t *slots, const int64_t *table,
                         int64_t nblk, const int64_t *num_keys, const dl_lora *lora,
                         const int64_t *row_slots) {
    const int64_t H = m->H, I = m->I, D = m->D, qkv_w = (m->Hq + 2 * m->Hkv) * D;
    if (M < 1 || M > 4 || !attn_shape_ok(m->Hq, m->Hkv, D, m->bs, m->blocks))
        return SLUICE_E_ARGS;
    /* every layer reads and writes the same ids: checked once for the step, the blocks
       of the widest window (0: every key) */
    if (!positions_ok(pos, M, m->positions)) return SLUICE_E_POS;
    int64_t widest = 0;
    for (int64_t l = 0; l < m->layers; l++) {
        const int64_t w = layers[l].window;
        if (w <= 0) { widest = 0; break; }
        widest = w > widest ? w : widest;
    }
    int rc = decode_rows_ok(slots, table, nblk, num_keys, widest, M, m->bs, m->blocks);
    if (rc) return rc;
    float *x = malloc((size_t)M * (H + qkv_w + m->Hq * D + 3 * I) * sizeof(float));
    if (!x) return SLUICE_E_NOMEM;
    float *qkv = x + M * H, *attn = qkv + M * qkv_w, *gu = attn + M * m->Hq * D;
    float *act = gu + 2 * M * I;
    /* shared whenever there are tasks to share: the helpers still spin from the qkv GEMV */
    const int attn_threads = M * m->Hkv > 1 ? m->threads : 1;
    for (int64_t l = 0; l < m->layers && rc == 0; l++) {
        const dl_layer *L = layers + l;
        sluice_rms_norm(h, L->in_norm, m->eps, x, M, H);
        const dl_lora *ad = lora ? lora + 4 * l : NULL;
        if ((rc = dl_linear(m, &L->qkv, x, qkv, M, 0))) break;
        if (ad && (rc = lora_apply(ad, x, 0, qkv, 0, M, row_slots, 1))) break;
        rope_rows(qkv, qkv_w, M, m->rope, pos, m->Hq + m->Hkv, D / 2);
        rc = attn_decode_run(qkv, qkv_w, L->cache, slots, table, nblk, num_keys, L->window,
                             M, m->Hq, m->Hkv, D, m->bs, m->scale, attn, attn_threads,
                             m->cache_bf16);
        if (rc || (rc = dl_linear(m, &L->o, attn, h, M, 1))) break;
        if (ad && (rc = lora_apply(ad + 1, attn, 0, h, 0, M, row_slots, 1))) break;
        sluice_rms_norm(h, L->post_norm, m->eps, x, M, H);
        if ((rc = dl_linear(m, &L->gate_up, x, gu, M, 0))) break;
        if (ad && (rc = lora_apply(ad + 2, x, 0, gu, 0, M, row_slots, 1))) break;
        sluice_silu_mul(gu, act, M, I);
        if ((rc = dl_linear(m, &L->down, act, h, M, 1))) break;
        if (ad && (rc = lora_apply(ad + 3, act, 0, h, 0, M, row_slots, 1))) break;
    }
    free(x);
    return rc;
}
