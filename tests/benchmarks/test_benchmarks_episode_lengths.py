"""experiments/benchmarks/episode_lengths.py: a run's episode lengths recorded and loaded, and the learner
benchmark's batches drawn from them (packed rows and padded rows holding exactly the drawn episodes)."""

import json

import numpy as np
import pytest
from benchmark_modules import load_benchmark_module

from ipa_jax.pipeline.run_folder import RunFolder
from ipa_jax.trajectory import Trajectory

episode_lengths = load_benchmark_module("episode_lengths")


def _episode(uid: str, n: int, actions: int, experts: int) -> Trajectory:
    """n tokens: actions action tokens, then experts imitation targets, from position 1 on."""
    action = np.zeros(n, bool)
    action[1 : 1 + actions] = True
    expert = np.zeros(n, bool)
    expert[1 + actions : 1 + actions + experts] = True
    return Trajectory(
        uid=uid,
        tokens=np.arange(n) % 7,
        action_mask=action,
        behavior_logprobs=np.where(action, -1.0, 0.0),
        chunk_ids=np.where(action, 0, -1),
        expert_mask=expert,
        reward=1.0,
        policy_version=0,
    )


@pytest.fixture
def run_dir(tmp_path):
    folder = RunFolder(tmp_path / "run")
    folder.write_config({"train": {"batch_size": 3, "buckets": [16, 32]}})
    episodes = [_episode("e0", 12, 0, 5), _episode("r0", 9, 4, 0), _episode("e1", 20, 0, 7), _episode("r1", 30, 11, 0)]
    folder.append_trajectories("train", episodes[:2])
    folder.append_trajectories("train", episodes[2:])
    return folder.path


@pytest.mark.parametrize(
    "kind, lengths, scored",
    [("rollout", [9, 30], [4, 11]), ("expert", [12, 20], [5, 7]), ("all", [12, 9, 20, 30], [5, 4, 7, 11])],
)
def test_recorded_lengths_round_trip_through_json(run_dir, tmp_path, kind, lengths, scored):
    record = episode_lengths.record_lengths(run_dir, kind)
    assert record == {
        "run": "run",
        "kind": kind,
        "batch_size": 3,
        "buckets": [16, 32],
        "lengths": lengths,
        "scored_tokens": scored,
        "common_prefix": min(lengths) - 1,  # the episodes' tokens are all 0, 1, 2, ... (mod 7)
    }
    path = tmp_path / "lengths.json"
    path.write_text(json.dumps(record))
    assert episode_lengths.load_lengths(str(path)) == record


def test_recording_a_run_without_such_episodes_or_with_a_bad_kind_is_an_error(tmp_path):
    folder = RunFolder(tmp_path / "run")
    folder.write_config({"train": {"batch_size": 1, "buckets": [16]}})
    folder.append_trajectories("train", [_episode("e0", 12, 0, 5)])
    with pytest.raises(ValueError, match="no rollout trajectories"):
        episode_lengths.record_lengths(folder.path, "rollout")
    with pytest.raises(ValueError, match="kind: must be one of"):
        episode_lengths.record_lengths(folder.path, "rollouts")


@pytest.mark.parametrize(
    "change, message",
    [
        ({"lengths": None}, "missing \\['lengths'\\]"),
        ({"lengths": [9, 1]}, "integers >= 2"),
        ({"lengths": [9, 40]}, "exceeds the largest bucket"),
        ({"scored_tokens": [4]}, "1 to length - 1"),
        ({"scored_tokens": [4, 30]}, "1 to length - 1"),
        ({"batch_size": 0}, "'batch_size' must be a positive integer"),
        ({"common_prefix": 9}, "'common_prefix' must be an integer in \\[0, 9\\)"),
        ({"common_prefix": -1}, "'common_prefix' must be"),
    ],
)
def test_a_bad_lengths_file_is_a_clear_error(tmp_path, change, message):
    record = {"batch_size": 2, "buckets": [16, 32], "lengths": [9, 30], "scored_tokens": [4, 11], **change}
    path = tmp_path / "lengths.json"
    path.write_text(json.dumps({k: v for k, v in record.items() if v is not None}))
    with pytest.raises(ValueError, match=message):
        episode_lengths.load_lengths(str(path))


