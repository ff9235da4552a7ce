"""Shared prefixes in packed rows (`pack_batch(share_prefix=True)`, train.share_prefix): a trajectory that begins
like its row's first holds only the rest and attends to the first's tokens as its prefix. The packer's layout,
and the loss, gradients and learner update against the same trajectories padded one per row (8 fake devices,
microbatches); a control shows the prefix is read (without it the log-probs change)."""

import dataclasses
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
from ipa_jax.pipeline.build import build_state, build_steps
from ipa_jax.train.step import shared_prefix_tokens
from ipa_jax.trajectory import pack_batch, pad_batch, shared_prefix_length

BUCKETS = (48, 96, 160)
PROMPT = 14  # tokens every trajectory begins with (a system prompt)


def _with_prompt(trajs, prompt, routed_shape=None):
    """The trajectories with `prompt` in front (not scored; its routed experts 0)."""
    n = len(prompt)
    out = []
    for tr in trajs:
        routed = None
        if tr.routed_experts is not None:
            routed = np.concatenate([np.zeros((n, *tr.routed_experts.shape[1:]), np.int32), tr.routed_experts])
        out.append(
            dataclasses.replace(
                tr,
                tokens=np.concatenate([prompt, tr.tokens]),
                action_mask=np.concatenate([np.zeros(n, bool), tr.action_mask]),
                behavior_logprobs=np.concatenate([np.zeros(n, np.float32), tr.behavior_logprobs]),
                chunk_ids=np.concatenate([np.full(n, -1, np.int32), tr.chunk_ids]),
                expert_mask=np.concatenate([np.zeros(n, bool), tr.expert_mask]),
                routed_experts=routed,
            )
        )
    return out


def _trajectories(n=16, seed=0, **kw):
    """n trajectories of 14 + 12-30 tokens: a common prompt, then each its own (starting tokens differ but for
    the group's samples of one task, which share more)."""
    rng = np.random.default_rng(seed)
    prompt = rng.integers(0, 128, PROMPT)
    return _with_prompt(synthetic_trajectories(n, seed=seed, num_tasks=5, **kw), prompt)


# ---------------------------------------------------------------------------------------------- the packer
def test_shared_prefix_length_stops_before_the_first_scored_token():
    trajs = _trajectories(6, seed=1)
    head = trajs[0]
    for tr in trajs[1:]:
        common = next(t for t in range(min(head.length, tr.length)) if head.tokens[t] != tr.tokens[t])
        first_scored = int(np.flatnonzero(tr.action_mask | tr.expert_mask)[0])
        assert shared_prefix_length(head, tr) == min(common, first_scored - 1) >= PROMPT - 1
    # an expert target right after the prompt's first token: nothing can be shared
    early = dataclasses.replace(trajs[1], expert_mask=np.eye(1, trajs[1].length, 1, dtype=bool)[0])
    early.action_mask = early.action_mask & ~early.expert_mask
    assert shared_prefix_length(head, early) == 0
    # routing replay: the prefix ends where the recorded experts first differ
    routed = [np.zeros((tr.length, 2, 2), np.int32) for tr in (head, trajs[1])]
    routed[1][5, 1, 0] = 3
    pair = [dataclasses.replace(tr, routed_experts=r) for tr, r in zip((head, trajs[1]), routed, strict=True)]
    assert shared_prefix_length(*pair) == 5
    # a trajectory equal to the head, with nothing scored, keeps its last token
    unscored = np.zeros(head.length, bool)
    assert shared_prefix_length(head, dataclasses.replace(head, action_mask=unscored, expert_mask=unscored)) == (
        head.length - 1
    )


