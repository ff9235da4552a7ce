"""The composed objective: advantages -> credit -> masks -> importance ratios -> aggregation, plus imitation.

Notation (docs/design.md, "The objective"; docs/off_policy.md): l = current log-prob (differentiated), b =
behaviour log-prob (the sampler's), o = old log-prob (the learner's own at the start of the update, when
recomputed), A_i advantage, G credit, rho policy ratio, c mismatch weight, all weights stop-gradient:
L = lambda_RL * (-Agg(w * l)) + lambda_IL * NLL(expert) + ...,  w_{i,t} = keep_{i,t} * rho_{i,t} * c_{i,t} * G_{i,t},
one (numerator, denominator) pair per term of the registry (objectives/terms/: rl, il, entropy, ...), each term
weighted by its ObjectiveConfig weight and in the loss iff that weight is non-zero.

Two ratios. The policy ratio l / p, p = o (old_logprobs="recompute") or b ("behavior"), drives rho (TOPR's
truncation) and the trust region. The mismatch ratio q / b, q = o ("recompute") or l ("behavior"), drives the
mismatch range mask, the probability-difference filter and the capped weight c. With "behavior" both are l / b.

Microbatching: compute advantages on the FULL batch, then objective_terms per microbatch; every term is a
(numerator, denominator) pair whose denominator depends only on masks, so summing both over microbatches and
calling combine_terms gives the full-batch loss; with full_dens = term_denominators(full-batch masks),
combine_terms(terms_mb, config, denominators=full_dens) is a per-microbatch loss whose sum over microbatches
(and so whose summed gradient) equals the full-batch one. Rows are never split, so per-row quantities (the kept
row denominator, sequence ratios) are exact in every microbatch.

Packed rows (segment_ids, objectives/sequences.py): a row holds several sequences; every per-row quantity above
is then per sequence (T_i, K_i, A_i, sequence ratios and trust region, the entropy filter's failures, the row
divisors and the row count B of the aggregation), so a packed batch gives the loss of the same sequences one per
row. Per-sequence inputs and outputs are [B, S] instead of [B]; chunk ids are unique within a row.

Diagnostics (dict), by shape:
  scalars: acceptance_rate (admitted rows, or admitted chunks at chunk level, among rows/chunks with actions),
    kept_fraction (chunks with >= 1 kept token / chunks), kept_token_fraction, mean_is_ratio / max_is_ratio
    (the policy ratio at is_level before truncation, over kept tokens; 1 at level none), clip_fraction (kept
    tokens whose policy ratio was truncated), mismatch_ratio_mean (the mismatch ratio at its level over action
    tokens; 1 at level none; inf if one overflows), mismatch_masked_fraction (action tokens dropped by the
    mismatch range mask or the probability-difference filter), mismatch_capped_fraction (kept tokens whose
    mismatch weight was capped), mean_abs_log_ratio (mean |l - b| over action tokens: the whole drift),
    mean_kl (mean Bernoulli-KL proxy of p vs l over action tokens: the trust region's), nonfinite_weights (kept
    tokens whose weight is inf/NaN: an overflowing admitted ratio); policy_loss adds loss and <name>_loss of
    every computed term.
  per row [B] ([B, S] packed: per sequence): advantages, negatives (bool: the rows sign_by marks negative; with
    baseline_stage "return" and sign_by "advantage", R_i - b_i < 0, while each token's own sign drives the ratio),
    sequence_kl (D_i, clamped at 0), admitted (bool; at chunk level: every chunk admitted), num_chunks (int32),
    policy_tokens (T_i, int32), retained_tokens (kept action tokens, int32).
  per token [B, T]: chunk_returns (G; G - b with baseline_stage "return"), chunk_ratios (exp of the chunk-mean
    l - b, 0 outside actions), weights (w, before aggregation scaling).
Scalars are over the arrays given (microbatch-local); per-row arrays concatenate across microbatches.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping

import jax
import jax.numpy as jnp

from ipa_jax.objectives.advantages import compute_advantages, negative_rows
from ipa_jax.objectives.aggregation import aggregation_weights, kept_row_scale
from ipa_jax.objectives.chunks import chunk_mean, chunk_starts, chunk_sum, compute_dtype, num_chunks
from ipa_jax.objectives.config import ObjectiveConfig
from ipa_jax.objectives.credit import (
    baselined_returns,
    branch_credit,
    credit_returns,
    return_baselines,
    scored_units,
)
from ipa_jax.objectives.kl import kl_penalized_rewards, sequence_kl
from ipa_jax.objectives.masks import entropy_filter_mask, mismatch_mask, probability_difference_mask
from ipa_jax.objectives.overlong import loss_action_mask, shaped_rewards
from ipa_jax.objectives.ratios import importance_weights, level_log_ratio, level_mean
from ipa_jax.objectives.sequences import Sequences, as_given, as_slots, sequence_count, sequences_of, to_tokens
from ipa_jax.objectives.terms import (
    TermBatch,
    TermMasks,
    computed_terms,
    enabled_terms,
    needs_entropy,
    term_weight,
)
from ipa_jax.objectives.terms.policy_gradient import ppo_token_loss
from ipa_jax.objectives.trust_region import bernoulli_kl, chunk_divergence, sequence_divergence
from ipa_jax.objectives.validation import validate_if_concrete

Terms = dict[str, tuple[jax.Array, jax.Array]]


def _ratio(num: jax.Array, den: jax.Array) -> jax.Array:
    return num / jnp.maximum(den, 1)


def _trust_region(
    kl: jax.Array, action: jax.Array, chunk_ids: jax.Array, starts: jax.Array, config: ObjectiveConfig, seqs: Sequences
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """kl [B, T] (Bernoulli-KL of p vs l per action token) -> (admitted bool[B, S], admitted tokens bool[B, T],
    acceptance rate): admit a sequence (chunk) iff its mean KL D <= delta."""
    has_actions = sequence_count(action, seqs) > 0
    if config.trust_region_level == "sequence":
        admitted = as_slots(sequence_divergence(kl, action, seqs), seqs) <= config.trust_region_delta
        return (
            admitted,
            action & to_tokens(admitted, seqs),
            _ratio(jnp.sum(admitted & has_actions), jnp.sum(has_actions)),
        )
    if config.trust_region_level == "chunk":
        admit_tok = action & (chunk_divergence(kl, action, chunk_ids) <= config.trust_region_delta)
        admitted = sequence_count(action & ~admit_tok, seqs) == 0
        return admitted, admit_tok, _ratio(jnp.sum(starts & admit_tok), jnp.sum(starts))
    return jnp.ones_like(has_actions), action, jnp.asarray(1.0, kl.dtype)


def _mismatch_correction(
    learner: jax.Array,
    behavior: jax.Array,
    action: jax.Array,
    chunk_ids: jax.Array,
    config: ObjectiveConfig,
    seqs: Sequences,
) -> tuple[jax.Array, jax.Array]:
    """learner q, behaviour b [B, T] -> (kept bool[B, T], log of the mismatch ratio q / b at mismatch_level [B, T]):
    the range mask and the probability-difference filter; everything kept (log-ratio 0) at level none."""
    if config.mismatch_level == "none":
        return action, jnp.zeros_like(learner)
    log_mismatch = level_log_ratio(
        jnp.where(action, learner - behavior, 0), action, chunk_ids, config.mismatch_level, seqs
    )
    keep = mismatch_mask(log_mismatch, action, config.mismatch_range)
    if math.isfinite(config.mismatch_prob_diff):
        # keep iff |level mean of exp(q) - exp(b)| <= threshold
        prob_diff = jnp.exp(jnp.where(action, learner, 0)) - jnp.exp(jnp.where(action, behavior, 0))
        keep &= probability_difference_mask(
            level_mean(prob_diff, action, chunk_ids, config.mismatch_level, seqs), action, config.mismatch_prob_diff
        )
    return keep, log_mismatch


def objective_terms(
    log_probs: jax.Array,
    behavior_log_probs: jax.Array,
    advantages: jax.Array,
    action_mask: jax.Array,
    chunk_ids: jax.Array | None,
    expert_mask: jax.Array | None,
    config: ObjectiveConfig,
    entropies: jax.Array | None = None,
    *,
    failures: jax.Array | None = None,
    old_log_probs: jax.Array | None = None,
    rewards: jax.Array | None = None,
    segment_ids: jax.Array | None = None,
    branch_advantages: jax.Array | None = None,
    branch_mask: jax.Array | None = None,
    extras: Mapping[str, jax.Array] | None = None,
    truncated: jax.Array | None = None,
    baselines: jax.Array | None = None,
) -> tuple[Terms, dict[str, jax.Array]]:
    """[B, T] inputs, advantages [B] -> ({term name: (num, den)} for computed_terms(config), diagnostics).

    What the caller passes (inputs are assumed valid: validate_objective_inputs on the host):
      log_probs l: the current policy's; the only input that carries gradient.
      behavior_log_probs b: the log-probs the sampler drew each action with (Trajectory.behavior_logprobs).
      old_log_probs o: required iff config.old_logprobs == "recompute", None otherwise: the learner's own log-probs
        of the same tokens under the parameters at the start of this update (one no-gradient forward of the same
        model, dtype and routing as l, before the first optimizer step on the batch; with several minibatches or
        epochs per batch, computed once per batch and reused). With old_log_probs == l the policy ratio is 1.
      advantages A [B]: computed on the FULL batch (estimate_advantages).
      chunk_ids: may be None unless the config uses chunks (then each row counts as one chunk).
      entropies [B, T]: needed when negative_token_fraction < 1.
      failures bool[B]: the rows the entropy filter treats as failed (default: the negative rows); the train step
        passes reward < the task's success threshold.
      rewards R [B]: needed when config.sign_by == "reward" (negatives are R_i <= 0).
      segment_ids int32[B, T]: packed rows (0 = padding, 1..S along each row); then advantages, failures and
        rewards are per sequence slot, [B, S], and chunk ids are unique within a row (objectives/sequences.py).
      branch_advantages float32[B, T], branch_mask bool[B, T]: credit "branch" only (TrajectoryBatch's fields;
        None: no trajectory was branched, all get chunk credit): `branch_credit`.
      extras: {name: [B, T]} the extra per-token inputs the computed terms read (ObjectiveTerm.inputs).
      truncated bool[B] ([B, S] packed): the episodes that ran out of tokens; required by overlong_filter, whose
        loss then covers only the other episodes' action tokens (every term, every denominator).
      baselines b [B] ([B, S] packed): required iff config.baseline_stage == "return", None otherwise: the
        baseline of the discounted returns (estimate_return_baselines on the FULL batch); the credit is then
        G_{i,t} - b_i, and with sign_by "advantage" each token is a negative iff its own credit is < 0.
    Computes in float32 (float64 if log_probs is float64). The terms are those of the registry (terms/): the
    shared policy-gradient quantities below (credit, masks, ratios, weights) are computed once and every term is a
    small function of them (TermBatch).
    """
    if segment_ids is not None and advantages.ndim != 2:
        raise ValueError(f"advantages: must be [B, S] (per sequence slot) with segment_ids, got {advantages.shape}")
    seqs = sequences_of(action_mask.shape, segment_ids, advantages.shape[-1])
    action = loss_action_mask(action_mask, truncated, config, segment_ids)
    chunk_ids = _loss_chunk_ids(action, chunk_ids, config, segment_ids)
    config.check_old_log_probs(old_log_probs is not None)
    dtype = compute_dtype(log_probs)
    l = log_probs.astype(dtype)
    l_sg = jax.lax.stop_gradient(l)
    b = behavior_log_probs.astype(dtype)
    adv = jax.lax.stop_gradient(advantages.astype(dtype))
    # Policy ratio l / p and mismatch ratio q / b: p = o, q = o with old log-probs; p = b, q = l without.
    proximal = b if old_log_probs is None else jax.lax.stop_gradient(old_log_probs.astype(dtype))
    learner = l_sg if old_log_probs is None else proximal
    policy_log_ratio = jnp.where(action, l_sg - proximal, 0)

    returns = credit_returns(adv, action, chunk_ids, config.credit, config.gamma, seqs)
    config.check_baselines(baselines is not None)
    if baselines is not None:
        baselines = baselines.astype(dtype)
        returns = baselined_returns(returns, baselines, action, seqs)

    # Trust region: D = mean Bernoulli KL of p vs l over the sequence (or chunk), admit iff D <= delta.
    kl = jnp.where(action, bernoulli_kl(proximal, l_sg), 0)
    starts = chunk_starts(action, chunk_ids)
    admitted, keep, acceptance = _trust_region(kl, action, chunk_ids, starts, config, seqs)

    mismatch_kept, log_mismatch = _mismatch_correction(learner, b, action, chunk_ids, config, seqs)
    keep &= mismatch_kept
    # After discounting, a row's own advantage is its last unit's credit R_i - b_i
    negatives = negative_rows(adv if baselines is None else adv - baselines, rewards, config.sign_by)
    negative_tokens = to_tokens(as_slots(negatives, seqs), seqs)
    if baselines is not None and config.sign_by == "advantage":
        negative_tokens = action & (returns < 0)  # each token by its own credit
    if config.credit == "branch" and branch_advantages is not None:
        returns, negative_tokens = branch_credit(
            returns, negative_tokens, branch_advantages, branch_mask, action, config.advantage_sign
        )
    if entropies is None and (config.negative_token_fraction < 1.0 or needs_entropy(config)):
        raise ValueError("entropies: required when negative_token_fraction < 1 or a term reads them")
    if config.negative_token_fraction < 1.0:
        failed = negatives if failures is None else failures.astype(bool)
        keep &= entropy_filter_mask(entropies, action, failed, config.negative_token_fraction, seqs)

    log_rho = level_log_ratio(policy_log_ratio, action, chunk_ids, config.is_level, seqs)
    rho, clipped = importance_weights(log_rho, keep, negative_tokens, config.is_apply_to, config.is_clip_max)
    # c = min(mismatch ratio, cap) on kept tokens of every row; 1 when the cap is off
    mismatch_weight, capped = (
        importance_weights(log_mismatch, keep, negative_tokens, "all", config.mismatch_is_cap)
        if math.isfinite(config.mismatch_is_cap)
        else (1.0, jnp.zeros_like(keep))
    )
    weights = jnp.where(keep, rho * mismatch_weight * returns, 0)
    if config.surrogate == "ppo":  # its clip fraction: kept tokens on a clipped branch of the surrogate
        _, clipped = ppo_token_loss(jnp.where(keep, policy_log_ratio, 0), returns, config)
        clipped &= keep

    scale, den_rl = aggregation_weights(action, chunk_ids, config.aggregation, dtype, seqs, config.norm_length)
    if config.row_denominator == "kept":
        scale = kept_row_scale(keep, dtype, seqs)
    expert = jnp.zeros_like(action) if expert_mask is None else expert_mask.astype(bool)
    batch = TermBatch(
        masks=TermMasks(action, expert, chunk_ids, seqs),
        log_probs=l,
        proximal=proximal,
        returns=returns,
        keep=keep,
        weights=weights,
        mismatch_weight=mismatch_weight,
        scale=scale,
        rl_denominator=den_rl,
        entropies=entropies,
        extras=_term_inputs(config, extras),
    )
    terms = {term.name: term.value(batch, config) for term in computed_terms(config)}

    n_keep = jnp.sum(keep)
    n_action = jnp.sum(action)
    raw_rho = jnp.exp(jnp.where(keep, log_rho, 0))
    kept_chunks = jnp.sum(starts & (chunk_sum(keep.astype(dtype), action, chunk_ids) > 0))
    total_log_ratio = jnp.where(action, l_sg - b, 0)
    diagnostics = {
        "acceptance_rate": acceptance.astype(dtype),
        "kept_fraction": _ratio(kept_chunks, jnp.sum(starts)).astype(dtype),
        "kept_token_fraction": _ratio(n_keep, n_action).astype(dtype),
        "mean_is_ratio": _ratio(jnp.sum(jnp.where(keep, raw_rho, 0)), n_keep).astype(dtype),
        "max_is_ratio": jnp.max(jnp.where(keep, raw_rho, 0)),
        "clip_fraction": _ratio(jnp.sum(clipped), n_keep).astype(dtype),
        "mismatch_ratio_mean": _ratio(jnp.sum(jnp.where(action, jnp.exp(log_mismatch), 0)), n_action).astype(dtype),
        "mismatch_masked_fraction": _ratio(jnp.sum(action & ~mismatch_kept), n_action).astype(dtype),
        "mismatch_capped_fraction": _ratio(jnp.sum(capped), n_keep).astype(dtype),
        "mean_abs_log_ratio": _ratio(jnp.sum(jnp.abs(total_log_ratio)), n_action).astype(dtype),
        "mean_kl": _ratio(jnp.sum(kl), n_action).astype(dtype),
        "nonfinite_weights": jnp.sum(keep & ~jnp.isfinite(weights)),
        "advantages": adv,
        "negatives": negatives,
        "sequence_kl": sequence_divergence(kl, action, seqs),
        "admitted": as_given(admitted, seqs),
        "num_chunks": num_chunks(action, chunk_ids, seqs),
        "policy_tokens": as_given(sequence_count(action, seqs), seqs),
        "retained_tokens": as_given(sequence_count(keep, seqs), seqs),
        "chunk_returns": returns,
        "chunk_ratios": jnp.exp(jnp.where(action, chunk_mean(total_log_ratio, action, chunk_ids), -jnp.inf)),
        "weights": jax.lax.stop_gradient(weights),
    }
    return terms, diagnostics


def term_denominators(
    action_mask: jax.Array,
    chunk_ids: jax.Array | None,
    expert_mask: jax.Array | None,
    config: ObjectiveConfig,
    segment_ids: jax.Array | None = None,
    truncated: jax.Array | None = None,
) -> dict[str, jax.Array]:
    """The denominators objective_terms returns, from the masks alone ([B, T] -> {term name: scalar}): compute
    them on the full batch first, then pass them to combine_terms for each microbatch. segment_ids: packed rows;
    truncated: as objective_terms'."""
    action = loss_action_mask(action_mask, truncated, config, segment_ids)
    chunk_ids = _loss_chunk_ids(action, chunk_ids, config, segment_ids)
    expert = jnp.zeros_like(action) if expert_mask is None else expert_mask.astype(bool)
    masks = TermMasks(action, expert, chunk_ids, sequences_of(action.shape, segment_ids))
    return {term.name: term.denominator(masks, config) for term in computed_terms(config)}


