"""The train step: one optimizer update from one TrajectoryBatch, a pure function jitted over the mesh.

    train_step(state, batch[, advantages[, old_log_probs[, extras[, baselines]]]]) -> (state, metrics)

1. Advantages A_i (from the FULL batch's rewards, unless given), with objective.baseline_stage "return" the
   baselines of the discounted returns (`estimate_return_baselines`, given with given advantages), and every
   objective term's denominator (masks only, `term_denominators`) are computed on the full batch first.
2. The batch is split into microbatches; lax.scan accumulates the gradient of
   sum_terms weight_term * numerator_term(microbatch) / denominator_term(full batch) over the enabled terms of
   the objective's registry (objectives/terms/), so the accumulated gradient equals the full-batch gradient (up
   to float reassociation); each computed term is reported as the metric <name>_loss. Per-row inputs of the
   objective travel with their rows: rewards (sign_by="reward"), the failure labels reward < success_reward
   (the entropy filter's failed rows), the old log-probs and the terms' extra per-token inputs (`extras`).
3. A non-finite loss or gradient, or an update not shown finite (new params or optimizer state, e.g. from an
   overflowing learning rate), leaves params and optimizer state unchanged and counts a skipped update. With
   options.optimizer the update is shown finite before it is computed, by `update_magnitude_bound` (a bound on
   every number it computes, from the gradient norm, learning rate and the largest parameter and moment). It fails
   only when learning rate x largest Adam moment / eps nears float32's range (with AdamW's defaults and clipping:
   learning rates above about 1e29), so only absurd learning rates skip an update that would have been finite.
   With gradient clipping the moments need no reading: |mu| <= clip_norm and nu <= clip_norm^2 hold for every
   state the step returns (`moments_within_clip`, kept by each clipped update), so `TrainStep` reads the moments
   only for a state it did not return (a restored checkpoint, another step's state), once, to check that it holds.
   Without it, each update is computed, checked, and applied only when every new number is finite.

Current log-probs (and entropies when asked) come from the model's blockwise `token_logprobs`.

Packed batches (batch.segment_ids, `pack_batch`): the model attends within each segment and restarts positions
there, the objective computes every per-trajectory quantity per segment, and per-trajectory inputs (rewards,
advantages) are [B, S]; the loss and gradient are those of the same trajectories one per row. With shared
prefixes (batch.prefix_segment_ids, `pack_batch(share_prefix=True)`) a trajectory that begins like its row's first
holds only the rest and attends to the first's tokens as its prefix: the same log-probs, so the same loss (the
MoE router's load-balancing statistics count the shared tokens once).

Old log-probs (objective.old_logprobs = "recompute"): the learner's log-probs under the parameters at the start of
the update, without gradient. On the first update of a batch those are the current parameters, so the step takes
stop_gradient(l) from the very forward that computes l (same parameters, dtype, block size and routing, no second
forward). When a batch makes several updates (train.minibatches / train.epochs_per_batch), the learner computes
them once before the first (`TrainStep.old_log_probs`, microbatched like the step) and passes each update its rows.

Reference log-probs (objective.kl_weight != 0 or objective.kl_penalty > 0): the frozen reference policy's
(state.ref_params) log-probs of the batch's tokens, by the same blockwise forward without gradient, microbatch by
microbatch (`TrainStep.reference_log_probs`); the learner computes them once per batch and passes them as
extras={"ref_log_probs": [B, T]}. The KL term reads them (objectives/terms/kl.py); the KL reward penalty lowers
each trajectory's reward by beta * sum_t k(b_t, ref_t) before the advantages (`batch_advantages`), b the sampler's
log-probs or, with objective.kl_penalty_logprobs "recompute" (verl's), the old ones: the first update of a batch
then computes them by a forward before the advantages, as the learner does for a batch of several updates.
"""

import functools
import math
import weakref
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.experimental.multihost_utils import process_allgather
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ipa_jax.models import token_logprobs
from ipa_jax.models.attention import segment_positions
from ipa_jax.models.sharding import DEFAULT_RULES, Rules, batch_sharding
from ipa_jax.objectives import (
    ObjectiveConfig,
    combine_terms,
    estimate_advantages,
    estimate_return_baselines,
    objective_terms,
    penalty_sequence_kl,
    term_denominators,
)
from ipa_jax.objectives.kl import kl_k3
from ipa_jax.objectives.overlong import shaped_rewards
from ipa_jax.objectives.sequences import Sequences, as_given, as_slots, sequence_count, sequences_of, to_tokens
from ipa_jax.objectives.terms import needs_entropy as terms_need_entropy
from ipa_jax.train.optimizer import (
    OptimizerConfig,
    PhaseSchedule,
    apply_direction,
    moments_within_clip,
    update_magnitude_bound,
)
from ipa_jax.train.state import TrainState
from ipa_jax.trajectory import TrajectoryBatch


