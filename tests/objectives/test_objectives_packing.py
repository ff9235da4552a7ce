"""Packed rows (segment_ids): the objective of sequences packed several to a row equals that of the same sequences
one per row (the padded path, itself checked against the float64 reference in test_objectives_reference.py):
loss, gradient with respect to the log-probs, and every per-sequence diagnostic, for every option."""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np
import pytest
from objectives_reference import random_batch
from test_objectives_reference import CONFIGS

from ipa_jax.objectives import (
    PRESETS,
    ObjectiveConfig,
    objective_terms,
    policy_loss,
    term_denominators,
    validate_objective_inputs,
)

PACKING_CONFIGS = {
    **CONFIGS,
    **{f"preset_{name}": dataclasses.replace(PRESETS[name], il_weight=0.3) for name in PRESETS},
    "sequence_levels_kept_rows": ObjectiveConfig(
        baseline="batch_mean",
        credit="token",
        gamma=0.8,
        is_level="sequence",
        is_apply_to="negatives",
        sign_by="reward",
        mismatch_level="sequence",
        mismatch_range=(0.3, 3.0),
        mismatch_is_cap=1.5,
        mismatch_prob_diff=0.2,
        trust_region_level="sequence",
        trust_region_delta=2e-2,
        negative_token_fraction=0.4,
        aggregation="sample_mean",
        row_denominator="kept",
        il_weight=0.5,
    ),
    "chunk_mean_chunk_trust_region": ObjectiveConfig(
        baseline="group_mean",
        credit="chunk",
        gamma=0.7,
        is_level="chunk",
        trust_region_level="chunk",
        trust_region_delta=1e-2,
        aggregation="chunk_mean",
        il_weight=0.0,
    ),
}
PER_SEQUENCE = ("advantages", "negatives", "sequence_kl", "admitted", "num_chunks", "policy_tokens", "retained_tokens")
PER_TOKEN = ("weights", "chunk_returns")


def pack_rows(batch: dict, capacity: int, rng: np.random.Generator):
    """The rows of `batch` (one sequence each, its length: up to its last target token plus 0-3 context tokens)
    packed next-fit in a shuffled order into rows of `capacity`, with one all-padding row at the end. Returns the
    packed arrays (per-sequence ones [B', S]) and where each sequence went: (packed row, segment, start, length)."""
    targets = batch["action_mask"] | batch["expert_mask"]
    n, T = targets.shape
    lengths = [min(T, int(np.flatnonzero(targets[i]).max()) + 1 + int(rng.integers(0, 4))) for i in range(n)]
    rows, fill = [[]], 0
    for i in rng.permutation(n):
        if fill + lengths[i] > capacity:
            rows.append([])
            fill = 0
        rows[-1].append(int(i))
        fill += lengths[i]
    rows.append([])
    S = max(len(r) for r in rows) + 1  # one spare slot: unused slots must not count
    packed = {
        name: np.zeros((len(rows), capacity), batch[name].dtype)
        for name in ("log_probs", "behavior_log_probs", "old_log_probs", "action_mask", "expert_mask", "entropies")
    }
    packed["chunk_ids"] = np.full((len(rows), capacity), -1, np.int32)
    packed["segment_ids"] = np.zeros((len(rows), capacity), np.int32)
    for name in ("rewards", "group_ids", "failures"):
        packed[name] = np.zeros((len(rows), S), batch[name].dtype)
    placed = {}
    for r, members in enumerate(rows):
        start, chunks = 0, 0
        for s, i in enumerate(members):
            span, n_i = slice(start, start + lengths[i]), lengths[i]
            for name in ("log_probs", "behavior_log_probs", "old_log_probs", "action_mask", "expert_mask", "entropies"):
                packed[name][r, span] = batch[name][i, :n_i]
            cid = batch["chunk_ids"][i, :n_i]
            packed["chunk_ids"][r, span] = np.where(cid >= 0, cid + chunks, -1)
            chunks += cid.max() + 1
            packed["segment_ids"][r, span] = s + 1
            for name in ("rewards", "group_ids", "failures"):
                packed[name][r, s] = batch[name][i]
            placed[i] = (r, s, start, n_i)
            start += n_i
    return packed, placed


@functools.partial(jax.jit, static_argnames="config")
def loss_diag_grad(batch: dict, segment_ids, config: ObjectiveConfig):
    old = batch["old_log_probs"] if config.needs_old_log_probs else None

    def f(log_probs):
        return policy_loss(
            log_probs,
            batch["behavior_log_probs"],
            batch["rewards"],
            batch["action_mask"],
            batch["chunk_ids"],
            batch["expert_mask"],
            batch["group_ids"],
            batch["entropies"],
            config,
            failures=batch["failures"],
            old_log_probs=old,
            segment_ids=segment_ids,
        )

    (loss, diag), grad = jax.value_and_grad(f, has_aux=True)(batch["log_probs"])
    return loss, diag, grad


