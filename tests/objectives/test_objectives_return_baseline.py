"""The baseline after discounting (objective.baseline_stage = "return"): A_{i,t} = gamma^(steps to end) R_i - b_i,
b the baseline's mean of the discounted returns over the scored units (chunks, tokens or sequences), against float64
NumPy loops written from that formula (objectives_reference.py), in padded and packed rows; an early chunk of a
success comes out negative and is a negative for TOPR's truncation; bad combinations are clear errors."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
from objectives_reference import random_batch, return_baselines, row_returns
from test_objectives_packing import loss_diag_grad, pack_rows

from ipa_jax.objectives import (
    ObjectiveConfig,
    estimate_advantages,
    estimate_return_baselines,
    ipa_config,
    objective_terms,
)

CREDITS = ("chunk", "token", "trajectory")
BASELINES = ("batch_mean", "group_mean", "rloo")


def expected_credit(config: ObjectiveConfig, batch: dict) -> tuple[np.ndarray, np.ndarray]:
    """(per-token credit [B, T], per-row baseline [B]) in float64: every row's discounted returns minus the
    baseline of the returns of the batch's (group's) scored units; rows without actions get 0."""
    action, chunk_ids = batch["action_mask"], batch["chunk_ids"]
    rewards = np.where(action.any(axis=1), config.advantage_sign * batch["rewards"].astype(np.float64), 0)
    base = return_baselines(
        config.credit, config.gamma, config.baseline, rewards, action, chunk_ids, batch["group_ids"]
    )
    credit = np.zeros(action.shape)
    for i in range(len(rewards)):
        acts = np.flatnonzero(action[i])
        if len(acts):
            credit[i, acts] = row_returns(config.credit, config.gamma, rewards[i], chunk_ids[i, acts]) - base[i]
    return credit, base


def batch_with_imitation_row(seed: int, B: int = 6, T: int = 30) -> dict:
    """random_batch with more groups and its last row imitation only (no action: out of every baseline)."""
    rng = np.random.default_rng(seed)
    batch = random_batch(rng, B=B, T=T)
    batch["group_ids"] = rng.integers(0, 3, size=B).astype(np.int32)
    batch["action_mask"][-1] = False
    batch["chunk_ids"][-1] = -1
    batch["expert_mask"][-1, 1:4] = True
    return batch


def diagnostics(config: ObjectiveConfig, batch: dict, segment_ids=None) -> dict:
    """policy_loss's diagnostics (test_objectives_packing.loss_diag_grad: failures default to the negatives)."""
    return jax.device_get(loss_diag_grad({"failures": None, **batch}, segment_ids, config)[1])


@pytest.mark.parametrize("baseline", BASELINES)
@pytest.mark.parametrize("credit", CREDITS)
def test_credit_after_discounting_matches_float64(credit, baseline):
    config = ObjectiveConfig(credit=credit, baseline=baseline, baseline_stage="return", gamma=0.8)
    with jax.enable_x64(True):
        for seed in range(3):
            batch = batch_with_imitation_row(seed)
            batch = {k: v.astype(np.float64) if v.dtype == np.float32 else v for k, v in batch.items()}
            diag = diagnostics(config, batch)
            credit_ref, base = expected_credit(config, batch)
            np.testing.assert_allclose(diag["chunk_returns"], credit_ref, rtol=1e-12, atol=1e-12)
            # a row's own sign: its last unit's credit R_i - b_i
            rl = batch["action_mask"].any(axis=1)
            np.testing.assert_array_equal(diag["negatives"], rl & (batch["rewards"] - base < 0))


@pytest.mark.parametrize(
    "config",
    [
        ObjectiveConfig(credit="chunk", baseline="batch_mean", baseline_stage="return", gamma=0.7),
        ObjectiveConfig(credit="token", baseline="group_mean", baseline_stage="return", gamma=0.9),
    ],
    ids=["chunk_batch_mean", "token_group_mean"],
)
def test_packed_rows_give_the_padded_credit(config):
    rng = np.random.default_rng(7)
    batch = batch_with_imitation_row(11, B=7, T=24)
    batch["failures"] = np.zeros(7, bool)
    batch["old_log_probs"] = batch["log_probs"]
    packed, placed = pack_rows(batch, 48, rng)
    segments = packed.pop("segment_ids")
    credit_ref, _ = expected_credit(config, batch)
    padded = diagnostics(config, batch)["chunk_returns"]
    packed_credit = diagnostics(config, packed, segments)["chunk_returns"]
    np.testing.assert_allclose(padded, credit_ref, rtol=1e-6, atol=1e-6)
    for i, (r, _, start, n) in placed.items():
        np.testing.assert_allclose(packed_credit[r, start : start + n], credit_ref[i, :n], rtol=1e-6, atol=1e-6)
    assert not np.any(packed_credit[packed["action_mask"] == 0])