def combine_terms(terms: Terms, config: ObjectiveConfig, denominators: dict[str, jax.Array] | None = None) -> jax.Array:
    """loss = sum over the enabled terms (weight != 0, registration order) of weight * num / max(den, 1).

    Denominators are counts, so max(., 1) only matters when a term has no tokens at all (it then adds 0).
    ``denominators`` (full-batch totals) replace the terms' own: the per-microbatch losses then sum to the
    full-batch loss."""
    den = {name: d for name, (_, d) in terms.items()} if denominators is None else denominators
    parts = [term_weight(t, config) * _ratio(terms[t.name][0], den[t.name]) for t in enabled_terms(config)]
    return functools.reduce(jnp.add, parts) if parts else jnp.zeros((), jnp.float32)


def term_losses(terms: Terms, denominators: dict[str, jax.Array] | None = None) -> dict[str, jax.Array]:
    """{"<name>_loss": num / max(den, 1)} of every term (unweighted), with the terms' own or the given
    denominators: the metrics of each term."""
    den = {name: d for name, (_, d) in terms.items()} if denominators is None else denominators
    return {f"{name}_loss": _ratio(num, den[name]) for name, (num, _) in terms.items()}


def _loss_chunk_ids(
    action: jax.Array, chunk_ids: jax.Array | None, config: ObjectiveConfig, segment_ids: jax.Array | None
) -> jax.Array:
    """The chunk ids of the loss's action tokens (-1 elsewhere); without chunk_ids, a chunk per sequence."""
    if chunk_ids is None:
        if config.uses_chunks:
            raise ValueError("chunk_ids: required by this ObjectiveConfig (a chunk-level option is set)")
        return jnp.where(action, 0 if segment_ids is None else segment_ids - 1, -1)
    return jnp.where(action, chunk_ids, -1) if config.overlong_filter else chunk_ids


