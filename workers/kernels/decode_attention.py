"""Attention of one new token per row over a float32 KV cache: one C kernel for compiled decode steps.

Why: traced by torch.compile, decode attention (workers/layers.py `attention`) becomes products and
sums that inductor fuses into loops of its own. On the cpu backend those loops ran at about a third
of the speed the cache's bytes allow: each score is a dot product of 64 lanes closed by a
horizontal sum, the query's rotary embedding is recomputed for every slot it meets, and every slot
of the cache is read whether the mask lets it count or not. At 16 running sequences attention took
a quarter of a SmolLM2 decode step on machine J (README, Measured).

Here one task is one part of one (batch row, KV head): the query heads that share the KV head (GQA's
group) against the slots the mask allows in one stretch of PART_SLOTS slots, listed once per batch
row by each thread that takes its tasks; slots it excludes are never read. Threads (OpenMP, the
runtime torch uses) split the tasks.
Without parts, one long row gave as many tasks as KV heads: SmolLM2's 3 on 2 threads left a thread
idle for a third of the step's attention, and a rank holding one KV head attended on one thread.
Each part's softmax is normalized over its own slots, and the parts of a (row, KV head) are then
combined, weighted by exp(part maximum - maximum) x part sum. Parts are cut at fixed slots, so a
row that fits one part is computed exactly as before, and no row's result depends on the batch or
on how many slots the step reads. Two paths compute a task:
- Vector (AVX2 and FMA, head_dim a multiple of 8). Scores 8 slots at a time: every query head of
  the group passes over the block's 8 keys while they sit in L1, one accumulator per slot, and one
  transposing sum turns the 8 accumulators into 8 scores (instead of a horizontal sum closing every
  dot product). The softmax takes 8 exponentials at a time (a polynomial, a float's rounding). The
  values are summed in tiles of slots whose rows stay in L1 while each pass (32 lanes of up to 3
  query heads, 12 accumulators in registers) goes over them. Software prefetches keep two streams
  from memory in flight: the keys 32 slots ahead and the values (of the first tile during the
  scores, of the next tile during each tile). The slot-by-slot kernel it replaced on such hosts
  read the cache at 6-9 GB/s on one that streams 22, this path at 8-10 (README, Measured, K).
- Portable C (any other host or head_dim): slot by slot, each allowed slot's key read once for the
  group and scored against each query head, expf, each allowed slot's value row read once for the
  group.

The serving engine's cache has a row per sequence and a step names each batch row's cache row
(`rows`); the static batch's cache rows are the batch rows (`rows` None). Only the first
`read_slots` slots of a row are looked at, as the step's mask is that wide.

Results are not bit-identical to the traced products and sums (other summation orders, and other
exponentials), nor from one path to the other, but a row's result depends on nothing but its own
query, cache row and mask: batch invariance holds as before.

A torch custom operator (`corelaunch::decode_attention`), compiled as C++ against the installed
torch at first use into the per-user cache of workers/native_build.py; unavailable (no compiler,
CORELAUNCH_DECODE_ATTENTION=0) means the traced products and sums run as before.
"""

from __future__ import annotations

import ctypes

import torch

from workers import native_build
from workers.kernels.small_linear import _cpu_identity
from workers.native_build import LibrarySpec, NativeUnavailable

MAX_GROUP = 64
"""Query heads per KV head the kernel takes (CL_MAX_GROUP in its source: the portable path keeps a
maximum per query head on the stack)."""
PART_SLOTS = 512
"""A task covers at most this many slots of a row (CL_PART_SLOTS in the source): longer rows are
cut into parts at fixed slots, and the parts' results combined (see the module docstring)."""

