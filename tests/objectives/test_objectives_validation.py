"""Bad inputs raise ValueErrors naming the problem: host-side validation, ObjectiveConfig, and the eager presets."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

from ipa_jax.objectives import (
    ObjectiveConfig,
    flash_reinforce_loss,
    ipa_loss,
    policy_loss,
    validate_objective_inputs,
)


def good():
    a = np.array([[0, 1, 1, 0, 1], [0, 0, 1, 1, 0]], bool)
    return {
        "log_probs": np.where(a, -0.5, 0).astype(np.float32),
        "behavior_log_probs": np.where(a, -0.6, 0).astype(np.float32),
        "rewards": np.array([1.0, 0.0], np.float32),
        "action_mask": a,
        "chunk_ids": np.array([[-1, 0, 0, -1, 1], [-1, -1, 0, 0, -1]], np.int32),
        "expert_mask": np.array([[0, 0, 0, 1, 0], [0, 1, 0, 0, 0]], bool),
        "group_ids": np.array([0, 1], np.int32),
        "entropies": np.ones((2, 5), np.float32),
    }


def with_(key, fn):
    batch = good()
    batch[key] = fn(batch[key].copy())
    return batch


def setitem(index, value):
    def fn(x):
        x[index] = value
        return x

    return fn


BAD = {
    "shape_mismatch": (with_("behavior_log_probs", lambda x: x[:, :4]), "behavior_log_probs: shape"),
    "rewards_shape": (with_("rewards", lambda x: x[:1]), "rewards: shape"),
    "one_dimensional": (with_("log_probs", lambda x: x[0]), "log_probs: must be a non-empty [B, T]"),
    "empty": (with_("log_probs", lambda x: x[:0]), "log_probs: must be a non-empty [B, T]"),
    "mask_not_bool": (with_("action_mask", lambda x: x.astype(np.int32)), "action_mask: must be a boolean"),
    "row_without_actions": (
        {
            **with_("action_mask", setitem(1, False)),
            "chunk_ids": np.array([[-1, 0, 0, -1, 1], [-1] * 5], np.int32),
            "expert_mask": np.array([[0, 0, 0, 1, 0], [0] * 5], bool),
        },
        "action_mask: row 1 has no action token",
    ),
    "action_at_position_0": (
        with_("action_mask", setitem((0, 0), True)),
        "action_mask: row 0 has an action at position 0",
    ),
    "nan_log_prob": (with_("log_probs", setitem((0, 1), np.nan)), "log_probs: action log-prob nan at row 0"),
    "inf_behavior": (with_("behavior_log_probs", setitem((1, 2), -np.inf)), "behavior_log_probs: action log-prob"),
    "positive_log_prob": (with_("log_probs", setitem((1, 3), 0.25)), "is NaN, inf or > 0"),
    "nan_reward": (with_("rewards", setitem(1, np.nan)), "rewards: non-finite reward at row 1"),
    "inf_reward": (with_("rewards", setitem(0, np.inf)), "rewards: non-finite reward at row 0"),
    "chunk_id_outside_actions": (with_("chunk_ids", setitem((0, 3), 0)), "chunk_ids: must be -1 outside"),
    "chunk_id_missing_inside": (with_("chunk_ids", setitem((0, 2), -1)), "chunk_ids: row 0 is not 0..K-1"),
    "chunk_ids_decreasing": (with_("chunk_ids", setitem(0, [-1, 0, 1, -1, 0])), "chunk_ids: row 0 is not 0..K-1"),
    "chunk_ids_skip": (with_("chunk_ids", setitem((0, 4), 2)), "chunk_ids: row 0 is not 0..K-1"),
    "chunk_ids_not_from_0": (with_("chunk_ids", setitem((1, slice(2, 4)), 1)), "chunk_ids: row 1 is not 0..K-1"),
    "expert_overlaps_action": (with_("expert_mask", setitem((0, 1), True)), "expert_mask: overlaps action_mask"),
    "nan_entropy": (with_("entropies", setitem((0, 2), np.nan)), "entropies: non-finite entropy"),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_input_raises_naming_the_problem(case):
    batch, message = BAD[case]
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        validate_objective_inputs(**batch)


def test_good_input_passes_and_tokens_are_checked_against_the_vocabulary():
    validate_objective_inputs(**good(), config=ObjectiveConfig())
    # A row of expert tokens only is a pure imitation row, not an error.
    validate_objective_inputs(
        **{**with_("action_mask", setitem(1, False)), "chunk_ids": np.array([[-1, 0, 0, -1, 1], [-1] * 5], np.int32)}
    )
    tokens = np.array([[1, 2, 3, 4, 5], [1, 2, 3, 4, 9]])
    validate_objective_inputs(**good(), tokens=tokens, vocab_size=10)
    with pytest.raises(ValueError, match=r"tokens: id 9 in row 1 is outside the vocabulary \[0, 8\)"):
        validate_objective_inputs(**good(), tokens=tokens, vocab_size=8)
    with pytest.raises(ValueError, match="tokens: id -1 in row 0"):
        validate_objective_inputs(**good(), tokens=tokens * np.array([[-1, 1, 1, 1, 1], [1] * 5]))


def test_inputs_the_config_needs():
    batch = good()
    with pytest.raises(ValueError, match="chunk_ids: required"):
        validate_objective_inputs(**{**batch, "chunk_ids": None}, config=ObjectiveConfig())
    with pytest.raises(ValueError, match="group_ids: required"):
        validate_objective_inputs(**{**batch, "group_ids": None}, config=ObjectiveConfig(baseline="group_mean"))
    with pytest.raises(ValueError, match="entropies: required"):
        validate_objective_inputs(**{**batch, "entropies": None}, config=ObjectiveConfig(negative_token_fraction=0.5))


@pytest.mark.parametrize(
    "field,value,message",
    [
        ("baseline", "mean", "ObjectiveConfig.baseline: 'mean' is not one of"),
        ("credit", "turn", "ObjectiveConfig.credit"),
        ("is_level", "seq", "ObjectiveConfig.is_level"),
        ("is_apply_to", "positives", "ObjectiveConfig.is_apply_to"),
        ("mismatch_level", "row", "ObjectiveConfig.mismatch_level"),
        ("old_logprobs", "proximal", "ObjectiveConfig.old_logprobs"),
        ("sign_by", "score", "ObjectiveConfig.sign_by"),
        ("row_denominator", "kept_tokens", "ObjectiveConfig.row_denominator"),
        ("row_denominator", "kept", "ObjectiveConfig.row_denominator: 'kept' divides each row of sample_mean"),
        ("mismatch_is_cap", 0.0, r"ObjectiveConfig.mismatch_is_cap: must be > 0"),
        ("mismatch_is_cap", float("nan"), "ObjectiveConfig.mismatch_is_cap"),
        ("mismatch_prob_diff", -0.1, r"ObjectiveConfig.mismatch_prob_diff: must be >= 0"),
        ("trust_region_level", "token", "ObjectiveConfig.trust_region_level"),
        ("aggregation", "mean", "ObjectiveConfig.aggregation"),
        ("advantage_sign", 0, "ObjectiveConfig.advantage_sign: must be 1 or -1"),
        ("advantage_sign", -0.5, "ObjectiveConfig.advantage_sign"),
        ("advantage_sign", True, "ObjectiveConfig.advantage_sign"),
        ("gamma", 0.0, "ObjectiveConfig.gamma: must be in"),
        ("gamma", 1.5, "ObjectiveConfig.gamma"),
        ("trust_region_delta", -1e-3, "ObjectiveConfig.trust_region_delta: must be >= 0"),
        ("trust_region_delta", float("nan"), "ObjectiveConfig.trust_region_delta"),
        ("negative_token_fraction", 1.5, r"ObjectiveConfig.negative_token_fraction: must be in \[0, 1\]"),
        ("negative_token_fraction", -0.1, "ObjectiveConfig.negative_token_fraction"),
        ("mismatch_range", (2.0, 1.0), "ObjectiveConfig.mismatch_range"),
        ("mismatch_range", (-1.0, 1.0), "ObjectiveConfig.mismatch_range"),
        ("is_clip_max", 0.0, "ObjectiveConfig.is_clip_max"),
        ("il_weight", float("inf"), "ObjectiveConfig.il_weight"),
    ],
)
def test_config_rejects_bad_values(field, value, message):
    base = ObjectiveConfig(aggregation="token_mean") if field == "row_denominator" else ObjectiveConfig()
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(base, **{field: value})


def test_mismatch_corrections_need_a_mismatch_level_and_none_means_off():
    for field in ("mismatch_is_cap", "mismatch_prob_diff"):
        with pytest.raises(ValueError, match=f"ObjectiveConfig.{field}: a mismatch correction needs"):
            ObjectiveConfig(mismatch_level="none", **{field: 0.5})
        assert getattr(ObjectiveConfig(**{field: None}), field) == float("inf")  # None and inf: off, stored as inf
    assert ObjectiveConfig(mismatch_level="none", mismatch_is_cap=None) == ObjectiveConfig(mismatch_level="none")


def test_old_log_probs_are_given_exactly_when_the_config_recomputes():
    batch = good()
    recompute = ObjectiveConfig(old_logprobs="recompute")
    with pytest.raises(ValueError, match="old_log_probs: required for old_logprobs='recompute'"):
        validate_objective_inputs(**batch, config=recompute)
    with pytest.raises(ValueError, match="old_log_probs: must be None for old_logprobs='behavior'"):
        validate_objective_inputs(**batch, config=ObjectiveConfig(), old_log_probs=batch["log_probs"])
    validate_objective_inputs(**batch, config=recompute, old_log_probs=batch["log_probs"])
    with pytest.raises(ValueError, match="old_log_probs: shape"):
        validate_objective_inputs(**batch, config=recompute, old_log_probs=batch["log_probs"][:, :4])
    with pytest.raises(ValueError, match="old_log_probs: action log-prob nan at row 1"):
        validate_objective_inputs(
            **batch,
            config=recompute,
            old_log_probs=np.where(batch["action_mask"] & (np.arange(2) == 1)[:, None], np.nan, batch["log_probs"]),
        )
    with pytest.raises(ValueError, match="old_log_probs: required"):  # the jitted objective checks it too
        jax.jit(
            lambda x: policy_loss(
                x,
                batch["behavior_log_probs"],
                batch["rewards"],
                batch["action_mask"],
                batch["chunk_ids"],
                config=recompute,
            )
        )(batch["log_probs"])


def test_config_is_hashable_and_normalises_lists():
    a = ObjectiveConfig(mismatch_range=[0.0, 5.0])
    assert a.mismatch_range == (0.0, 5.0) and hash(a) == hash(ObjectiveConfig()) and a == ObjectiveConfig()
    assert ObjectiveConfig(trust_region_delta=float("inf")).trust_region_delta == float("inf")


def test_presets_check_eager_inputs_and_their_options():
    batch = good()
    l, b, r, a, c = (batch[k] for k in ("log_probs", "behavior_log_probs", "rewards", "action_mask", "chunk_ids"))
    with pytest.raises(ValueError, match="trust_region_delta: must be >= 0"):
        flash_reinforce_loss(l, b, r, a, delta=-1.0)
    with pytest.raises(ValueError, match="trust_region_delta"):
        flash_reinforce_loss(l, b, r, a, delta=float("nan"))
    with pytest.raises(ValueError, match="negative_token_fraction"):
        flash_reinforce_loss(l, b, r, a, negative_token_fraction=2.0, entropies=batch["entropies"])
    with pytest.raises(ValueError, match="entropies: required"):
        flash_reinforce_loss(l, b, r, a, negative_token_fraction=0.5)
    with pytest.raises(ValueError, match="rewards: non-finite"):
        flash_reinforce_loss(l, b, np.array([np.nan, 0.0], np.float32), a)
    with pytest.raises(ValueError, match="log_probs: action log-prob"):
        ipa_loss(np.where(a, 0.5, 0).astype(np.float32), b, r, a, c)
    with pytest.raises(ValueError, match="baseline: ipa_loss supports"):
        ipa_loss(l, b, r, a, c, baseline="group_mean")
    with pytest.raises(ValueError, match="chunk_ids: must be -1 outside"):
        ipa_loss(l, b, r, a, np.zeros_like(c))
    # Under jit the inputs are tracers: no host check, the computation still runs.
    loss, _ = jax.jit(lambda x: flash_reinforce_loss(x, b, r, a))(l)
    assert np.isfinite(float(loss))