@dataclass(frozen=True)
class StepOptions:
    """Static choices of the train step (hashable)."""

    objective: ObjectiveConfig
    microbatches: int = 1
    logprob_block_size: int = 128
    logprob_keep_logits_mib: int = 256  # keep the forward's logits for the backward up to this size
    entropy: bool = False  # compute token entropies (always on when the objective needs them)
    routing_replay: bool = False  # feed batch.routed_experts to the model's MoE layers
    load_balancing_coef: float = 0.0
    router_z_coef: float = 0.0
    compute_dtype: str | None = None  # cast floating params to this dtype in the forward (None = as stored)
    success_reward: float = 1.0  # a row with reward < this is a failure (the entropy filter's failed rows)
    # The AdamW behind state.tx (make_optimizer(optimizer)), to show an update finite before computing it; None
    # (any optax transformation): compute each update and check it (module doc, 3.)
    optimizer: OptimizerConfig | None = None

    @property
    def needs_entropy(self) -> bool:
        return self.entropy or self.objective.negative_token_fraction < 1.0 or terms_need_entropy(self.objective)


def _split_microbatches(x: jax.Array, m: int) -> jax.Array:
    """[B, ...] -> [M, B/M, ...]; microbatch j = rows j, j+M, j+2M, ... so every device's rows are spread over
    all microbatches (the leading, device-sharded axis stays whole)."""
    return x.reshape(x.shape[0] // m, m, *x.shape[1:]).swapaxes(0, 1)


def _merge_microbatches(x: jax.Array) -> jax.Array:
    """The inverse of _split_microbatches: [M, B/M, ...] -> [B, ...]."""
    return x.swapaxes(0, 1).reshape(x.shape[0] * x.shape[1], *x.shape[2:])


def _all_finite(tree: Any) -> jax.Array:
    """Whether every floating leaf of `tree` is finite (a scalar bool)."""
    leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.inexact)]
    return jnp.all(jnp.stack(leaves)) if leaves else jnp.asarray(True)


def _smallest_float_max(tree: Any) -> float:
    """The largest finite value of the narrowest floating dtype among `tree`'s leaves."""
    return min(float(jnp.finfo(x.dtype).max) for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.floating))


def _cast_floating(tree: Any, dtype: str | None) -> Any:
    if dtype is None:
        return tree
    return jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)


def greedy_reproduced_rows(logp: jax.Array, expert_mask: jax.Array, sequences: Sequences | None = None) -> jax.Array:
    """bool[B] ([B, S] packed: per sequence): rows with expert tokens, each of which has probability > 1/2, so that
    greedy decoding under teacher forcing reproduces them (p > 1/2 implies the argmax). logp, expert_mask: [B, T].

    On fresh expert episodes this is a lower bound of the greedy success rate on the expert's tasks (the
    argmax may also be right with p <= 1/2), at the cost of no extra forward pass."""
    seqs = sequences_of(logp.shape) if sequences is None else sequences
    # no expert token with p_t <= 1/2, and at least one expert token
    unsure = sequence_count(expert_mask & ~(logp > jnp.log(0.5)), seqs)
    return as_given((unsure == 0) & (sequence_count(expert_mask, seqs) > 0), seqs)


def batch_sequences(batch: TrajectoryBatch) -> Sequences:
    """The batch's sequences: one per row, or its packed rows' segments with [B, S] per-trajectory fields."""
    return sequences_of(batch.tokens.shape, batch.segment_ids, batch.rewards.shape[-1])


def _float32(x: jax.Array | None) -> jax.Array | None:
    return None if x is None else x.astype(jnp.float32)


def batch_advantages(
    batch: TrajectoryBatch,
    objective: ObjectiveConfig,
    ref_log_probs: jax.Array | None = None,
    old_log_probs: jax.Array | None = None,
) -> jax.Array:
    """A per trajectory ([B], or [B, S] packed) from the batch's rewards by the objective's estimator
    (estimate_advantages: KL reward penalty, overlong punishment, baseline and std normalisation over the
    trajectories whose action tokens the loss covers, advantage_sign). ref_log_probs [B, T]: required with
    objective.kl_penalty > 0; old_log_probs [B, T]: required when the penalty reads them (kl_penalty_logprobs)."""
    return estimate_advantages(
        batch.rewards,
        batch.action_mask,
        batch.group_ids,
        objective,
        batch.segment_ids,
        batch.truncated,
        behavior_log_probs=batch.behavior_logprobs.astype(jnp.float32),
        ref_log_probs=_float32(ref_log_probs),
        old_log_probs=_float32(old_log_probs),
    )


