"""The baselines' estimators and surrogates against float64 NumPy written from the published formulas: GRPO
(group mean and std), Dr.GRPO (no std, constant normaliser), RLOO (leave-one-out), REINFORCE++ (batch whitening),
PPO's clipped surrogate with dual clip over any estimator. Values and gradients with respect to the log-probs,
in float64 (scoped x64) so that the comparison is to 1e-10. docs/objectives.md names each formula's source."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from objectives_reference import random_batch

from ipa_jax.objectives import (
    ObjectiveConfig,
    compute_advantages,
    dr_grpo_config,
    grpo_config,
    policy_loss,
    ppo_clipped_loss,
    ppo_dual_clip_config,
    reinforce_pp_config,
    rloo_config,
)

GROUPS = np.array([0, 0, 0, 1, 1, 2, 3, 1], np.int32)  # group 2: one sample; row 6: imitation only (no actions)
EPS = 1e-6


def reference_advantages(rewards, groups, action, baseline, norm, eps=EPS, group_of_one="zero"):
    """Per row, from the formulas; rows without actions get 0 and are left out of every statistic."""
    r = np.asarray(rewards, np.float64)
    rl = action.any(axis=1)
    tokens = action.sum(axis=1).astype(np.float64)
    adv = np.zeros(len(r))
    for i in np.flatnonzero(rl):
        group = r[(groups == groups[i]) & rl]
        if baseline == "none":
            adv[i] = r[i]
        elif baseline == "batch_mean":
            adv[i] = r[i] - r[rl].mean()
        elif baseline == "group_mean":  # GRPO: R_i - mean(R_group); verl's group of one: mean 0
            adv[i] = r[i] - (0.0 if len(group) == 1 and group_of_one == "reward" else group.mean())
        else:  # RLOO: R_i - 1/(n-1) sum_{j != i} R_j; alone in its group: R_i
            adv[i] = r[i] - (group.sum() - r[i]) / (len(group) - 1) if len(group) > 1 else r[i]
        if norm == "group_std":  # GRPO: / (std(R_group) + eps), the sample (n-1) std; 1 for a group of one
            adv[i] /= (np.std(group, ddof=1) if len(group) > 1 else 1.0) + eps
    if norm == "batch_std":  # REINFORCE++: whiten over the batch's action tokens (row i counted T_i times)
        w = tokens * rl
        mean = np.sum(w * adv) / w.sum()
        std = np.sqrt(np.sum(w * (adv - mean) ** 2) / (w.sum() - 1))
        adv = np.where(rl, (adv - mean) / (std + eps), 0.0)
    return adv


def reference_ppo(l, old, adv, clip_low, clip_high, dual_clip, log_ratio_clamp=20.0):
    """Token loss and d loss / d l of PPO's clipped surrogate with dual clip, from the formula; the log-ratio
    clamped to [-c, c] before exp (no gradient beyond it)."""
    log_ratio = np.asarray(l, np.float64) - np.asarray(old, np.float64)
    ratio = np.exp(np.clip(log_ratio, -log_ratio_clamp, log_ratio_clamp))
    unclipped = -adv * ratio
    clipped = -adv * np.clip(ratio, 1 - clip_low, 1 + clip_high)
    loss = np.maximum(unclipped, clipped)
    live = (unclipped >= clipped) & (np.abs(log_ratio) <= log_ratio_clamp)  # the unclipped branch is the max
    if np.isfinite(dual_clip):
        bounded = (adv < 0) & (loss > -dual_clip * adv)
        loss = np.where(bounded, -dual_clip * adv, loss)
        live &= ~bounded
    return loss, np.where(live, -adv * ratio, 0.0)


def reference_loss(config, l, old, rewards, groups, action):
    """(loss, d loss / d l) with trajectory credit (every token of row i gets A_i), no IS ratio, no masks."""
    adv = reference_advantages(rewards, groups, action, config.baseline, config.advantage_norm)
    A = np.broadcast_to(adv[:, None], l.shape)
    if config.surrogate == "ppo":
        token_loss, token_grad = reference_ppo(
            l, old, A, config.ppo_clip_low, config.ppo_clip_high, config.ppo_dual_clip, config.ppo_log_ratio_clamp
        )
    else:  # REINFORCE: -A l
        token_loss, token_grad = -A * l, -A
    rows = action.any(axis=1).sum()
    T = np.maximum(action.sum(axis=1, keepdims=True), 1)
    scale, den = {
        "sample_mean": (1.0 / T, rows),  # (1/B) sum_i (1/T_i) sum_t
        "token_mean": (np.ones_like(l), action.sum()),  # sum_i sum_t / sum_i T_i
        "sequence_sum": (np.ones_like(l), rows),  # (1/B) sum_i sum_t
        "token_sum_norm": (np.ones_like(l), rows * config.norm_length),  # (1/B) sum_i sum_t / L
    }[config.aggregation]
    scale = np.where(action, scale, 0.0)
    return np.sum(scale * token_loss) / den, scale * token_grad / den


def _batch(seed):
    batch = random_batch(np.random.default_rng(seed), B=len(GROUPS), T=24)
    batch["action_mask"][6] = False  # an imitation row: no actions, one expert token
    batch["chunk_ids"][6] = -1
    batch["expert_mask"][6, 1] = True
    batch["group_ids"] = GROUPS
    batch["rewards"] = np.array([1.0, 0.0, 0.5, 1.0, 1.0, 0.0, 2.0, 0.0], np.float32)
    noise = np.random.default_rng(seed + 1).normal(0, 0.4, batch["log_probs"].shape)
    batch["old_log_probs"] = np.where(batch["action_mask"], batch["log_probs"] + noise, 0.0)
    return batch


@pytest.mark.parametrize(
    "baseline, norm",
    [("group_mean", "group_std"), ("group_mean", "none"), ("rloo", "none"), ("rloo", "group_std"),
     ("none", "batch_std"), ("group_mean", "batch_std"), ("batch_mean", "none")],
)  # fmt: skip
def test_advantages_match_the_published_formulas(baseline, norm):
    batch = _batch(0)
    action = batch["action_mask"]
    with jax.enable_x64(True):
        tokens = jnp.asarray(action.sum(axis=1))
        adv = compute_advantages(
            jnp.asarray(batch["rewards"], jnp.float64),
            baseline,
            jnp.asarray(GROUPS),
            jnp.asarray(action.any(axis=1)),
            norm=norm,
            eps=EPS,
            token_counts=tokens,
        )
        adv = np.asarray(adv)
    assert adv.dtype == np.float64
    expected = reference_advantages(batch["rewards"], GROUPS, action, baseline, norm)
    np.testing.assert_allclose(np.asarray(adv), expected, rtol=1e-12, atol=1e-12)
    assert adv[6] == 0 and np.abs(expected[action.any(axis=1)]).max() > 0.1


@pytest.mark.parametrize("norm", ["none", "group_std"])
def test_a_group_of_one_gets_zero_or_verls_reward(norm):
    """Row 5 is alone in group 2: A = 0 by default; with group_of_one "reward" (verl's GRPO: the group's mean 0,
    its std 1) A = R, or R / (1 + eps) with group_std; every other row is unchanged. Through policy_loss too."""
    batch = _batch(2)
    batch["rewards"][5] = 0.75
    action = batch["action_mask"]
    for group_of_one in ("zero", "reward"):
        config = ObjectiveConfig(baseline="group_mean", advantage_norm=norm, group_of_one=group_of_one)
        expected = reference_advantages(batch["rewards"], GROUPS, action, "group_mean", norm, EPS, group_of_one)
        with jax.enable_x64(True):
            _, diag = policy_loss(
                jnp.asarray(batch["log_probs"], jnp.float64), jnp.asarray(batch["behavior_log_probs"], jnp.float64),
                jnp.asarray(batch["rewards"], jnp.float64), action, batch["chunk_ids"], batch["expert_mask"],
                batch["group_ids"], config=config,
            )  # fmt: skip
            np.testing.assert_allclose(np.asarray(diag["advantages"]), expected, rtol=1e-12, atol=1e-12)
        lone = 0.75 / (1 + EPS if norm == "group_std" else 1)
        assert expected[5] == (0.0 if group_of_one == "zero" else pytest.approx(lone, rel=1e-12)) and lone != 0


def test_advantage_sign_flips_every_estimator():
    batch = _batch(1)
    action = batch["action_mask"]
    args = (jnp.asarray(batch["rewards"]), "rloo", jnp.asarray(GROUPS), jnp.asarray(action.any(axis=1)))
    plus = compute_advantages(*args, 1, norm="group_std")
    minus = compute_advantages(*args, -1, norm="group_std")
    np.testing.assert_allclose(np.asarray(minus), -np.asarray(plus), rtol=1e-6)


CONFIGS = {
    "grpo": grpo_config(),
    "grpo_no_std": grpo_config(std=False),
    "dr_grpo": dr_grpo_config(norm_length=32),
    "rloo": rloo_config(),
    "reinforce_pp": reinforce_pp_config(),
    "ppo_dual_clip": ppo_dual_clip_config(dual_clip=2.0, clip_low=0.2, clip_high=0.28),
    # the surrogate over other estimators
    "ppo_over_rloo_std": dataclasses.replace(ppo_dual_clip_config(), baseline="rloo", advantage_norm="group_std"),
    "ppo_of_the_behaviour_ratio": dataclasses.replace(ppo_dual_clip_config(), old_logprobs="behavior"),
    "ppo_over_group_mean_sample_mean": dataclasses.replace(
        ppo_dual_clip_config(1.5), baseline="group_mean", aggregation="sample_mean"
    ),
}


@pytest.mark.parametrize("name", CONFIGS)
def test_objective_matches_float64_reference(name):
    config = CONFIGS[name]
    with jax.enable_x64(True):
        for seed in range(3):
            batch = _batch(seed)
            old = batch["old_log_probs"] if config.needs_old_log_probs else None
            proximal = batch["old_log_probs"] if old is not None else batch["behavior_log_probs"]

            def f(l, batch=batch, old=old):
                return policy_loss(
                    l,
                    jnp.asarray(batch["behavior_log_probs"], jnp.float64),
                    jnp.asarray(batch["rewards"], jnp.float64),
                    batch["action_mask"],
                    batch["chunk_ids"],
                    batch["expert_mask"],
                    batch["group_ids"],
                    config=config,
                    old_log_probs=None if old is None else jnp.asarray(old, jnp.float64),
                )[0]

            l = batch["log_probs"].astype(np.float64)
            loss, grad = jax.value_and_grad(f)(jnp.asarray(l))
            ref_loss, ref_grad = reference_loss(
                config, l, proximal.astype(np.float64), batch["rewards"], GROUPS, batch["action_mask"]
            )
            np.testing.assert_allclose(float(loss), ref_loss, rtol=1e-10, atol=1e-12)
            np.testing.assert_allclose(np.asarray(grad), ref_grad, rtol=1e-10, atol=1e-12)


def test_ppo_surrogate_branches_and_gradient():
    """Every branch of the clipped surrogate on chosen ratios, then random ones against the reference."""
    with jax.enable_x64(True):
        # (log ratio, A): inside the range; above 1 + eps with A > 0 (clipped); below 1 - eps with A < 0
        # (clipped); above 1 + eps with A < 0 (unclipped, not dual-bound); far above with A < 0 (dual clip).
        log_ratio = jnp.log(jnp.array([1.1, 1.5, 0.5, 1.5, 4.0]))
        adv = jnp.array([1.0, 1.0, -1.0, -1.0, -1.0])
        loss, clipped = ppo_clipped_loss(log_ratio, adv, 0.2, 0.2, 3.0)
        np.testing.assert_allclose(np.asarray(loss), [-1.1, -1.2, 0.8, 1.5, 3.0], rtol=1e-12)
        np.testing.assert_array_equal(np.asarray(clipped), [False, True, True, False, True])
        rng = np.random.default_rng(3)
        x, a = rng.normal(0, 0.6, (6, 9)), rng.normal(0, 1, (6, 9))
        for dual in (np.inf, 2.0):
            loss, grad = jax.value_and_grad(lambda v, dual=dual: jnp.sum(ppo_clipped_loss(v, a, 0.2, 0.28, dual)[0]))(
                jnp.asarray(x)
            )
            ref_loss, ref_grad = reference_ppo(x, np.zeros_like(x), a, 0.2, 0.28, dual)
            np.testing.assert_allclose(float(loss), ref_loss.sum(), rtol=1e-12)
            np.testing.assert_allclose(np.asarray(grad), ref_grad, rtol=1e-12, atol=1e-15)
            assert 0 < np.count_nonzero(ref_grad == 0) < ref_grad.size  # both live and clipped tokens


@pytest.mark.parametrize("dual_clip", [np.inf, 3.0])
def test_ppo_log_ratio_clamp_keeps_float32_finite(dual_clip):
    """Log-ratios of +-30, +-89 and +-100 (exp overflows float32 past 88.7) with both signs of the advantage: in
    float32 the loss and gradient are finite and equal the float64 formula with the log-ratio clamped at 20 (no
    gradient beyond it); tokens within the clamp keep theirs."""
    log_ratio = np.array([[30.0, -30.0, 89.0, -89.0, 100.0, -100.0, 0.1, -0.1]] * 2)
    adv = np.array([[1.0] * 8, [-1.0] * 8])
    ref_loss, ref_grad = reference_ppo(log_ratio, np.zeros_like(log_ratio), adv, 0.2, 0.2, dual_clip, 20.0)

    def loss_of(x):
        return jnp.sum(ppo_clipped_loss(x, jnp.asarray(adv, jnp.float32), 0.2, 0.2, dual_clip, 20.0)[0])

    loss, grad = jax.value_and_grad(loss_of)(jnp.asarray(log_ratio, jnp.float32))
    assert np.isfinite(float(loss)) and np.isfinite(np.asarray(grad)).all()
    np.testing.assert_allclose(float(loss), ref_loss.sum(), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(grad), ref_grad, rtol=1e-6, atol=1e-7)
    assert (ref_grad[:, :6] == 0).all() and (ref_grad[:, 6:] != 0).all()  # only the tokens within the clamp learn
    _, clipped = ppo_clipped_loss(jnp.asarray(log_ratio), jnp.asarray(adv), 0.2, 0.2, dual_clip, 20.0)
    np.testing.assert_array_equal(np.asarray(clipped)[:, :6], True)  # beyond the clamp: no gradient


def test_ppo_log_ratio_clamp_is_the_configs():
    """policy_loss reads objective.ppo_log_ratio_clamp (default 20, verl's): a batch whose old log-probs lie 90
    below the current ones has the float64 reference's loss with that clamp; inf turns it off (float64: finite)."""
    batch = _batch(0)
    l = batch["log_probs"].astype(np.float64)
    old = np.where(batch["action_mask"], l - np.where(np.arange(l.shape[1]) % 3 == 0, 90.0, 0.1), 0.0)
    config = ppo_dual_clip_config(dual_clip=np.inf)
    assert config.ppo_log_ratio_clamp == 20.0
    with jax.enable_x64(True):
        for clamp in (20.0, 5.0, np.inf):
            cfg = dataclasses.replace(config, ppo_log_ratio_clamp=clamp)
            args = (batch["action_mask"], batch["chunk_ids"], batch["expert_mask"], batch["group_ids"])
            loss = policy_loss(
                jnp.asarray(l), jnp.asarray(batch["behavior_log_probs"], jnp.float64),
                jnp.asarray(batch["rewards"], jnp.float64), *args, config=cfg, old_log_probs=jnp.asarray(old),
            )[0]  # fmt: skip
            expected, _ = reference_loss(cfg, l, old, batch["rewards"], GROUPS, batch["action_mask"])
            np.testing.assert_allclose(float(loss), expected, rtol=1e-10)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(advantage_norm="group_std"), "advantage_norm: 'group_std' divides a group baseline"),
        (dict(advantage_norm="std"), "advantage_norm: 'std' is not one of"),
        (dict(baseline="leave_one_out"), "baseline: 'leave_one_out' is not one of"),
        (dict(advantage_eps=0.0), "advantage_eps: must be a finite number > 0"),
        (dict(surrogate="ppo"), "is_level: the ppo surrogate carries its own ratio"),
        (dict(surrogate="ppo", is_level="none", ppo_clip_low=1.0), r"ppo_clip_low: must be in \[0, 1\)"),
        (dict(surrogate="ppo", is_level="none", ppo_clip_high=-0.1), r"ppo_clip_high: must be in \[0, inf\)"),
        (dict(surrogate="ppo", is_level="none", ppo_dual_clip=1.0), "ppo_dual_clip: must be > 1"),
        (dict(ppo_dual_clip=3.0), "ppo_dual_clip: the dual clip belongs to the ppo surrogate"),
        (dict(group_of_one="reward"), "group_of_one: 'reward' sets the advantage of a group of one"),
        (dict(baseline="rloo", group_of_one="reward"), "group_of_one: .*rloo's group of one always has A = R"),
        (dict(group_of_one="one"), "group_of_one: 'one' is not one of"),
        (dict(ppo_log_ratio_clamp=0.0), r"ppo_log_ratio_clamp: must be > 0 \(inf or None = off\)"),
        (dict(ppo_log_ratio_clamp=float("nan")), "ppo_log_ratio_clamp: must be > 0"),
        (dict(aggregation="token_sum_norm"), "norm_length: must be > 0 exactly with aggregation 'token_sum_norm'"),
        (dict(norm_length=16), "norm_length: must be > 0 exactly with aggregation 'token_sum_norm'"),
        (dict(aggregation="token_sum_norm", norm_length=2.5), "norm_length: must be an integer >= 0"),
    ],
)
def test_estimator_and_surrogate_values_are_validated(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ObjectiveConfig(**kwargs)
