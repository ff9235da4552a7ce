"""Qwen3-MoE sparse block: float32 router, top-k, optional routing replay, dropless dispatch.

Three dispatch paths compute the same function (tested to agree in outputs and gradients). No capacity factor
anywhere: no token is ever dropped.
  dense   — every expert on every token, combined with a [N, E] weight matrix (the readable reference; E/k x the
            useful work).
  ragged  — the N*k (token, expert) assignments sorted by expert, three `jax.lax.ragged_dot` grouped matmuls,
            unsorted and weighted. A grouped GEMM on GPU and TPU; on CPU XLA lowers ragged_dot to a masked dense
            product over all E groups (E x the useful work).
  blocked — the sorted assignments in per-expert runs of whole blocks of rows, three batched matmuls with each
            block's expert weights gathered: at most N*k + E*(block - 1) rows of work. The fastest on CPU
            (bench_model.py).
`moe_impl="auto"` (the default) is ragged on GPU and TPU; on CPU blocked, or dense for calls with few tokens
(decode steps).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from ipa_jax.models.config import MOE_IMPLS, Qwen3Config
from ipa_jax.models.layers import make_param


def route(x: jax.Array, router: jax.Array, top_k: int, norm_topk_prob: bool,
          replay: jax.Array | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
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


def swiglu_experts_dense(x: jax.Array, experts: jax.Array, weights: jax.Array, w_gate: jax.Array, w_up: jax.Array,
                         w_down: jax.Array) -> jax.Array:
    """Reference: y_e = down_e(silu(gate_e x) * up_e x) for all e; out = sum_e c[n, e] y_e[n], c from (experts,
    weights).

    x [N, H], experts int32[N, k], weights [N, k] (model dtype), w_gate/w_up [E, H, I], w_down [E, I, H] -> [N, H].
    """
    n, num_experts = x.shape[0], w_gate.shape[0]
    combine = jnp.zeros((n, num_experts), x.dtype).at[jnp.arange(n)[:, None], experts].add(weights)
    # Batched over experts, each W_e read as stored: "nh,ehi->eni" made XLA transpose every expert weight per call
    # (in a decode loop, at every step).
    xe = jnp.broadcast_to(x, (num_experts, *x.shape))
    h = jax.nn.silu(jnp.einsum("enh,ehi->eni", xe, w_gate)) * jnp.einsum("enh,ehi->eni", xe, w_up)
    y = jnp.einsum("eni,eih->enh", h, w_down)
    return jnp.einsum("ne,enh->nh", combine, y)


def swiglu_experts_ragged(x: jax.Array, experts: jax.Array, weights: jax.Array, w_gate: jax.Array, w_up: jax.Array,
                          w_down: jax.Array) -> jax.Array:
    """Grouped path, same signature and result as `swiglu_experts_dense`.

    Sort the N*k assignments by expert (stable), run grouped matmuls with group sizes = tokens per expert,
    scatter back to assignment order, out[n] = sum_j weights[n, j] * y[n, j].
    """
    n, k = experts.shape
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    group_sizes = jnp.bincount(flat, length=w_gate.shape[0]).astype(jnp.int32)
    xs = x[order // k]
    h = jax.nn.silu(jax.lax.ragged_dot(xs, w_gate, group_sizes)) * jax.lax.ragged_dot(xs, w_up, group_sizes)
    ys = jax.lax.ragged_dot(h, w_down, group_sizes)
    y = jnp.zeros_like(ys).at[order].set(ys).reshape(n, k, -1)
    return jnp.einsum("nkh,nk->nh", y, weights)


def expert_block_rows(assignments: int, num_experts: int, largest: int = 128) -> int:
    """Rows per block of the blocked path: the power of two >= the mean assignments per expert, within [8, largest]
    (small batches waste little padding; large ones get matmuls big enough to run near peak on a CPU)."""
    mean = max(assignments // num_experts, 1)
    return int(min(max(8, 1 << (mean - 1).bit_length()), largest))


def expert_blocks(experts: jax.Array, num_experts: int, rows: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Lays the N*k assignments out in blocks of `rows` rows, every block one expert's: expert e's assignments
    (token order) fill ceil(count_e / rows) consecutive blocks, the rest of its last block stays empty.

    experts int32[N, k] -> (row_token int32[G * rows]: the token of each row, N for an empty row;
    assignment_row int32[N * k]: the row of assignment n * k + j; block_expert int32[G]: the expert of each block).
    G = (N*k + E*(rows - 1)) // rows bounds sum_e ceil(count_e / rows) for any routing, so nothing is dropped.
    """
    n, k = experts.shape
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)  # assignments grouped by expert
    counts = jnp.bincount(flat, length=num_experts)
    padded = -(-counts // rows) * rows
    run_end = jnp.cumsum(padded)  # expert e owns rows [run_end[e] - padded[e], run_end[e])
    first_sorted = jnp.cumsum(counts) - counts  # index in `order` of expert e's first assignment
    sorted_expert = flat[order]
    sorted_row = (run_end - padded)[sorted_expert] + jnp.arange(n * k) - first_sorted[sorted_expert]
    num_blocks = (n * k + num_experts * (rows - 1)) // rows
    row_token = jnp.full((num_blocks * rows,), n, jnp.int32).at[sorted_row].set(order // k)
    assignment_row = jnp.zeros((n * k,), jnp.int32).at[order].set(sorted_row)
    # Blocks past the last run belong to no expert: any expert's weights do (their rows are empty).
    block_expert = jnp.searchsorted(run_end, jnp.arange(num_blocks) * rows, side="right")
    return row_token, assignment_row, jnp.minimum(block_expert, num_experts - 1).astype(jnp.int32)


def swiglu_experts_blocked(x: jax.Array, experts: jax.Array, weights: jax.Array, w_gate: jax.Array,
                           w_up: jax.Array, w_down: jax.Array) -> jax.Array:
    """Blocked path, same signature and result as `swiglu_experts_dense`.

    Tokens gathered into per-expert blocks (`expert_blocks`) xs [G, m, H]; y = down(silu(xs gate) * (xs up)) with
    the weights of each block's expert gathered ([G, H, 2I] gate and up side by side: one matmul instead of two,
    ~15% faster on CPU); out[n] = sum_j weights[n, j] * y[row of (n, j)].
    """
    n, k = experts.shape
    rows = expert_block_rows(n * k, w_gate.shape[0])
    row_token, assignment_row, block_expert = expert_blocks(experts, w_gate.shape[0], rows)
    # Empty rows (token N) read an appended zero row: a plain gather, cheaper than a masked (fill) one.
    x_and_zero = jnp.concatenate([x, jnp.zeros((1, x.shape[1]), x.dtype)])
    xs = x_and_zero.at[row_token].get(mode="promise_in_bounds").reshape(-1, rows, x.shape[1])
    gate_up = jnp.einsum("gmh,ghi->gmi", xs, jnp.concatenate([w_gate, w_up], axis=-1)[block_expert])
    gate, up = jnp.split(gate_up, 2, axis=-1)
    ys = jnp.einsum("gmi,gih->gmh", jax.nn.silu(gate) * up, w_down[block_expert]).reshape(-1, x.shape[1])
    return jnp.einsum("nkh,nk->nh", ys[assignment_row].reshape(n, k, -1), weights)


DISPATCH = {"dense": swiglu_experts_dense, "ragged": swiglu_experts_ragged, "blocked": swiglu_experts_blocked}


@dataclasses.dataclass(frozen=True)
class MoeDispatch:
    """How one forward sends tokens to experts: `impl` (a key of DISPATCH) run separately on each of `groups`
    equal slices of the tokens. On a mesh the groups are the batch shards, so each device sorts and multiplies
    only its own tokens (one global sort would gather every token on every device); 1 = all tokens at once."""

    impl: str
    groups: int = 1


def moe_dispatch(impl: str, batch_shards: int) -> MoeDispatch:
    """The dispatch of a forward whose batch is split `batch_shards` ways: one token group per shard, except for
    ragged, whose `jax.lax.ragged_dot` has no vmap rule with shared weights (JAX: NYI): its sort stays global."""
    return MoeDispatch(impl, 1 if impl == "ragged" else batch_shards)


def dispatch_experts(moe: MoeDispatch, x: jax.Array, experts: jax.Array, weights: jax.Array, w_gate: jax.Array,
                     w_up: jax.Array, w_down: jax.Array) -> jax.Array:
    """DISPATCH[moe.impl] (x [N, H], experts/weights [N, k]) vmapped over moe.groups slices of the N tokens."""
    fn = DISPATCH[moe.impl]
    if moe.groups == 1:
        return fn(x, experts, weights, w_gate, w_up, w_down)
    split = lambda a: a.reshape(moe.groups, -1, *a.shape[1:])  # noqa: E731
    out = jax.vmap(fn, in_axes=(0, 0, 0, None, None, None))(split(x), split(experts), split(weights), w_gate, w_up,
                                                            w_down)
    return out.reshape(x.shape)


# On CPU the dense path beats the blocked one while tokens x experts stays this small (decode steps: the sort,
# gathers and per-block weights cost more than the E/k x extra matmul rows; bench_engine.py --experts=16).
SMALL_DENSE_ROWS = 1024


def resolve_moe_impl(impl: str, tokens: int | None = None, num_experts: int = 0) -> str:
    """The concrete dispatch path of `impl`: "auto" is ragged (grouped GEMM) on accelerators and on CPU blocked,
    or dense when the call's `tokens` (per dispatch group) x `num_experts` <= SMALL_DENSE_ROWS."""
    if impl not in MOE_IMPLS:
        raise ValueError(f"moe_impl must be one of {MOE_IMPLS}, got {impl!r}")
    if impl != "auto":
        return impl
    if jax.devices()[0].platform != "cpu":
        return "ragged"
    return "dense" if tokens is not None and tokens * num_experts <= SMALL_DENSE_ROWS else "blocked"


class Experts(nnx.Module):
    """Stacked expert weights (HF: mlp.experts.{e}.{gate,up,down}_proj.weight)."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, dtype, rngs: nnx.Rngs):
        self.gate_proj = make_param(rngs, (num_experts, hidden, intermediate), ("expert", "embed", "expert_mlp"),
                                    dtype, "experts")
        self.up_proj = make_param(rngs, (num_experts, hidden, intermediate), ("expert", "embed", "expert_mlp"),
                                  dtype, "experts")
        self.down_proj = make_param(rngs, (num_experts, intermediate, hidden), ("expert", "expert_mlp", "embed"),
                                    dtype, "experts")


class SparseMoeBlock(nnx.Module):
    """Router (HF: mlp.gate.weight) + experts; returns the output and the router statistics for the aux losses."""

    def __init__(self, config: Qwen3Config, dtype, rngs: nnx.Rngs):
        self.top_k, self.norm_topk_prob = config.num_experts_per_tok, config.norm_topk_prob
        self.gate = make_param(rngs, (config.hidden_size, config.num_experts), ("embed", "router_experts"), dtype,
                               "linear")
        self.experts = Experts(config.num_experts, config.hidden_size, config.moe_intermediate_size, dtype, rngs)

    def __call__(self, x: jax.Array, token_mask: jax.Array, replay: jax.Array | None, moe: MoeDispatch):
        """x [B, T, H], token_mask bool[B, T] (real tokens, for the statistics), replay int32[B, T, k] | None,
        moe: the dispatch (path and token groups).

        -> (out [B, T, H], stats: experts int32[B, T, k], expert_counts [E] and prob_sums [E] and z_sum (float32,
        over real tokens only)).
        """
        b, t, h = x.shape
        flat = x.reshape(b * t, h)
        weights, experts, logits = route(flat, self.gate[...], self.top_k, self.norm_topk_prob,
                                         None if replay is None else replay.reshape(b * t, -1))
        e = self.experts
        out = dispatch_experts(moe, flat, experts, weights.astype(x.dtype), e.gate_proj[...], e.up_proj[...],
                               e.down_proj[...])
        real = token_mask.reshape(-1).astype(jnp.float32)
        one_hot_counts = jax.nn.one_hot(experts, logits.shape[-1], dtype=jnp.float32).sum(axis=1)  # [N, E]
        stats = {
            "experts": experts.reshape(b, t, -1),
            "expert_counts": jnp.einsum("ne,n->e", one_hot_counts, real),
            "prob_sums": jnp.einsum("ne,n->e", jax.nn.softmax(logits, axis=-1), real),
            "z_sum": jnp.sum(jax.nn.logsumexp(logits, axis=-1) ** 2 * real),
        }
        return out.reshape(b, t, h), stats
