"""Trajectory record: validation messages, lossless JSONL round trip, chunk ids, padding into a TrajectoryBatch."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from ipa_jax.trajectory import Trajectory, TrajectoryBatch, build_chunk_ids, pad_batch, read_jsonl, write_jsonl


def make(uid="t0", length=12, seed=0, routed=False, task_id=None, **overrides) -> Trajectory:
    """Prompt of 3 tokens, then two action turns separated by a 2-token observation."""
    rng = np.random.default_rng(seed)
    action = np.zeros(length, bool)
    action[3:6] = True
    action[8:length] = True
    ends = [5]
    behavior = np.where(action, -rng.exponential(1.0, length), 0).astype(np.float32)
    fields = dict(
        uid=uid,
        tokens=rng.integers(0, 100, length),
        action_mask=action,
        behavior_logprobs=behavior,
        chunk_ids=build_chunk_ids(action, ends),
        expert_mask=np.zeros(length, bool),
        reward=1.0,
        policy_version=3,
        info={"task_id": task_id} if task_id else {},
        routed_experts=rng.integers(0, 8, (length, 2, 2)) if routed else None,
    )
    fields.update(overrides)
    return Trajectory(**fields)


def test_constructor_canonicalises_dtypes_and_valid_record_passes():
    t = make(action_mask=np.array([0, 0, 0, 1, 1, 1, 0, 0, 1, 1, 1, 1]))
    assert t.tokens.dtype == np.int32 and t.action_mask.dtype == np.bool_ and t.chunk_ids.dtype == np.int32
    assert t.behavior_logprobs.dtype == np.float32
    t.validate(vocab_size=100)
    assert t.num_chunks == 2 and t.length == 12


@pytest.mark.parametrize(
    "field,value,message",
    [
        ("uid", "", "field 'uid'"),
        ("tokens", np.arange(12) + 0.5, "field 'tokens': must be integer"),
        ("tokens", np.full(12, -1), "field 'tokens': negative token id"),
        ("tokens", np.arange(1), "field 'tokens': must be 1-D with at least 2 tokens"),
        ("action_mask", np.zeros(11, bool), "field 'action_mask': shape"),
        ("action_mask", np.array([1.5] * 12), "field 'action_mask': dtype float64"),
        ("action_mask", np.zeros(12, bool), "field 'action_mask': no action token \\(and no expert token\\)"),
        ("expert_mask", np.eye(12, dtype=bool)[0], "field 'expert_mask': position 0"),
        ("expert_mask", np.eye(12, dtype=bool)[4], "field 'expert_mask': overlaps action_mask at position 4"),
        ("chunk_ids", np.where(np.arange(12) >= 3, 0, -1), "field 'chunk_ids': must be -1 outside action tokens"),
        ("chunk_ids", np.array([-1, -1, -1, 1, 1, 1, -1, -1, 2, 2, 2, 2]), "field 'chunk_ids': the first action"),
        ("chunk_ids", np.array([-1, -1, -1, 0, 0, 0, -1, -1, 2, 2, 2, 2]), "field 'chunk_ids': must be 0..K-1"),
        ("chunk_ids", np.array([-1, -1, -1, 0, 1, 0, -1, -1, 1, 1, 1, 1]), "field 'chunk_ids': must be 0..K-1"),
        ("reward", float("nan"), "field 'reward': must be a number that is finite in float32"),
        ("reward", float("inf"), "field 'reward'"),
        ("policy_version", -1, "field 'policy_version'"),
        ("policy_version", 1.5, "field 'policy_version'"),
        ("chunk_versions", np.array([1, 2, 3]), "field 'chunk_versions': must be int32\\[2\\]"),
        ("routed_experts", np.zeros((11, 2, 2), np.int32), "field 'routed_experts': must be int32\\[T=12, L, k\\]"),
        ("info", ["not", "a", "dict"], "field 'info'"),
    ],
)
def test_validate_names_field_and_uid(field, value, message):
    t = make(uid="traj-7")
    t = dataclasses.replace(t, **{field: value})
    with pytest.raises(ValueError, match=message) as err:
        t.validate()
    assert "traj-7" in str(err.value) or field == "uid"


def test_validate_action_specific_cases():
    t = make(uid="u1")
    t.action_mask[0] = True
    t.chunk_ids[0] = 0
    with pytest.raises(ValueError, match="u1.*'action_mask': position 0 has no predictor"):
        t.validate()
    for bad in (np.nan, np.inf, 0.5):
        t = make(uid="u2")
        t.behavior_logprobs[4] = bad
        with pytest.raises(ValueError, match="u2.*'behavior_logprobs': action log-prob .* at position 4"):
            t.validate()
    t = make(uid="u3")
    t.behavior_logprobs[1] = -0.1
    with pytest.raises(ValueError, match="u3.*'behavior_logprobs': must be 0 outside action tokens"):
        t.validate()
    with pytest.raises(ValueError, match="u4.*'tokens': token id .* outside the vocabulary of size 5"):
        make(uid="u4").validate(vocab_size=5)


def test_bounds_make_every_valid_trajectory_trainable():
    """What validates must pad and train: versions within int32 (and not ahead of the learner when it says where
    it is), rewards finite in float32 (and within train.reward_range when given)."""
    for version in (2**31, 2**40, True):
        with pytest.raises(ValueError, match=r"'policy_version': must be an integer in \[0, 2\*\*31 - 1\]"):
            make(policy_version=version).validate()
    with pytest.raises(ValueError, match="'policy_version': 5 is ahead of the learner's version 4"):
        make(policy_version=5).validate(max_version=4)
    with pytest.raises(ValueError, match="'chunk_versions': 6 is ahead of the learner's version 4"):
        make(policy_version=3, chunk_versions=np.array([3, 6])).validate(max_version=4)
    with pytest.raises(ValueError, match="'reward': must be a number that is finite in float32, got 1e\\+300"):
        make(reward=1e300).validate()
    with pytest.raises(ValueError, match=r"'reward': 2.0 is outside the accepted range \[-1.0, 1.0\]"):
        make(reward=2.0).validate(reward_range=(-1.0, 1.0))
    edge = make(policy_version=2**31 - 1, reward=-3e38)
    edge.validate(max_version=2**31 - 1)
    batch = pad_batch([edge])
    assert batch.policy_versions[0] == 2**31 - 1 and np.isfinite(batch.rewards).all()


def test_jsonl_round_trip_is_lossless(tmp_path):
    rng = np.random.default_rng(1)
    trajs = [make(uid=f"t{i}", seed=i, routed=(i == 1), task_id=f"task{i % 2}") for i in range(3)]
    # Awkward float32 values: tiny, subnormal, many digits, -0.0 is not allowed on actions but +-values are.
    trajs[0].behavior_logprobs[3:6] = np.array([-1e-45, -np.float32(1) / 3, -3.4e38], np.float32)
    trajs[0].behavior_logprobs[8:] = -rng.random(4).astype(np.float32) * 1e-7
    trajs[1].chunk_versions = np.array([4, 5], np.int32)
    trajs[2].info.update({"env": "calc", "nested": {"a": [1, 2.5, None]}, "count": np.int64(3)})
    trajs[2].reward = 0.1 + 0.2  # a float64 reward that is not short in decimal
    path = tmp_path / "t.jsonl"
    write_jsonl(path, trajs)
    back = read_jsonl(path)
    assert len(back) == 3 and len(path.read_text().splitlines()) == 3
    for a, b in zip(trajs, back):
        b.validate()
        assert a.uid == b.uid and a.reward == b.reward and a.policy_version == b.policy_version
        for name in ("tokens", "action_mask", "chunk_ids", "expert_mask"):
            np.testing.assert_array_equal(getattr(a, name), getattr(b, name))
            assert getattr(b, name).dtype == getattr(a, name).dtype
        # Bit-exact float32.
        np.testing.assert_array_equal(a.behavior_logprobs.view(np.uint32), b.behavior_logprobs.view(np.uint32))
        assert (a.routed_experts is None) == (b.routed_experts is None)
        assert (a.chunk_versions is None) == (b.chunk_versions is None)
    np.testing.assert_array_equal(back[1].routed_experts, trajs[1].routed_experts)
    assert back[1].routed_experts.dtype == np.int32 and back[1].routed_experts.shape == (12, 2, 2)
    np.testing.assert_array_equal(back[1].chunk_versions, [4, 5])
    assert back[2].info == {"task_id": "task0", "env": "calc", "nested": {"a": [1, 2.5, None]}, "count": 3}


def test_float32_round_trip_is_bit_exact_for_every_finite_value():
    bits = np.random.default_rng(2).integers(0, 2**32, 20000, dtype=np.uint64).astype(np.uint32)
    values = bits.view(np.float32)
    values = np.concatenate([values[np.isfinite(values)], np.float32([-0.0, 0.0, 1e-45, -3.4028235e38])])
    t = make(length=len(values), behavior_logprobs=values)  # not a valid record: the round trip is raw
    back = Trajectory.from_json(t.to_json())
    np.testing.assert_array_equal(back.behavior_logprobs.view(np.uint32), values.view(np.uint32))


def test_from_json_never_truncates_a_float_token_id():
    record = json.loads(make().to_json())
    record["tokens"][1] = 1.5
    with pytest.raises(ValueError, match="'tokens': must be integer"):
        Trajectory.from_json(json.dumps(record)).validate()


def test_read_jsonl_reports_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(make().to_json() + "\n\n{not json\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:3: trajectory JSON does not parse"):
        read_jsonl(path)
    path.write_text('{"uid": "x", "tokens": [1, 2]}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:1: trajectory 'x': missing field"):
        read_jsonl(path)


def test_build_chunk_ids():
    a = np.array([0, 1, 1, 0, 0, 1, 1, 1, 0, 1], bool)
    np.testing.assert_array_equal(build_chunk_ids(a, [2, 7]), [-1, 0, 0, -1, -1, 1, 1, 1, -1, 2])
    np.testing.assert_array_equal(build_chunk_ids(a, [2, 7, 9]), [-1, 0, 0, -1, -1, 1, 1, 1, -1, 2])
    np.testing.assert_array_equal(build_chunk_ids(a, []), np.where(a, 0, -1))
    np.testing.assert_array_equal(build_chunk_ids(a, [1, 2]), [-1, 0, 1, -1, -1, 2, 2, 2, -1, 2])
    with pytest.raises(ValueError, match="position 3 is not an action token"):
        build_chunk_ids(a, [3])
    with pytest.raises(ValueError, match="strictly increasing"):
        build_chunk_ids(a, [7, 2])
    with pytest.raises(ValueError, match="outside"):
        build_chunk_ids(a, [10])


def test_pure_imitation_row_validates_round_trips_and_pads(tmp_path):
    """A scripted expert's episode: expert tokens only, no action, no chunk."""
    n = 12
    expert = np.isin(np.arange(n), [3, 4, 5, 8, 9, 10, 11])
    t = make(
        uid="expert",
        action_mask=np.zeros(n, bool),
        behavior_logprobs=np.zeros(n, np.float32),
        chunk_ids=np.full(n, -1),
        expert_mask=expert,
        chunk_versions=np.zeros(0, np.int32),
    )
    t.validate()
    assert t.num_chunks == 0
    write_jsonl(tmp_path / "e.jsonl", [t])
    (back,) = read_jsonl(tmp_path / "e.jsonl")
    np.testing.assert_array_equal(back.expert_mask, expert)
    batch = pad_batch([t, make(uid="rl")])
    assert not batch.action_mask[0].any() and batch.expert_mask[0, :n].tolist() == expert.tolist()
    with pytest.raises(ValueError, match="chunk_ids': must be -1 outside action tokens"):
        make(action_mask=np.zeros(n, bool), behavior_logprobs=np.zeros(n, np.float32), expert_mask=expert).validate()