_SOURCE = r"""
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>
#if defined(__AVX2__) && defined(__FMA__) && !defined(CL_PORTABLE_ONLY)
#include <immintrin.h>
#define CL_VECTOR_PATH 1
#else
#define CL_VECTOR_PATH 0
#endif

#define KEY_AHEAD 4                 /* blocks of 8 slots: keys are prefetched 32 slots ahead */
#define VALUE_TILE_BYTES 16384      /* value rows of one tile: they stay in L1 for every pass */
#define CL_MAX_GROUP 64             /* query heads per KV head: MAX_GROUP on the Python side */
#define CL_PART_SLOTS 512           /* a task covers at most this many slots of a row: PART_SLOTS in Python */
#define CL_ALL_NEG_INF -1.f         /* a part's "sum" when all its scores are -inf (see all_neg_inf) */

int cl_decode_attention_vector_path(void) { return CL_VECTOR_PATH; }

static long parts_of(long read_slots) { return (read_slots + CL_PART_SLOTS - 1) / CL_PART_SLOTS; }

/* Whether a part's scores for one query head (largest: best) are all -inf, from an infinity in a
   key or the query. Such a part has no true sum (its exponentials are exp(-inf + inf), NaN): it
   reports CL_ALL_NEG_INF instead, and the combination leaves it out, as one task over the whole
   row gives those slots no weight. A part with a NaN score keeps its NaN sum, which reaches the
   output. Real sums are at least 1 (the maximum's own exponential) or NaN. */
static int all_neg_inf(const float *scores, long count, float best) {
    if (best != -INFINITY) return 0;
    for (long s = 0; s < count; s++)
        if (scores[s] != scores[s]) return 0;
    return 1;
}

/* Floats of workspace cl_decode_attention needs: per thread, a group's scores over read_slots and
   the allowed slots' indices (int32, one float each); then, when read_slots spans more than one
   part, every part's result of every (batch row, KV head): the group's outputs and, per query head,
   the part's maximum score and sum of exponentials. */
long cl_decode_attention_workspace_floats(long batch, long kv_heads, long group, long head_dim, long read_slots,
                                          int threads) {
    long parts = parts_of(read_slots);
    return (long)threads * (group + 1) * read_slots
           + (parts > 1 ? batch * kv_heads * parts * group * (head_dim + 2) : 0);
}

#if CL_VECTOR_PATH
/* exp(x) for 8 lanes, x <= 0 (scores minus their maximum): 2^n exp(r), n = round(x log2 e),
   r = x - n ln 2 (ln 2 in two parts), exp(r) by a degree-6 polynomial on [-ln2/2, ln2/2] (relative
   error about 2e-7, a float's rounding). Below -87.3 the result is flushed to 0 (expf gives
   subnormals down to about -104: weights that small change no float sum). A NaN stays NaN. */
static inline __m256 exp8(__m256 x) {
    const __m256 lo = _mm256_set1_ps(-87.33654f);
    __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
    x = _mm256_max_ps(lo, x);  /* operands in this order: a NaN in x comes through */
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(under, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}

/* One vector holding the lane sums of a[0..7] (lane j: the sum of a[j]'s lanes). */
static inline __m256 sums8(const __m256 *a) {
    __m256 s01 = _mm256_hadd_ps(a[0], a[1]), s23 = _mm256_hadd_ps(a[2], a[3]);
    __m256 s45 = _mm256_hadd_ps(a[4], a[5]), s67 = _mm256_hadd_ps(a[6], a[7]);
    __m256 s0123 = _mm256_hadd_ps(s01, s23), s4567 = _mm256_hadd_ps(s45, s67);
    /* each 128-bit half of s0123 holds half of the sums of a[0..3]; likewise s4567 */
    return _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20), _mm256_permute2f128_ps(s0123, s4567, 0x31));
}

/* One task (a part of one (batch row, KV head)), dim % 8 == 0: the group's queries qg (group x dim)
   over the `count` slots listed in idx of keys and values (slots x dim); scores: group x count
   floats. o gets the group's outputs; stats, unless NULL (a row in one part), each query head's
   largest score and sum of exponentials (see all_neg_inf), for combine_parts. */
static void task_vector(const float *qg, const float *keys, const float *values, const int32_t *idx, long count,
                        long group, long dim, float scale, float *scores, float *o, float *stats) {
    const __m256 vscale = _mm256_set1_ps(scale);
    long tile = VALUE_TILE_BYTES / (dim * 4) < 8 ? 8 : VALUE_TILE_BYTES / (dim * 4);
    /* Scores, 8 slots at a time: each query head of the group passes over the block's 8 keys while
       they sit in L1, with 8 accumulators (one per slot) and one transposing sum at the end. */
    for (long s0 = 0; s0 < count; s0 += 8) {
        long n = count - s0 < 8 ? count - s0 : 8;
        const float *key[8];
        for (long j = 0; j < 8; j++) key[j] = keys + (long)idx[s0 + (j < n ? j : n - 1)] * dim;
        /* Two streams from memory in flight instead of one: the keys KEY_AHEAD blocks on, and this
           block's values while it is in the first tile (the value pass prefetches later tiles). */
        for (long s = s0 + 8 * KEY_AHEAD; s < s0 + 8 * KEY_AHEAD + 8 && s < count; s++)
            for (long d = 0; d < dim; d += 16) __builtin_prefetch(keys + (long)idx[s] * dim + d, 0, 3);
        if (s0 < tile)
            for (long j = 0; j < n; j++)
                for (long d = 0; d < dim; d += 16) __builtin_prefetch(values + (long)idx[s0 + j] * dim + d, 0, 2);
        for (long g = 0; g < group; g++) {
            const float *qq = qg + g * dim;
            __m256 acc[8];
            for (int j = 0; j < 8; j++) acc[j] = _mm256_setzero_ps();
            for (long d = 0; d < dim; d += 8) {
                __m256 qv = _mm256_loadu_ps(qq + d);
                for (int j = 0; j < 8; j++) acc[j] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(key[j] + d), acc[j]);
            }
            float block[8];
            _mm256_storeu_ps(block, _mm256_mul_ps(sums8(acc), vscale));
            memcpy(scores + g * count + s0, block, n * sizeof(float));
        }
    }
    /* The softmax of each query head, 8 exponentials at a time. */
    for (long g = 0; g < group; g++) {
        float *sg = scores + g * count, best = -INFINITY, total = 0.f, lanes[8];
        for (long s = 0; s < count; s++) best = sg[s] > best ? sg[s] : best;
        int infinite = stats && all_neg_inf(sg, count, best);  /* before sg holds exponentials */
        __m256 vbest = _mm256_set1_ps(best), vtotal = _mm256_setzero_ps();
        long s = 0;
        for (; s + 8 <= count; s += 8) {
            __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(sg + s), vbest));
            _mm256_storeu_ps(sg + s, e);
            vtotal = _mm256_add_ps(vtotal, e);
        }
        _mm256_storeu_ps(lanes, vtotal);
        for (int j = 0; j < 8; j++) total += lanes[j];
        if (s < count) {
            for (long j = 0; j < 8; j++) lanes[j] = s + j < count ? sg[s + j] - best : -INFINITY;
            _mm256_storeu_ps(lanes, exp8(_mm256_loadu_ps(lanes)));
            for (long j = 0; s + j < count; j++) { sg[s + j] = lanes[j]; total += lanes[j]; }
        }
        float inv = 1.f / total;
        for (s = 0; s < count; s++) sg[s] *= inv;
        if (stats) { stats[2 * g] = best; stats[2 * g + 1] = infinite ? CL_ALL_NEG_INF : total; }
    }
    /* Values, in tiles of slots whose rows (VALUE_TILE_BYTES) stay in L1 while every pass goes over
       them: a pass takes 32 lanes of the head for up to 3 query heads (12 accumulators, parked in
       `o` between tiles). The next tile's rows are prefetched meanwhile. */
    for (long t0 = 0; t0 < count; t0 += tile) {
        long t1 = t0 + tile < count ? t0 + tile : count, t2 = t1 + tile < count ? t1 + tile : count;
        for (long s = t1; s < t2; s++)
            for (long d = 0; d < dim; d += 16) __builtin_prefetch(values + (long)idx[s] * dim + d, 0, 3);
        for (long d0 = 0; d0 < dim; d0 += 32) {
            long vecs = (dim - d0 < 32 ? dim - d0 : 32) / 8;
            for (long g0 = 0; g0 < group; g0 += 3) {
                long gs = group - g0 < 3 ? group - g0 : 3;
                __m256 acc[3][4];
                for (int a = 0; a < 3; a++)
                    for (int c = 0; c < 4; c++)
                        acc[a][c] = t0 > 0 && a < gs && c < vecs ? _mm256_loadu_ps(o + (g0 + a) * dim + d0 + 8 * c)
                                                                 : _mm256_setzero_ps();
                for (long s = t0; s < t1; s++) {
                    const float *value = values + (long)idx[s] * dim + d0;
                    __m256 v[4];
                    for (int c = 0; c < 4; c++) v[c] = c < vecs ? _mm256_loadu_ps(value + 8 * c) : _mm256_setzero_ps();
                    for (int a = 0; a < 3 && a < gs; a++) {
                        __m256 w = _mm256_set1_ps(scores[(g0 + a) * count + s]);
                        for (int c = 0; c < 4; c++) if (c < vecs) acc[a][c] = _mm256_fmadd_ps(w, v[c], acc[a][c]);
                    }
                }
                for (int a = 0; a < gs; a++)
                    for (int c = 0; c < vecs; c++) _mm256_storeu_ps(o + (g0 + a) * dim + d0 + 8 * c, acc[a][c]);
            }
        }
    }
}
#endif

/* The same task in portable C, any dim, slot by slot: each allowed slot's key is read once for the
   whole group and scored against each query head (a dot product closed by a horizontal sum), the
   softmax takes the C library's expf, and each allowed slot's value row is read once for the group. */
static void task_portable(const float *qg, const float *keys, const float *values, const int32_t *idx, long count,
                          long group, long dim, float scale, float *scores, float *o, float *stats) {
    float best[CL_MAX_GROUP];  /* per query head of the group (the operator checks the bound) */
    for (long g = 0; g < group; g++) best[g] = -INFINITY;
    for (long s = 0; s < count; s++) {
        const float *key = keys + (long)idx[s] * dim;
        for (long g = 0; g < group; g++) {
            const float *qq = qg + g * dim;
            float dot = 0.f;
            #pragma omp simd reduction(+:dot)
            for (long d = 0; d < dim; d++) dot += qq[d] * key[d];
            dot *= scale;
            scores[g * count + s] = dot;
            if (dot > best[g]) best[g] = dot;
        }
    }
    for (long g = 0; g < group; g++) {
        float *sg = scores + g * count, *og = o + g * dim, total = 0.f;
        int infinite = stats && all_neg_inf(sg, count, best[g]);  /* before sg holds exponentials */
        for (long s = 0; s < count; s++) { sg[s] = expf(sg[s] - best[g]); total += sg[s]; }
        float inv = 1.f / total;
        for (long s = 0; s < count; s++) sg[s] *= inv;
        for (long d = 0; d < dim; d++) og[d] = 0.f;
        if (stats) { stats[2 * g] = best[g]; stats[2 * g + 1] = infinite ? CL_ALL_NEG_INF : total; }
    }
    for (long s = 0; s < count; s++) {
        const float *value = values + (long)idx[s] * dim;
        for (long g = 0; g < group; g++) {
            float w = scores[g * count + s], *og = o + g * dim;
            #pragma omp simd
            for (long d = 0; d < dim; d++) og[d] += w * value[d];
        }
    }
}

/* First index i in idx[0..count) with idx[i] >= slot (idx ascending). */
static long first_at_or_after(const int32_t *idx, long count, long slot) {
    long lo = 0, hi = count;
    while (lo < hi) {
        long mid = (lo + hi) / 2;
        if (idx[mid] < slot) lo = mid + 1; else hi = mid;
    }
    return lo;
}

/* Whether a part's reported sum puts it in the combination: not empty (0), not all -inf; NaN is. */
static int used_part(float sum) { return sum != 0.f && sum != CL_ALL_NEG_INF; }

/* The parts of one (batch row, KV head) into its group's outputs o (group x dim). Each part's
   outputs are normalized by its own sum; weighted by exp(part max - max) x part sum, over the total.
   Parts with no allowed slot (sum 0) and parts whose scores are all -inf (CL_ALL_NEG_INF) are left
   out; a single part left is copied as it is, so a row whose slots all lie in one part gets the
   same bits as if read_slots had been one part. A NaN score reaches the output through its part's
   sum (NaN: the maximum passes NaN by). With no part left, zeros for a row with nothing allowed
   (as one task gives) and NaN for one whose scores are all -inf (softmax over nothing finite). */
static void combine_parts(const float *part, long parts, long group, long dim, float *o) {
    long stride = group * (dim + 2);
    for (long g = 0; g < group; g++) {
        float best = -INFINITY, total = 0.f, *og = o + g * dim;
        long used = 0, last = 0, infinite = 0;
        for (long p = 0; p < parts; p++) {
            const float *st = part + p * stride + group * dim + 2 * g;
            infinite |= st[1] == CL_ALL_NEG_INF;
            if (used_part(st[1])) {
                used++, last = p;
                best = st[0] > best ? st[0] : best;
            }
        }
        if (used <= 1) {
            if (used == 1) memcpy(og, part + last * stride + g * dim, dim * sizeof(float));
            else for (long d = 0; d < dim; d++) og[d] = infinite ? NAN : 0.f;
            continue;
        }
        for (long p = 0; p < parts; p++) {
            const float *st = part + p * stride + group * dim + 2 * g;
            if (used_part(st[1])) total += expf(st[0] - best) * st[1];
        }
        for (long d = 0; d < dim; d++) og[d] = 0.f;
        for (long p = 0; p < parts; p++) {
            const float *st = part + p * stride + group * dim + 2 * g, *op = part + p * stride + g * dim;
            if (!used_part(st[1])) continue;
            float w = expf(st[0] - best) * st[1] / total;
            for (long d = 0; d < dim; d++) og[d] += w * op[d];
        }
    }
}

/* out (batch, q_heads, head_dim) = softmax(q k^T * scale | mask) v for one query per batch row.
   q (batch, q_heads, head_dim); caches (cache_rows, kv_heads, slots, head_dim), all contiguous;
   rows (batch) the cache row of each batch row, or NULL for row b; mask (batch, read_slots), true
   where a slot counts. workspace: cl_decode_attention_workspace_floats(batch, kv_heads, group,
   head_dim, read_slots, threads) floats.

   One task is one part of one (batch row, KV head): the row's slots cut at every CL_PART_SLOTS, so
   that one long row's few KV heads still give every thread work (SmolLM2's 3 KV heads on 2 threads
   left one thread idle a third of the time). Parts are cut at fixed slots, whatever the batch and
   read_slots: a row's result depends on its own query, cache row and mask only. */
void cl_decode_attention(const float *q, const float *k_cache, const float *v_cache, const int64_t *rows,
                         const uint8_t *mask, float *out, float *workspace, long batch, long q_heads, long kv_heads,
                         long slots, long head_dim, long read_slots, float scale, int threads) {
    long group = q_heads / kv_heads, parts = parts_of(read_slots), tasks = batch * kv_heads * parts;
    long part_stride = group * (head_dim + 2);
    float *partials = workspace + (long)threads * (group + 1) * read_slots;  /* used when parts > 1 */
    #pragma omp parallel num_threads(threads)
    {
        float *scores = workspace + (long)omp_get_thread_num() * (group + 1) * read_slots;
        int32_t *idx = (int32_t *)(scores + group * read_slots);
        long listed = -1, count = 0;
        #pragma omp for schedule(static)
        for (long t = 0; t < tasks; t++) {
            long b = t / (kv_heads * parts), h = t / parts % kv_heads, p = t % parts, row = rows ? rows[b] : b;
            if (b != listed) {  /* batch row b's allowed slots, listed once for all its tasks */
                const uint8_t *m = mask + b * read_slots;
                count = 0;
                for (long s = 0; s < read_slots; s++)
                    if (m[s]) idx[count++] = (int32_t)s;
                listed = b;
            }
            long lo = parts > 1 ? first_at_or_after(idx, count, p * CL_PART_SLOTS) : 0;
            long hi = parts > 1 ? first_at_or_after(idx, count, (p + 1) * CL_PART_SLOTS) : count;
            const float *keys = k_cache + (row * kv_heads + h) * slots * head_dim;
            const float *values = v_cache + (row * kv_heads + h) * slots * head_dim;
            const float *qg = q + (b * q_heads + h * group) * head_dim;
            float *o = parts > 1 ? partials + ((b * kv_heads + h) * parts + p) * part_stride
                                 : out + (b * q_heads + h * group) * head_dim;
            float *stats = parts > 1 ? o + group * head_dim : NULL;
            if (hi == lo) {  /* nothing to attend to: zeros (never for a real token), or an empty part */
                memset(o, 0, (parts > 1 ? part_stride : group * head_dim) * sizeof(float));
                continue;
            }
#if CL_VECTOR_PATH
            if (head_dim % 8 == 0) {
                task_vector(qg, keys, values, idx + lo, hi - lo, group, head_dim, scale, scores, o, stats);
                continue;
            }
#endif
            task_portable(qg, keys, values, idx + lo, hi - lo, group, head_dim, scale, scores, o, stats);
        }
        if (parts > 1) {
            #pragma omp for schedule(static)
            for (long bh = 0; bh < batch * kv_heads; bh++)
                combine_parts(partials + bh * parts * part_stride, parts, group, head_dim, out + bh * group * head_dim);
        }
    }
}
"""