def estimate_advantages(
    rewards: jax.Array,
    action_mask: jax.Array,
    group_ids: jax.Array | None,
    config: ObjectiveConfig,
    segment_ids: jax.Array | None = None,
    truncated: jax.Array | None = None,
    *,
    behavior_log_probs: jax.Array | None = None,
    ref_log_probs: jax.Array | None = None,
    old_log_probs: jax.Array | None = None,
) -> jax.Array:
    """rewards [B] ([B, S] packed), action_mask [B, T] -> advantages A [B] ([B, S]) by the config's estimator:
    the rewards plus the overlong punishment (shaped_rewards), the baseline and std normalisation over the
    sequences whose action tokens the loss covers (loss_action_mask), batch_std weighting each by its tokens.
    With config.kl_penalty > 0 the rewards are first R_i - beta * KL_i (`penalty_sequence_kl`: ref_log_probs and
    behavior_log_probs, or old_log_probs with kl_penalty_logprobs "recompute", [B, T] required). With
    config.baseline_stage "return" the baseline waits for the discounted returns: A_i = the (shaped, signed) R_i,
    and estimate_return_baselines gives the baseline."""
    action = loss_action_mask(action_mask, truncated, config, segment_ids)
    seqs = sequences_of(action.shape, segment_ids, rewards.shape[-1])
    tokens = as_given(sequence_count(action, seqs), seqs)
    if config.kl_penalty > 0:
        kl = penalty_sequence_kl(action_mask, config, seqs, behavior_log_probs, ref_log_probs, old_log_probs)
        rewards = kl_penalized_rewards(rewards.astype(kl.dtype), kl, config.kl_penalty)
    return compute_advantages(
        shaped_rewards(rewards, action_mask, config, segment_ids),
        config.baseline if config.baseline_stage == "reward" else "none",
        group_ids,
        tokens > 0,
        config.advantage_sign,
        norm=config.advantage_norm,
        eps=config.advantage_eps,
        token_counts=tokens,
        group_of_one=config.group_of_one,
    )


