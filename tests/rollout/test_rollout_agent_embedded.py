"""Real episodes: tiny random Qwen3-MoE in the EmbeddedEngine, the tiny tokenizer, the agent loop and a worker.

The random model's output layer is nudged towards <|im_end|>, <tool_call> and </tool_call> so that its
episodes have several turns (tool calls with error observations) instead of one endless turn.
"""

import asyncio
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from rollout_fakes import RecordingEngine, append_only_chat, check_token_invariants
from tiny_models import tiny_qwen3_config

from ipa_jax.engines import EmbeddedEngine
from ipa_jax.envs import make_env
from ipa_jax.models import init_model, token_logprobs
from ipa_jax.rollout import RolloutWorker, TrajectoryQueue
from ipa_jax.rollout.agent import AgentConfig, run_episodes
from ipa_jax.trajectory import pad_batch

MAX_LEN = 512


@pytest.fixture(scope="module")
def chat():
    return append_only_chat()


@pytest.fixture(scope="module")
def model(chat):
    model = init_model(tiny_qwen3_config(moe=True, vocab_size=len(chat.tokenizer), max_position_embeddings=1024))
    task = make_env("lookup").tasks("train", 1, 0)[0]
    prompt = jnp.asarray([chat.encode(chat.render(task.initial_messages(), task.tools, add_generation_prompt=True))])
    hidden, _ = model.hidden_states(prompt)
    direction = hidden[0].mean(0)
    direction = direction / jnp.sum(direction**2)
    w = model.lm_head[...]
    for token, logit_shift in ((chat.im_end_id, 4.0), (3, 3.0), (4, 3.0)):  # 3, 4: <tool_call>, </tool_call>
        w = w.at[:, token].add(logit_shift * direction)
    model.lm_head[...] = w
    return model


def make_engine(model):
    return EmbeddedEngine(model, seed=0, max_len=MAX_LEN, max_batch=8, batch_buckets=(8,))


def test_real_episodes_token_invariants_logprobs_and_routing(chat, model):
    tasks = make_env("lookup").tasks("train", 8, 0)
    engine = RecordingEngine(make_engine(model))
    cfg = AgentConfig(max_new_tokens=32, max_context=MAX_LEN, return_routed_experts=True, record_messages=True)
    trajs = asyncio.run(run_episodes(engine, chat, tasks, cfg, concurrency=8))
    assert max(t.num_chunks for t in trajs) >= 2  # multi-turn episodes happened
    assert sum(t.info["num_tool_calls"] for t in trajs) >= 2
    for task, traj in zip(tasks, trajs):
        check_token_invariants(chat, engine, traj, task)
        assert traj.info["finish_reason"] in ("answer", "length", "max_turns", "endoftext", "context")
    # The learner's full forward (one padded batch) gives the log-probs the sampler used at temperature 1,
    # aligned per token, and the experts the engine routed each token to (routing replay rows).
    batch = pad_batch(trajs, buckets=(MAX_LEN,))
    graphdef, state = nnx.split(model)
    learner = jax.jit(lambda st, x, m: token_logprobs(nnx.merge(graphdef, st), x, m))
    lp, _, aux = learner(state, jnp.asarray(batch.tokens), jnp.asarray(batch.attention_mask))
    lp, experts = np.asarray(lp), np.sort(np.asarray(aux["routed_experts"]), axis=-1)
    for i, traj in enumerate(trajs):
        n, act = len(traj.tokens), traj.action_mask
        np.testing.assert_allclose(lp[i, :n][act], traj.behavior_logprobs[act], atol=2e-4)
        rows = np.sort(traj.routed_experts, axis=-1)[:-1]
        assert rows.shape == experts[i, : n - 1].shape
        assert (rows == experts[i, : n - 1]).all(axis=(1, 2)).mean() > 0.99


def test_worker_with_embedded_engine(chat, model):
    tasks = make_env("calculator").tasks("train", 4, 0)
    q = TrajectoryQueue(capacity=32)
    worker = RolloutWorker(
        make_engine(model),
        chat,
        itertools.cycle(tasks),
        q,
        AgentConfig(max_new_tokens=16, max_context=MAX_LEN),
        concurrency=8,
        max_episodes=16,
    )
    worker.start().join(timeout=300)
    worker.check()
    trajs = q.drain()
    assert len(trajs) == 16 and worker.stats()["finished"] == 16
    for traj in trajs:
        traj.validate(vocab_size=len(chat.tokenizer))
    s = worker.stats()
    assert s["episodes_per_s"] > 0 and s["generated_tokens"] == sum(int(t.action_mask.sum()) for t in trajs)
