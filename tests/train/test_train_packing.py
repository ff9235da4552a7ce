"""Sequence packing: the packer (every token placed once, segments never cross rows, positions restart, chunk ids
continue along a row) and the learner on packed rows, whose loss and gradient equal the padded batch's on a
sharded mesh of 8 fake devices with microbatches, for the IPA and FlashREINFORCE presets and sequence-level
options."""

import math

import jax
import numpy as np
import pytest
from train_helpers import (
    PACKED_MESH,
    PACKED_OBJECTIVES,
    assert_same_loss_and_gradients,
    graded,
    make_exp,
    max_rel_diff,
    offline_learner_run,
    synthetic_trajectories,
)

from ipa_jax.models import make_mesh
from ipa_jax.models.attention import segment_positions
from ipa_jax.pipeline.build import build_state, build_steps
from ipa_jax.trajectory import first_fit_decreasing, pack_batch, packed_row_count, pad_batch

BUCKETS = (32, 64)


def _trajectories(n=16, seed=0, **kw):
    """n - 1 short trajectories (5-20 tokens) and a long one (50-60): the batch's bucket is 64."""
    short = synthetic_trajectories(n - 1, seed=seed, min_len=5, max_len=20, num_tasks=5, **kw)
    return short + synthetic_trajectories(1, seed=seed + 1000, min_len=50, max_len=60, **kw)


# ---------------------------------------------------------------------------------------------- the packer
def test_first_fit_decreasing_places_every_item_once_in_the_first_bin_with_room():
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 40, 60).tolist()
    bins = first_fit_decreasing(lengths, 64)
    assert sorted(i for b in bins for i in b) == list(range(60))
    used = [sum(lengths[i] for i in b) for b in bins]
    assert max(used) <= 64
    # Replaying the placements: each item went to the first bin that had room for it at that moment.
    room = [64] * len(bins)
    order = sorted(range(60), key=lambda i: (-lengths[i], i))
    bin_of = {i: k for k, b in enumerate(bins) for i in b}
    for i in order:
        assert bin_of[i] == next(k for k, free in enumerate(room) if free >= lengths[i])
        room[bin_of[i]] -= lengths[i]
    with pytest.raises(ValueError, match="exceeds the capacity"):
        first_fit_decreasing([3, 65], 64)


def test_packed_row_count_series():
    assert [packed_row_count(n, 1, 100) for n in range(1, 14)] == [1, 2, 3, 4, 6, 6, 8, 8, 12, 12, 12, 12, 16]
    assert packed_row_count(5, 4, 100) == 8 and packed_row_count(9, 4, 100) == 12 and packed_row_count(9, 4, 8) == 8


def test_pack_batch_places_every_token_once_within_one_row():
    trajs = _trajectories(23, seed=3, num_layers_k=(2, 2))
    batch, slots = pack_batch(trajs, BUCKETS, pad_id=7, row_multiple=4)
    B, T = batch.tokens.shape
    assert T == 64 and B % 4 == 0 and B < len(trajs)
    assert slots.shape == batch.rewards.shape == batch.group_ids.shape == batch.policy_versions.shape
    assert slots.shape[1] & (slots.shape[1] - 1) == 0  # a power of two
    assert sorted(slots[slots >= 0].tolist()) == list(range(len(trajs)))
    padded = pad_batch(trajs, BUCKETS)
    seg = batch.segment_ids
    covered = np.zeros((B, T), int)
    chunks_before = np.zeros(B, int)
    for (r, s), j in np.ndenumerate(slots):
        if j < 0:
            assert batch.rewards[r, s] == 0 and batch.group_ids[r, s] == -1 and batch.policy_versions[r, s] == -1
            assert not (seg[r] == s + 1).any()
            continue
        tr = trajs[j]
        where = np.flatnonzero(seg[r] == s + 1)
        assert len(where) == tr.length and (np.diff(where) == 1).all()  # one contiguous run in one row
        span = slice(where[0], where[-1] + 1)
        covered[r, span] += 1
        np.testing.assert_array_equal(batch.tokens[r, span], tr.tokens)
        np.testing.assert_array_equal(batch.positions[r, span], np.arange(tr.length))  # restart per segment
        np.testing.assert_array_equal(batch.action_mask[r, span], tr.action_mask)
        np.testing.assert_array_equal(batch.expert_mask[r, span], tr.expert_mask)
        np.testing.assert_array_equal(batch.behavior_logprobs[r, span], tr.behavior_logprobs)
        np.testing.assert_array_equal(batch.routed_experts[r, span], tr.routed_experts)
        # chunk ids continue the numbering of the row's earlier trajectories
        np.testing.assert_array_equal(
            batch.chunk_ids[r, span], np.where(tr.action_mask, tr.chunk_ids + chunks_before[r], -1)
        )
        chunks_before[r] += tr.num_chunks
        assert batch.rewards[r, s] == tr.reward and batch.policy_versions[r, s] == tr.policy_version
        assert batch.group_ids[r, s] == padded.group_ids[j]  # the same task numbering as the padded batch
        assert batch.attention_mask[r, span].all()
    np.testing.assert_array_equal(covered, batch.attention_mask)  # every real token belongs to exactly one run
    assert (covered <= 1).all() and covered.sum() == sum(tr.length for tr in trajs)
    pad = ~batch.attention_mask
    assert (batch.tokens[pad] == 7).all() and (seg[pad] == 0).all() and (batch.chunk_ids[pad] == -1).all()
    assert not (batch.action_mask[pad] | batch.expert_mask[pad]).any() and (batch.routed_experts[pad] == 0).all()
    # segments are increasing runs along a row, padding only at its end; the model's positions agree
    for r in range(B):
        real = seg[r][seg[r] > 0]
        assert (np.diff(real) >= 0).all() and (seg[r][len(real) :] == 0).all()
    np.testing.assert_array_equal(np.asarray(segment_positions(seg)), batch.positions)