def penalty_kl(
    batch: TrajectoryBatch,
    objective: ObjectiveConfig,
    ref_log_probs: jax.Array | None,
    old_log_probs: jax.Array | None = None,
) -> jax.Array:
    """KL_i of the reward penalty (`penalty_sequence_kl`): the sum over trajectory i's action tokens of k(p, ref),
    k the objective.kl_penalty_estimator, p the behaviour (or old) log-probs. [B] ([B, S] packed)."""
    return penalty_sequence_kl(
        batch.action_mask,
        objective,
        batch_sequences(batch),
        batch.behavior_logprobs.astype(jnp.float32),
        _float32(ref_log_probs),
        _float32(old_log_probs),
    )


def _token_logprobs(params, rest, graphdef, mb: TrajectoryBatch, options: StepOptions, return_entropy: bool):
    """The learner's forward: (log-probs float32 [b, T], entropies [b, T] | None, aux) of one microbatch, at its
    action and expert tokens (the only ones any loss or statistic reads; elsewhere 0)."""
    cast = options.compute_dtype
    model = nnx.merge(graphdef, _cast_floating(params, cast), _cast_floating(rest, cast))  # rest: LoRA's base weights
    logp, entropy, aux = token_logprobs(
        model,
        mb.tokens,
        mb.attention_mask,
        mb.positions,
        segment_ids=mb.segment_ids,
        prefix_segment_ids=mb.prefix_segment_ids,
        return_entropy=return_entropy,
        block_size=options.logprob_block_size,
        keep_logits_bytes=options.logprob_keep_logits_mib << 20,
        routed_experts=mb.routed_experts if options.routing_replay else None,
        scored=mb.action_mask | mb.expert_mask,
    )
    return logp.astype(jnp.float32), entropy, aux


def _microbatch_loss(
    params,
    rest,
    graphdef,
    mb: TrajectoryBatch,
    adv: jax.Array,
    baselines: jax.Array | None,
    old: jax.Array | None,
    extras: dict[str, jax.Array],
    dens: dict,
    options: StepOptions,
):
    """Loss share of one microbatch (its sum over microbatches is the full-batch loss) and its statistics.
    old: the microbatch's old log-probs, or None (then, under "recompute", those of this forward); extras: its
    rows of the terms' extra per-token inputs; baselines: its rows of the return baselines (baseline_stage
    "return"), or None."""
    logp, entropy, aux = _token_logprobs(params, rest, graphdef, mb, options, options.needs_entropy)
    if old is None and options.objective.needs_old_log_probs:
        old = jax.lax.stop_gradient(logp)  # the parameters at the start of the update are these
    terms, diag = objective_terms(
        logp,
        mb.behavior_logprobs,
        adv,
        mb.action_mask,
        mb.chunk_ids,
        mb.expert_mask,
        options.objective,
        entropy,
        failures=mb.rewards < options.success_reward,
        old_log_probs=old,
        rewards=mb.rewards,
        segment_ids=mb.segment_ids,
        branch_advantages=mb.branch_advantages,
        branch_mask=mb.branch_mask,
        extras=extras,
        truncated=mb.truncated,
        baselines=baselines,
    )
    loss = combine_terms(terms, options.objective, denominators=dens)
    # MoE auxiliary losses only when weighted (otherwise XLA drops their computation entirely). They are
    # per-microbatch means, averaged over microbatches (not exactly the full-batch value).
    coefs = {"load_balancing_loss": options.load_balancing_coef, "router_z_loss": options.router_z_coef}
    aux_losses = {name: aux[name] / options.microbatches for name, coef in coefs.items() if coef > 0}
    aux_loss = sum(coefs[name] * value for name, value in aux_losses.items())
    action = mb.action_mask
    n_action = jnp.sum(action).astype(jnp.float32)
    ref = extras.get("ref_log_probs")
    # The drift from the reference whatever the term's estimator: sum of k3(current, reference) over action tokens
    logp_sg = jax.lax.stop_gradient(logp)
    reference_kl = (
        0.0 if ref is None else jnp.sum(jnp.where(action, kl_k3(logp_sg, jnp.where(action, ref, logp_sg)), 0))
    )
    n_keep = jnp.sum(diag["retained_tokens"]).astype(jnp.float32)
    n_chunks = jnp.sum(diag["num_chunks"]).astype(jnp.float32)
    seqs = batch_sequences(mb)
    present = as_given(sequence_count(mb.attention_mask, seqs) > 0, seqs)  # the slots holding a trajectory
    success = action & to_tokens(as_slots(mb.rewards >= options.success_reward, seqs), seqs)
    # Sums (not means) so that microbatches combine exactly into full-batch statistics.
    stats = {
        **{f"{name}_num": num for name, (num, _) in terms.items()},
        "n_action": n_action,
        "n_success_action": jnp.sum(success).astype(jnp.float32),
        "n_success_negative": jnp.sum(success & (diag["chunk_returns"] < 0)).astype(jnp.float32),
        "n_keep": n_keep,
        "n_chunks": n_chunks,
        "n_kept_chunks": diag["kept_fraction"] * n_chunks,
        "sum_abs_log_ratio": diag["mean_abs_log_ratio"] * n_action,
        "sum_kl": diag["mean_kl"] * n_action,
        "sum_is_ratio": diag["mean_is_ratio"] * n_keep,
        "max_is_ratio": diag["max_is_ratio"],
        "n_clipped": diag["clip_fraction"] * n_keep,
        "sum_mismatch_ratio": diag["mismatch_ratio_mean"] * n_action,
        "n_mismatch_masked": diag["mismatch_masked_fraction"] * n_action,
        "n_mismatch_capped": diag["mismatch_capped_fraction"] * n_keep,
        "nonfinite_weights": diag["nonfinite_weights"].astype(jnp.float32),
        "n_trajectories": jnp.sum(present).astype(jnp.float32),
        "admitted": jnp.sum(diag["admitted"] & present).astype(jnp.float32),
        "max_chunks": jnp.max(diag["num_chunks"]).astype(jnp.float32),
        "n_il_rows": jnp.sum(sequence_count(mb.expert_mask, seqs) > 0).astype(jnp.float32),
        "n_il_greedy_rows": jnp.sum(greedy_reproduced_rows(logp, mb.expert_mask, seqs)).astype(jnp.float32),
        "sum_entropy": (
            jnp.sum(jnp.where(action, entropy, 0.0)) if entropy is not None else jnp.zeros((), jnp.float32)
        ),
        "sum_reference_kl": jnp.asarray(reference_kl, jnp.float32),
        **aux_losses,
    }
    return loss + aux_loss, stats