_OPERATOR_SOURCE = r"""
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

/* corelaunch::decode_attention's CPU kernel, registered with the dispatcher when the library loads. */
static at::Tensor decode_attention_cpu(const at::Tensor &q, const at::Tensor &k_cache, const at::Tensor &v_cache,
                                       const std::optional<at::Tensor> &rows, const at::Tensor &mask,
                                       int64_t read_slots, double scale) {
    TORCH_CHECK(q.dim() == 4 && q.size(2) == 1 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes()
                && q.scalar_type() == at::kFloat && k_cache.scalar_type() == at::kFloat
                && v_cache.scalar_type() == at::kFloat && k_cache.is_contiguous() && v_cache.is_contiguous()
                && k_cache.size(1) > 0 && q.size(3) > 0  /* before the division below, and the tiling's by head_dim */
                && q.size(3) == k_cache.size(3) && q.size(1) % k_cache.size(1) == 0
                && q.size(1) / k_cache.size(1) <= CL_MAX_GROUP && read_slots > 0 && read_slots <= k_cache.size(2)
                && mask.scalar_type() == at::kBool && mask.numel() == q.size(0) * read_slots,
                "decode_attention takes float32 q (batch, q_heads, 1, head_dim), contiguous float32 caches "
                "(rows, kv_heads, slots, head_dim) with at most ", CL_MAX_GROUP, " query heads per KV head, "
                "read_slots within the slots and a bool mask of batch x read_slots; got q ", q.sizes(), " ", q.scalar_type(),
                ", caches ", k_cache.sizes(), " ", k_cache.scalar_type(), ", mask ", mask.sizes(), " ",
                mask.scalar_type(), ", read_slots ", read_slots);
    int64_t batch = q.size(0);
    TORCH_CHECK(rows.has_value() || batch <= k_cache.size(0), "decode_attention: batch ", batch,
                " without rows needs as many cache rows, not ", k_cache.size(0));
    at::Tensor r = rows.has_value() ? rows->to(at::kLong).contiguous() : at::Tensor();
    TORCH_CHECK(!r.defined() || r.numel() == batch, "decode_attention: rows has ", r.defined() ? r.numel() : 0,
                " entries, not batch ", batch);
    if (r.defined()) {
        const int64_t *rp = r.data_ptr<int64_t>();
        for (int64_t b = 0; b < batch; b++)
            TORCH_CHECK(rp[b] >= 0 && rp[b] < k_cache.size(0), "decode_attention: row ", rp[b], " of batch row ", b,
                        " is outside the cache's ", k_cache.size(0), " rows");
    }
    at::Tensor qc = q.contiguous(), m = mask.contiguous();
    at::Tensor out = at::empty(q.sizes(), q.options());
    int threads = at::get_num_threads();
    int64_t group = q.size(1) / k_cache.size(1);
    at::Tensor workspace = at::empty({(int64_t)cl_decode_attention_workspace_floats(
        batch, k_cache.size(1), group, q.size(3), read_slots, threads)}, q.options());
    cl_decode_attention(qc.data_ptr<float>(), k_cache.data_ptr<float>(), v_cache.data_ptr<float>(),
                        r.defined() ? r.data_ptr<int64_t>() : nullptr, (const uint8_t *)m.data_ptr<bool>(),
                        out.data_ptr<float>(), workspace.data_ptr<float>(), batch, q.size(1), k_cache.size(1),
                        k_cache.size(2), q.size(3), read_slots, (float)scale, threads);
    return out;
}

TORCH_LIBRARY_IMPL(corelaunch, CPU, m) { m.impl("decode_attention", &decode_attention_cpu); }
"""