@pytest.mark.parametrize("name", PACKING_CONFIGS)
def test_packed_rows_equal_one_sequence_per_row(name):
    config = PACKING_CONFIGS[name]
    rng = np.random.default_rng(2024)
    for _ in range(3):
        batch = random_batch(rng, B=7, T=24)
        batch["old_log_probs"] = np.where(batch["action_mask"], batch["log_probs"] - 0.05, 0).astype(np.float32)
        batch["failures"] = rng.random(7) < 0.5
        packed, placed = pack_rows(batch, 48, rng)
        segments = packed.pop("segment_ids")
        old = batch["old_log_probs"] if config.needs_old_log_probs else None
        validate_objective_inputs(
            packed["log_probs"],
            packed["behavior_log_probs"],
            packed["rewards"],
            packed["action_mask"],
            packed["chunk_ids"],
            packed["expert_mask"],
            packed["group_ids"],
            packed["entropies"],
            config,
            failures=packed["failures"],
            old_log_probs=None if old is None else packed["old_log_probs"],
            segment_ids=segments,
        )
        loss, diag, grad = jax.device_get(loss_diag_grad(batch, None, config))
        p_loss, p_diag, p_grad = jax.device_get(loss_diag_grad(packed, segments, config))

        magnitude = np.abs(grad).max()
        np.testing.assert_allclose(p_loss, loss, rtol=1e-6, atol=1e-6 * max(abs(float(loss)), 1.0))
        for i, (r, s, start, n) in placed.items():
            np.testing.assert_allclose(p_grad[r, start : start + n], grad[i, :n], rtol=1e-5, atol=1e-6 * magnitude)
            assert not grad[i, n:].any()
            for key in PER_TOKEN:
                np.testing.assert_allclose(
                    p_diag[key][r, start : start + n], diag[key][i, :n], rtol=1e-5, atol=1e-6, err_msg=key
                )
            for key in PER_SEQUENCE:
                np.testing.assert_allclose(p_diag[key][r, s], diag[key][i], rtol=1e-5, atol=1e-6, err_msg=key)
        for key in (
            "acceptance_rate",
            "kept_fraction",
            "kept_token_fraction",
            "mean_is_ratio",
            "clip_fraction",
            "mismatch_masked_fraction",
            "rl_loss",
            "il_loss",
        ):
            # atol 1e-6: a group-centred loss (GRPO's PPO surrogate at ratio 1) cancels to ~0 in float32
            np.testing.assert_allclose(p_diag[key], diag[key], rtol=1e-5, atol=1e-6, err_msg=key)
        dens = term_denominators(batch["action_mask"], batch["chunk_ids"], batch["expert_mask"], config)
        p_dens = term_denominators(packed["action_mask"], packed["chunk_ids"], packed["expert_mask"], config, segments)
        assert {k: float(v) for k, v in dens.items()} == {k: float(v) for k, v in p_dens.items()}


def test_packed_inputs_are_validated():
    batch = random_batch(np.random.default_rng(5), B=3, T=16)
    batch["old_log_probs"] = batch["log_probs"]
    batch["failures"] = np.zeros(3, bool)
    packed, placed = pack_rows(batch, 40, np.random.default_rng(0))
    segments = packed.pop("segment_ids")
    args = [
        packed[k] for k in ("log_probs", "behavior_log_probs", "rewards", "action_mask", "chunk_ids", "expert_mask")
    ]
    validate_objective_inputs(*args, segment_ids=segments)
    with pytest.raises(ValueError, match=r"rewards: shape \(\d+,\) must be \[B, S\]"):
        validate_objective_inputs(*args[:2], packed["rewards"][:, 0], *args[3:], segment_ids=segments)
    r, s, start, n = placed[0]
    split = segments.copy()
    split[r, start + 1] = 0  # a padding token inside a sequence splits it into two runs of one id
    with pytest.raises(ValueError, match="segment_ids: row .* increasing contiguous runs"):
        validate_objective_inputs(*args, segment_ids=split)
    first_is_target = [a.copy() for a in args]
    first_is_target[5][r, start] = True  # an expert token on a segment's first token (no predictor)
    with pytest.raises(ValueError, match="first token of a segment"):
        validate_objective_inputs(*first_is_target, segment_ids=segments)
    with pytest.raises(ValueError, match=r"advantages: must be \[B, S\]"):
        objective_terms(*args[:2], packed["rewards"][:, 0], *args[3:], ObjectiveConfig(), segment_ids=segments)
