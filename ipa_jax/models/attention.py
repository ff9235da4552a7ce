"""Attention kernels: the einsum reference and three fast paths that compute the same function.

Every kernel takes q [B, T, Hq, D], k/v [B, S, Hkv, D] (GQA: Hq a multiple of Hkv) and `visible` bool[B, T, S]
(which keys each query attends to), returns [B, T, Hq * D], takes its softmax in float32 and gives a query with
no visible key a finite average of the values (never NaN). `attention_impl` picks one:

  reference  one einsum over every key, queries in `lax.map` blocks (each rematerialised) to bound memory.
  blocked    causal blocks: queries in blocks of `query_block`, block i against keys [0, end of block i) only,
             einsums with the G query heads of a KV head folded into the query axis ([B, Hkv, T * G, S] scores,
             q/k/v transposed once per call, the softmax normaliser applied to the output). Fastest on CPU
             (bench_model.py).
  xla        the same causal blocks, each one `jax.nn.dot_product_attention(implementation="xla")`.
  cudnn      one `jax.nn.dot_product_attention(implementation="cudnn", is_causal=True)`: cuDNN flash attention
             (NVIDIA GPUs, 16-bit dtypes); `visible` goes in as an additive bias.
  splash     splash attention (a Pallas TPU kernel with its own backward pass), causal within segments: it reads
             the rows' segment ids (0 = padding, which only padding sees) instead of `visible`; the sequence is
             padded to whole blocks of SPLASH_BLOCK; off TPU it runs in Pallas' interpreter (tests; slow). On a
             mesh it runs under `shard_map` over the batch (and KV heads over the tensor axis when they divide):
             GSPMD cannot split a Pallas call.
  auto       cudnn on NVIDIA GPUs in bfloat16/float16, blocked on CPU, splash on TPU when head_dim is a multiple
             of 128 (TPU lanes), xla elsewhere.

The causal paths skip the keys after a query's index. That is exact for every query that sees no later key of
its row: all real tokens of rows whose real tokens' positions grow along the row, as right- or left-padded rows
and packed segments have (a left pad, which nothing reads, may differ).

With a KV cache (`attend_cache`) the keys are cache slots, not this call's tokens, and come head-major (keys
[B, Hkv, D, S], values [B, Hkv, S, D]: models/cache.py): every path uses all keys; blocked multiplies the cache as
it is stored.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as splash_mask
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from ipa_jax.models.config import ATTENTION_IMPLS

# Query and key block of the splash kernel (TPU lanes: a multiple of 128); sequences are padded to whole blocks.
SPLASH_BLOCK = 128


@dataclasses.dataclass(frozen=True)
class AttentionMesh:
    """Where a forward's attention runs when a Pallas kernel needs `shard_map`: the mesh, the axes its batch is
    split over (empty when the batch does not divide) and the axes of the attention heads (the "kv_heads" rule)."""

    mesh: Mesh
    batch_axes: tuple[str, ...]
    head_axes: tuple[str, ...]


def segment_positions(segment_ids: jax.Array) -> jax.Array:
    """Each token's index within its segment, int32[B, T], for segment_ids int32[B, T] whose segments are
    contiguous runs of one id (packed rows): RoPE positions restart at 0 in every segment."""
    index = jnp.arange(segment_ids.shape[1], dtype=jnp.int32)
    starts = jnp.pad(segment_ids[:, 1:] != segment_ids[:, :-1], ((0, 0), (1, 0)), constant_values=True)
    return index - jax.lax.cummax(jnp.where(starts, index, 0), axis=1)


def visible_keys(
    q_pos: jax.Array,
    k_pos: jax.Array,
    k_valid: jax.Array,
    q_segments: jax.Array | None = None,
    k_segments: jax.Array | None = None,
    q_prefix_segments: jax.Array | None = None,
) -> jax.Array:
    """bool[B, T, S]: key s is visible to query t iff it is valid, k_pos[s] <= q_pos[t] and (with segment ids)
    both lie in one segment. q_pos/q_segments [B, T], k_pos/k_valid/k_segments [B, S].

    q_prefix_segments int32[B, T] (packed rows with shared prefixes, 0 = none): a query also sees the keys of
    segment q_prefix_segments[t] at positions before its own segment's first position (the prefix its
    segment continues). Needs q_segments, contiguous runs along the row (self-attention: keys = queries)."""
    visible = k_valid[:, None, :] & (k_pos[:, None, :] <= q_pos[:, :, None])
    if q_segments is None:
        return visible
    same = q_segments[:, :, None] == k_segments[:, None, :]
    if q_prefix_segments is not None:
        segment_start = q_pos - segment_positions(q_segments)  # the position of the segment's first token
        same |= (q_prefix_segments[:, :, None] == k_segments[:, None, :]) & (
            k_pos[:, None, :] < segment_start[:, :, None]
        )
    return visible & same


def _masked_softmax(scores: jax.Array, visible: jax.Array) -> jax.Array:
    """softmax over the last axis in float32 with invisible keys at the lowest float32 (a row with none visible
    averages uniformly)."""
    scores = jnp.where(visible, scores.astype(jnp.float32), jnp.finfo(jnp.float32).min)
    return jax.nn.softmax(scores, axis=-1)


def _einsum_attention(q, k, v, visible, scale):
    """The reference kernel: scores [B, Hkv, G, T, S] from one einsum."""
    b, t, hq, d = q.shape
    hkv = k.shape[2]
    q = q.reshape(b, t, hkv, hq // hkv, d)
    scores = jnp.einsum("btkgd,bskd->bkgts", q, k) * jnp.asarray(scale, q.dtype)
    probs = _masked_softmax(scores, visible[:, None, None]).astype(v.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v)
    return out.reshape(b, t, hq * d)


def _queries_head_major(q: jax.Array, num_kv_heads: int) -> jax.Array:
    """q [B, T, Hq, D] -> [B, Hkv, T * G, D]: the G query heads of a KV head folded into the query axis, each
    query's G heads adjacent, so a block of queries is a contiguous run of rows."""
    b, t, hq, d = q.shape
    groups = hq // num_kv_heads
    return q.reshape(b, t, num_kv_heads, groups, d).transpose(0, 2, 1, 3, 4).reshape(b, num_kv_heads, t * groups, d)


