"""Manipulation checks and the imitation plateau: the mean credit weight per chunk position (what chunk vs token
credit changes) and the warm start that ends when its greedy match stops rising (train.il_warmup_patience)."""

import jax
import numpy as np
import pytest
from train_helpers import make_exp, synthetic_trajectories

from ipa_jax.models import MeshConfig, make_mesh
from ipa_jax.objectives.credit import credit_returns
from ipa_jax.pipeline import RunFolder
from ipa_jax.pipeline.build import build_learner
from ipa_jax.train import JsonlSource
from ipa_jax.train.learner import PLATEAU_MIN_GAIN, Plateau
from ipa_jax.train.metrics import CREDIT_POSITIONS, chunk_position_weights
from ipa_jax.trajectory import write_jsonl


def test_chunk_position_weights_by_hand():
    # Row 0: chunks 0, 1 (weights 1, 3 | 5); row 1 packed: sequence 1 chunks 0, 1 (2 | 4, 6), sequence 2 chunk 2 (8).
    returns = np.array([[0, 1, 3, 0, 5, 0, 0], [2, 0, 4, 6, 0, 8, 0]], np.float64)
    action = returns != 0
    chunk_ids = np.array([[-1, 0, 0, -1, 1, -1, -1], [0, -1, 1, 1, -1, 2, -1]])
    segments = np.array([[1, 1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 2, 2, 0]])
    got = chunk_position_weights(returns, action, chunk_ids, segments, 3)
    # position 0: row 0 chunk 0 (mean 2), row 1 seq 1 chunk 0 (2), row 1 seq 2 chunk 2 (8); position 1: 5 and 5.
    np.testing.assert_allclose(got[:2], [(2 + 2 + 8) / 3, (5 + 5) / 2])
    assert np.isnan(got[2])
    unpacked = chunk_position_weights(returns[:1], action[:1], chunk_ids[:1], None, 2)
    np.testing.assert_allclose(unpacked, [2.0, 5.0])


@pytest.mark.parametrize("credit", ["chunk", "token"])
def test_chunk_position_weights_of_credit_returns(credit):
    """Unit advantages: chunk credit weighs chunk k of K by gamma^(K-1-k); token credit by the mean over its tokens
    of gamma^(tokens after). Reference: float64 NumPy from those formulas."""
    trajs = synthetic_trajectories(6, seed=2)
    length = max(len(t.tokens) for t in trajs)
    action = np.zeros((6, length), bool)
    chunk_ids = np.full((6, length), -1)
    for i, t in enumerate(trajs):
        action[i, : len(t.tokens)], chunk_ids[i, : len(t.tokens)] = t.action_mask, t.chunk_ids
    gamma = 0.8
    returns = np.asarray(credit_returns(np.ones(6, np.float32), action, chunk_ids, credit, gamma))
    got = chunk_position_weights(returns, action, chunk_ids, None, CREDIT_POSITIONS)
    expected = [[] for _ in range(CREDIT_POSITIONS)]
    for i in range(6):
        ks = np.unique(chunk_ids[i][action[i]])
        n = action[i].sum()
        after = n - 1 - np.cumsum(action[i]) + 1  # action tokens after each token
        for k in ks[:CREDIT_POSITIONS]:
            tokens = action[i] & (chunk_ids[i] == k)
            per_token = gamma ** (len(ks) - 1 - k) if credit == "chunk" else np.mean(gamma ** after[tokens])
            expected[k].append(per_token)
    np.testing.assert_allclose(got, [np.mean(e) if e else np.nan for e in expected], rtol=1e-5)


def test_plateau_counts_steps_without_a_rise():
    gain = PLATEAU_MIN_GAIN
    plateau = Plateau(patience=3)
    # Rises, then three steps within the gain of the best: the third completes the plateau.
    means = [0.1, 0.3, 0.5, 0.5 + gain / 2, 0.5, 0.5 + gain / 3]
    assert [plateau.add(m) for m in means] == [False, False, False, False, False, True]
    # A slow creep adds up: 0.004 per step passes the gain on the third step and restarts the count.
    creep = Plateau(patience=3)
    assert [creep.add(0.5 + 0.004 * i) for i in range(6)] == [False] * 6
    assert not any(Plateau(patience=0).add(0.5) for _ in range(10))  # 0 = off
    # A match still at zero reaches no level: the count starts with the first mean of at least the gain.
    rising = Plateau(patience=3)
    assert [rising.add(m) for m in [0.0] * 8 + [gain / 2] * 3 + [2 * gain] * 4] == [False] * 14 + [True]


def test_warm_start_ends_at_its_plateau_and_rl_logs_credit_weights(tmp_path):
    data = tmp_path / "data.jsonl"
    trajs = synthetic_trajectories(8, seed=3, expert_every=1)
    write_jsonl(data, trajs)
    warm, rl_steps, window, patience = 60, 2, 2, 3
    exp = make_exp(
        f"train.data=('{data}',)",
        "train.batch_size=8",
        f"train.il_warmup_steps={warm}",
        f"train.steps={warm + rl_steps}",
        f"train.il_warmup_patience={patience}",
        f"train.il_warmup_window={window}",
        "optimizer.il_lr=1e-2",
        "optimizer.warmup_steps=2",
        "checkpoint.every=0",
        "logging.tensorboard=False",
    )
    mesh = make_mesh(MeshConfig(data=2, fsdp=1, expert=1, tensor=1), devices=jax.devices()[:2])
    run_dir = str(tmp_path / "run")
    learner = build_learner(exp, JsonlSource(exp.train.data), run_dir=run_dir, mesh=mesh)
    learner.run()
    start = learner.rl_start
    assert 0 < start < warm, start
    rows = [r for r in RunFolder(run_dir).read_metrics() if "loss" in r]
    match = [r["il_greedy_match"] for r in rows[:start]]
    # Independent replay of the rule on the logged matches: the first step whose window mean has not risen the
    # gain above the best window mean for `patience` steps.
    best, flat, ended = -np.inf, 0, None
    for step in range(window, len(match) + 1):
        mean = np.mean(match[step - window : step])
        if best == -np.inf and mean < PLATEAU_MIN_GAIN:
            continue  # no level reached yet
        flat = 0 if mean > best + PLATEAU_MIN_GAIN else flat + 1
        best = mean if flat == 0 else best
        if flat == patience:
            ended = step
            break
    assert ended == start
    # RL rows log the credit weight per chunk position: chunk credit, gamma^(K-1-k) averaged over the batch.
    gamma = exp.objective.gamma
    chunks = [len(np.unique(t.chunk_ids[t.action_mask])) for t in trajs]
    for row in rows[start:]:
        for k in range(CREDIT_POSITIONS):
            expected = np.mean([gamma ** (n - 1 - k) for n in chunks if n > k])
            assert row[f"credit_weight_chunk{k}"] == pytest.approx(expected, rel=1e-5)
    assert not any("credit_weight_chunk0" in r for r in rows[:start])
