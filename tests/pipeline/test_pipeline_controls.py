"""The control arms of the ablations (configs/ablations/control_*.py, credit_token_matched.py and their longhorizon_*
versions): they share their base's IL warm start, the imitation control's RL phase trains on fresh expert episodes,
the no-update control's learning rate moves no weight, and the matched token credit gives the first chunk the weight
chunk credit gives it on the episodes the base's successes look like."""

import dataclasses
import os

import jax.numpy as jnp
import numpy as np
import pytest
from tiny_pipeline import REPO, tiny_config
from transformers import AutoTokenizer

from ipa_jax.analysis.sweep import warm_start_key
from ipa_jax.chat import ChatFormat
from ipa_jax.objectives.credit import credit_returns
from ipa_jax.pipeline import RunFolder, load_config, validate
from ipa_jax.pipeline.build import build_mesh, build_state
from ipa_jax.pipeline.config import ConfigError
from ipa_jax.pipeline.online import ExpertSource, OnlineSource, expert_trajectory
from ipa_jax.pipeline.tokenizer import build_corpus_tokenizer
from ipa_jax.train.optimizer import apply_direction, make_optimizer

ABLATIONS = os.path.join(REPO, "configs", "ablations")
CONTROLS = ("control_il_continue", "control_no_update", "credit_token_matched")
# Each base's reference arm, and the arms that must start RL from its warm start.
ARMS = {
    "credit_chunk": CONTROLS + ("credit_token", "credit_trajectory", "agg_token_mean"),
    "longhorizon_credit_chunk": tuple(f"longhorizon_{name}" for name in CONTROLS + ("credit_token", "agg_token_mean")),
}


def _path(name: str) -> str:
    return os.path.join(ABLATIONS, f"{name}.py")


def _resolved(name: str):
    return validate(load_config(_path(name)))


@pytest.mark.parametrize("reference", sorted(ARMS))
def test_controls_share_the_warm_start_of_their_base(reference):
    key = warm_start_key(_path(reference))
    assert key is not None
    for arm in ARMS[reference]:
        assert warm_start_key(_path(arm)) == key, arm
    # The two bases are different tasks: their warm starts differ.
    assert warm_start_key(_path("credit_chunk")) != warm_start_key(_path("longhorizon_credit_chunk"))


@pytest.mark.parametrize("prefix", ["", "longhorizon_"])
def test_imitation_control_is_the_warm_start_continued(prefix):
    base, control = _resolved(f"{prefix}credit_chunk"), _resolved(f"{prefix}control_il_continue")
    assert (base.online_source, control.online_source) == ("queue", "expert")
    # pipeline.build's warm-start objective, the warm start's learning rate.
    assert control.objective == dataclasses.replace(base.objective, rl_weight=0.0, il_weight=1.0)
    assert control.optimizer.lr == base.optimizer.il_lr
    assert control.train.steps == base.train.steps  # as many updates


def test_expert_source_feeds_fresh_expert_episodes_after_the_warm_start(tmp_path, tokenizer_dir):
    exp = validate(
        tiny_config(
            tmp_path / "run",
            **{
                "model.tokenizer": tokenizer_dir,
                "train.steps": 2,
                "train.il_warmup_steps": 1,
                "objective.rl_weight": 0.0,
                "objective.il_weight": 1.0,
            },
        )
    )
    source = OnlineSource(exp, build_state(exp, build_mesh(exp.mesh)), RunFolder(str(tmp_path / "run")))
    try:
        warm = source.next_trajectories(4)
        source.local.step = 1  # == rl_start: the RL phase
        rl = source.next_trajectories(4)
        assert isinstance(source.local, ExpertSource)  # no rollouts at all
    finally:
        source.close()
    for traj in warm + rl:  # pure imitation rows of distinct training tasks
        assert traj.info["expert"] and traj.expert_mask.any() and not traj.action_mask.any() and traj.reward == 1.0
    assert len({t.info["task_id"] for t in warm + rl}) == 8


def test_expert_source_needs_an_imitation_term(tmp_path):
    with pytest.raises(ConfigError, match="objective.il_weight"):
        validate(tiny_config(tmp_path, **{"rollout.source": "expert"}))  # the ipa preset: il_weight 0
    # With the IL fallback the resampling source provides imitation targets: auto stays resample.
    exp = validate(
        tiny_config(tmp_path, **{"objective.rl_weight": 0.0, "objective.il_weight": 1.0, "resample.il_fallback": True})
    )
    assert exp.online_source == "resample"


