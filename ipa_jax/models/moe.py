"""Qwen3-MoE sparse block: float32 router, top-k, optional routing replay, dropless dispatch.

The dispatch paths compute the same function (tested to agree in outputs and gradients). No capacity factor
anywhere: no token is ever dropped.
  dense   — every expert on every token, combined with a [N, E] weight matrix (the readable reference; E/k x the
            useful work).
  ragged  — the N*k (token, expert) assignments sorted by expert, three `jax.lax.ragged_dot` grouped matmuls,
            unsorted and weighted. On CPU, and by default on GPU (XLA:GPU with jax 0.11), XLA lowers ragged_dot to
            zero-padded per-group dense products (E x the useful work, and E x the memory: see resolve_moe_impl).
  megablox — the sorted assignments through megablox's grouped matmul (a Pallas TPU kernel, with its own custom
            VJP), gate and up in one call; off TPU the kernel runs in Pallas' interpreter (tests; slow). On a
            mesh it runs under `shard_map`, one token group per batch shard (GSPMD cannot split a Pallas call).
  blocked — the sorted assignments, each expert's run cut into blocks of rows (`expert_blocks`): every expert's
            first block in one matmul batched over the experts, the further blocks the routing needs in a loop,
            each multiplied with its expert's weights, with a hand-written backward pass (`grouped_swiglu`). The
            fastest on CPU (bench_model.py), and the one that fits on GPU. XLA:CPU copies a block's expert weights
            out of the stacked tensor when the expert is a loop index; the batched first blocks read them as
            stored. An earlier version, batched matmuls over every block of a static bound with each block's
            weights gathered, took 1.2-1.3x the time of the loop.
  tokamax  — the sorted assignments through the tokamax package's `ragged_dot` (an optional dependency, imported
            when first used), gate and up in one call: on NVIDIA Hopper its Pallas Mosaic GPU kernel (bf16/fp16
            inputs), else its Pallas Triton kernel, else (CPU, tests) XLA's ragged_dot. Its custom VJP keeps the
            backward grouped: d lhs = dy W_e^T per group (the same kernel, on the weights transposed) and
            d W_e = lhs_e^T dy_e per group (a kernel with the ragged dimension contracted), so no dense
            per-expert product is formed. The kernels take rhs [E, K, N], the layout the experts are stored in
            (gate/up [E, H, I], down [E, I, H]; Hugging Face's per-expert [out, in] matrices are transposed on
            load and export, hf_io.py): no transpose in the forward; tokamax transposes the weights for d lhs.
`moe_impl="auto"` (the default) is megablox on TPU, tokamax on GPU when the package imports (else blocked), blocked
on CPU, or on CPU dense for calls with few tokens (decode steps).

Every path skips assignments whose expert is outside [0, E): they contribute nothing and cost nothing beyond the
sort. Expert parallelism builds on that (`dispatch_experts`): on a mesh whose `expert` axis has S > 1 devices,
each device holds E / S experts and runs the path on its own experts only, the assignments of the others' experts
skipped; tokens split over the expert axis are all-gathered along it first and the partial outputs
reduce-scattered back. That is dropless with static shapes, and for top-k >= S it moves no more data than an
all-to-all exchange of the assignments (S x the local tokens in, the same out, against k x).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from absl import flags
from flax import nnx
from jax.ad_checkpoint import checkpoint_name
from jax.experimental.pallas.ops.tpu.megablox import ops as megablox
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from ipa_jax.models.config import MOE_IMPLS, Qwen3Config
from ipa_jax.models.layers import make_param
from ipa_jax.models.lora import LoraConfig, adapted_weight, make_adapter

# The name (jax.ad_checkpoint.checkpoint_name) of the grouped matmuls' outputs, which the "matmuls" remat policy
# keeps: they are no dot_general (ragged_dot, Pallas calls), so jax's dots policies do not see them.
GROUPED_MATMUL = "moe_grouped_matmul"


def route(
    x: jax.Array, router: jax.Array, top_k: int, norm_topk_prob: bool, replay: jax.Array | None = None
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Router in float32: p = softmax(x W); experts = top-k(p) (or the replayed ones); w = p[experts] (/ sum).

    x [N, H], router [H, E], replay int32[N, k] or None (a row with any negative entry keeps its own top-k:
    padding rows of replayed routings) -> (weights float32[N, k], experts int32[N, k], logits float32[N, E]).
    Gate weights always come from this router, so gradients reach it under replay too.
    """
    logits = x.astype(jnp.float32) @ router.astype(jnp.float32)
    probs = jax.nn.softmax(logits, axis=-1)
    top_p, experts = jax.lax.top_k(probs, top_k)
    if replay is not None:
        use_replay = jnp.all(replay >= 0, axis=-1, keepdims=True)
        experts = jnp.where(use_replay, replay, experts).astype(jnp.int32)
        top_p = jnp.take_along_axis(probs, experts, axis=-1)
    if norm_topk_prob:
        top_p = top_p / jnp.sum(top_p, axis=-1, keepdims=True)
    return top_p, experts.astype(jnp.int32), logits