_MAX_STATS = ("max_is_ratio", "max_chunks")


def recompute_log_probs(
    state: TrainState, batch: TrajectoryBatch, *, options: StepOptions, reference: bool = False
) -> jax.Array:
    """The learner's log-probs of the batch's tokens under state.params (reference: under the frozen
    state.ref_params), without gradient: [B, T] float32, by the train step's forward (dtype, block size, routing
    replay) microbatch by microbatch."""
    params = state.ref_params if reference else state.params
    if params is None:
        raise ValueError("reference log-probs: the train state has no reference policy (TrainState.with_reference)")

    def forward(mb):
        return jax.lax.stop_gradient(_token_logprobs(params, state.rest, state.graphdef, mb, options, False)[0])

    if options.microbatches == 1:
        return forward(batch)
    mbs = jax.tree.map(lambda x: _split_microbatches(x, options.microbatches), batch)
    return _merge_microbatches(jax.lax.map(forward, mbs))


def batch_gradients(
    state: TrainState,
    batch: TrajectoryBatch,
    advantages: jax.Array | None,
    old_log_probs: jax.Array | None = None,
    extras: dict[str, jax.Array] | None = None,
    baselines: jax.Array | None = None,
    *,
    options: StepOptions,
):
    """The loss of one update on `batch` and its gradient w.r.t. state.params (float32 leaves), accumulated over
    options.microbatches. Returns (loss, grads, stats, advantages, denominators): statistics summed over the
    microbatches (maxima for the _MAX_STATS), the advantages and the full-batch denominators it used. Arguments as
    train_step's."""
    objective, m = options.objective, options.microbatches
    b = batch.tokens.shape[0]
    if b % m:
        raise ValueError(f"batch size {b} is not divisible by microbatches={m}")
    if old_log_probs is not None and not objective.needs_old_log_probs:
        raise ValueError(f"old_log_probs: must be None for old_logprobs={objective.old_logprobs!r}")
    extras = dict(extras or {})
    if advantages is None:
        if baselines is not None:
            raise ValueError("baselines: given without advantages (the advantages they belong to)")
        advantages = batch_advantages(batch, objective, extras.get("ref_log_probs"), old_log_probs)
        baselines = estimate_return_baselines(
            advantages,
            batch.action_mask,
            batch.chunk_ids,
            batch.group_ids,
            objective,
            batch.segment_ids,
            batch.truncated,
        )
    objective.check_baselines(baselines is not None)
    advantages = advantages.astype(jnp.float32)
    dens = term_denominators(
        batch.action_mask, batch.chunk_ids, batch.expert_mask, objective, batch.segment_ids, batch.truncated
    )
    grad_fn = jax.value_and_grad(_microbatch_loss, has_aux=True)
    f32 = lambda tree: jax.tree.map(lambda x: x.astype(jnp.float32), tree)  # noqa: E731

    if m == 1:
        (loss, stats), grads = grad_fn(
            state.params, state.rest, state.graphdef, batch, advantages, baselines, old_log_probs, extras, dens, options
        )
        return loss, f32(grads), stats, advantages, dens
    split = lambda tree: jax.tree.map(lambda x: _split_microbatches(x, m), tree)  # noqa: E731

    def accumulate(carry, xs):
        grads_acc, loss_acc = carry
        mb, adv, base, old, extra = xs
        (loss, stats), grads = grad_fn(
            state.params, state.rest, state.graphdef, mb, adv, base, old, extra, dens, options
        )
        grads_acc = jax.tree.map(lambda a, g: a + g.astype(jnp.float32), grads_acc, grads)
        return (grads_acc, loss_acc + loss), stats

    zero_grads = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), state.params)
    (grads, loss), per_mb = jax.lax.scan(
        accumulate,
        (zero_grads, jnp.zeros((), jnp.float32)),
        split((batch, advantages, baselines, old_log_probs, extras)),
    )
    stats = {k: (jnp.max(v) if k in _MAX_STATS else jnp.sum(v)) for k, v in per_mb.items()}
    return loss, grads, stats, advantages, dens


