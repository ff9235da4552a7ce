"""The published settings as ObjectiveConfigs (PRESETS, by name) and the two algorithms as thin wrappers over the
composed loss (numeric arguments are static). docs/off_policy.md says which source each IPA and FlashREINFORCE
setting reproduces; docs/objectives.md gives the baselines' formulas (GRPO, Dr.GRPO, RLOO, REINFORCE++, PPO)."""

from __future__ import annotations

import dataclasses

import jax

from ipa_jax.objectives.composed import policy_loss
from ipa_jax.objectives.config import ObjectiveConfig


def flash_reinforce_config(delta: float = 3e-3, negative_token_fraction: float = 1.0) -> ObjectiveConfig:
    """FlashREINFORCE: batch-mean baseline, trajectory credit, detached unclipped token ratio, sequence
    Bernoulli-KL trust region, sample-mean aggregation, optional failure-token entropy filter, no IL."""
    return ObjectiveConfig(
        baseline="batch_mean",
        credit="trajectory",
        gamma=1.0,
        is_level="token",
        is_apply_to="all",
        is_clip_max=None,
        mismatch_level="none",
        trust_region_level="sequence",
        trust_region_delta=delta,
        negative_token_fraction=negative_token_fraction,
        aggregation="sample_mean",
        rl_weight=1.0,
        il_weight=0.0,
    )


def ipa_config(
    gamma: float = 0.95,
    baseline: str = "none",
    negative_is_clip: float | None = 1.0,
    chunk_ratio_range: tuple[float, float] = (0.0, 5.0),
    aggregation: str = "sample_mean",
) -> ObjectiveConfig:
    """IPA: discounted chunk returns, chunk mismatch mask, chunk ratio on negatives only, truncated."""
    if baseline not in ("none", "batch_mean"):
        raise ValueError(f"baseline: ipa_loss supports 'none' or 'batch_mean', got {baseline!r}")
    return ObjectiveConfig(
        baseline=baseline,
        credit="chunk",
        gamma=gamma,
        is_level="chunk",
        is_apply_to="negatives",
        is_clip_max=negative_is_clip,
        mismatch_level="chunk",
        mismatch_range=chunk_ratio_range,
        trust_region_level="none",
        negative_token_fraction=1.0,
        aggregation=aggregation,
        rl_weight=1.0,
        il_weight=0.0,
    )


def ipa_seed_config() -> ObjectiveConfig:
    """IPA as the ROME paper's pseudo-code step writes it: chunk returns discounted by 0.95 of the raw reward, the
    chunk's geometric-mean ratio truncated at 10 on negatives (positive iff the reward is > 0), a token mismatch
    mask with threshold 5, log-probs summed over each trajectory's tokens and averaged over trajectories
    (sequence_sum), one ratio against the sampler's log-probs, no IL."""
    return ObjectiveConfig(
        baseline="none",
        credit="chunk",
        gamma=0.95,
        old_logprobs="behavior",
        is_level="chunk",
        is_apply_to="negatives",
        sign_by="reward",
        is_clip_max=10.0,
        mismatch_level="token",
        mismatch_range=(0.0, 5.0),
        trust_region_level="none",
        aggregation="sequence_sum",
        rl_weight=1.0,
        il_weight=0.0,
    )


def ipa_roll_config() -> ObjectiveConfig:
    """IPA as ROLL's agentic pipeline wires it: discounted segment returns (gamma 0.95) of the raw score, TOPR on
    the segment ratio current / old (old = the learner's recomputed log-probs) clipped to [0, 1] on rows with
    score <= 0, the segment train/inference filter keeping old / infer ratios in [0, 5], no train/inference IS
    weight, seq-mean-token-mean over the kept (filtered) tokens, no IL."""
    return ObjectiveConfig(
        baseline="none",
        credit="chunk",
        gamma=0.95,
        old_logprobs="recompute",
        is_level="chunk",
        is_apply_to="negatives",
        sign_by="reward",
        is_clip_max=1.0,
        mismatch_level="chunk",
        mismatch_range=(0.0, 5.0),
        trust_region_level="none",
        aggregation="sample_mean",
        row_denominator="kept",
        rl_weight=1.0,
        il_weight=0.0,
    )


def _trajectory_rl(**fields) -> ObjectiveConfig:
    """The shared base of the critic-free estimator presets: one advantage for the whole trajectory (gamma 1), no
    chunk importance weights and no train/inference mismatch correction, RL only; `fields` set the rest."""
    base = dict(credit="trajectory", gamma=1.0, is_level="none", mismatch_level="none", rl_weight=1.0, il_weight=0.0)
    return ObjectiveConfig(**(base | fields))


def _ppo(**fields) -> ObjectiveConfig:
    """_trajectory_rl with PPO's clipped surrogate of the ratio current / old (the learner's recomputed log-probs)."""
    return _trajectory_rl(old_logprobs="recompute", surrogate="ppo", **fields)


def grpo_config(std: bool = True) -> ObjectiveConfig:
    """GRPO (Shao et al. 2024, arXiv:2402.03300): A_i = (R_i - mean_group) / (std_group + eps) (std=False: the
    mean only), shared by every token of the trajectory; PPO's clipped surrogate (eps 0.2) of the ratio current /
    old (the learner's recomputed log-probs), each trajectory's token mean averaged over trajectories; no IL.
    Its KL penalty against a reference policy is not part of this preset."""
    return _ppo(baseline="group_mean", advantage_norm="group_std" if std else "none", aggregation="sample_mean")


