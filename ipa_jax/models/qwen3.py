"""Qwen3 / Qwen3-MoE causal LM in flax.nnx (one model for the family; MoE layers chosen by the config)."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from ipa_jax.models.attention import AttentionMesh, resolve_attention_impl, segment_positions, visible_keys
from ipa_jax.models.cache import KVCache, scatter_rows, write_slots
from ipa_jax.models.config import Qwen3Config
from ipa_jax.models.layers import INIT_STD, MLP, Attention, RMSNorm, make_param, rope_tables
from ipa_jax.models.lora import LoraParam, lora_a_bound, lora_delta
from ipa_jax.models.moe import GROUPED_MATMUL, MoeDispatch, SparseMoeBlock, moe_dispatch, resolve_moe_impl
from ipa_jax.models.sharding import (
    DEFAULT_RULES,
    Rules,
    batch_shards,
    constrain,
    param_shardings,
    place,
    rule_mesh_axes,
)

REMAT_POLICIES = {
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.checkpoint_dots,
    "dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    # Every matmul output but attention's (batched dots: [B, heads, T, S] scores): the projections and the MoE's
    # grouped matmuls, which are no dot_general and are kept by name. The backward recomputes attention and the
    # elementwise work (norms, activations).
    "matmuls": jax.checkpoint_policies.save_from_both_policies(
        jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
        jax.checkpoint_policies.save_only_these_names(GROUPED_MATMUL),
    ),
}


# nnx.vmap / nnx.scan metadata: the stacked layer axis of scan_layers, prepended to each Param's logical axes.
LAYER_AXIS = {nnx.PARTITION_NAME: "layers", "logical_axes": "layers"}


class ModelOutput(NamedTuple):
    """logits [B, T, V] (model dtype); cache: the updated KVCache or None; aux: see Qwen3ForCausalLM.__call__."""

    logits: jax.Array
    cache: KVCache | None
    aux: dict[str, Any]


class LayerInputs(NamedTuple):
    """What every decoder layer reads besides the hidden states: RoPE tables cos/sin [B, T, head_dim / 2], visible
    bool[B, T, S] (attention), token_mask bool[B, T] (real tokens, for the MoE statistics), slots int32[B, T]
    (cache slots) or None, segments int32[B, T] (0 = padding, real tokens 1 + their segment: the splash kernel's
    form of `visible`)."""

    cos: jax.Array
    sin: jax.Array
    visible: jax.Array
    token_mask: jax.Array
    slots: jax.Array | None
    segments: jax.Array


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
            self.mlp = MLP(config.hidden_size, config.intermediate_size, dtype, rngs, config.lora)

    def __call__(
        self, h, inputs: LayerInputs, kv_cache, replay, *, moe: MoeDispatch, attention_mesh: AttentionMesh | None = None
    ):
        """h [B, T, H], kv_cache (k, v) buffers or None, replay int32[B, T, k] or None -> (h, kv_cache, MoE stats
        or None)."""
        attn_out, kv_cache = self.self_attn(
            self.input_layernorm(h),
            inputs.cos,
            inputs.sin,
            inputs.visible,
            kv_cache,
            inputs.slots,
            inputs.segments,
            attention_mesh,
        )
        h = h + attn_out
        x = self.post_attention_layernorm(h)
        if self.is_moe:
            mlp_out, stats = self.mlp(x, inputs.token_mask, replay, moe)
        else:
            mlp_out, stats = self.mlp(x), None
        return h + mlp_out, kv_cache, stats


def stacked_layers(config: Qwen3Config, dtype, rngs: nnx.Rngs) -> DecoderLayer:
    """One DecoderLayer whose parameters have a leading axis of num_hidden_layers (logical axis "layers"), for
    nnx.scan. Every layer is of one kind (Qwen3Config checks), so layer 0's kind is every layer's."""

    @nnx.split_rngs(splits=config.num_hidden_layers)
    @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata=LAYER_AXIS)
    def make(layer_rngs):
        return DecoderLayer(config, 0, dtype, layer_rngs)

    return make(rngs)


class Qwen3ForCausalLM(nnx.Module):
    """Qwen3 dense / MoE causal LM. Parameter names follow HF (model.* prefix dropped), weights stored [in, out].

    With config.scan_layers, `layers` is one DecoderLayer with every parameter stacked over the layers
    ([L, ...]) and the forward runs it under nnx.scan; otherwise `layers` is a list of L layers.
    `mesh` (optional) turns on sharding constraints on activations at layer boundaries (batch over the "batch"
    rule); parameters are placed by `init_model` / `from_pretrained`.
    """

    def __init__(
        self,
        config: Qwen3Config,
        *,
        dtype=jnp.float32,
        rngs: nnx.Rngs,
        mesh: Mesh | None = None,
        rules: Rules = DEFAULT_RULES,
    ):
        self.config, self.dtype, self.mesh, self.rules = config, jnp.dtype(dtype), mesh, tuple(rules)
        self.embed_tokens = make_param(rngs, (config.vocab_size, config.hidden_size), ("vocab", "embed"), dtype, "copy")
        if config.scan_layers:
            self.layers = stacked_layers(config, dtype, rngs)
        else:
            self.layers = nnx.List([DecoderLayer(config, i, dtype, rngs) for i in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        if not config.tie_word_embeddings:
            self.lm_head = make_param(
                rngs, (config.hidden_size, config.vocab_size), ("embed", "vocab"), dtype, "linear"
            )

    def lm_head_weight(self) -> jax.Array:
        """Output projection [H, V] (the embedding transposed when tied)."""
        return self.embed_tokens[...].T if self.config.tie_word_embeddings else self.lm_head[...]

    def hidden_states(
        self,
        input_ids: jax.Array,
        positions: jax.Array | None = None,
        attention_mask: jax.Array | None = None,
        *,
        segment_ids: jax.Array | None = None,
        prefix_segment_ids: jax.Array | None = None,
        cache: KVCache | None = None,
        routed_experts: jax.Array | None = None,
        moe_impl: str | None = None,
    ):
        """Final normed hidden states [B, T, H] and aux (aux["cache"] holds the updated cache when one is given).

        input_ids int32[B, T]; positions int32[B, T] (default: arange(T) per row, or the index within the
        segment with segment_ids); attention_mask bool[B, T] (real tokens; default all); segment_ids int32[B, T]
        (packed rows: a token attends only within its segment, a contiguous run of one id; not with a cache);
        prefix_segment_ids int32[B, T] (packed rows with shared prefixes, `pack_batch(share_prefix=True)`): a
        token also attends to segment prefix_segment_ids[t]'s tokens at positions before its own segment's first;
        routed_experts int32[B, T, L, k] (routing replay; L = num_hidden_layers, entries of non-MoE layers
        ignored); moe_impl overrides config.moe_impl.
        """
        cfg = self.config
        b, t = input_ids.shape
        shards = batch_shards(self.mesh, self.rules, b)
        moe = moe_dispatch(
            resolve_moe_impl(moe_impl or cfg.moe_impl, b * t // shards, cfg.num_experts),
            shards,
            self.mesh,
            rule_mesh_axes("batch", self.rules),
            rule_mesh_axes("expert", self.rules),
            cfg.moe_block_rows,
        )
        if routed_experts is not None and routed_experts.shape != (
            b,
            t,
            cfg.num_hidden_layers,
            cfg.num_experts_per_tok,
        ):
            raise ValueError(
                f"routed_experts shape {routed_experts.shape} != "
                f"{(b, t, cfg.num_hidden_layers, cfg.num_experts_per_tok)}"
            )
        if segment_ids is not None and cache is not None:
            raise ValueError("segment_ids (packed rows) cannot be combined with a KV cache")
        if prefix_segment_ids is not None and segment_ids is None:
            raise ValueError("prefix_segment_ids (shared prefixes) needs the packed rows' segment_ids")
        if positions is None:
            positions = (
                jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
                if segment_ids is None
                else segment_positions(segment_ids)
            )
        token_mask = jnp.ones((b, t), bool) if attention_mask is None else attention_mask.astype(bool)

        if cache is None:
            slots = None
            visible = visible_keys(positions, positions, token_mask, segment_ids, segment_ids, prefix_segment_ids)
        else:
            slots = write_slots(positions, token_mask, cache.max_len)
            key_valid = scatter_rows(cache.valid, slots, jnp.ones((b, t), bool))
            slot_positions = jnp.broadcast_to(jnp.arange(cache.max_len), key_valid.shape)
            visible = visible_keys(positions, slot_positions, key_valid)

        # Gather from the all-gathered table (as FSDP does for every weight): a gather from a vocab- and
        # width-sharded table into batch-sharded activations would make GSPMD replicate the result anyway.
        table = constrain(self.embed_tokens[...], self.mesh, (None, None), self.rules)
        h = constrain(table[input_ids], self.mesh, ("batch", None, None), self.rules)
        if prefix_segment_ids is not None and resolve_attention_impl(cfg.attention_impl, h.dtype, cfg.head_dim) == (
            "splash"
        ):
            raise ValueError(
                "attention_impl 'splash' reads segment ids only and cannot attend to a shared prefix: use another "
                "attention_impl or train.share_prefix=False"
            )
        cos, sin = rope_tables(cfg, positions, h.dtype)  # the parameters' dtype (a trainer may cast them)
        real_segment = 1 if segment_ids is None else segment_ids.astype(jnp.int32) + 1
        inputs = LayerInputs(cos, sin, visible, token_mask, slots, jnp.where(token_mask, real_segment, 0))
        batch_axes = rule_mesh_axes("batch", self.rules) if shards > 1 else ()
        attention_mesh = (
            None if self.mesh is None else AttentionMesh(self.mesh, batch_axes, rule_mesh_axes("kv_heads", self.rules))
        )

        layer_fn = self._layer_fn(moe, attention_mesh)
        if cfg.scan_layers and cache is None:
            h, moe_stats = self._scan_layers(h, inputs, routed_experts, layer_fn)
            routed = None if moe_stats is None else jnp.moveaxis(moe_stats["experts"], 0, 2)
        else:
            h, moe_stats, routed, (keys, values) = self._unrolled_layers(h, inputs, cache, routed_experts, layer_fn)
        aux = self._aux_losses(moe_stats, token_mask)
        aux["routed_experts"] = routed
        if cache is not None:
            aux["cache"] = KVCache(keys, values, key_valid)
        return self.norm(h), aux

    def _layer_fn(self, moe: MoeDispatch, attention_mesh: AttentionMesh | None):
        """One decoder layer's call (layer, h, inputs, kv, replay) -> (h, kv, stats), rematerialised by
        config.remat_policy."""

        def layer_fn(layer, h, inputs, kv, replay):
            return layer(h, inputs, kv, replay, moe=moe, attention_mesh=attention_mesh)

        if self.config.remat_policy == "none":
            return layer_fn
        return nnx.remat(layer_fn, policy=REMAT_POLICIES[self.config.remat_policy])

    def _scan_layers(self, h, inputs: LayerInputs, routed_experts, layer_fn):
        """The stacked layers under nnx.scan (no cache) -> (h, MoE stats stacked [L, ...] or None)."""

        def body(layer, h, replay):
            h, _, stats = layer_fn(layer, h, inputs, None, replay)
            return constrain(h, self.mesh, ("batch", None, None), self.rules), stats

        replay = None if routed_experts is None else jnp.moveaxis(routed_experts, 2, 0)  # [L, B, T, k]
        scan = nnx.scan(
            body,
            in_axes=(0, nnx.Carry, None if replay is None else 0),
            out_axes=(nnx.Carry, 0),
            transform_metadata=LAYER_AXIS,
        )
        return scan(self.layers, h, replay)

    def _layer_list(self) -> list[DecoderLayer]:
        """The decoder layers one by one (slices of the stacked parameters with scan_layers)."""
        if not self.config.scan_layers:
            return list(self.layers)
        graphdef, state = nnx.split(self.layers)
        return [
            nnx.merge(graphdef, jax.tree.map(lambda x, i=i: x[i], state)) for i in range(self.config.num_hidden_layers)
        ]

    def _unrolled_layers(self, h, inputs: LayerInputs, cache: KVCache | None, routed_experts, layer_fn):
        """The layers in a Python loop -> (h, MoE stats stacked over the MoE layers or None, routed experts
        int32[B, T, L, k] (-1 in dense layers) or None for a dense model, (keys, values): the updated cache
        buffers of every layer, empty without a cache)."""
        cfg = self.config
        b, t = inputs.token_mask.shape
        new_keys, new_values, moe_stats, routed = [], [], [], []
        for i, layer in enumerate(self._layer_list()):
            kv = None if cache is None else (cache.keys[i], cache.values[i])
            replay = None if routed_experts is None else routed_experts[:, :, i]
            h, kv, stats = layer_fn(layer, h, inputs, kv, replay)
            h = constrain(h, self.mesh, ("batch", None, None), self.rules)
            if kv is not None:
                new_keys.append(kv[0])
                new_values.append(kv[1])
            if stats is not None:
                moe_stats.append(stats)
            if cfg.num_experts > 0:
                routed.append(
                    stats["experts"] if stats is not None else jnp.full((b, t, cfg.num_experts_per_tok), -1, jnp.int32)
                )
        stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *moe_stats) if moe_stats else None
        return h, stacked, (jnp.stack(routed, axis=2) if routed else None), (tuple(new_keys), tuple(new_values))

    def _aux_losses(self, moe_stats: dict | None, token_mask: jax.Array) -> dict[str, jax.Array]:
        """Switch load balancing E * sum_e f_e P_e (f: top-k assignment share, P: mean router prob, pooled over MoE
        layers and real tokens as transformers does) and router z-loss mean(logsumexp(logits)^2). moe_stats:
        each statistic stacked over the MoE layers."""
        if moe_stats is None:
            zero = jnp.zeros((), jnp.float32)
            return {"load_balancing_loss": zero, "router_z_loss": zero}
        num_moe_layers = moe_stats["z_sum"].shape[0]
        rows = jnp.maximum(jnp.sum(token_mask.astype(jnp.float32)), 1.0) * num_moe_layers
        counts = jnp.sum(moe_stats["expert_counts"], axis=0) / rows
        probs = jnp.sum(moe_stats["prob_sums"], axis=0) / rows
        return {
            "load_balancing_loss": self.config.num_experts * jnp.sum(counts * probs),
            "router_z_loss": jnp.sum(moe_stats["z_sum"]) / rows,
        }

    def __call__(
        self,
        input_ids: jax.Array,
        positions: jax.Array | None = None,
        attention_mask: jax.Array | None = None,
        *,
        segment_ids: jax.Array | None = None,
        cache: KVCache | None = None,
        routed_experts: jax.Array | None = None,
        moe_impl: str | None = None,
    ) -> ModelOutput:
        """input_ids int32[B, T] -> ModelOutput(logits [B, T, V], cache, aux).

        aux: "load_balancing_loss", "router_z_loss" (float32 scalars, 0 for dense models), "routed_experts"
        int32[B, T, L, k] (experts used per layer, -1 in non-MoE layers; None for a dense model).
        With a cache: tokens are written at their positions and attend to every valid cached position <= theirs.
        """
        hidden, aux = self.hidden_states(
            input_ids,
            positions,
            attention_mask,
            segment_ids=segment_ids,
            cache=cache,
            routed_experts=routed_experts,
            moe_impl=moe_impl,
        )
        new_cache = aux.pop("cache", None)
        logits = hidden @ self.lm_head_weight()
        return ModelOutput(logits=logits, cache=new_cache, aux=aux)


def initial_value(var: nnx.Variable, rng: np.random.Generator, dtype) -> np.ndarray:
    """A host value for `var` from its `init` metadata: "ones", "zeros", "lora_a" (models/lora.py) or "normal"
    (N(0, 0.02))."""
    init = var.get_metadata()["init"]
    if init in ("ones", "zeros"):
        return (np.ones if init == "ones" else np.zeros)(var.shape, jnp.dtype(dtype))
    if init == "lora_a":
        bound = lora_a_bound(var.shape)
        return rng.uniform(-bound, bound, var.shape).astype(jnp.dtype(dtype))
    return (INIT_STD * rng.standard_normal(var.shape, np.float32)).astype(jnp.dtype(dtype))


def init_model(
    config: Qwen3Config,
    *,
    seed: int = 0,
    dtype=jnp.float32,
    mesh: Mesh | None = None,
    sharding_rules: Rules | None = None,
) -> Qwen3ForCausalLM:
    """A randomly initialised model (HF init: N(0, 0.02) weights, unit norms, zero biases), drawn on the host with NumPy
    (no RNG kernels to compile) and placed directly into each parameter's sharding when a mesh is given."""
    rules = DEFAULT_RULES if sharding_rules is None else tuple(sharding_rules)
    abstract = nnx.eval_shape(
        lambda: Qwen3ForCausalLM(config, dtype=dtype, rngs=nnx.Rngs(seed), mesh=mesh, rules=rules)
    )
    graphdef, state = nnx.split(abstract)
    shardings = None if mesh is None else param_shardings(state, mesh, rules)
    # Adapters from a stream of their own: the base weights are those of the same seed without adapters.
    rng, adapter_rng = np.random.default_rng(seed), np.random.default_rng([seed, 1])

    def draw(var: nnx.Variable, sharding) -> nnx.Variable:
        source = adapter_rng if isinstance(var, LoraParam) else rng
        return var.replace(value=place(initial_value(var, source, dtype), sharding))

    is_var = lambda x: isinstance(x, nnx.Variable)  # noqa: E731
    if shardings is None:
        state = jax.tree.map(lambda v: draw(v, None), state, is_leaf=is_var)
    else:
        state = jax.tree.map(draw, state, shardings, is_leaf=is_var)
    return nnx.merge(graphdef, state)