def train_step(
    state: TrainState,
    batch: TrajectoryBatch,
    advantages: jax.Array | None,
    old_log_probs: jax.Array | None = None,
    extras: dict[str, jax.Array] | None = None,
    baselines: jax.Array | None = None,
    *,
    options: StepOptions,
    schedule: PhaseSchedule,
    moments_within: bool = False,
) -> tuple[TrainState, dict[str, jax.Array]]:
    """One update. batch: [B, T] arrays (B divisible by options.microbatches); advantages [B] ([B, S] packed) or
    None (computed here from batch.rewards with the objective's baseline); old_log_probs [B, T]
    (objective.old_logprobs = "recompute" only) or None (then the current ones: this update is the batch's first);
    extras: {name: [B, T]} the extra per-token inputs of the objective's terms (ObjectiveTerm.inputs), or None;
    baselines [B] ([B, S]): with given advantages and objective.baseline_stage "return", the baseline of the
    returns (estimate_return_baselines on the batch the advantages came from), None otherwise.
    Returns the new state and scalar metrics."""
    if old_log_probs is None and advantages is None and options.objective.penalty_reads_old_log_probs:
        # the KL reward penalty reads the old log-probs before the advantages, so before this update's own forward
        old_log_probs = recompute_log_probs(state, batch, options=options)
    loss, grads, stats, advantages, dens = batch_gradients(
        state, batch, advantages, old_log_probs, extras, baselines, options=options
    )
    grad_norm = optax.global_norm(grads)
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, state.params)

    lr = schedule(state.step, state.rl_start)

    def keep(_):
        return state.params, state.opt_state, jnp.asarray(False)

    def apply(_):
        direction, opt_state = state.tx.update(grads, state.opt_state, state.params)
        return apply_direction(state.params, direction, lr), opt_state, jnp.asarray(True)

    def apply_if_finite(_):
        params, opt_state, _ = apply(None)
        ok = _all_finite(params) & _all_finite(opt_state)
        return jax.lax.cond(ok, lambda _: (params, opt_state, jnp.asarray(True)), keep, None)

    # A skipped update keeps params and optimizer state bit for bit (the learning rate schedule follows the
    # step). A finite gradient can still make a non-finite update (an overflowing learning rate), so the update
    # must be shown finite too: by a bound from its inputs when the step knows the optimizer, which lets it write
    # params and moments in place; otherwise by computing it and checking the result, which needs fresh buffers
    # for them (a fifth of a small CPU step).
    if options.optimizer is None:
        new_params, new_opt_state, applied = jax.lax.cond(finite, apply_if_finite, keep, None)
    else:
        bound = update_magnitude_bound(options.optimizer, state.params, state.opt_state, grad_norm, lr, moments_within)
        bounded = bound <= 0.5 * _smallest_float_max(state.params)  # half: room for rounding
        new_params, new_opt_state, applied = jax.lax.cond(finite & bounded, apply, keep, None)
    skipped = (~applied).astype(jnp.int32)
    new_state = state.replace(
        params=new_params,
        opt_state=new_opt_state,
        step=state.step + 1,
        skipped=state.skipped + skipped,
        rng=jax.random.split(state.rng)[0],
    )

    # Means over the trajectories (the used slots of packed rows; every row of a one-per-row batch).
    seqs = batch_sequences(batch)
    present = as_given(sequence_count(batch.attention_mask, seqs) > 0, seqs)
    n_traj = jnp.maximum(stats["n_trajectories"], 1.0)
    rewards = batch.rewards.astype(jnp.float32)
    reward_mean, advantage_mean = (jnp.sum(jnp.where(present, x, 0)) / n_traj for x in (rewards, advantages))
    spread = lambda x, mean: jnp.sqrt(jnp.sum(jnp.where(present, (x - mean) ** 2, 0)) / n_traj)  # noqa: E731
    n_action = jnp.maximum(stats["n_action"], 1.0)
    n_keep = jnp.maximum(stats["n_keep"], 1.0)
    metrics = {
        "loss": loss,
        **{f"{name}_loss": stats[f"{name}_num"] / jnp.maximum(den, 1) for name, den in dens.items()},
        "grad_norm": grad_norm,
        "lr": lr,
        "skipped": skipped,
        "skipped_total": new_state.skipped,
        "reward_mean": reward_mean,
        "reward_std": spread(rewards, reward_mean),
        "advantage_mean": advantage_mean,
        "advantage_std": spread(advantages, advantage_mean),
        "advantage_min": jnp.min(jnp.where(present, advantages, jnp.inf)),
        "advantage_max": jnp.max(jnp.where(present, advantages, -jnp.inf)),
        "admitted_fraction": stats["admitted"] / n_traj,
        "kept_token_fraction": stats["n_keep"] / n_action,
        # Manipulation check of where the baseline is subtracted: successes' action tokens with credit G < 0
        "credit_negative_share_success": stats["n_success_negative"] / jnp.maximum(stats["n_success_action"], 1.0),
        "il_rows": stats["n_il_rows"],
        # Fraction of imitation rows greedy decoding would reproduce (greedy_reproduced_rows); 0 without any.
        "il_greedy_match": stats["n_il_greedy_rows"] / jnp.maximum(stats["n_il_rows"], 1.0),
        "kept_chunk_fraction": stats["n_kept_chunks"] / jnp.maximum(stats["n_chunks"], 1.0),
        "is_ratio_mean": stats["sum_is_ratio"] / n_keep,
        "is_ratio_max": stats["max_is_ratio"],
        "clip_fraction": stats["n_clipped"] / n_keep,
        "mismatch_abs": stats["sum_abs_log_ratio"] / n_action,  # mean |l - b| over action tokens: the whole drift
        "mismatch_kl": stats["sum_kl"] / n_action,  # mean Bernoulli-KL proxy of the policy ratio (the trust region's)
        # The mismatch ratio (old / behaviour; current / behaviour without old log-probs) at its level:
        "mismatch_ratio_mean": stats["sum_mismatch_ratio"] / n_action,
        "mismatch_masked_fraction": stats["n_mismatch_masked"] / n_action,  # dropped by its range / prob-diff masks
        "mismatch_capped_fraction": stats["n_mismatch_capped"] / n_keep,  # kept tokens whose weight was capped
        "chunks_mean": stats["n_chunks"] / n_traj,
        "chunks_max": stats["max_chunks"],
        "action_tokens": stats["n_action"],
        "real_tokens": jnp.sum(batch.attention_mask).astype(jnp.float32),
        "nonfinite_weights": stats["nonfinite_weights"],
        **{name: stats[name] for name in ("load_balancing_loss", "router_z_loss") if name in stats},
    }
    if options.needs_entropy:
        metrics["entropy"] = stats["sum_entropy"] / n_action
    if extras and "ref_log_probs" in extras:
        metrics["reference_kl"] = stats["sum_reference_kl"] / n_action  # mean k3(current, reference) per action token
        if options.objective.kl_penalty > 0:  # the penalty's KL_i (behaviour or old vs reference), mean over rows
            kl = penalty_kl(batch, options.objective, extras["ref_log_probs"], old_log_probs)
            metrics["kl_penalty_sequence_mean"] = jnp.sum(jnp.where(present, kl, 0)) / n_traj
    if batch.prefix_segment_ids is not None:
        metrics["shared_prefix_tokens"] = shared_prefix_tokens(batch)
    metrics.update(overlong_metrics(batch, options.objective, present, n_traj))
    return new_state, metrics