def test_pad_batch_layout():
    trajs = [
        make(uid="a", length=12, task_id="x"),
        make(uid="b", length=70, seed=1, task_id="y"),
        make(uid="c", length=20, seed=2, task_id="x"),
        make(uid="d", length=9, seed=3),
    ]
    batch = pad_batch(trajs)
    assert isinstance(batch, TrajectoryBatch)
    assert batch.tokens.shape == (4, 128) and batch.tokens.dtype == np.int32
    np.testing.assert_array_equal(batch.group_ids, [0, 1, 0, 2])
    np.testing.assert_array_equal(batch.rewards, [1, 1, 1, 1])
    np.testing.assert_array_equal(batch.policy_versions, [3, 3, 3, 3])
    np.testing.assert_array_equal(batch.positions[0], np.arange(128))
    for i, t in enumerate(trajs):
        n = t.length
        np.testing.assert_array_equal(batch.tokens[i, :n], t.tokens)
        np.testing.assert_array_equal(batch.attention_mask[i], np.arange(128) < n)
        np.testing.assert_array_equal(batch.chunk_ids[i, :n], t.chunk_ids)
        assert (batch.tokens[i, n:] == 0).all() and (batch.chunk_ids[i, n:] == -1).all()
        assert not batch.action_mask[i, n:].any() and not batch.expert_mask[i, n:].any()
        assert (batch.behavior_logprobs[i, n:] == 0).all()
    assert batch.routed_experts is None
    assert pad_batch(trajs[:1], buckets=(8, 16), pad_id=7).tokens.shape == (1, 16)
    assert (pad_batch(trajs[:1], buckets=(8, 16), pad_id=7).tokens[0, 12:] == 7).all()


