"""Attention of one new token per row over a float32 KV cache: one C kernel for compiled decode steps.

Why: traced by torch.compile, decode attention (workers/layers.py `attention`) becomes products and
sums that inductor fuses into loops of its own. On the cpu backend those loops ran at about a third
of the speed the cache's bytes allow: each score is a dot product of 64 lanes closed by a
horizontal sum, the query's rotary embedding is recomputed for every slot it meets, and every slot
of the cache is read whether the mask lets it count or not. At 16 running sequences attention took
a quarter of a SmolLM2 decode step on machine J (README, Measured).

Here one task is one (batch row, KV head): the query heads that share the KV head (GQA's group)
are scored against each slot the mask allows, slot by slot, with the slot's key read once for the
whole group; the softmax is taken per query head in float32 over those slots; the values are then
summed, each allowed slot's value row read once for the group. Slots the mask excludes are never
read. Threads (OpenMP, the runtime torch uses) split the tasks.

The serving engine's cache has a row per sequence and a step names each batch row's cache row
(`rows`); the static batch's cache rows are the batch rows (`rows` None). Only the first
`read_slots` slots of a row are looked at, as the step's mask is that wide.

Results are not bit-identical to the traced products and sums (another summation order, and the
exponential is the C library's), but a row's result depends on nothing but its own query, cache
row and mask: batch invariance holds as before.

A torch custom operator (`corelaunch::decode_attention`), compiled as C++ against the installed
torch at first use into the per-user cache of workers/native_build.py; unavailable (no compiler,
CORELAUNCH_DECODE_ATTENTION=0) means the traced products and sums run as before.
"""

from __future__ import annotations

import functools
import os

import torch

from workers import native_build
from workers.kernels.small_linear import _cpu_identity
from workers.native_build import LibrarySpec, NativeUnavailable

_SOURCE = r"""
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

/* out (batch, q_heads, head_dim) = softmax(q k^T * scale | mask) v for one query per batch row.
   q (batch, q_heads, head_dim); caches (cache_rows, kv_heads, slots, head_dim), all contiguous;
   rows (batch) the cache row of each batch row, or NULL for row b; mask (batch, read_slots), true
   where a slot counts. scratch: threads x (group x read_slots) floats. */
void cl_decode_attention(const float *q, const float *k_cache, const float *v_cache, const int64_t *rows,
                         const uint8_t *mask, float *out, float *scratch, long batch, long q_heads, long kv_heads,
                         long slots, long head_dim, long read_slots, float scale, int threads) {
    long group = q_heads / kv_heads, tasks = batch * kv_heads;
    #pragma omp parallel num_threads(threads)
    {
        int tid = omp_get_thread_num();
        float *scores = scratch + (long)tid * group * read_slots;
        #pragma omp for schedule(static)
        for (long t = 0; t < tasks; t++) {
            long b = t / kv_heads, h = t % kv_heads;
            long row = rows ? rows[b] : b;
            const float *keys = k_cache + (row * kv_heads + h) * slots * head_dim;
            const float *values = v_cache + (row * kv_heads + h) * slots * head_dim;
            const float *qg = q + (b * q_heads + h * group) * head_dim;
            const uint8_t *m = mask + b * read_slots;
            float *o = out + (b * q_heads + h * group) * head_dim;
            float best[64];  /* per query head of the group; groups are small (asserted by the caller) */
            for (long g = 0; g < group; g++) best[g] = -INFINITY;
            for (long s = 0; s < read_slots; s++) {
                if (!m[s]) continue;
                const float *key = keys + s * head_dim;
                for (long g = 0; g < group; g++) {
                    const float *qq = qg + g * head_dim;
                    float dot = 0.f;
                    #pragma omp simd reduction(+:dot)
                    for (long d = 0; d < head_dim; d++) dot += qq[d] * key[d];
                    dot *= scale;
                    scores[g * read_slots + s] = dot;
                    if (dot > best[g]) best[g] = dot;
                }
            }
            for (long g = 0; g < group; g++) {
                float *og = o + g * head_dim;
                for (long d = 0; d < head_dim; d++) og[d] = 0.f;
                if (best[g] == -INFINITY) continue;  /* nothing to attend to: zeros (never for a real token) */
                float total = 0.f;
                for (long s = 0; s < read_slots; s++) {
                    if (!m[s]) continue;
                    float e = expf(scores[g * read_slots + s] - best[g]);
                    scores[g * read_slots + s] = e;
                    total += e;
                }
                float inv = 1.f / total;
                for (long s = 0; s < read_slots; s++)
                    if (m[s]) scores[g * read_slots + s] *= inv;
            }
            for (long s = 0; s < read_slots; s++) {
                if (!m[s]) continue;
                const float *value = values + s * head_dim;
                for (long g = 0; g < group; g++) {
                    float w = scores[g * read_slots + s], *og = o + g * head_dim;
                    #pragma omp simd
                    for (long d = 0; d < head_dim; d++) og[d] += w * value[d];
                }
            }
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
                && q.size(3) == k_cache.size(3) && q.size(1) % k_cache.size(1) == 0
                && q.size(1) / k_cache.size(1) <= 64 && read_slots > 0 && read_slots <= k_cache.size(2)
                && mask.scalar_type() == at::kBool && mask.numel() == q.size(0) * read_slots,
                "decode_attention takes float32 q (batch, q_heads, 1, head_dim), contiguous float32 caches "
                "(rows, kv_heads, slots, head_dim) with at most 64 query heads per KV head, read_slots within "
                "the slots and a bool mask of batch x read_slots; got q ", q.sizes(), " ", q.scalar_type(),
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
    at::Tensor scratch = at::empty({(int64_t)threads * group * read_slots}, q.options());
    cl_decode_attention(qc.data_ptr<float>(), k_cache.data_ptr<float>(), v_cache.data_ptr<float>(),
                        r.defined() ? r.data_ptr<int64_t>() : nullptr, (const uint8_t *)m.data_ptr<bool>(),
                        out.data_ptr<float>(), scratch.data_ptr<float>(), batch, q.size(1), k_cache.size(1),
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


unavailable_reason: str | None = None


@functools.lru_cache(maxsize=None)
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
    CPU against a float32 cache (an fp8 cache keeps the traced path, which dequantizes it)."""
    return (q.device.type == "cpu" and q.dtype == torch.float32 and k_cache.dtype == torch.float32
            and q.shape[2] == 1 and q.shape[1] // k_cache.shape[1] <= 64 and available())


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
    return torch.ops.corelaunch.decode_attention(q, k_cache, v_cache, rows, mask, read_slots, scale)


def mark_constants_for_tracing() -> None:
    """Tells torch.compile to take available() as a constant (usable() calls it in every traced
    decode attention), as workers/kernels/small_linear.py does for its own."""
    import torch._dynamo

    torch._dynamo.assume_constant_result(available)