# ---------------------------------------------------------------------------------------------- the learner
@pytest.fixture(scope="module")
def mesh():
    assert jax.device_count() == 8, "tests/conftest.py sets 8 fake CPU devices"
    return make_mesh(PACKED_MESH, devices=jax.devices())


@pytest.mark.parametrize("name", PACKED_OBJECTIVES)
def test_packed_batch_same_loss_and_gradients_as_padded(mesh, name):
    exp = make_exp("train.batch_size=16", "train.microbatches=2", "train.packing=True", *PACKED_OBJECTIVES[name])
    state = build_state(exp, mesh)
    step, _ = build_steps(exp, state, mesh)
    trajs = graded(_trajectories(16, seed=11))
    padded = pad_batch(trajs, BUCKETS)
    packed, _ = pack_batch(trajs, BUCKETS, row_multiple=2 * step.data_parallel_size)
    assert packed.tokens.shape[0] < padded.tokens.shape[0] and packed.segment_ids.max() >= 3
    stats, _ = assert_same_loss_and_gradients(step, state, padded, packed)
    assert float(stats["n_trajectories"]) == 16 and float(stats["n_il_rows"]) > 0
    if name == "flash_reinforce":
        assert 0 < float(stats["admitted"]) < 16  # the sequence trust region admits some and rejects others
    if name == "sequence_level":
        assert 0 < float(stats["n_keep"]) < float(stats["n_action"])  # masks and the entropy filter drop some


def _run(tmp_path, mesh, tag, *overrides):
    """A learner run on 16 trajectories (16 padded rows or 8 packed rows of 64): its metrics, initial and final
    params."""
    return offline_learner_run(tmp_path, mesh, tag, _trajectories(16, seed=5), *overrides)


def test_learner_packed_update_equals_padded(tmp_path, mesh):
    (padded,), init, after = _run(tmp_path, mesh, "padded", "train.steps=1")
    (packed,), packed_init, packed_after = _run(tmp_path, mesh, "packed", "train.steps=1", "train.packing=True")
    assert max_rel_diff(packed_init, init) == 0.0
    assert padded["seq_len"] == packed["seq_len"] == 64
    for key in (
        "loss",
        "rl_loss",
        "grad_norm",
        "reward_mean",
        "reward_std",
        "advantage_mean",
        "advantage_std",
        "advantage_min",
        "advantage_max",
        "admitted_fraction",
        "kept_token_fraction",
        "chunks_mean",
        "chunks_max",
        "action_tokens",
        "real_tokens",
        "is_ratio_mean",
        "mismatch_kl",
        "policy_lag_mean",
    ):
        assert math.isclose(packed[key], padded[key], rel_tol=1e-5, abs_tol=1e-7), key
    delta = jax.tree.map(np.subtract, after, init)
    assert max_rel_diff(jax.tree.map(np.subtract, packed_after, init), delta) < 1e-3


def test_learner_packed_minibatches_and_epochs(tmp_path, mesh):
    """Two epochs of two minibatches of packed rows from one batch, with recomputed old log-probs."""
    rows, _, _ = _run(
        tmp_path,
        mesh,
        "packed",
        "train.steps=4",
        "train.packing=True",
        "train.minibatches=2",
        "train.epochs_per_batch=2",
        "objective.old_logprobs=recompute",
    )
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and all(r["skipped"] == 0 for r in rows)
    assert all(math.isfinite(r["loss"]) for r in rows)
    # each epoch's two minibatches together hold the whole batch
    assert rows[0]["action_tokens"] + rows[1]["action_tokens"] == rows[2]["action_tokens"] + rows[3]["action_tokens"]
    assert abs(rows[0]["is_ratio_max"] - 1) < 1e-4 and rows[3]["is_ratio_max"] > 1 + 1e-4