_FLAGS = ("-O3", "-march=native", "-fopenmp")


def _host_spec() -> LibrarySpec:
    """The kernel with its torch operator, compiled as C++ against this torch."""
    return native_build.torch_operator_spec("corelaunch_decode_attention", _SOURCE, _OPERATOR_SOURCE, _FLAGS,
                                            "the decode attention kernel", _cpu_identity())


def kernel_spec(source: str = _SOURCE, portable: bool = False, stem: str = "corelaunch_decode_attention_c",
                what: str = "the decode attention kernel") -> LibrarySpec:
    """The kernel alone (C, no operator), for tests and benchmarks/decode_attention.py through
    run_kernel: the host's build, or with `portable` the portable C path (slot by slot, expf) that
    hosts without AVX2 and FMA run, and head dims that are not a multiple of 8 everywhere."""
    flags = (*_FLAGS, "-DCL_PORTABLE_ONLY") if portable else _FLAGS
    return LibrarySpec(stem + ("_portable" if portable else ""), source, flags,
                       what + (" (portable path)" if portable else ""), _cpu_identity())


def build_kernel(spec: LibrarySpec) -> ctypes.CDLL:
    """Build (once per source, flags and CPU) and load a kernel_spec library; raises NativeUnavailable."""
    return declare(native_build.build_and_load(spec))


def declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    """Give ctypes the library's C signatures (run_kernel's calls)."""
    p, i64 = ctypes.c_void_p, ctypes.c_long
    lib.cl_decode_attention.argtypes = [p, p, p, p, p, p, p, i64, i64, i64, i64, i64, i64, ctypes.c_float,
                                        ctypes.c_int]
    lib.cl_decode_attention.restype = None
    lib.cl_decode_attention_workspace_floats.argtypes = [i64, i64, i64, i64, i64, ctypes.c_int]
    lib.cl_decode_attention_workspace_floats.restype = i64
    return lib


def run_kernel(lib: ctypes.CDLL, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               rows: torch.Tensor | None, mask: torch.Tensor, read_slots: int, scale: float) -> torch.Tensor:
    """What the operator computes, through a given build (its arguments unchecked: tests and benchmarks)."""
    batch, q_heads, _, head_dim = q.shape
    kv_heads, slots = k_cache.shape[1], k_cache.shape[2]
    if q_heads // kv_heads > MAX_GROUP:  # the portable path keeps a maximum per query head on the stack
        raise ValueError(f"{q_heads // kv_heads} query heads per KV head; the kernel takes at most {MAX_GROUP}")
    threads = torch.get_num_threads()
    q, mask = q.contiguous(), mask.expand(batch, *mask.shape[1:]).contiguous()
    rows = None if rows is None else rows.to(torch.int64).contiguous()
    out = torch.empty_like(q)
    scratch = torch.empty(lib.cl_decode_attention_workspace_floats(batch, kv_heads, q_heads // kv_heads, head_dim,
                                                                   read_slots, threads))
    lib.cl_decode_attention(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
                            None if rows is None else rows.data_ptr(), mask.data_ptr(), out.data_ptr(),
                            scratch.data_ptr(), batch, q_heads, kv_heads, slots, head_dim, read_slots, scale, threads)
    return out