def shared_prefix_tokens(batch: TrajectoryBatch) -> jax.Array:
    """Tokens the batch's trajectories read from a shared prefix instead of holding: a segment that continues
    another starts at position P, its prefix's length. float32 scalar; real_tokens + it = the trajectories' tokens."""
    first = batch.attention_mask & (segment_positions(batch.segment_ids) == 0) & (batch.prefix_segment_ids > 0)
    return jnp.sum(jnp.where(first, batch.positions, 0)).astype(jnp.float32)


def overlong_metrics(batch: TrajectoryBatch, objective: ObjectiveConfig, present: jax.Array, n_traj: jax.Array):
    """overlong_filtered: the truncated trajectories overlong_filter left out of the loss; overlong_penalty_mean:
    the mean soft overlong punishment added to the rewards. Each only when its option is on."""
    metrics = {}
    if objective.overlong_filter:
        metrics["overlong_filtered"] = jnp.sum(present & batch.truncated).astype(jnp.float32)
    if objective.overlong_shaping:
        penalty = shaped_rewards(batch.rewards, batch.action_mask, objective, batch.segment_ids) - batch.rewards
        metrics["overlong_penalty_mean"] = jnp.sum(jnp.where(present, penalty, 0)).astype(jnp.float32) / n_traj
    return metrics


