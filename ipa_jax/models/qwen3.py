"""Qwen3 / Qwen3-MoE causal LM in flax.nnx (one model for the family; MoE layers chosen by the config)."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from ipa_jax.models.cache import KVCache, scatter_rows, write_slots
from ipa_jax.models.config import MOE_IMPLS, Qwen3Config
from ipa_jax.models.layers import INIT_STD, MLP, Attention, RMSNorm, make_param, rope_tables
from ipa_jax.models.moe import SparseMoeBlock
from ipa_jax.models.sharding import DEFAULT_RULES, Rules, constrain, param_shardings, place

REMAT_POLICIES = {
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.checkpoint_dots,
    "dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


class ModelOutput(NamedTuple):
    """logits [B, T, V] (model dtype); cache: the updated KVCache or None; aux: see Qwen3ForCausalLM.__call__."""

    logits: jax.Array
    cache: KVCache | None
    aux: dict[str, Any]


class DecoderLayer(nnx.Module):
    """Pre-norm block: h += attn(norm(h)); h += mlp_or_moe(norm(h))."""

    def __init__(self, config: Qwen3Config, layer_idx: int, dtype, rngs: nnx.Rngs):
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.self_attn = Attention(config, dtype, rngs)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.is_moe = config.is_moe_layer(layer_idx)
        if self.is_moe:
            self.mlp = SparseMoeBlock(config, dtype, rngs)
        else:
            self.mlp = MLP(config.hidden_size, config.intermediate_size, dtype, rngs)

    def __call__(self, h, cos, sin, positions, token_mask, key_valid, kv_cache, slots, replay, *, moe_impl: str):
        attn_out, kv_cache = self.self_attn(self.input_layernorm(h), cos, sin, positions, key_valid, kv_cache, slots)
        h = h + attn_out
        x = self.post_attention_layernorm(h)
        if self.is_moe:
            mlp_out, stats = self.mlp(x, token_mask, replay, moe_impl)
        else:
            mlp_out, stats = self.mlp(x), None
        return h + mlp_out, kv_cache, stats


class Qwen3ForCausalLM(nnx.Module):
    """Qwen3 dense / MoE causal LM. Parameter names follow HF (model.* prefix dropped), weights stored [in, out].

    `mesh` (optional) turns on sharding constraints on activations at layer boundaries (batch over the "batch"
    rule); parameters are placed by `init_model` / `from_pretrained`.
    """

    def __init__(self, config: Qwen3Config, *, dtype=jnp.float32, rngs: nnx.Rngs, mesh: Mesh | None = None,
                 rules: Rules = DEFAULT_RULES):
        self.config, self.dtype, self.mesh, self.rules = config, jnp.dtype(dtype), mesh, tuple(rules)
        self.embed_tokens = make_param(rngs, (config.vocab_size, config.hidden_size), ("vocab", "embed"), dtype,
                                       "copy")
        self.layers = nnx.List([DecoderLayer(config, i, dtype, rngs) for i in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        if not config.tie_word_embeddings:
            self.lm_head = make_param(rngs, (config.hidden_size, config.vocab_size), ("embed", "vocab"), dtype,
                                      "linear")

    def lm_head_weight(self) -> jax.Array:
        """Output projection [H, V] (the embedding transposed when tied)."""
        return self.embed_tokens[...].T if self.config.tie_word_embeddings else self.lm_head[...]

    def hidden_states(self, input_ids: jax.Array, positions: jax.Array | None = None,
                      attention_mask: jax.Array | None = None, *, cache: KVCache | None = None,
                      routed_experts: jax.Array | None = None, moe_impl: str | None = None):
        """Final normed hidden states [B, T, H] and aux (aux["cache"] holds the updated cache when one is given).

        input_ids int32[B, T]; positions int32[B, T] (default arange(T) per row); attention_mask bool[B, T]
        (real tokens; default all); routed_experts int32[B, T, L, k] (routing replay; L = num_hidden_layers,
        entries of non-MoE layers ignored); moe_impl overrides config.moe_impl ("dense" | "ragged").
        """
        cfg = self.config
        b, t = input_ids.shape
        positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t)) if positions is None else positions
        token_mask = jnp.ones((b, t), bool) if attention_mask is None else attention_mask.astype(bool)
        moe_impl = moe_impl or cfg.moe_impl
        if moe_impl not in MOE_IMPLS:
            raise ValueError(f"moe_impl must be one of {MOE_IMPLS}, got {moe_impl!r}")
        if routed_experts is not None and routed_experts.shape != (b, t, cfg.num_hidden_layers,
                                                                   cfg.num_experts_per_tok):
            raise ValueError(f"routed_experts shape {routed_experts.shape} != "
                             f"{(b, t, cfg.num_hidden_layers, cfg.num_experts_per_tok)}")

        if cache is None:
            slots, key_valid = None, token_mask
        else:
            slots = write_slots(positions, token_mask, cache.max_len)
            key_valid = scatter_rows(cache.valid, slots, jnp.ones((b, t), bool))

        # Gather from the all-gathered table (as FSDP does for every weight): a gather from a vocab- and
        # width-sharded table into batch-sharded activations would make GSPMD replicate the result anyway.
        table = constrain(self.embed_tokens[...], self.mesh, (None, None), self.rules)
        h = constrain(table[input_ids], self.mesh, ("batch", None, None), self.rules)
        cos, sin = rope_tables(cfg, positions, h.dtype)  # the parameters' dtype (a trainer may cast them)

        def layer_fn(layer, *args):
            return layer(*args, moe_impl=moe_impl)

        if cfg.remat_policy != "none":
            layer_fn = nnx.remat(layer_fn, policy=REMAT_POLICIES[cfg.remat_policy])
        new_keys, new_values, moe_stats = [], [], []
        routed = []
        for i, layer in enumerate(self.layers):
            kv = None if cache is None else (cache.keys[i], cache.values[i])
            replay = None if routed_experts is None else routed_experts[:, :, i]
            h, kv, stats = layer_fn(layer, h, cos, sin, positions, token_mask, key_valid, kv, slots, replay)
            h = constrain(h, self.mesh, ("batch", None, None), self.rules)
            if kv is not None:
                new_keys.append(kv[0])
                new_values.append(kv[1])
            if stats is not None:
                moe_stats.append(stats)
            if cfg.num_experts > 0:
                routed.append(stats["experts"] if stats is not None
                              else jnp.full((b, t, cfg.num_experts_per_tok), -1, jnp.int32))
        hidden = self.norm(h)

        aux = self._aux_losses(moe_stats, token_mask)
        aux["routed_experts"] = jnp.stack(routed, axis=2) if routed else None
        if cache is not None:
            aux["cache"] = KVCache(tuple(new_keys), tuple(new_values), key_valid)
        return hidden, aux

    def _aux_losses(self, moe_stats: list[dict], token_mask: jax.Array) -> dict[str, jax.Array]:
        """Switch load balancing E * sum_e f_e P_e (f: top-k assignment share, P: mean router prob, pooled over MoE
        layers and real tokens as transformers does) and router z-loss mean(logsumexp(logits)^2)."""
        if not moe_stats:
            zero = jnp.zeros((), jnp.float32)
            return {"load_balancing_loss": zero, "router_z_loss": zero}
        rows = jnp.maximum(jnp.sum(token_mask.astype(jnp.float32)), 1.0) * len(moe_stats)
        counts = sum(s["expert_counts"] for s in moe_stats) / rows
        probs = sum(s["prob_sums"] for s in moe_stats) / rows
        return {
            "load_balancing_loss": self.config.num_experts * jnp.sum(counts * probs),
            "router_z_loss": sum(s["z_sum"] for s in moe_stats) / rows,
        }

    def __call__(self, input_ids: jax.Array, positions: jax.Array | None = None,
                 attention_mask: jax.Array | None = None, *, cache: KVCache | None = None,
                 routed_experts: jax.Array | None = None, moe_impl: str | None = None) -> ModelOutput:
        """input_ids int32[B, T] -> ModelOutput(logits [B, T, V], cache, aux).

        aux: "load_balancing_loss", "router_z_loss" (float32 scalars, 0 for dense models), "routed_experts"
        int32[B, T, L, k] (experts used per layer, -1 in non-MoE layers; None for a dense model).
        With a cache: tokens are written at their positions and attend to every valid cached position <= theirs.
        """
        hidden, aux = self.hidden_states(input_ids, positions, attention_mask, cache=cache,
                                         routed_experts=routed_experts, moe_impl=moe_impl)
        new_cache = aux.pop("cache", None)
        logits = hidden @ self.lm_head_weight()
        return ModelOutput(logits=logits, cache=new_cache, aux=aux)


def init_model(config: Qwen3Config, *, seed: int = 0, dtype=jnp.float32, mesh: Mesh | None = None,
               sharding_rules: Rules | None = None) -> Qwen3ForCausalLM:
    """A randomly initialised model (HF init: N(0, 0.02) weights, unit norms, zero biases), drawn on the host with NumPy
    (no RNG kernels to compile) and placed directly into each parameter's sharding when a mesh is given."""
    rules = DEFAULT_RULES if sharding_rules is None else tuple(sharding_rules)
    abstract = nnx.eval_shape(lambda: Qwen3ForCausalLM(config, dtype=dtype, rngs=nnx.Rngs(seed), mesh=mesh,
                                                       rules=rules))
    graphdef, state = nnx.split(abstract)
    shardings = None if mesh is None else param_shardings(state, mesh, rules)
    rng = np.random.default_rng(seed)

    def draw(var: nnx.Variable, sharding) -> nnx.Variable:
        init = var.get_metadata()["init"]
        if init in ("ones", "zeros"):
            host = (np.ones if init == "ones" else np.zeros)(var.shape, jnp.dtype(dtype))
        else:
            host = (INIT_STD * rng.standard_normal(var.shape, np.float32)).astype(jnp.dtype(dtype))
        return var.replace(value=place(host, sharding))

    is_var = lambda x: isinstance(x, nnx.Variable)  # noqa: E731
    if shardings is None:
        state = jax.tree.map(lambda v: draw(v, None), state, is_leaf=is_var)
    else:
        state = jax.tree.map(draw, state, shardings, is_leaf=is_var)
    return nnx.merge(graphdef, state)