def test_pack_batch_shares_the_row_heads_prefix():
    trajs = _trajectories(23, seed=3, num_layers_k=(2, 2))
    plain, _ = pack_batch(trajs, BUCKETS, pad_id=7, row_multiple=2)
    batch, slots = pack_batch(trajs, BUCKETS, pad_id=7, row_multiple=2, share_prefix=True)
    assert plain.prefix_segment_ids is None
    B, T = batch.tokens.shape
    assert batch.attention_mask.sum() < plain.attention_mask.sum() and B * T <= plain.tokens.size
    assert sorted(slots[slots >= 0].tolist()) == list(range(len(trajs)))
    held, total = batch.attention_mask.sum(), sum(tr.length for tr in trajs)
    assert float(shared_prefix_tokens(batch)) == total - held > 0
    seg, pre = batch.segment_ids, batch.prefix_segment_ids
    borrowers = 0
    for (r, s), j in np.ndenumerate(slots):
        if j < 0:
            continue
        tr, head = trajs[j], trajs[slots[r, 0]]
        where = np.flatnonzero(seg[r] == s + 1)
        skip = 0 if s == 0 else shared_prefix_length(head, tr)
        borrowers += skip > 0
        assert len(where) == tr.length - skip and (np.diff(where) == 1).all()
        span = slice(where[0], where[-1] + 1)
        np.testing.assert_array_equal(batch.tokens[r, span], tr.tokens[skip:])
        np.testing.assert_array_equal(batch.positions[r, span], np.arange(skip, tr.length))  # its own positions
        np.testing.assert_array_equal(batch.action_mask[r, span], tr.action_mask[skip:])
        np.testing.assert_array_equal(batch.expert_mask[r, span], tr.expert_mask[skip:])
        np.testing.assert_array_equal(batch.behavior_logprobs[r, span], tr.behavior_logprobs[skip:])
        np.testing.assert_array_equal(batch.routed_experts[r, span], tr.routed_experts[skip:])
        assert (pre[r, span] == (1 if skip else 0)).all()
        # every scored token of the trajectory is held, with its predecessor
        assert batch.action_mask[r, span].sum() == tr.action_mask.sum()
        assert batch.expert_mask[r, span].sum() == tr.expert_mask.sum()
        assert not (batch.action_mask[r, where[0]] or batch.expert_mask[r, where[0]])
        np.testing.assert_array_equal(batch.tokens[r, :skip], head.tokens[:skip])  # the head holds the prefix
    assert borrowers >= len(trajs) - 2 * B
    assert (pre[~batch.attention_mask] == 0).all()


@pytest.mark.parametrize("share_prefix", [True, False])
def test_pack_batch_picks_the_bucket_with_the_fewest_positions(share_prefix):
    trajs = _trajectories(16, seed=4)
    longest = max(tr.length for tr in trajs)
    assert 24 < longest <= 48  # no two of the longest fit the shortest bucket
    sizes = {}
    for buckets in ((48,), (96,), (160,)):
        batch, _ = pack_batch(trajs, buckets, share_prefix=share_prefix)
        sizes[buckets[0]] = batch.tokens.size
    batch, _ = pack_batch(trajs, BUCKETS, share_prefix=share_prefix)
    assert batch.tokens.size == min(sizes.values())
    assert batch.tokens.shape[1] == min(b for b, n in sizes.items() if n == batch.tokens.size)
    assert batch.tokens.shape[1] > 48  # longer rows hold more trajectories (and share one prompt among them)


# ---------------------------------------------------------------------------------------------- the learner
@pytest.fixture(scope="module")
def mesh():
    assert jax.device_count() == 8, "tests/conftest.py sets 8 fake CPU devices"
    return make_mesh(PACKED_MESH, devices=jax.devices())