unavailable_reason: str | None = None


@native_build.once_per_process
def _host_build():
    """The host's library, or why it cannot be built: tried once per process (a second copy loaded
    would register the operator's kernel again)."""
    try:
        return native_build.build_and_load(_host_spec())
    except NativeUnavailable as err:
        return str(err)


def available() -> bool:
    """Whether the operator's CPU kernel is built and registered (built now if needed). A constant
    to torch.compile (workers/compiled.py marks it before tracing)."""
    global unavailable_reason
    lib, unavailable_reason = native_build.load_unless_turned_off("CORELAUNCH_DECODE_ATTENTION", _host_build)
    return lib is not None


def usable(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether a traced decode step's attention takes the kernel: one float32 query per row on the
    CPU against a float32 cache (an fp8 cache keeps the traced path, which dequantizes it). A graph
    traced without mark_constants_for_tracing (a torch.compile other than workers/compiled.py's)
    keeps the traced path: tracing into available() (its lock) broke the graph at every layer.
    What the operator itself refuses (query heads not a multiple of the KV heads, a cache not laid
    out contiguously) keeps the traced path too, rather than failing the step."""
    if torch.compiler.is_compiling() and not _marked_for_tracing:
        return False
    q_heads, kv_heads = q.shape[1], k_cache.shape[1]
    return (q.device.type == "cpu" and q.dtype == torch.float32 and k_cache.dtype == torch.float32
            and q.shape[2] == 1 and kv_heads > 0 and q_heads % kv_heads == 0 and q_heads // kv_heads <= MAX_GROUP
            and k_cache.is_contiguous() and available())


# Schema and shape function here, so that torch.compile can trace the operator before anything is
# built; its CPU kernel is C++ in the library, registered when _host_build() loads it.
_OPS = torch.library.Library("corelaunch", "FRAGMENT")
_OPS.define("decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor? rows, Tensor mask, "
            "int read_slots, float scale) -> Tensor")


@torch.library.register_fake("corelaunch::decode_attention")
def _decode_attention_shape(q, k_cache, v_cache, rows, mask, read_slots, scale):
    return torch.empty_like(q, memory_format=torch.contiguous_format)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, rows: torch.Tensor | None,
                     mask: torch.Tensor, read_slots: int, scale: float) -> torch.Tensor:
    """(batch, q_heads, 1, head_dim): each batch row's query over cache row rows[b] (b when None),
    slots [0, read_slots) where mask (batch x read_slots elements, e.g. (batch, 1, 1, read_slots))
    is true."""
    if mask.shape[0] == 1 and q.shape[0] > 1:  # one mask shared by the batch
        mask = mask.expand(q.shape[0], *mask.shape[1:])
    if not torch.compiler.is_compiling() and not available():  # loading the library registers the kernel
        raise RuntimeError(f"the decode attention kernel is unavailable: {unavailable_reason}")
    return torch.ops.corelaunch.decode_attention(q, k_cache, v_cache, rows, mask, read_slots, scale)


_marked_for_tracing = False
"""Whether mark_constants_for_tracing ran in this process (usable() asks while traced)."""


def mark_constants_for_tracing() -> None:
    """Tells torch.compile to take available() as a constant (usable() calls it in every traced
    decode attention), as workers/kernels/small_linear.py does for its own."""
    import torch._dynamo

    global _marked_for_tracing
    torch._dynamo.assume_constant_result(available)
    _marked_for_tracing = True