def _to_head_major(q, k, v):
    """q as `_queries_head_major`; k, v [B, S, Hkv, D] -> [B, Hkv, S, D]."""
    return _queries_head_major(q, k.shape[2]), k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)


def _head_major_block(q, k, v, visible, scale, keys_slots_last: bool = False):
    """Attention of head-major queries q [B, Hkv, Q, D] over k/v [B, Hkv, S, D] (k [B, Hkv, D, S] with
    keys_slots_last), visible bool[B, Q, S]: two plain batched matmuls, no transposes.
    out = (exp(s - max) v) / sum exp(s - max): the normaliser divides the [Q, D] output, not the [Q, S]
    probabilities."""
    scores = jnp.einsum("bkqd,bkds->bkqs" if keys_slots_last else "bkqd,bksd->bkqs", q, k)
    scores = scores.astype(jnp.float32) * scale
    scores = jnp.where(visible[:, None], scores, jnp.finfo(jnp.float32).min)
    weights = jnp.exp(scores - jax.lax.stop_gradient(jnp.max(scores, axis=-1, keepdims=True)))
    out = jnp.einsum("bkqs,bksd->bkqd", weights.astype(v.dtype), v)
    return out / jnp.sum(weights, axis=-1, keepdims=True).astype(out.dtype)


def _from_head_major(out: jax.Array, t: int, groups: int) -> jax.Array:
    """Head-major attention output [B, Hkv, T * G, D] -> [B, T, Hq * D] (the inverse of `_to_head_major` on q)."""
    b, hkv, _, d = out.shape
    return out.reshape(b, hkv, t, groups, d).transpose(0, 2, 1, 3, 4).reshape(b, t, hkv * groups * d)


def blocked_attention(q, k, v, visible, scale: float, query_block: int) -> jax.Array:
    """The `blocked` path: q, k, v to head-major once; queries in blocks of `query_block`, block i against the keys
    up to the end of its block only (later keys are invisible to it; ~half the work).

    q [B, T, Hq, D], k/v [B, T, Hkv, D], visible bool[B, T, T] -> [B, T, Hq * D].
    """
    t = q.shape[1]
    groups = q.shape[2] // k.shape[2]
    qh, kh, vh = _to_head_major(q, k, v)
    visible = jnp.repeat(visible, groups, axis=1)  # [B, T * G, T], rows in qh's order
    block = query_block if 0 < query_block < t else t
    outs = []
    for start in range(0, t, block):
        rows = slice(start * groups, min(start + block, t) * groups)
        keys = slice(0, min(start + block, t))
        outs.append(_head_major_block(qh[:, :, rows], kh[:, :, keys], vh[:, :, keys], visible[:, rows, keys], scale))
    return _from_head_major(outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=2), t, groups)