def _segments(row_segments: np.ndarray) -> list[tuple[int, int]]:
    """(start, length) of each segment id > 0 of one packed row, in order."""
    ids = [int(s) for s in np.unique(row_segments) if s > 0]
    return [(int(np.argmax(row_segments == s)), int(np.sum(row_segments == s))) for s in ids]


def test_benchmark_batches_hold_exactly_the_drawn_episodes():
    record = {
        "batch_size": 6,
        "buckets": [32, 64],
        "lengths": [5, 12, 20, 33, 40, 64],
        "scored_tokens": [1, 3, 19, 8, 39, 40],
    }
    scored_of = dict(zip(record["lengths"], record["scored_tokens"]))
    batches = episode_lengths.length_batches(record, 3, vocab=50, rng=np.random.default_rng(0))
    assert len(batches) == 3
    for lengths, padded, packed, _ in batches:
        assert len(lengths) == 6 and set(lengths) <= set(record["lengths"])
        # padded: one episode per row, in draw order, to the batch's longest
        assert padded.tokens.shape == (6, max(lengths))
        np.testing.assert_array_equal(padded.attention_mask.sum(1), lengths)
        np.testing.assert_array_equal(padded.action_mask.sum(1), [scored_of[n] for n in lengths])
        # packed: rows of a bucket that fits (pack_batch's choice), segments holding exactly the drawn lengths
        assert packed.tokens.shape[1] in (32, 64) and packed.tokens.shape[1] >= max(lengths)
        found, packed_tokens = [], []
        for r in range(packed.tokens.shape[0]):
            segments = _segments(packed.segment_ids[r])
            assert sum(n for _, n in segments) == packed.attention_mask[r].sum()
            for start, n in segments:
                found.append(n)
                span = slice(start, start + n)
                packed_tokens.append(tuple(packed.tokens[r, span]))
                assert packed.action_mask[r, span].sum() == scored_of[n]
                np.testing.assert_array_equal(packed.positions[r, span], np.arange(n))
        assert sorted(found) == sorted(lengths)
        # the same episodes: each packed segment's tokens are one padded row's
        assert sorted(packed_tokens) == sorted(tuple(row[:n]) for row, n in zip(padded.tokens, lengths))


def test_synthetic_episodes_have_exactly_the_scored_tokens_asked_for():
    rng = np.random.default_rng(1)
    lengths, scored = [2, 3, 40, 40, 100, 300], [1, 2, 1, 39, 70, 45]
    for tr, n, a in zip(episode_lengths.synthetic_trajectories(lengths, 30, rng, scored), lengths, scored):
        tr.validate(vocab_size=30)
        assert tr.length == n and tr.action_mask.sum() == a
        assert tr.action_mask[-1]  # the last turn ends the episode
        assert tr.num_chunks == -(-a // 32)


def test_benchmark_batches_share_the_common_prefix():
    """With a common prefix every drawn episode begins with it and differs right after; the shared batch holds it
    once per row (each row's first episode whole, the others from their own tokens on)."""
    record = {"batch_size": 8, "buckets": [64, 128], "lengths": [40, 44, 48], "scored_tokens": [10, 12, 9]}
    record["common_prefix"] = 20
    for lengths, padded, packed, shared in episode_lengths.length_batches(record, 2, 50, np.random.default_rng(3)):
        tokens = padded.tokens
        assert (tokens[:, :20] == tokens[0, :20]).all() and len(set(tokens[:, 20])) > 1
        assert shared.prefix_segment_ids is not None and packed.prefix_segment_ids is None
        rows = [r for r in range(shared.tokens.shape[0]) if shared.attention_mask[r].any()]
        segments = sum(len(_segments(shared.segment_ids[r])) for r in rows)
        assert segments == 8 and shared.attention_mask.sum() == lengths.sum() - 20 * (8 - len(rows))
        assert shared.tokens.size < packed.tokens.size