def test_pad_batch_routed_experts_and_errors():
    routed = [make(uid="a", routed=True), make(uid="b", length=15, seed=1, routed=True)]
    batch = pad_batch(routed, buckets=(16,))
    assert batch.routed_experts.shape == (2, 16, 2, 2) and batch.routed_experts.dtype == np.int32
    np.testing.assert_array_equal(batch.routed_experts[0, :12], routed[0].routed_experts)
    assert (batch.routed_experts[0, 12:] == 0).all()
    with pytest.raises(ValueError, match="'c'.*routed_experts.*missing"):
        pad_batch(routed + [make(uid="c")], buckets=(16,))
    other = make(uid="e", routed_experts=np.zeros((12, 3, 2), np.int32))
    with pytest.raises(ValueError, match="'e'.*routed_experts"):
        pad_batch(routed + [other], buckets=(16,))
    with pytest.raises(ValueError, match="'b'.*'tokens': length 15 exceeds the largest bucket 8"):
        pad_batch(routed, buckets=(8,))
    with pytest.raises(ValueError, match="at least one trajectory"):
        pad_batch([])
    bad = make(uid="z", reward=float("nan"))
    with pytest.raises(ValueError, match="'z'.*'reward'"):
        pad_batch([bad])


def test_trajectory_module_imports_numpy_and_stdlib_only():
    import ast
    import sys

    import ipa_jax.trajectory as module

    tree = ast.parse(open(module.__file__, encoding="utf-8").read())
    roots = {
        alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names
    }
    roots |= {node.module.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert roots - sys.stdlib_module_names - {"__future__"} == {"numpy"}


def test_chunk_advantages_validate_round_trip_and_fill_padded_and_packed_rows(tmp_path):
    from ipa_jax.trajectory import pack_batch

    branched = make("b", length=12, chunk_advantages=[0.5, -0.25])
    plain = make("p", length=10, seed=1)
    branched.validate()
    path = tmp_path / "t.jsonl"
    write_jsonl(path, [branched, plain])
    back = read_jsonl(path)
    np.testing.assert_array_equal(back[0].chunk_advantages, np.asarray([0.5, -0.25], np.float32))
    assert back[1].chunk_advantages is None
    # per token: the advantage of the token's chunk, on the branched trajectory's action tokens only
    expected = np.where(branched.action_mask, np.where(branched.chunk_ids == 0, 0.5, -0.25), 0)
    padded = pad_batch([branched, plain], buckets=(16,))
    np.testing.assert_array_equal(padded.branch_advantages[0, :12], expected)
    np.testing.assert_array_equal(padded.branch_mask[0, :12], branched.action_mask)
    assert not padded.branch_mask[1].any() and not padded.branch_advantages[1].any()
    assert not padded.branch_mask[0, 12:].any()
    packed, slots = pack_batch([branched, plain], buckets=(32,))
    row = packed.segment_ids[0]
    first = slots[0].tolist().index(0) + 1  # the segment holding the branched trajectory
    np.testing.assert_array_equal(packed.branch_advantages[0][row == first], expected)
    assert not packed.branch_mask[0][row != first].any()
    assert pad_batch([plain]).branch_advantages is None  # no branched trajectory: no fields
    for value, message in (([0.5], r"float32\[2\]"), ([0.5, np.inf], "finite"), ([[0.5, 1.0]], r"float32\[2\]")):
        with pytest.raises(ValueError, match=f"'chunk_advantages': must be .*{message}"):
            make(chunk_advantages=value).validate()