def dr_grpo_config(norm_length: int = 2048) -> ObjectiveConfig:
    """Dr.GRPO (Liu et al. 2025, arXiv:2503.20783): GRPO without its two biases: no std normalisation and no
    per-trajectory length normalisation; token sums over a constant norm_length (the generation budget) averaged
    over trajectories (token_sum_norm)."""
    return dataclasses.replace(grpo_config(std=False), aggregation="token_sum_norm", norm_length=norm_length)


def rloo_config() -> ObjectiveConfig:
    """RLOO (Ahmadian et al. 2024, arXiv:2402.14740; Kool et al. 2019): REINFORCE with the leave-one-out baseline
    A_i = R_i - mean of the group's other rewards, the whole trajectory one action: -(1/B) sum_i A_i sum_t l, on
    policy (no ratio, no clipping); no IL."""
    return _trajectory_rl(baseline="rloo", aggregation="sequence_sum")


def reinforce_pp_config() -> ObjectiveConfig:
    """REINFORCE++ (Hu 2025, arXiv:2501.03262): no critic and no group baseline; the outcome reward whitened over
    the batch's action tokens, (R - mean) / (std + eps); PPO's clipped surrogate of current / old, token mean over
    the batch; no IL. Its per-token KL reward penalty is not part of this preset."""
    return _ppo(baseline="none", advantage_norm="batch_std", aggregation="token_mean")


def ppo_dual_clip_config(dual_clip: float = 3.0, clip_low: float = 0.2, clip_high: float = 0.2) -> ObjectiveConfig:
    """PPO's clipped surrogate (Schulman et al. 2017, arXiv:1707.06347) with dual clip (Ye et al. 2020,
    arXiv:1912.09729): ratio current / old clipped to [1 - clip_low, 1 + clip_high], negative advantages' loss
    bounded by -c A; token mean. No critic here: the advantages are the batch-mean baseline's, and any estimator
    (objective.baseline, advantage_norm, credit) can replace it."""
    return _ppo(
        baseline="batch_mean",
        aggregation="token_mean",
        ppo_clip_low=clip_low,
        ppo_clip_high=clip_high,
        ppo_dual_clip=dual_clip,
    )


def flash_reinforce_loss(
    log_probs: jax.Array,
    behavior_log_probs: jax.Array,
    rewards: jax.Array,
    action_mask: jax.Array,
    *,
    delta: float = 3e-3,
    negative_token_fraction: float = 1.0,
    entropies: jax.Array | None = None,
    failures: jax.Array | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """FlashREINFORCE on one full batch: [B, T] arrays, rewards [B] -> (loss, diagnostics).

    A_i = R_i - mean(R); admitted_i = max(0, (1/T_i) sum_t d_{i,t}) <= delta; w = admitted * exp(l - b) * A
    (detached, computed only on admitted tokens); loss = -(1/B) sum_i (1/T_i) sum_t w l. With q =
    negative_token_fraction < 1 the failed rows (``failures`` bool[B], default A_i < 0) keep only their
    ceil(q T_i) highest-entropy tokens (entropies [B, T]); T_i still counts every action token.
    """
    return policy_loss(
        log_probs,
        behavior_log_probs,
        rewards,
        action_mask,
        entropies=entropies,
        config=flash_reinforce_config(delta, negative_token_fraction),
        failures=failures,
    )


def ipa_loss(
    log_probs: jax.Array,
    behavior_log_probs: jax.Array,
    rewards: jax.Array,
    action_mask: jax.Array,
    chunk_ids: jax.Array,
    *,
    gamma: float = 0.95,
    baseline: str = "none",
    negative_is_clip: float | None = 1.0,
    chunk_ratio_range: tuple[float, float] = (0.0, 5.0),
    aggregation: str = "sample_mean",
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """IPA (chunked MDP) on one full batch: [B, T] arrays, rewards [B] -> (loss, diagnostics).

    A_i = R_i - baseline; G_{i,k} = gamma^(K_i-1-k) A_i; r_{i,k} = exp(mean_{t in c_k}(l - b));
    kept_{i,k} = range[0] <= r_{i,k} <= range[1]; w = kept * G * (1 if A_i >= 0 else min(r_{i,k}, clip));
    loss = -Agg(w * l), w stop-gradient.
    """
    config = ipa_config(gamma, baseline, negative_is_clip, chunk_ratio_range, aggregation)
    return policy_loss(log_probs, behavior_log_probs, rewards, action_mask, chunk_ids, config=config)


PRESETS: dict[str, ObjectiveConfig] = {
    "ipa": ipa_config(),
    "ipa_seed": ipa_seed_config(),
    "ipa_roll": ipa_roll_config(),
    "flash_reinforce": flash_reinforce_config(),
    "grpo": grpo_config(),
    "dr_grpo": dr_grpo_config(),
    "rloo": rloo_config(),
    "reinforce_pp": reinforce_pp_config(),
    "ppo_dual_clip": ppo_dual_clip_config(),
}