@pytest.mark.parametrize("prefix", ["", "longhorizon_"])
def test_no_update_learning_rate_moves_no_float32_weight(prefix):
    base, control = _resolved(f"{prefix}credit_chunk"), _resolved(f"{prefix}control_no_update")
    assert dataclasses.replace(control.optimizer, lr=base.optimizer.lr) == base.optimizer
    rng = np.random.default_rng(0)
    params = {"w": jnp.asarray(rng.normal(0, 0.02, (64, 64)), jnp.float32), "norm": jnp.ones(64, jnp.float32)}
    tx = make_optimizer(control.optimizer)
    opt_state = tx.init(params)
    moved = frozen = params
    for _ in range(30):  # gradients from 1e-12 to 1e2, as from a vanishing or a spiking loss
        scale = 10.0 ** rng.uniform(-12, 2)
        grads = {k: jnp.asarray(rng.normal(0, scale, v.shape), jnp.float32) for k, v in params.items()}
        direction, opt_state = tx.update(grads, opt_state, frozen)
        frozen = apply_direction(frozen, direction, jnp.float32(control.optimizer.lr))
        moved = apply_direction(moved, direction, jnp.float32(base.optimizer.lr))
    for k in params:
        assert np.array_equal(np.asarray(frozen[k]), np.asarray(params[k])), k
        assert not np.array_equal(np.asarray(moved[k]), np.asarray(params[k])), k  # the RL rate does move them


def _success_chunk_lengths(exp, tokenizer) -> list[np.ndarray]:
    """Tokens per assistant turn of the expert episodes of 256 training tasks (a success's chunks: the policy writes
    the same turns), counted from the expert mask's runs."""
    chat = ChatFormat(tokenizer, enable_thinking=exp.rollout.enable_thinking)
    out = []
    for i, task in enumerate(exp.env.make().tasks("train", 256, seed=0)):
        mask = expert_trajectory(task, exp.env.make(), chat, uid=str(i)).expert_mask.astype(np.int8)
        edges = np.diff(np.concatenate([[0], mask, [0]]))
        out.append(np.flatnonzero(edges == -1) - np.flatnonzero(edges == 1))
    return out


@pytest.mark.parametrize("prefix", ["", "longhorizon_"])
def test_matched_token_credit_gives_the_first_chunk_the_chunk_credit_weight(prefix, tokenizer_dir):
    base, matched = _resolved(f"{prefix}credit_chunk"), _resolved(f"{prefix}credit_token_matched")
    if prefix:  # the long-horizon run's tokenizer: built on its environment too
        tokenizer = build_corpus_tokenizer(int(base.model.arch["vocab_size"]), base.env)
    else:
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    episodes = _success_chunk_lengths(base, tokenizer)
    # The typical success (medians): K chunks, n action tokens, m of them in chunk 0. Token credit depends on n and
    # m only, chunk credit on K only, so the row puts the other n - m tokens in chunks 1..K-1 in any split.
    k, n, m = (int(np.median(x)) for x in zip(*[(len(c), c.sum(), c[0]) for c in episodes]))
    rest = [len(part) for part in np.array_split(np.arange(n - m), k - 1)]
    chunk_ids = np.repeat(np.arange(k), [m, *rest])[None]  # action tokens only: credit ignores the context
    mask = np.ones_like(chunk_ids, bool)
    advantage = jnp.ones(1)
    token = credit_returns(advantage, jnp.asarray(mask), None, "token", matched.objective.gamma)
    chunk = credit_returns(advantage, jnp.asarray(mask), jnp.asarray(chunk_ids), "chunk", base.objective.gamma)
    first = chunk_ids[0] == 0
    assert float(chunk[0, 0]) == pytest.approx(base.objective.gamma ** (k - 1))
    assert float(jnp.mean(token[0][first])) == pytest.approx(float(chunk[0, 0]), abs=1e-3)
    # Credit_token.py's gamma gives that chunk a fraction of it: the mismatch this arm removes.
    unmatched = credit_returns(advantage, jnp.asarray(mask), None, "token", base.objective.gamma)
    assert float(jnp.mean(unmatched[0][first])) < 0.2 * float(chunk[0, 0])