def data_parallel_size(mesh: Mesh, rules: Rules = DEFAULT_RULES) -> int:
    """How many ways the batch axis is split (the mesh axes of the "batch" sharding rule)."""
    axes = batch_sharding(mesh, rules, 1).spec[0]
    axes = (axes,) if isinstance(axes, str) else tuple(axes or ())
    return math.prod(mesh.shape[a] for a in axes)


def place_state(state: TrainState, mesh: Mesh) -> TrainState:
    """Every leaf on `mesh`: already mesh-sharded leaves stay, anything else (scalars, RNG, an unsharded model)
    becomes replicated, so the jitted step sees one device set."""
    replicated = NamedSharding(mesh, P())

    def place(x):
        s = getattr(x, "sharding", None)
        if isinstance(s, NamedSharding) and s.mesh == mesh:
            return x
        if mesh.is_multi_process:  # device_put's array spans other processes' devices: Orbax cannot save it
            value = np.asarray(x)
            return jax.make_array_from_callback(value.shape, replicated, lambda index: value[index])
        return jax.device_put(x, replicated)

    return jax.tree.map(place, state)


class TrainStep:
    """train_step jitted with explicit in/out shardings over `mesh` and the state donated.

    step = TrainStep(state, mesh, options, schedule); state, metrics = step(state, device_batch[, advantages[,
    old_log_probs[, extras[, baselines]]]]). `device_batch` comes from `step.put_batch(numpy_batch)` (each process
    feeds its own rows; extras, {name: [B, T]}, and baselines go through put_batch the same way).
    """

    def __init__(
        self, state: TrainState, mesh: Mesh, options: StepOptions, schedule: PhaseSchedule, rules: Rules = DEFAULT_RULES
    ):
        self.mesh, self.options, self.schedule, self.rules = mesh, options, schedule, rules
        self.state_shardings = jax.tree.map(lambda x: x.sharding, state)
        self.replicated = NamedSharding(mesh, P())
        self._compiled: dict[tuple, Any] = {}
        self._compiled_old: dict[tuple, Any] = {}
        self._check_moments = None  # jitted moments_within_clip, built on first use
        self._returned = []  # weak references to the optimizer state arrays this step last returned within the clip
        self.moment_checks = 0  # states whose moments were read to check the clip invariant

    def _moments_within(self, state: TrainState) -> bool:
        """Whether the update bound may take the moments as within the clip (`moments_within_clip`): true of every
        state this step returned from one within it (each of its updates is clipped: the invariant holds to float32
        rounding, which the bound's factor 2 of room covers), read and checked for any other."""
        optimizer = self.options.optimizer
        if optimizer is None or optimizer.clip_norm <= 0:
            return False
        leaves = jax.tree.leaves(state.opt_state)
        if len(leaves) == len(self._returned) and all(ref() is leaf for ref, leaf in zip(self._returned, leaves)):
            return True
        if self._check_moments is None:
            self._check_moments = jax.jit(functools.partial(moments_within_clip, optimizer))
        self.moment_checks += 1
        return bool(self._check_moments(state.opt_state))

    def batch_shardings(self, batch: Any) -> Any:
        """Leading (batch) axis over the mesh's data-like axes, the rest replicated, for any tree of arrays."""
        return jax.tree.map(lambda x: batch_sharding(self.mesh, self.rules, x.ndim), batch)

    def put_batch(self, batch: Any) -> Any:
        """Host (NumPy) global batch (or [B] array) -> sharded device arrays; each process uploads only its own
        rows."""
        from ipa_jax.train.distributed import device_put_global

        return device_put_global(batch, self.batch_shardings(batch))

    @property
    def data_parallel_size(self) -> int:
        """How many ways the mesh splits a batch's rows."""
        return data_parallel_size(self.mesh, self.rules)

    def _jitted(
        self,
        batch: TrajectoryBatch,
        with_advantages: bool,
        with_old: bool,
        extras: tuple[str, ...],
        with_base: bool,
        moments_within: bool = False,
    ):
        packed = batch.segment_ids is not None
        branched = batch.branch_advantages is not None  # a batch without branched trajectories has no such fields
        shared = batch.prefix_segment_ids is not None
        key = (batch.routed_experts is not None, packed, shared, with_advantages, with_old, branched, extras, with_base)
        key += (moments_within,)
        if key not in self._compiled:
            fn = lambda state, batch, adv, old, extra, base: train_step(  # noqa: E731
                state,
                batch,
                adv,
                old,
                extra,
                base,
                options=self.options,
                schedule=self.schedule,
                moments_within=moments_within,
            )
            # advantages (and return baselines) are per row [B], or per sequence slot [B, S] in packed rows
            adv_sharding = batch_sharding(self.mesh, self.rules, 1 + packed) if with_advantages else None
            base_sharding = batch_sharding(self.mesh, self.rules, 1 + packed) if with_base else None
            old_sharding = batch_sharding(self.mesh, self.rules, 2) if with_old else None
            extra_shardings = {name: batch_sharding(self.mesh, self.rules, 2) for name in extras}
            self._compiled[key] = jax.jit(
                fn,
                in_shardings=(
                    self.state_shardings,
                    self.batch_shardings(batch),
                    adv_sharding,
                    old_sharding,
                    extra_shardings,
                    base_sharding,
                ),
                out_shardings=(self.state_shardings, self.replicated),
                donate_argnums=(0,),
            )
        return self._compiled[key]

    def __call__(
        self,
        state: TrainState,
        batch: TrajectoryBatch,
        advantages: jax.Array | None = None,
        old_log_probs: jax.Array | None = None,
        extras: dict[str, jax.Array] | None = None,
        baselines: jax.Array | None = None,
    ) -> tuple[TrainState, dict[str, jax.Array]]:
        extras = dict(extras or {})
        jitted = self._jitted(
            batch,
            advantages is not None,
            old_log_probs is not None,
            tuple(sorted(extras)),
            baselines is not None,
            within := self._moments_within(state),
        )
        new_state, metrics = jitted(state, batch, advantages, old_log_probs, extras, baselines)
        self._returned = [weakref.ref(leaf) for leaf in jax.tree.leaves(new_state.opt_state)] if within else []
        return new_state, metrics

    def old_log_probs(self, state: TrainState, batch: TrajectoryBatch) -> np.ndarray:
        """Host (NumPy) global batch -> the learner's log-probs of its tokens under state.params, float32 [B, T] on
        the host of every process (`recompute_log_probs`; the learner passes each update its rows)."""
        return self._host_log_probs(state, batch, reference=False)

    def reference_log_probs(self, state: TrainState, batch: TrajectoryBatch) -> np.ndarray:
        """Host (NumPy) global batch -> the frozen reference policy's (state.ref_params) log-probs of its tokens,
        float32 [B, T] on the host of every process, like `old_log_probs`: the extras "ref_log_probs"."""
        return self._host_log_probs(state, batch, reference=True)

    def _host_log_probs(self, state: TrainState, batch: TrajectoryBatch, reference: bool) -> np.ndarray:
        key = (
            batch.routed_experts is not None,
            batch.segment_ids is not None,
            batch.prefix_segment_ids is not None,
            reference,
        )
        if key not in self._compiled_old:
            self._compiled_old[key] = jax.jit(
                lambda state, batch: recompute_log_probs(state, batch, options=self.options, reference=reference),
                in_shardings=(self.state_shardings, self.batch_shardings(batch)),
                out_shardings=batch_sharding(self.mesh, self.rules, 2),
            )
        # Every process gets the global array: each then uploads its own rows of each update's minibatch.
        return np.asarray(process_allgather(self._compiled_old[key](state, self.put_batch(batch)), tiled=True))