@pytest.mark.parametrize("name", PACKED_OBJECTIVES)
def test_shared_prefix_batch_same_loss_and_gradients_as_padded(mesh, name):
    exp = make_exp(
        "train.batch_size=16",
        "train.microbatches=2",
        "train.packing=True",
        "train.share_prefix=True",
        f"train.buckets={BUCKETS}",
        *PACKED_OBJECTIVES[name],
    )
    state = build_state(exp, mesh)
    step, _ = build_steps(exp, state, mesh)
    trajs = graded(_trajectories(16, seed=11))
    padded = pad_batch(trajs, BUCKETS)
    shared, _ = pack_batch(trajs, BUCKETS, row_multiple=2 * step.data_parallel_size, share_prefix=True)
    # 8 rows (2 microbatches x 4 data shards): T = 48, where a few rows hold two trajectories, one a borrower
    borrowers = {(r, shared.segment_ids[r, t]) for r, t in zip(*np.nonzero(shared.prefix_segment_ids), strict=True)}
    assert len(borrowers) >= 3 and shared.attention_mask.sum() <= padded.attention_mask.sum() - 3 * PROMPT
    assert_same_loss_and_gradients(step, state, padded, shared)


def test_shared_prefix_log_probs_equal_the_whole_trajectories(mesh):
    """Each scored token's log-prob in the shared rows equals the one of its trajectory alone in a padded row; the
    control, the same rows without the prefix they continue, differs at the borrowers' tokens."""
    exp = make_exp("train.batch_size=16", "train.packing=True", "train.share_prefix=True", f"train.buckets={BUCKETS}")
    state = build_state(exp, mesh)
    step, _ = build_steps(exp, state, mesh)
    trajs = _trajectories(16, seed=12)
    padded = pad_batch(trajs, BUCKETS)
    shared, slots = pack_batch(trajs, (160,), row_multiple=step.data_parallel_size, share_prefix=True)
    blind = shared._replace(prefix_segment_ids=np.zeros_like(shared.prefix_segment_ids))
    want, got, without = (step.old_log_probs(state, b) for b in (padded, shared, blind))
    scored = padded.action_mask | padded.expert_mask
    borrowed_error = []
    for (r, s), j in np.ndenumerate(slots):
        if j < 0:
            continue
        where = np.flatnonzero(shared.segment_ids[r] == s + 1)
        held = scored[j, trajs[j].length - len(where) : trajs[j].length]
        reference = want[j, : trajs[j].length][-len(where) :][held]
        np.testing.assert_allclose(got[r, where][held], reference, rtol=1e-5, atol=1e-5)
        if shared.prefix_segment_ids[r, where[0]]:
            borrowed_error.append(np.abs(without[r, where][held] - reference).max())
    assert len(borrowed_error) >= 8 and min(borrowed_error) > 1e-3


def _run(tmp_path, mesh, tag, *overrides):
    return offline_learner_run(tmp_path, mesh, tag, _trajectories(16, seed=5), f"train.buckets={BUCKETS}", *overrides)


def test_learner_shared_prefix_update_equals_padded(tmp_path, mesh):
    (padded,), init, after = _run(tmp_path, mesh, "padded", "train.steps=1")
    (shared,), _, shared_after = _run(
        tmp_path, mesh, "shared", "train.steps=1", "train.packing=True", "train.share_prefix=True"
    )
    assert shared["real_tokens"] <= padded["real_tokens"] - 3 * PROMPT  # 8 rows: a few borrowers
    # what the rows do not hold is what the trajectories read from a shared prefix
    assert shared["real_tokens"] + shared["shared_prefix_tokens"] == padded["real_tokens"]
    assert "shared_prefix_tokens" not in padded
    for key in ("loss", "rl_loss", "grad_norm", "reward_mean", "advantage_std", "admitted_fraction", "action_tokens"):
        assert math.isclose(shared[key], padded[key], rel_tol=1e-5, abs_tol=1e-7), key
    delta = jax.tree.map(np.subtract, after, init)
    assert max_rel_diff(jax.tree.map(np.subtract, shared_after, init), delta) < 1e-3


def test_share_prefix_needs_packing():
    with pytest.raises(ValueError, match=r"train.share_prefix.*needs train.packing=True"):
        make_exp("train.share_prefix=True")