def swiglu_experts_dense(
    x: jax.Array, experts: jax.Array, weights: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array
) -> jax.Array:
    """Reference: y_e = down_e(silu(gate_e x) * up_e x) for all e; out = sum_e c[n, e] y_e[n], c from (experts,
    weights).

    x [N, H], experts int32[N, k], weights [N, k] (model dtype), w_gate/w_up [E, H, I], w_down [E, I, H] -> [N, H].
    An expert outside [0, E) is skipped (module doc).
    """
    n, num_experts = x.shape[0], w_gate.shape[0]
    combine = jnp.zeros((n, num_experts), x.dtype).at[jnp.arange(n)[:, None], experts].add(weights, mode="drop")
    # Batched over experts, each W_e read as stored: "nh,ehi->eni" made XLA transpose every expert weight per call
    # (in a decode loop, at every step).
    xe = jnp.broadcast_to(x, (num_experts, *x.shape))
    h = jax.nn.silu(jnp.einsum("enh,ehi->eni", xe, w_gate)) * jnp.einsum("enh,ehi->eni", xe, w_up)
    y = jnp.einsum("eni,eih->enh", h, w_down)
    return jnp.einsum("ne,enh->nh", combine, y)


def swiglu_experts_ragged(
    x: jax.Array, experts: jax.Array, weights: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array
) -> jax.Array:
    """Grouped path, same signature and result as `swiglu_experts_dense`.

    Sort the N*k assignments by expert (stable), run grouped matmuls with group sizes = tokens per expert,
    scatter back to assignment order, out[n] = sum_j weights[n, j] * y[n, j].
    """
    n, k = experts.shape
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    group_sizes = jnp.bincount(flat, length=w_gate.shape[0]).astype(jnp.int32)
    xs = x[order // k]
    grouped = lambda lhs, rhs: checkpoint_name(jax.lax.ragged_dot(lhs, rhs, group_sizes), GROUPED_MATMUL)  # noqa: E731
    h = jax.nn.silu(grouped(xs, w_gate)) * grouped(xs, w_up)
    ys = grouped(h, w_down)
    y = jnp.zeros_like(ys).at[order].set(ys).reshape(n, k, -1)
    return jnp.einsum("nkh,nk->nh", y, weights)


def expert_block_rows(assignments: int, num_experts: int, largest: int = 256) -> int:
    """Rows per block of the blocked path: a quarter more than the mean assignments per expert, rounded up to a
    multiple of 8, within [8, largest] and at most the assignments. Every expert's first block is computed whatever
    its run's length (`grouped_swiglu`), so a block about one run long wastes least while the runs of a balanced
    routing still fit it; longer runs continue in the loop. bench_learner's step at 2 x 256 (mean 128): 160 rows
    181 ms, 256 rows 194 ms; at 4 x 512 (mean 512) 544 or 608 rows were no faster than 256 (`largest`)."""
    mean = -(-assignments // num_experts)
    return int(min(max(8, -(-(mean + mean // 4) // 8) * 8), largest, assignments))


class ExpertBlocks(NamedTuple):
    """Blocks of `rows` rows over the N*k assignments sorted by expert, expert e's run (sorted rows
    [start_e, start_e + count_e)) cut into ceil(count_e / rows) blocks. Arrays of the bound G = N*k // rows + E on
    the number of blocks, whose first `num_blocks` are used.

    expert int32[G]: each block's expert; start int32[G]: its first sorted row; length int32[G]: how many of its
    rows belong to the run (a run's last block may be short); num_blocks: int32 scalar.
    """

    expert: jax.Array
    start: jax.Array
    length: jax.Array
    num_blocks: jax.Array


def expert_blocks(counts: jax.Array, assignments: int, rows: int, run_start: jax.Array | None = None) -> ExpertBlocks:
    """The blocks (`ExpertBlocks`) of the runs of `assignments` sorted assignments, counts int32[E] per expert;
    run_start int32[E]: each run's first sorted row (default: the runs back to back from row 0)."""
    num_experts = counts.shape[0]
    per_expert = -(-counts // rows)
    blocks_end = jnp.cumsum(per_expert)  # expert e owns blocks [blocks_end[e] - per_expert[e], blocks_end[e])
    index = jnp.arange(assignments // rows + num_experts)
    expert = jnp.minimum(jnp.searchsorted(blocks_end, index, side="right"), num_experts - 1)
    if run_start is None:
        run_start = jnp.cumsum(counts) - counts
    start = run_start[expert] + (index - (blocks_end - per_expert)[expert]) * rows
    length = jnp.clip(run_start[expert] + counts[expert] - start, 0, rows)
    return ExpertBlocks(
        expert.astype(jnp.int32), start.astype(jnp.int32), length.astype(jnp.int32), blocks_end[-1].astype(jnp.int32)
    )


def _block_window(start: jax.Array, length: jax.Array, total: int, rows: int) -> tuple[jax.Array, jax.Array]:
    """The window of sorted rows [first, first + rows) of the block of `length` rows at `start`, kept inside
    [0, total) (a last block that would overrun starts earlier), and which of the window's rows are the block's
    own: (first, own bool[..., rows]). start/length: scalars, or [E] for one block per expert."""
    first = jnp.minimum(start, total - rows)
    offset = jnp.arange(rows) + (first - start)[..., None]
    return first, (offset >= 0) & (offset < length[..., None])


class _Split(NamedTuple):
    """The blocks of `expert_blocks` in two parts: each expert's first block, all E at once (`window_first`
    int32[E], `own` bool[E, rows]: `_block_window`), and the blocks after it (`later`)."""

    window_first: jax.Array
    own: jax.Array
    later: ExpertBlocks


def _split_blocks(counts: jax.Array, total: int, rows: int) -> _Split:
    """The `_Split` of the blocks of `rows` rows over `total` sorted assignments, counts int32[E] per expert."""
    run_start = jnp.cumsum(counts) - counts
    first, own = _block_window(run_start, jnp.minimum(counts, rows), total, rows)
    return _Split(first, own, expert_blocks(jnp.maximum(counts - rows, 0), total, rows, run_start + rows))


def _swiglu_rows(xs, w_gate_up, w_down):
    """Blocks of rows through their experts: xs [G, R, H], w_gate_up [G, H, 2I], w_down [G, I, H] ->
    (y [G, R, H], gate_up [G, R, 2I])."""
    gate_up = jnp.einsum("grh,ghi->gri", xs, w_gate_up)
    gate, up = jnp.split(gate_up, 2, axis=-1)
    return jnp.einsum("gri,gih->grh", jax.nn.silu(gate) * up, w_down), gate_up


def _swiglu_rows_grad(xs, gate_up, dy, w_gate_up, w_down):
    """The backward pass of `_swiglu_rows` from its dy [G, R, H] -> (d xs, d w_gate_up, d w_down): dW_down = h^T dy,
    dh = dy W_down^T, d gate_up from silu's derivative, dW_gate_up = xs^T d gate_up, d xs = d gate_up W_gate_up^T."""
    gate, up = jnp.split(gate_up, 2, axis=-1)
    sig = jax.nn.sigmoid(gate)
    act = gate * sig  # silu(gate)
    d_w_down = jnp.einsum("gri,grh->gih", act * up, dy)
    dh = jnp.einsum("grh,gih->gri", dy, w_down)
    # silu'(g) = sig (1 + g (1 - sig))
    d_gate_up = jnp.concatenate([dh * up * sig * (1 + gate * (1 - sig)), dh * act], axis=-1)
    return (jnp.einsum("gri,ghi->grh", d_gate_up, w_gate_up), jnp.einsum("grh,gri->ghi", xs, d_gate_up), d_w_down)


def _grouped_forward(x, row_token, counts, w_gate_up, w_down, rows):
    """y (sorted rows [N*k, H]) and gate_up (sorted rows [N*k, 2I], kept for the backward pass)."""
    total = row_token.shape[0]
    split = _split_blocks(counts, total, rows)
    window = split.window_first[:, None] + jnp.arange(rows)  # [E, rows]
    y, gate_up = _swiglu_rows(x[row_token[window]], w_gate_up, w_down)
    # Rows that are not a block's own hold another expert's results: dropped here, kept below.
    dest = jnp.where(split.own, window, total).reshape(-1)

    def first(new):
        return jnp.zeros((total, new.shape[-1]), x.dtype).at[dest].set(new.reshape(-1, new.shape[-1]), mode="drop")

    blocks = split.later

    def block(i, carry):
        ys, gate_ups = carry
        start, own = _block_window(blocks.start[i], blocks.length[i], total, rows)
        e = blocks.expert[i]
        y, gate_up = _swiglu_rows(
            x[jax.lax.dynamic_slice_in_dim(row_token, start, rows)][None], w_gate_up[e][None], w_down[e][None]
        )
        keep = lambda buf, new: jax.lax.dynamic_update_slice_in_dim(  # noqa: E731
            buf, jnp.where(own[:, None], new[0], jax.lax.dynamic_slice_in_dim(buf, start, rows)), start, 0
        )
        return keep(ys, y), keep(gate_ups, gate_up)

    return jax.lax.fori_loop(0, blocks.num_blocks, block, (first(y), first(gate_up)))


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def grouped_swiglu(
    x: jax.Array, row_token: jax.Array, counts: jax.Array, w_gate_up: jax.Array, w_down: jax.Array, rows: int
) -> jax.Array:
    """y[r] = down_e(silu(x[t] gate_e) * (x[t] up_e)) for every sorted row r (token t = row_token[r] of expert e's
    run), expert by expert in blocks of `rows` rows, one matmul for gate and up: every expert's first block in one
    batched matmul over the experts (their weights read where they are stored), the further blocks (experts with more
    than `rows` assignments) in a loop, each multiplied with its expert's weights.

    x [N, H], row_token int32[N*k] (the token of each sorted row), counts int32[E] (the runs' lengths),
    w_gate_up [E, H, 2I], w_down [E, I, H] -> [N*k, H]. The backward pass takes the blocks in the same two parts.
    """
    return _grouped_forward(x, row_token, counts, w_gate_up, w_down, rows)[0]


def _grouped_swiglu_fwd(x, row_token, counts, w_gate_up, w_down, rows):
    ys, gate_ups = _grouped_forward(x, row_token, counts, w_gate_up, w_down, rows)
    ys, gate_ups = (checkpoint_name(a, GROUPED_MATMUL) for a in (ys, gate_ups))
    return ys, (x, row_token, counts, w_gate_up, w_down, gate_ups)


def _grouped_swiglu_bwd(rows, residuals, d_ys):
    """`_swiglu_rows_grad` of every block, dy = 0 at the rows that are not the block's own (so nothing leaks into
    another expert): the first blocks batched, then a loop over the further ones."""
    x, row_token, counts, w_gate_up, w_down, gate_ups = residuals
    total = row_token.shape[0]
    split = _split_blocks(counts, total, rows)
    window = split.window_first[:, None] + jnp.arange(rows)  # [E, rows]
    tokens = row_token[window]
    d_xs, d_gate_up_w, d_down_w = _swiglu_rows_grad(
        x[tokens], gate_ups[window], jnp.where(split.own[..., None], d_ys[window], 0), w_gate_up, w_down
    )
    d_x = jnp.zeros_like(x).at[tokens.reshape(-1)].add(d_xs.reshape(-1, x.shape[-1]))
    blocks = split.later

    def block(i, carry):
        d_x, d_gate_up_w, d_down_w = carry
        start, own = _block_window(blocks.start[i], blocks.length[i], total, rows)
        e = blocks.expert[i]
        tokens = jax.lax.dynamic_slice_in_dim(row_token, start, rows)
        dy = jnp.where(own[:, None], jax.lax.dynamic_slice_in_dim(d_ys, start, rows), 0)
        d_xs, d_gu, d_dn = _swiglu_rows_grad(
            x[tokens][None],
            jax.lax.dynamic_slice_in_dim(gate_ups, start, rows)[None],
            dy[None],
            w_gate_up[e][None],
            w_down[e][None],
        )
        return (
            d_x.at[tokens].add(d_xs[0]),
            d_gate_up_w.at[e].add(d_gu[0].astype(d_gate_up_w.dtype)),
            d_down_w.at[e].add(d_dn[0].astype(d_down_w.dtype)),
        )

    d_x, d_gate_up_w, d_down_w = jax.lax.fori_loop(0, blocks.num_blocks, block, (d_x, d_gate_up_w, d_down_w))
    return d_x, None, None, d_gate_up_w, d_down_w


grouped_swiglu.defvjp(_grouped_swiglu_fwd, _grouped_swiglu_bwd)


def swiglu_experts_blocked(
    x: jax.Array,
    experts: jax.Array,
    weights: jax.Array,
    w_gate: jax.Array,
    w_up: jax.Array,
    w_down: jax.Array,
    block_rows: int = 0,
) -> jax.Array:
    """Blocked path, same signature and result as `swiglu_experts_dense`.

    The N*k assignments sorted by expert (stable), `grouped_swiglu` over the sorted rows (gate and up side by side:
    one matmul instead of two) in blocks of `block_rows` rows (at most N*k; 0 = `expert_block_rows`),
    out[n] = sum_j weights[n, j] * y[sorted row of (n, j)].
    """
    n, k = experts.shape
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    counts = jnp.bincount(flat, length=w_gate.shape[0]).astype(jnp.int32)
    rows = min(block_rows, n * k) if block_rows else expert_block_rows(n * k, w_gate.shape[0])
    ys = grouped_swiglu(
        x, (order // k).astype(jnp.int32), counts, jnp.concatenate([w_gate, w_up], axis=-1), w_down, rows
    )
    sorted_row = jnp.zeros((n * k,), jnp.int32).at[order].set(jnp.arange(n * k, dtype=jnp.int32))
    return jnp.einsum("nkh,nk->nh", ys[sorted_row].reshape(n, k, -1), weights)


# Rows of one megablox tile (its m dimension); the hidden and intermediate dimensions are tiled by up to 128.
MEGABLOX_TILE = 128


def _sorted_swiglu(
    x: jax.Array,
    experts: jax.Array,
    weights: jax.Array,
    w_gate: jax.Array,
    w_up: jax.Array,
    w_down: jax.Array,
    grouped_matmul,
    row_multiple: int = 1,
) -> jax.Array:
    """The kernel paths' common body, same signature and result as `swiglu_experts_dense` given
    grouped_matmul(lhs [M, K] in groups of rows, rhs [E, K, N], group_sizes int32[E]) -> [M, N]: the N*k
    assignments sorted by expert (stable), padded to a multiple of `row_multiple` rows, two grouped matmuls (gate
    and up side by side, then down) with group sizes = assignments per expert,
    out[n] = sum_j weights[n, j] * y[sorted row of (n, j)]."""
    n, k = experts.shape
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    group_sizes = jnp.bincount(flat, length=w_gate.shape[0]).astype(jnp.int32)
    rows = n * k
    # Rows past the groups (padding, skipped assignments) are not computed, forward or backward: a kernel may
    # leave anything in them, and selecting zeros there drops it in both directions.
    in_groups = (jnp.arange(rows + -rows % row_multiple) < jnp.sum(group_sizes))[:, None]

    def grouped(lhs, rhs):
        out = grouped_matmul(jnp.where(in_groups, lhs, 0), rhs, group_sizes)
        return checkpoint_name(jnp.where(in_groups, out, 0), GROUPED_MATMUL)

    xs = jnp.pad(x[order // k], ((0, -rows % row_multiple), (0, 0)))
    gate, up = jnp.split(grouped(xs, jnp.concatenate([w_gate, w_up], axis=-1)), 2, axis=-1)
    ys = grouped(jax.nn.silu(gate) * up, w_down)[:rows]
    sorted_row = jnp.zeros((rows,), jnp.int32).at[order].set(jnp.arange(rows, dtype=jnp.int32))
    return jnp.einsum("nkh,nk->nh", ys[sorted_row].reshape(n, k, -1), weights)


def swiglu_experts_megablox(
    x: jax.Array, experts: jax.Array, weights: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array
) -> jax.Array:
    """TPU path, same signature and result as `swiglu_experts_dense`: `_sorted_swiglu` on megablox's grouped
    matmul, the sorted rows padded to whole tiles."""
    tile = min(MEGABLOX_TILE, -(-experts.size // 8) * 8)
    interpret = jax.devices()[0].platform != "tpu"

    def gmm(lhs, rhs, group_sizes):
        tiling = (tile, min(128, rhs.shape[1]), min(128, rhs.shape[2]))
        return megablox.gmm(lhs, rhs, group_sizes, lhs.dtype, tiling, None, None, False, interpret)

    return _sorted_swiglu(x, experts, weights, w_gate, w_up, w_down, gmm, tile)


@functools.cache
def tokamax_ragged_dot():
    """tokamax.ragged_dot, or None when the tokamax package is not installed."""
    try:
        import tokamax  # noqa: PLC0415 (optional: the GPU extra)
    except ImportError:
        return None
    # tokamax reads its options from absl flags and, if no absl app has parsed them, parses sys.argv on first use,
    # which fails in any other program (pytest, a script with its own arguments): its options keep their defaults.
    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()
    return tokamax.ragged_dot


def swiglu_experts_tokamax(
    x: jax.Array, experts: jax.Array, weights: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array
) -> jax.Array:
    """GPU path, same signature and result as `swiglu_experts_dense`: `_sorted_swiglu` on tokamax's ragged_dot,
    which picks its implementation (module doc)."""
    ragged_dot = tokamax_ragged_dot()
    if ragged_dot is None:
        raise ImportError('moe_impl="tokamax" needs the tokamax package: pip install tokamax (or ipa_jax[gpu])')
    return _sorted_swiglu(x, experts, weights, w_gate, w_up, w_down, ragged_dot)


DISPATCH = {
    "dense": swiglu_experts_dense,
    "ragged": swiglu_experts_ragged,
    "blocked": swiglu_experts_blocked,
    "megablox": swiglu_experts_megablox,
    "tokamax": swiglu_experts_tokamax,
}
# Paths whose groups of tokens run under shard_map on a mesh: GSPMD cannot split a Pallas call.
KERNEL_PATHS = ("megablox", "tokamax")


@dataclasses.dataclass(frozen=True)
class MoeDispatch:
    """How one forward sends tokens to experts: `impl` (a key of DISPATCH) run separately on each of `groups`
    equal slices of the tokens. On a mesh the groups are the batch shards, so each device sorts and multiplies
    only its own tokens (one global sort would gather every token on every device); 1 = all tokens at once.
    With `mesh` the groups are `shard_map` instances over the mesh axes `batch_axes` (KERNEL_PATHS, and expert
    parallelism), else a vmap. `expert_axes`: the mesh axes the experts are split over (expert parallelism, module
    doc), () = every device computes every expert. `block_rows`: the blocked path's rows per block (0 = its rule)."""

    impl: str
    groups: int = 1
    mesh: Mesh | None = None
    batch_axes: tuple[str, ...] = ()
    expert_axes: tuple[str, ...] = ()
    block_rows: int = 0

    def path(self):
        """The dispatch function, (x, experts, weights, w_gate, w_up, w_down) -> out, of `impl`."""
        if self.impl == "blocked" and self.block_rows:
            return functools.partial(swiglu_experts_blocked, block_rows=self.block_rows)
        return DISPATCH[self.impl]


def moe_dispatch(
    impl: str,
    batch_shards: int,
    mesh: Mesh | None = None,
    batch_axes: tuple[str, ...] = (),
    expert_axes: tuple[str, ...] = (),
    block_rows: int = 0,
) -> MoeDispatch:
    """The dispatch of a forward whose batch is split `batch_shards` ways over the mesh axes `batch_axes` and whose
    experts are split over `expert_axes`: expert parallelism under shard_map on `mesh` when the expert axes have
    more than one device; else one token group per batch shard, except for ragged, whose `jax.lax.ragged_dot` has
    no vmap rule with shared weights (JAX: NYI): its sort stays global. The groups of KERNEL_PATHS run under
    shard_map. block_rows: the blocked path's rows per block (0 = its rule)."""
    expert_axes = tuple(a for a in expert_axes if mesh is not None and mesh.shape[a] > 1)
    block_rows = block_rows if impl == "blocked" else 0
    if expert_axes:
        return MoeDispatch(
            impl, batch_shards, mesh, tuple(batch_axes) if batch_shards > 1 else (), expert_axes, block_rows
        )
    if impl == "ragged":
        return MoeDispatch(impl, 1)
    if impl in KERNEL_PATHS and batch_shards > 1:
        return MoeDispatch(impl, batch_shards, mesh, tuple(batch_axes))
    return MoeDispatch(impl, batch_shards, block_rows=block_rows)


def _expert_parallel(
    moe: MoeDispatch,
    x: jax.Array,
    experts: jax.Array,
    weights: jax.Array,
    w_gate: jax.Array,
    w_up: jax.Array,
    w_down: jax.Array,
) -> jax.Array:
    """DISPATCH[moe.impl] with the experts split over moe.expert_axes (module doc), under shard_map: each device
    gets its batch shard's tokens (all tokens when the batch is not split) and its E / S experts' weights; tokens
    split over the expert axes are all-gathered along them, the assignments of other devices' experts skipped, and
    the outputs reduce-scattered back (psum'd when the tokens were not split over the expert axes)."""
    fn, axes = moe.path(), moe.expert_axes
    tokens_split = set(axes) <= set(moe.batch_axes)

    def local(x, experts, weights, w_gate, w_up, w_down):
        if tokens_split:
            x, experts, weights = (jax.lax.all_gather(a, axes, tiled=True) for a in (x, experts, weights))
        per_device = w_gate.shape[0]
        own = experts - jax.lax.axis_index(axes) * per_device
        mine = (own >= 0) & (own < per_device)
        y = fn(x, jnp.where(mine, own, per_device), jnp.where(mine, weights, 0), w_gate, w_up, w_down)
        return jax.lax.psum_scatter(y, axes, scatter_dimension=0, tiled=True) if tokens_split else jax.lax.psum(y, axes)

    tokens, weights_spec = P(moe.batch_axes or None), P(axes)
    # check_vma off: the paths' loops start from replicated zeros, and the Pallas kernel declares no per-axis variation.
    return jax.shard_map(
        local,
        mesh=moe.mesh,
        in_specs=(tokens, tokens, tokens, weights_spec, weights_spec, weights_spec),
        out_specs=tokens,
        check_vma=False,
    )(x, experts, weights, w_gate, w_up, w_down)


def dispatch_experts(
    moe: MoeDispatch,
    x: jax.Array,
    experts: jax.Array,
    weights: jax.Array,
    w_gate: jax.Array,
    w_up: jax.Array,
    w_down: jax.Array,
) -> jax.Array:
    """DISPATCH[moe.impl] (x [N, H], experts/weights [N, k]): expert-parallel with moe.expert_axes, else over
    moe.groups slices of the N tokens: shard_map instances with moe.mesh (each sees its shard's tokens and every
    expert's weights), else vmapped."""
    if moe.expert_axes:
        return _expert_parallel(moe, x, experts, weights, w_gate, w_up, w_down)
    fn = moe.path()
    if moe.groups == 1:
        return fn(x, experts, weights, w_gate, w_up, w_down)
    if moe.mesh is not None:
        tokens = P(moe.batch_axes)
        # check_vma off: the Pallas call declares no per-axis variation of its outputs (each instance is independent).
        return jax.shard_map(
            fn, mesh=moe.mesh, in_specs=(tokens, tokens, tokens, P(), P(), P()), out_specs=tokens, check_vma=False
        )(x, experts, weights, w_gate, w_up, w_down)
    split = lambda a: a.reshape(moe.groups, -1, *a.shape[1:])  # noqa: E731
    out = jax.vmap(fn, in_axes=(0, 0, 0, None, None, None))(
        split(x), split(experts), split(weights), w_gate, w_up, w_down
    )
    return out.reshape(x.shape)


# On CPU the dense path beats the blocked one while tokens x experts stays this small (decode steps: the sort and
# the loop over blocks cost more than the E/k x extra matmul rows). bench_engine.py --experts=16 (16 experts top-4),
# decode tokens/s blocked vs dense: 510 vs 588 at batch 8 (128 rows), 1194 vs 1063 at batch 32 (512 rows).
SMALL_DENSE_ROWS = 256


def resolve_moe_impl(impl: str, tokens: int | None = None, num_experts: int = 0) -> str:
    """The concrete dispatch path of `impl`: "auto" is megablox on TPU, tokamax on GPU when the tokamax package is
    installed (else blocked), and on CPU blocked, or dense when the call's `tokens` (per dispatch group) x
    `num_experts` <= SMALL_DENSE_ROWS.

    Not ragged on GPU: on an H200 with jax 0.11.2, XLA:GPU lowered ragged_dot to zero-padded dense per-expert
    products, and bench_learner.py's train step asked for 90 GiB of temporaries at 0.9B parameters (8 x 2048
    tokens) and 125 GiB at 4.5B (4 x 4096), out of memory both; the blocked path ran the 4.5B step in 2.5 s."""
    if impl not in MOE_IMPLS:
        raise ValueError(f"moe_impl must be one of {MOE_IMPLS}, got {impl!r}")
    if impl != "auto":
        return impl
    platform = jax.devices()[0].platform
    if platform == "tpu":
        return "megablox"
    if platform == "gpu":
        return "tokamax" if tokamax_ragged_dot() is not None else "blocked"
    few_tokens = platform == "cpu" and tokens is not None and tokens * num_experts <= SMALL_DENSE_ROWS
    return "dense" if few_tokens else "blocked"


class Experts(nnx.Module):
    """Stacked expert weights (HF: mlp.experts.{e}.{gate,up,down}_proj.weight), with per-expert adapters when `lora`
    has experts=True (models/lora.py)."""

    def __init__(
        self, num_experts: int, hidden: int, intermediate: int, dtype, rngs: nnx.Rngs, lora: LoraConfig | None = None
    ):
        self.gate_proj = make_param(
            rngs, (num_experts, hidden, intermediate), ("expert", "embed", "expert_mlp"), dtype, "experts"
        )
        self.up_proj = make_param(
            rngs, (num_experts, hidden, intermediate), ("expert", "embed", "expert_mlp"), dtype, "experts"
        )
        self.down_proj = make_param(
            rngs, (num_experts, intermediate, hidden), ("expert", "expert_mlp", "embed"), dtype, "experts"
        )
        self.gate_proj_lora = make_adapter(lora, "gate_proj", self.gate_proj, rngs, experts=True)
        self.up_proj_lora = make_adapter(lora, "up_proj", self.up_proj, rngs, experts=True)
        self.down_proj_lora = make_adapter(lora, "down_proj", self.down_proj, rngs, experts=True)

    def weights(self) -> tuple[jax.Array, jax.Array, jax.Array]:
        """(gate [E, H, I], up [E, H, I], down [E, I, H]), adapters merged in."""
        return (
            adapted_weight(self.gate_proj, self.gate_proj_lora),
            adapted_weight(self.up_proj, self.up_proj_lora),
            adapted_weight(self.down_proj, self.down_proj_lora),
        )


class SparseMoeBlock(nnx.Module):
    """Router (HF: mlp.gate.weight) + experts; returns the output and the router statistics for the aux losses."""

    def __init__(self, config: Qwen3Config, dtype, rngs: nnx.Rngs):
        self.top_k, self.norm_topk_prob = config.num_experts_per_tok, config.norm_topk_prob
        self.gate = make_param(
            rngs, (config.hidden_size, config.num_experts), ("embed", "router_experts"), dtype, "linear"
        )
        self.experts = Experts(
            config.num_experts, config.hidden_size, config.moe_intermediate_size, dtype, rngs, config.lora
        )

    def __call__(self, x: jax.Array, token_mask: jax.Array, replay: jax.Array | None, moe: MoeDispatch):
        """x [B, T, H], token_mask bool[B, T] (real tokens, for the statistics), replay int32[B, T, k] | None,
        moe: the dispatch (path and token groups).

        -> (out [B, T, H], stats: experts int32[B, T, k], expert_counts [E] and prob_sums [E] and z_sum (float32,
        over real tokens only)).
        """
        b, t, h = x.shape
        flat = x.reshape(b * t, h)
        weights, experts, logits = route(
            flat, self.gate[...], self.top_k, self.norm_topk_prob, None if replay is None else replay.reshape(b * t, -1)
        )
        out = dispatch_experts(moe, flat, experts, weights.astype(x.dtype), *self.experts.weights())
        real = token_mask.reshape(-1).astype(jnp.float32)
        one_hot_counts = jax.nn.one_hot(experts, logits.shape[-1], dtype=jnp.float32).sum(axis=1)  # [N, E]
        stats = {
            "experts": experts.reshape(b, t, -1),
            "expert_counts": jnp.einsum("ne,n->e", one_hot_counts, real),
            "prob_sums": jnp.einsum("ne,n->e", jax.nn.softmax(logits, axis=-1), real),
            "z_sum": jnp.sum(jax.nn.logsumexp(logits, axis=-1) ** 2 * real),
        }
        return out.reshape(b, t, h), stats