def two_episodes() -> dict:
    """A success (R = 1) and a failure (R = 0), three one-token chunks each, every policy ratio 1/2."""
    action = np.zeros((2, 8), bool)
    action[:, [2, 4, 6]] = True
    chunk_ids = np.where(action, np.cumsum(action, axis=1) - 1, -1).astype(np.int32)
    log_probs = np.where(action, -1.0, 0).astype(np.float32)
    return {
        "log_probs": log_probs,
        "behavior_log_probs": np.where(action, -1.0 + np.log(2.0), 0).astype(np.float32),
        "rewards": np.array([1.0, 0.0], np.float32),
        "action_mask": action,
        "chunk_ids": chunk_ids,
        "expert_mask": None,
        "group_ids": None,
        "entropies": None,
    }


def test_chunks_of_one_success_differ_in_sign_and_negatives_are_truncated():
    # gamma 1/2: the success's chunks have returns 1/4, 1/2, 1, the failure's 0; b = (7/4) / 6 chunks = 7/24
    ipa = ipa_config(gamma=0.5, baseline="batch_mean")
    batch = two_episodes()
    after = diagnostics(dataclasses.replace(ipa, baseline_stage="return"), batch)
    b = 7 / 24
    success = np.array([0.25, 0.5, 1.0]) - b
    np.testing.assert_allclose(after["chunk_returns"][0, [2, 4, 6]], success, rtol=1e-6)
    np.testing.assert_allclose(after["chunk_returns"][1, [2, 4, 6]], -b, rtol=1e-6)
    assert success[0] < 0 < success[1]
    # TOPR: the negative first chunk gets the policy ratio 1/2, the positive chunks none
    np.testing.assert_allclose(after["weights"][0, [2, 4, 6]], success * np.array([0.5, 1, 1]), rtol=1e-6)
    # Before discounting (the default) every chunk of the success has its sign: A = 1 - 1/2
    before = diagnostics(ipa, batch)
    np.testing.assert_allclose(before["chunk_returns"][0, [2, 4, 6]], [0.125, 0.25, 0.5], rtol=1e-6)


@pytest.mark.parametrize("baseline", BASELINES)
def test_trajectory_credit_is_the_same_at_either_stage(baseline):
    reward = ObjectiveConfig(credit="trajectory", baseline=baseline, is_level="sequence")
    batch = batch_with_imitation_row(3)
    after = diagnostics(dataclasses.replace(reward, baseline_stage="return"), batch)
    before = diagnostics(reward, batch)
    for key in ("chunk_returns", "weights", "rl_loss"):
        np.testing.assert_allclose(after[key], before[key], rtol=1e-6, atol=1e-7, err_msg=key)


def test_default_stage_is_reward_and_needs_no_baselines():
    batch = batch_with_imitation_row(0)
    assert ObjectiveConfig().baseline_stage == "reward"
    config = ObjectiveConfig(baseline="batch_mean")
    adv = estimate_advantages(batch["rewards"], batch["action_mask"], None, config)
    assert estimate_return_baselines(adv, batch["action_mask"], batch["chunk_ids"], None, config) is None
    args = (batch["log_probs"], batch["behavior_log_probs"], adv, batch["action_mask"], batch["chunk_ids"], None)
    with pytest.raises(ValueError, match="baselines: must be None for baseline_stage='reward'"):
        objective_terms(*args, config, baselines=adv)
    after = dataclasses.replace(config, baseline_stage="return")
    with pytest.raises(ValueError, match="baselines: required for baseline_stage='return'"):
        objective_terms(*args, after)


def test_return_stage_advantages_are_the_rewards():
    batch = batch_with_imitation_row(1)
    config = ObjectiveConfig(baseline="batch_mean", baseline_stage="return", advantage_sign=-1)
    adv = np.asarray(estimate_advantages(batch["rewards"], batch["action_mask"], None, config))
    np.testing.assert_array_equal(adv, np.where(batch["action_mask"].any(axis=1), -batch["rewards"], 0))


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"baseline_stage": "returns"}, r"'returns' is not one of \('reward', 'return'\)"),
        ({"baseline_stage": "return"}, "baseline 'none' has none to subtract"),
        (
            {"baseline_stage": "return", "baseline": "batch_mean", "advantage_norm": "batch_std"},
            "advantage_norm 'batch_std' .* not defined on per-token returns",
        ),
        (
            {"baseline_stage": "return", "baseline": "group_mean", "advantage_norm": "group_std"},
            "advantage_norm 'group_std'",
        ),
        ({"baseline_stage": "return", "baseline": "batch_mean", "credit": "branch"}, "already baselined"),
    ],
)
def test_bad_stage_combinations_are_clear_errors(fields, message):
    with pytest.raises(ValueError, match=f"ObjectiveConfig.baseline_stage: (.* )?{message}"):
        ObjectiveConfig(**fields)