def merge_lora(model: Qwen3ForCausalLM) -> Qwen3ForCausalLM:
    """`model` itself without adapters; with adapters (config.lora) a plain model of the same architecture whose
    targeted weights are W + (alpha / r) A B (in W's dtype and sharding), what HF exports and engines take."""
    lora = model.config.lora
    if lora is None:
        return model
    variables = dict(nnx.to_flat_state(nnx.state(model)))
    plain = nnx.eval_shape(
        lambda: Qwen3ForCausalLM(
            model.config.replace(lora=None), dtype=model.dtype, rngs=nnx.Rngs(0), mesh=model.mesh, rules=model.rules
        )
    )
    graphdef, state = nnx.split(plain)

    def merged(path, var: nnx.Variable) -> nnx.Variable:
        keys = tuple(getattr(p, "key", getattr(p, "idx", None)) for p in path)
        weight = variables[keys][...]
        adapter = (*keys[:-1], f"{keys[-1]}_lora")
        if (*adapter, "a") in variables:
            delta = lora_delta(variables[(*adapter, "a")][...], variables[(*adapter, "b")][...], lora.scale)
            weight = (weight.astype(jnp.float32) + delta).astype(weight.dtype)
        return var.replace(value=weight)

    state = jax.tree_util.tree_map_with_path(merged, state, is_leaf=lambda x: isinstance(x, nnx.Variable))
    return nnx.merge(graphdef, state)