def penalty_sequence_kl(
    action_mask: jax.Array,
    config: ObjectiveConfig,
    sequences: Sequences,
    behavior_log_probs: jax.Array | None,
    ref_log_probs: jax.Array | None,
    old_log_probs: jax.Array | None = None,
) -> jax.Array:
    """KL_i of the reward penalty: KL_i = sum_{t in actions of i} k(p_t, ref_t), k = config.kl_penalty_estimator, p
    the behaviour log-probs, or the old ones with kl_penalty_logprobs "recompute" (verl's). [B, T] -> [B] ([B, S]
    packed). ValueError naming a missing input."""
    if ref_log_probs is None:
        raise ValueError("ref_log_probs: required by objective.kl_penalty > 0 (the reference policy's log-probs)")
    name, policy = (
        ("old_log_probs", old_log_probs)
        if config.kl_penalty_logprobs == "recompute"
        else ("behavior_log_probs", behavior_log_probs)
    )
    if policy is None:
        raise ValueError(
            f"{name}: required by objective.kl_penalty > 0 with kl_penalty_logprobs={config.kl_penalty_logprobs!r}"
        )
    return sequence_kl(policy, ref_log_probs, action_mask, config.kl_penalty_estimator, sequences)


def estimate_return_baselines(
    advantages: jax.Array,
    action_mask: jax.Array,
    chunk_ids: jax.Array | None,
    group_ids: jax.Array | None,
    config: ObjectiveConfig,
    segment_ids: jax.Array | None = None,
    truncated: jax.Array | None = None,
) -> jax.Array | None:
    """advantages [B] ([B, S] packed; estimate_advantages' R_i), action_mask [B, T] -> the baseline b [B] ([B, S])
    of config.baseline_stage "return" (None at stage "reward"), on the FULL batch like the advantages:
    b = config.baseline's mean of the discounted returns G_{i,t} = gamma^(steps to end) R_i over the scored units
    of the loss's action tokens (`scored_units`: chunks for chunk credit, tokens for token credit, sequences for
    trajectory credit; `return_baselines`). objective_terms then gives each token G_{i,t} - b_i."""
    if config.baseline_stage == "reward":
        return None
    action = loss_action_mask(action_mask, truncated, config, segment_ids)
    seqs = sequences_of(action.shape, segment_ids, advantages.shape[-1])
    chunk_ids = _loss_chunk_ids(action, chunk_ids, config, segment_ids)
    returns = credit_returns(advantages, action, chunk_ids, config.credit, config.gamma, seqs)
    units = scored_units(action, chunk_ids, config.credit, seqs)
    return return_baselines(returns, units, config.baseline, group_ids, seqs)