def _fused_attention(q, k, v, visible, scale, implementation: str, is_causal: bool = False):
    """`jax.nn.dot_product_attention` with `visible` as its boolean mask."""
    b, t, hq, d = q.shape
    out = jax.nn.dot_product_attention(
        q, k, v, mask=visible[:, None], scale=scale, is_causal=is_causal, implementation=implementation
    )
    return out.reshape(b, t, hq * d)


def reference_attention(q, k, v, visible, scale: float, query_block: int = 0) -> jax.Array:
    """The reference: softmax(q k^T * scale) v over the visible keys, all keys at once.

    With 0 < query_block < T the queries go in blocks (each rematerialised in the backward pass), so the
    float32 scores held at once are [B, H, query_block, S] instead of [B, H, T, S]; every row's result is the same.
    """
    b, t = visible.shape[:2]
    if not 0 < query_block < t:
        return _einsum_attention(q, k, v, visible, scale)
    num_blocks = -(-t // query_block)
    pad = num_blocks * query_block - t

    def blocks(x):  # [B, T, ...] -> [num_blocks, B, query_block, ...]
        x = jnp.pad(x, ((0, 0), (0, pad)) + ((0, 0),) * (x.ndim - 2))
        return x.reshape(b, num_blocks, query_block, *x.shape[2:]).swapaxes(0, 1)

    block_fn = jax.checkpoint(lambda qv: _einsum_attention(qv[0], k, v, qv[1], scale))
    out = jax.lax.map(block_fn, (blocks(q), blocks(visible)))  # [nb, B, qb, Hq * D]
    return out.swapaxes(0, 1).reshape(b, num_blocks * query_block, -1)[:, :t]


def causal_block_attention(kernel, q, k, v, visible, scale: float, query_block: int) -> jax.Array:
    """`kernel` over query blocks [i * query_block, (i + 1) * query_block), each against the keys up to the end of
    its block only (self-attention: S == T; the later keys are invisible to it). Blocks unroll in Python: each
    has its own key length, and causality saves ~half the work (3/8 with 4 blocks)."""
    t = q.shape[1]
    if not 0 < query_block < t:
        return kernel(q, k, v, visible, scale)
    outs = []
    for start in range(0, t, query_block):
        end = min(start + query_block, t)
        outs.append(kernel(q[:, start:end], k[:, :end], v[:, :end], visible[:, start:end, :end], scale))
    return jnp.concatenate(outs, axis=1)


def _splash_local(q, k, v, segments, scale: float) -> jax.Array:
    """Splash attention of one shard: q [B, T, Hq, D], k/v [B, T, Hkv, D], segments int32[B, T] -> [B, T, Hq * D].
    Per row and KV head, the G query heads of the head as one multi-query kernel call (vmapped)."""
    b, t, hq, d = q.shape
    hkv = k.shape[2]
    groups = hq // hkv
    padded = -(-t // SPLASH_BLOCK) * SPLASH_BLOCK
    pad = lambda x: jnp.pad(x, ((0, 0), (0, padded - t)) + ((0, 0),) * (x.ndim - 2))  # noqa: E731
    blocks = splash.BlockSizes(
        block_q=SPLASH_BLOCK,
        block_kv=SPLASH_BLOCK,
        block_kv_compute=SPLASH_BLOCK,
        block_q_dkv=SPLASH_BLOCK,
        block_kv_dkv=SPLASH_BLOCK,
        block_kv_dkv_compute=SPLASH_BLOCK,
        block_q_dq=SPLASH_BLOCK,
        block_kv_dq=SPLASH_BLOCK,
    )
    kernel = splash.make_splash_mqa_single_device(
        splash_mask.MultiHeadMask([splash_mask.CausalMask((padded, padded))] * groups),
        block_sizes=blocks,
        interpret=jax.devices()[0].platform != "tpu",
    )
    qh = pad(q * jnp.asarray(scale, q.dtype)).reshape(b, padded, hkv, groups, d).transpose(0, 2, 3, 1, 4)
    kh, vh = pad(k).transpose(0, 2, 1, 3), pad(v).transpose(0, 2, 1, 3)  # [B, Hkv, T, D]

    def row(q_row, k_row, v_row, seg):  # [Hkv, G, T, D], [Hkv, T, D] x 2, [T]
        ids = splash.SegmentIds(q=seg, kv=seg)
        return jax.vmap(lambda qg, kg, vg: kernel(qg, kg, vg, segment_ids=ids))(q_row, k_row, v_row)

    out = jax.vmap(row)(qh, kh, vh, pad(segments))  # [B, Hkv, G, T, D]
    return out.transpose(0, 3, 1, 2, 4)[:, :t].reshape(b, t, hq * d)


def splash_attention(q, k, v, segments, scale: float, mesh: AttentionMesh | None = None) -> jax.Array:
    """The `splash` path: q [B, T, Hq, D], k/v [B, T, Hkv, D], segments int32[B, T] (0 = padding; real tokens 1 +
    their segment) -> [B, T, Hq * D], causal within segments. With `mesh`, under shard_map: each instance its
    rows (and KV heads, when the head axes divide them)."""
    if mesh is None:
        return _splash_local(q, k, v, segments, scale)
    shards = lambda axes: functools.reduce(lambda n, a: n * mesh.mesh.shape[a], axes, 1)  # noqa: E731
    heads = mesh.head_axes if mesh.head_axes and k.shape[2] % shards(mesh.head_axes) == 0 else None
    rows = mesh.batch_axes if mesh.batch_axes and q.shape[0] % shards(mesh.batch_axes) == 0 else None
    qkv = P(rows, None, heads, None)
    # check_vma off: the Pallas call declares no per-axis variation of its outputs (each instance is independent).
    return jax.shard_map(
        lambda *a: _splash_local(*a, scale),
        mesh=mesh.mesh,
        in_specs=(qkv, qkv, qkv, P(rows, None)),
        out_specs=P(rows, None, heads),
        check_vma=False,
    )(q, k, v, segments)


def resolve_attention_impl(impl: str, dtype, head_dim: int | None = None) -> str:
    """The concrete path of `impl` ("auto" by backend, compute dtype and head_dim; see the module docstring)."""
    if impl not in ATTENTION_IMPLS:
        raise ValueError(f"attention_impl must be one of {ATTENTION_IMPLS}, got {impl!r}")
    if impl != "auto":
        return impl
    device = jax.devices()[0]
    if device.platform == "gpu" and "nvidia" in device.device_kind.lower():
        return "cudnn" if jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16) else "xla"
    if device.platform == "tpu" and head_dim is not None and head_dim % 128 == 0:
        return "splash"
    return "blocked" if device.platform == "cpu" else "xla"


def attend(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    visible: jax.Array,
    scale: float,
    *,
    impl: str,
    query_block: int,
    segments: jax.Array | None = None,
    mesh: AttentionMesh | None = None,
) -> jax.Array:
    """Self-attention of q [B, T, Hq, D] over k/v [B, T, Hkv, D], the keys of these queries' own tokens in index
    order (so the causal paths may skip later keys), with `visible` bool[B, T, T] -> [B, T, Hq * D].

    impl: a concrete path (`resolve_attention_impl`). splash reads `segments` int32[B, T] (0 = padding, real
    tokens 1 + their segment: what `visible` encodes for rows whose positions grow along the row) and `mesh`.
    """
    if impl == "splash":
        if segments is None:
            raise ValueError("attention_impl 'splash' needs the rows' segment ids")
        return splash_attention(q, k, v, segments, scale, mesh)
    if impl == "reference":
        return reference_attention(q, k, v, visible, scale, query_block)
    if impl == "cudnn":
        return _fused_attention(q, k, v, visible, scale, "cudnn", is_causal=True)
    if impl == "blocked":
        return blocked_attention(q, k, v, visible, scale, query_block)
    kernel = functools.partial(_fused_attention, implementation="xla")
    return causal_block_attention(kernel, q, k, v, visible, scale, query_block)


def attend_cache(
    q: jax.Array, k_columns: jax.Array, v_heads: jax.Array, visible: jax.Array, scale: float, *, impl: str
) -> jax.Array:
    """Attention of q [B, T, Hq, D] over a KV cache's keys k_columns [B, Hkv, D, S] and values v_heads
    [B, Hkv, S, D] with `visible` bool[B, T, S] -> [B, T, Hq * D]. Every path uses all S slots; blocked (the CPU
    path) multiplies the buffers as stored, the others take them [B, S, Hkv, D] (transposed copies: what
    `jax.nn.dot_product_attention` reads); cudnn and splash, which have no KV-cache form here, run its xla
    implementation."""
    if impl == "blocked":
        t, groups = q.shape[1], q.shape[2] // k_columns.shape[1]
        qh = _queries_head_major(q, k_columns.shape[1])
        out = _head_major_block(
            qh, k_columns, v_heads, jnp.repeat(visible, groups, axis=1), scale, keys_slots_last=True
        )
        return _from_head_major(out, t, groups)
    k, v = k_columns.transpose(0, 3, 1, 2), v_heads.swapaxes(1, 2)
    if impl == "reference":
        return reference_attention(q, k, v, visible, scale)
    return _fused_attention(q, k, v, visible, scale, "xla")
