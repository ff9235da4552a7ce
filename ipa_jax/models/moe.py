"""Qwen3-MoE sparse block: float32 router, top-k, optional routing replay, dropless dispatch.

Two dispatch paths compute the same function (tested to agree in outputs and gradients):
  dense  — every expert on every token, combined with a [N, E] weight matrix (the readable reference);
  ragged — the N*k (token, expert) assignments sorted by expert, three `jax.lax.ragged_dot` grouped matmuls,
           unsorted and weighted. No capacity factor anywhere: no token is ever dropped.
ragged_dot is a grouped GEMM on GPU (Triton/XLA) and TPU; on CPU JAX lowers it to a masked dense product over
all E groups (E x the useful work), so on CPU the dense path is the faster one (see bench_model.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from ipa_jax.models.config import Qwen3Config
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
    h = jax.nn.silu(jnp.einsum("nh,ehi->eni", x, w_gate)) * jnp.einsum("nh,ehi->eni", x, w_up)
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


DISPATCH = {"dense": swiglu_experts_dense, "ragged": swiglu_experts_ragged}


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

    def __call__(self, x: jax.Array, token_mask: jax.Array, replay: jax.Array | None, moe_impl: str):
        """x [B, T, H], token_mask bool[B, T] (real tokens, for the statistics), replay int32[B, T, k] | None.

        -> (out [B, T, H], stats: experts int32[B, T, k], expert_counts [E] and prob_sums [E] and z_sum (float32,
        over real tokens only)).
        """
        b, t, h = x.shape
        flat = x.reshape(b * t, h)
        weights, experts, logits = route(flat, self.gate[...], self.top_k, self.norm_topk_prob,
                                         None if replay is None else replay.reshape(b * t, -1))
        e = self.experts
        out = DISPATCH[moe_impl](flat, experts, weights.astype(x.dtype), e.gate_proj[...], e.up_proj[...],
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