def _term_inputs(config: ObjectiveConfig, extras: Mapping[str, jax.Array] | None) -> dict[str, jax.Array]:
    """The extra per-token inputs the computed terms read; ValueError naming the first missing one."""
    given = dict(extras or {})
    for term in computed_terms(config):
        missing = [name for name in term.inputs if name not in given]
        if missing:
            raise ValueError(f"extras: objective term {term.name!r} needs the per-token input {missing[0]!r}")
    return given


def policy_loss(
    log_probs: jax.Array,
    behavior_log_probs: jax.Array,
    rewards: jax.Array,
    action_mask: jax.Array,
    chunk_ids: jax.Array | None = None,
    expert_mask: jax.Array | None = None,
    group_ids: jax.Array | None = None,
    entropies: jax.Array | None = None,
    config: ObjectiveConfig = ObjectiveConfig(),
    *,
    failures: jax.Array | None = None,
    old_log_probs: jax.Array | None = None,
    segment_ids: jax.Array | None = None,
    extras: Mapping[str, jax.Array] | None = None,
    truncated: jax.Array | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The composed loss on one full batch: [B, T] arrays, rewards [B] -> (scalar loss, diagnostics).

    old_log_probs [B, T]: required iff config.old_logprobs == "recompute" (objective_terms says what they are).
    extras: {name: [B, T]} the extra per-token inputs of the computed terms (ObjectiveTerm.inputs).
    truncated bool[B] ([B, S]): the episodes that ran out of tokens (overlong_filter; objective_terms).
    Advantages come from estimate_advantages (KL reward penalty, overlong punishment, baseline, std normalisation;
    with baseline_stage "return", the baseline of the returns from estimate_return_baselines).
    segment_ids int32[B, T]: packed rows; rewards, group_ids and failures are then [B, S] (per sequence slot).
    Jitted internally (config static); called eagerly (no tracers), the inputs are first checked by
    validate_objective_inputs. Inside a trace the inputs are assumed valid."""
    validate_if_concrete(
        log_probs,
        behavior_log_probs,
        rewards,
        action_mask,
        chunk_ids,
        expert_mask,
        group_ids,
        entropies,
        config,
        failures=failures,
        old_log_probs=old_log_probs,
        segment_ids=segment_ids,
        truncated=truncated,
    )
    return _policy_loss(
        log_probs,
        behavior_log_probs,
        rewards,
        action_mask,
        chunk_ids,
        expert_mask,
        group_ids,
        entropies,
        config,
        failures,
        old_log_probs,
        segment_ids,
        dict(extras or {}),
        truncated,
    )


@functools.partial(jax.jit, static_argnames="config")
def _policy_loss(
    log_probs,
    behavior_log_probs,
    rewards,
    action_mask,
    chunk_ids,
    expert_mask,
    group_ids,
    entropies,
    config,
    failures,
    old_log_probs,
    segment_ids,
    extras,
    truncated,
):
    adv = estimate_advantages(
        rewards,
        action_mask,
        group_ids,
        config,
        segment_ids,
        truncated,
        behavior_log_probs=behavior_log_probs,
        ref_log_probs=extras.get("ref_log_probs"),
        old_log_probs=old_log_probs,
    )
    baselines = estimate_return_baselines(adv, action_mask, chunk_ids, group_ids, config, segment_ids, truncated)
    terms, diagnostics = objective_terms(
        log_probs,
        behavior_log_probs,
        adv,
        action_mask,
        chunk_ids,
        expert_mask,
        config,
        entropies,
        failures=failures,
        old_log_probs=old_log_probs,
        rewards=rewards,
        segment_ids=segment_ids,
        extras=extras,
        truncated=truncated,
        baselines=baselines,
    )
    loss = combine_terms(terms, config)
    diagnostics.update(term_losses(terms))
    diagnostics["loss"] = loss
    return loss, diagnostics
