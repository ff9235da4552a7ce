"""Chunk-level initialized resampling: expert loading, anchored rollouts, fork estimation, rollback, parallel
initialization and the IL fallback, with scripted engines and a stateful toy environment."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random
from typing import Any
from unittest import mock

import numpy as np
import pytest
from rollout_fakes import ScriptedEngine, append_only_chat, expert_script, expert_turn_texts

from ipa_jax.envs import Env, Task, ToolCall, ToolError, make_env, register_env, registry
from ipa_jax.rollout.agent import AgentConfig, run_episode
from ipa_jax.rollout.resample import (
    Planned,
    ResampleConfig,
    Resampler,
    ResampleSource,
    build_experts,
    estimate_forks,
    expert_from_messages,
    load_experts,
    probe_forks,
    replay_expert,
    resample_round,
    run_anchored,
)
from ipa_jax.trajectory import pad_batch, write_jsonl

K = 4  # tool-call chunks of every StackEnv task


class StackEnv(Env):
    """A stateful toy task: push the given numbers one call at a time, then answer their sum. Each
    observation shows the whole stack, so replaying the expert's calls must rebuild the same state."""

    name = "resample_stack"

    def __init__(self) -> None:
        super().__init__()
        self.stack: list[int] = []

    @property
    def tools(self) -> list[dict[str, Any]]:
        return [
            {
                "type": "function",
                "function": {
                    "name": "push",
                    "description": "Push a number.",
                    "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]},
                },
            }
        ]

    def reset(self, task: Task) -> str:
        self.stack = []
        return super().reset(task)

    def _sample(self, rng: random.Random):
        values = [rng.randrange(10, 99) for _ in range(K)]
        return f"Push {values} one at a time, then answer their sum.", str(sum(values)), {"values": values}

    def _execute(self, call: ToolCall) -> str:
        if len(self.stack) >= len(self.task.data["values"]):
            raise ToolError("stack is full")
        self.stack.append(int(call.arguments["x"]))
        return json.dumps({"stack": self.stack})

    def expert_action(self, task: Task, observations: list[str]) -> ToolCall | str:
        values = task.data["values"]
        if len(observations) < len(values):
            return ToolCall("push", {"x": values[len(observations)]})
        return str(sum(values))

    def max_turns_for(self, data: dict[str, Any]) -> int:
        return len(data["values"]) + 1


@pytest.fixture(scope="module", autouse=True)
def stack_env_registered():
    # Registered only while this module's tests run: other tests iterate over list_envs().
    with mock.patch.dict(registry._REGISTRY):
        register_env(StackEnv.name, StackEnv)
        yield


def run(coro):
    return asyncio.run(coro)


@pytest.fixture(scope="module")
def chat():
    return append_only_chat()


@pytest.fixture(scope="module")
def tasks():
    return make_env(StackEnv.name).tasks("train", 3, 0)


@pytest.fixture(scope="module")
def experts(tasks):
    return [expert_from_messages(make_env(t.env).expert(t), t) for t in tasks]


def failure_script(chat, tasks, p_fail, seed: int = 0):
    """Plays the expert except that at expert chunk k (the answer is chunk K) it answers "wrong" (reward 0) with
    probability p_fail(k), read when the turn is played (so a test can change it between rounds)."""
    rng = random.Random(seed)
    texts = {t.prompt: expert_turn_texts(make_env(t.env), t) for t in tasks}

    def script(prompt, call_index):
        text = chat.decode(prompt)
        turns = next(v for k, v in texts.items() if f"user\n{k}<|im_end|>" in text)
        turn = text.count("<|im_start|>assistant\n") - 1
        if rng.random() < p_fail(turn):
            return "wrong"
        return turns[turn]

    return script


def forking_script(chat, tasks, fork_chunk: int, p_fail_fork: float, p_fail_other: float, seed: int = 0):
    """Fails with probability p_fail_fork at expert chunk `fork_chunk` and p_fail_other elsewhere: success after
    anchor j is prod_{k >= j} (1 - p_k), which jumps at anchor fork_chunk + 1."""
    return failure_script(chat, tasks, lambda k: p_fail_fork if k == fork_chunk else p_fail_other, seed)


# ---- config -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(mode="sometimes"), "mode"),
        (dict(anchors=(1.5,)), "anchors"),
        (dict(anchors=(-1,)), "anchors"),
        (dict(anchors=(True,)), "anchors"),
        (dict(mode="parallel", anchors=()), "anchors"),
        (dict(samples_per_anchor=0), "samples_per_anchor"),
        (dict(window=0), "window"),
        (dict(threshold=0.0), "threshold"),
        (dict(fork_jump=1.5), "fork_jump"),
        (dict(weighting="softmax"), "weighting"),
        (dict(select_top=-1), "select_top"),
        (dict(il_fallback=1), "il_fallback"),
        (dict(il_whole_episode=1), "il_whole_episode"),
        (dict(mode="fork", anchors=()), "anchors"),
        (dict(success_reward=float("nan")), "success_reward"),
        (dict(experts=""), "experts"),
        (dict(tasks_per_round=0), "tasks_per_round"),
        (dict(num_tasks=3), "num_tasks"),
        (dict(num_tasks=-1), "num_tasks"),
    ],
)
def test_config_errors_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"ResampleConfig.{field}"):
        ResampleConfig(**kwargs)


def test_config_from_dict():
    cfg = ResampleConfig.from_dict({"mode": "parallel", "anchors": [0, 0.5, 1.0], "il_fallback": True})
    assert cfg.anchors == (0, 0.5, 1.0) and cfg.il_fallback
    with pytest.raises(ValueError, match="unknown key.*anchor_list"):
        ResampleConfig.from_dict({"anchor_list": [1]})


# ---- experts ------------------------------------------------------------------------------------------------


def test_expert_chunks_and_replay(chat, tasks, experts):
    task, expert = tasks[0], experts[0]
    full = make_env(task.env).expert(task)
    assert expert.num_chunks == K and expert.messages == tuple(full[1:])
    assert [m["role"] for m in expert.prefill(2)] == ["assistant", "tool"] * 2 and expert.prefill(0) == []
    with pytest.raises(ValueError, match="anchor must be an int in"):
        expert.prefill(K + 1)
    replay = replay_expert(expert, chat)
    assert replay.reward == 1.0 and len(replay.prefix_lengths) == K + 1
    for j in range(K + 1):  # prefix j == the template's rendering of the conversation after chunk j
        want = chat.encode(chat.render(full[: 1 + 2 * j], task.tools, add_generation_prompt=True))
        assert replay.tokens[: replay.prefix_lengths[j]] == want
    for k, (a, b) in enumerate(replay.chunk_spans):
        assert chat.decode(replay.tokens[a:b]) == expert_turn_texts(make_env(task.env), task)[k] + "<|im_end|>"
    with pytest.raises(ValueError, match="tool responses follow"):
        expert_from_messages(full[:2] + full[3:], task)
    with pytest.raises(ValueError, match="initial messages"):
        expert_from_messages(full[1:], task)


def test_load_experts_both_formats(tmp_path, chat, tasks, experts):
    env = make_env(tasks[0].env)
    chat_path = tmp_path / "experts.jsonl"
    with open(chat_path, "w") as f:
        for t in tasks:
            f.write(json.dumps({"messages": env.expert(t), "tools": t.tools, "task": t.to_dict()}) + "\n")
    loaded = load_experts(chat_path, chat)
    assert [(e.messages, e.chunk_ends) for e in loaded] == [(e.messages, e.chunk_ends) for e in experts]
    # Trajectory JSONL of expert-played episodes (the task comes from the `tasks` mapping).
    engine = ScriptedEngine(chat, expert_script(chat, tasks))
    trajs = [run(run_episode(engine, chat, t)) for t in tasks]
    traj_path = tmp_path / "trajs.jsonl"
    write_jsonl(traj_path, trajs)
    loaded = load_experts(traj_path, chat, tasks={t.task_id: t for t in tasks})
    assert [(e.messages, e.chunk_ends) for e in loaded] == [(e.messages, e.chunk_ends) for e in experts]
    with pytest.raises(ValueError, match=r"trajs.jsonl:1: .*not among"):
        load_experts(traj_path, chat)
    anchored = run(run_anchored(engine, chat, experts[0], 2))
    write_jsonl(tmp_path / "anchored.jsonl", [anchored])
    with pytest.raises(ValueError, match="anchored.jsonl:1: .*itself an anchored rollout"):
        load_experts(tmp_path / "anchored.jsonl", chat, tasks={t.task_id: t for t in tasks})
    # A call whose JSON is spaced differently from the template's cannot be reproduced token for token.
    bad = trajs[0]
    ids = bad.tokens.tolist()
    k0 = np.flatnonzero(bad.chunk_ids == 0)
    chunk = chat.encode(chat.decode(ids[k0[0] : k0[-1] + 1]).replace('"x": ', '"x":  '))
    respaced = ids[: k0[0]] + chunk + ids[k0[-1] + 1 :]
    action = np.zeros(len(respaced), bool)
    action[k0[0] : k0[0] + len(chunk)] = True
    odd = dataclasses.replace(
        bad,
        tokens=np.asarray(respaced),
        action_mask=action,
        behavior_logprobs=np.where(action, -0.1, 0.0).astype(np.float32),
        chunk_ids=np.where(action, 0, -1),
        expert_mask=np.zeros(len(respaced), bool),
    )
    write_jsonl(tmp_path / "odd.jsonl", [odd])
    with pytest.raises(ValueError, match="does not re-render"):
        load_experts(tmp_path / "odd.jsonl", chat, tasks={t.task_id: t for t in tasks})
    # A tampered observation or a wrong answer is caught by the replay.
    msgs = env.expert(tasks[0])
    msgs[2] = {**msgs[2], "content": "tampered"}
    wrong = env.expert(tasks[0])
    wrong[-1] = {"role": "assistant", "content": "0"}
    for i, m in enumerate((msgs, wrong)):
        with open(tmp_path / f"bad{i}.jsonl", "w") as f:
            f.write(json.dumps({"messages": m, "task": tasks[0].to_dict()}) + "\n")
    with pytest.raises(ValueError, match="bad0.jsonl:1: .*replaying push"):
        load_experts(tmp_path / "bad0.jsonl", chat)
    with pytest.raises(ValueError, match="bad1.jsonl:1: .*does not solve"):
        load_experts(tmp_path / "bad1.jsonl", chat)


# ---- anchored rollouts --------------------------------------------------------------------------------------


@pytest.mark.parametrize("anchor", range(K + 1))
def test_anchored_episode_reproduces_prefix_state_and_masks(chat, tasks, experts, anchor):
    task, expert = tasks[1], experts[1]
    play = expert_script(chat, [task])
    seen_state = []

    def script(prompt, call_index):  # the environment as the policy's first turn finds it
        if call_index == 0:
            seen_state.append((list(env.stack), env.num_tool_calls, env.done))
        return play(prompt, call_index)

    env = make_env(task.env)
    engine = ScriptedEngine(chat, script)
    traj = run(run_anchored(engine, chat, expert, anchor, AgentConfig(), env=env, uid="a"))
    traj.validate(vocab_size=len(chat.tokenizer))
    full = make_env(task.env).expert(task)
    # Token for token: the prompt the engine saw is the template of the expert conversation after chunk j,
    # and the whole episode (the scripted policy plays the expert) is the template of the full conversation.
    prefix = chat.encode(chat.render(full[: 1 + 2 * anchor], task.tools, add_generation_prompt=True))
    assert engine.calls["a"][0][0] == prefix
    assert traj.tokens.tolist() == chat.encode(chat.render(full, task.tools))[:-1]
    assert traj.reward == 1.0
    # Environment state at the anchor: the first j values pushed, as a fresh env stepped through them.
    ref = make_env(task.env)
    ref.reset(task)
    for m in full[1 : 1 + 2 * anchor : 2]:
        ref.step(ToolCall("push", m["tool_calls"][0]["function"]["arguments"]))
    assert seen_state == [(ref.stack, anchor, False)] and ref.stack == task.data["values"][:anchor]
    # Masks: expert turns of chunks < j are expert targets, the rest of the prefix is context, the tail's
    # generated turns are actions with chunk ids from 0; nothing else is marked.
    replay = replay_expert(expert, chat)
    P = len(prefix)
    expert_ref = np.zeros(len(traj.tokens), bool)
    for a, b in replay.chunk_spans[:anchor]:
        expert_ref[a:b] = True
    np.testing.assert_array_equal(traj.expert_mask, expert_ref)
    assert not traj.action_mask[:P].any() and traj.action_mask[P] and traj.chunk_ids[P] == 0
    assert traj.chunk_ids[P - 1] == -1 and not traj.expert_mask[P - 1]  # the generation prompt: context
    for k, (a, b) in enumerate(replay.chunk_spans[anchor:]):  # tail chunks = the expert's later turns
        assert traj.action_mask[a:b].all() and (traj.chunk_ids[a:b] == k).all()
    answer = slice(replay.prefix_lengths[-1], len(traj.tokens))
    assert traj.action_mask[answer].all() and (traj.chunk_ids[answer] == K - anchor).all()
    assert traj.num_chunks == K + 1 - anchor and traj.action_mask.sum() + expert_ref.sum() == sum(
        b - a for a, b in replay.chunk_spans
    ) + (len(traj.tokens) - replay.prefix_lengths[-1])
    assert traj.info["resample"] == {
        "task_id": task.task_id,
        "anchor": anchor,
        "num_expert_chunks": K,
        "expert_uid": expert.uid,
        "il_target": False,
    }
    assert traj.info["task_id"] == (f"{task.task_id}@{anchor}" if anchor else task.task_id)
    assert traj.info["num_tool_calls"] == K - anchor


# ---- fork estimation ----------------------------------------------------------------------------------------


def test_estimate_forks_formula():
    est = estimate_forks("t", {0: (0, 4), 1: (1, 4), 2: (3, 4), 3: (4, 4), 4: (0, 0)}, fork_jump=0.5)
    assert est.anchors == (0, 1, 2, 3) and est.rates == (0.0, 0.25, 0.75, 1.0)
    assert est.jumps == (0.0, 0.25, 0.5, 0.25) and est.forks == (2,) and est.crucial_fork == 2
    assert est.spans == () and est.largest_jump() == (1, 2)
    # Jumps between anchors further apart are spans: the decisive chunk is one of those between them.
    est = estimate_forks("t", {0: (0, 2), 2: (2, 2), 5: (0, 2), 7: (2, 2)}, fork_jump=0.5)
    assert est.forks == () and est.spans == ((0, 2), (5, 7)) and est.crucial_fork is None
    assert est.largest_jump() == (0, 2) and est.largest_jump(after=1) == (5, 7)  # equal jumps: the earliest
    est = estimate_forks("t", {0: (0, 4), 1: (2, 4), 3: (4, 4), 4: (1, 4)}, fork_jump=0.5)
    assert est.forks == (1,) and est.spans == ((1, 3),) and est.crucial_fork == 1
    assert est.largest_jump() == (0, 1) and est.largest_jump(after=1) == (1, 3) and est.largest_jump(3) is None
    assert estimate_forks("t", {0: (1, 2), 1: (1, 2)}, 0.5).crucial_fork is None
    with pytest.raises(ValueError, match="anchor 1: successes 3"):
        estimate_forks("t", {1: (3, 2)}, 0.5)


@pytest.mark.parametrize("fork_chunk", [0, 2])
def test_probe_finds_planted_fork(chat, tasks, experts, fork_chunk):
    # Decisive chunk `fork_chunk`: success from anchor <= fork_chunk is <= 0.1; from anchor fork_chunk + 1
    # it is >= 0.97^3: the fork is anchor fork_chunk + 1.
    engine = ScriptedEngine(chat, forking_script(chat, tasks, fork_chunk, 0.9, 0.03, seed=fork_chunk))
    (est,) = run(probe_forks(engine, chat, experts[:1], samples=12, fork_jump=0.5))
    assert est.anchors == tuple(range(K + 1)) and est.samples == (12,) * (K + 1)
    assert est.forks == (fork_chunk + 1,) and est.crucial_fork == fork_chunk + 1
    assert est.task_id == tasks[0].task_id


def test_parallel_resampler_finds_fork_and_allocates(chat, tasks, experts):
    cfg = ResampleConfig(mode="parallel", anchors=tuple(range(K + 1)), samples_per_anchor=3, window=12, fork_jump=0.5)
    res = Resampler(cfg, experts[:1])
    engine = ScriptedEngine(chat, forking_script(chat, tasks, 1, 0.95, 0.03, seed=7))
    tid = tasks[0].task_id
    for _ in range(4):
        batch = run(resample_round(res, engine, chat, [tid], concurrency=4))
        assert len(batch) == 3 * (K + 1) and not any(t.expert_mask.any() for t in batch)
    assert res.fork_estimate(tid).crucial_fork == 2
    report = json.loads(json.dumps(res.fork_report()))
    (task_report,) = report["tasks"]
    assert task_report["task_id"] == tid and task_report["crucial_fork"] == 2
    assert task_report["samples"] == [12] * (K + 1)
    by_anchor = report["anchors"]
    assert [row["anchor"] for row in by_anchor] == list(range(K + 1))
    assert [row["success"] for row in by_anchor] == task_report["rates"]
    assert [row["crucial_forks"] for row in by_anchor] == [int(a == 2) for a in range(K + 1)]
    # Variance weighting moves the budget to anchors with mixed outcomes: all-fail (anchors 0, 1) and
    # all-success anchors get the least; the budget is kept.
    var = Resampler(dataclasses.replace(cfg, weighting="variance"), experts[:1])
    var.load_state_dict({**res.state_dict(), "mode": "parallel"})
    outcomes = {0: [0] * 12, 1: [0] * 12, 2: [1] * 6 + [0] * 6, 3: [1] * 12, 4: [1] * 11 + [0]}
    for a, seq in outcomes.items():
        for ok in seq:
            var.record(tid, a, float(ok))
    alloc = var.allocation(tid)
    p = {a: (sum(s) + 1) / (len(s) + 2) for a, s in outcomes.items()}
    w = {a: p[a] * (1 - p[a]) for a in p}
    assert sum(alloc.values()) == 3 * (K + 1) and max(alloc, key=alloc.get) == 2
    assert all(abs(alloc[a] - 15 * w[a] / sum(w.values())) < 1 for a in alloc)
    top = Resampler(dataclasses.replace(cfg, weighting="variance", select_top=2), experts[:1])
    top.load_state_dict(var.state_dict())
    assert sorted(top.allocation(tid)) == [2, 4] and sum(top.allocation(tid).values()) == 6
    frac = Resampler(ResampleConfig(mode="parallel", anchors=(0.0, 0.5, 0.6, 1.0, 9)), experts[:1])
    assert frac.parallel_anchors(tid) == [0, 2, 4]  # 0.5 * 4 = 2, 0.6 * 4 -> 2, 1.0 -> 4, 9 -> capped at 4


def test_parallel_anchors_attribute_a_jump_only_between_adjacent_anchors(chat, tasks, experts):
    """Anchors 0, 2, 4 and a policy that fails only at chunk 2: the jump from anchor 2 to 4 says one of chunks 2
    and 3 decides, not which: a span, no crucial fork (every anchor, as probed, puts the fork at 3)."""
    cfg = ResampleConfig(mode="parallel", anchors=(0.0, 0.5, 1.0), samples_per_anchor=2, window=2)
    res = Resampler(cfg, experts[:1])
    engine = ScriptedEngine(chat, forking_script(chat, tasks, 2, 1.0, 0.0))
    tid = tasks[0].task_id
    run(resample_round(res, engine, chat, [tid]))
    est = res.fork_estimate(tid)
    assert est.anchors == (0, 2, 4) and est.rates == (0.0, 0.0, 1.0)
    assert est.forks == () and est.spans == ((2, 4),) and est.crucial_fork is None
    assert json.loads(json.dumps(res.fork_report()))["tasks"][0]["spans"] == [[2, 4]]


def test_fork_mode_follows_the_fork_as_the_policy_improves(chat, tasks, experts):
    """Fork mode on a policy that fails at chunks 1 and 3, then learns chunk 3. Round by round: probes at
    parallel's anchors (0, 2, 4) find a span (2, 4); its midpoint 3 resolves the fork 4 (chunk 3 decides);
    samples go to anchor 3, just before it. Once chunk 3 is learned the estimate moves: the fork at 4 goes, a
    fork at 3 (stale rate at 2) sends samples to 2, whose success opens the span (0, 2), bisected at 1, which
    resolves the fork 2 (chunk 1). The IL fallback imitates the chunks at the jump only, on up to il_samples
    rollouts at its later anchor."""
    failing = {1, 3}
    engine = ScriptedEngine(chat, failure_script(chat, tasks, lambda k: float(k in failing)))
    cfg = ResampleConfig(mode="fork", anchors=(0.0, 0.5, 1.0), samples_per_anchor=2, window=2, il_fallback=True)
    res = Resampler(cfg, experts[:1])
    tid = tasks[0].task_id
    spans = replay_expert(experts[0], chat).chunk_spans

    def chunks_imitated(traj):  # the expert chunks whose tokens are all imitation targets, and nothing else is
        chunks = [k for k, (a, b) in enumerate(spans) if b <= len(traj.tokens) and traj.expert_mask[a:b].all()]
        assert traj.expert_mask.sum() == sum(spans[k][1] - spans[k][0] for k in chunks)
        return chunks

    def one_round():
        planned = sorted({p.anchor for p in res.plan([tid])})
        return planned, run(resample_round(res, engine, chat, [tid]))

    planned, batch = one_round()  # probes: 0 and 2 fail, 4 succeeds -> span (2, 4)
    assert planned == [0, 2, 4] and res.fork_estimate(tid).spans == ((2, 4),)
    # The failed groups at 0 and 2 imitate the span's chunks 2, 3 on the first of this round's rollouts at 4.
    assert [(t.info["resample"]["anchor"], chunks_imitated(t)) for t in batch] == [
        (0, []),
        (0, []),
        (2, []),
        (2, []),
        (4, [2, 3]),
        (4, []),
    ]
    planned, batch = one_round()  # bisection: 3 fails -> fork 4
    assert planned == [3] and res.fork_estimate(tid).crucial_fork == 4
    assert [(t.info["resample"]["anchor"], chunks_imitated(t)) for t in batch] == [(3, []), (3, []), (4, [3])]
    assert one_round()[0] == [3]  # the fork holds: samples stay just before it
    failing.discard(3)  # the policy learns chunk 3
    assert one_round()[0] == [3] and res.fork_estimate(tid).crucial_fork == 3  # 3 now succeeds, 2 is stale
    assert one_round()[0] == [2] and res.fork_estimate(tid).spans == ((0, 2),)
    assert one_round()[0] == [1] and res.fork_estimate(tid).crucial_fork == 2
    planned, batch = one_round()
    assert planned == [1] and [(t.info["resample"]["anchor"], chunks_imitated(t)) for t in batch] == [
        (1, []),
        (1, []),
        (2, [1]),
    ]
    # The estimate is a function of the recent outcomes: a checkpoint round trip plans the same.
    again = Resampler(cfg, experts[:1])
    again.load_state_dict(json.loads(json.dumps(res.state_dict())))
    assert again.plan([tid]) == res.plan([tid]) == [Planned(tid, 1)] * 2


# ---- rollback -----------------------------------------------------------------------------------------------


def reference_rollback(K: int, outcomes: list[tuple[int, bool]], window: int, threshold: float) -> list[int]:
    """Anchor after each (anchor, success) outcome, from the definition: the anchor starts at K and moves
    to anchor - 1 when the last `window` outcomes at the current anchor (since arriving) have a success
    rate >= threshold; outcomes at other anchors are ignored."""
    anchor, seen, out = K, [], []
    for a, ok in outcomes:
        if a == anchor:
            seen.append(ok)
            if len(seen) >= window and sum(seen[-window:]) / window >= threshold and anchor > 0:
                anchor, seen = anchor - 1, []
        out.append(anchor)
    return out


def test_rollback_moves_only_past_threshold(experts):
    cfg = ResampleConfig(mode="rollback", window=4, threshold=0.75, samples_per_anchor=2)
    res = Resampler(cfg, experts[:1])
    tid = experts[0].task_id
    assert res.rollback_anchor(tid) == K and res.plan([tid]) == [Planned(tid, K)] * 2
    for ok in (1, 1, 1):  # successes, but the window is not full yet
        assert not res.record(tid, K, float(ok))
    assert not res.record(tid, K - 1, 1.0)  # another anchor (e.g. still in flight) never counts
    assert res.record(tid, K, 0.0) and res.rollback_anchor(tid) == K - 1  # 3/4 = threshold: moves
    for ok in (1, 0, 1, 0, 1, 0):  # 1/2 or 2/4 < 0.75 in every window
        assert not res.record(tid, K - 1, float(ok))
    assert not res.record(tid, K - 1, 1.0)  # last four 0, 1, 0, 1: 1/2
    assert res.record(tid, K - 1, 1.0)  # last four 1, 0, 1, 1: 3/4
    assert res.rollback_anchor(tid) == K - 2 and res.plan([tid]) == [Planned(tid, K - 2)] * 2


def test_rollback_matches_reference_and_resumes_after_state_dict(experts):
    rng = random.Random(0)
    cfg = ResampleConfig(mode="rollback", window=3, threshold=0.6)
    tid = experts[0].task_id
    live = Resampler(cfg, experts[:1])
    outcomes: list[tuple[int, bool]] = []
    got: list[int] = []
    restored = Resampler(cfg, experts[:1])
    for i in range(300):
        a = live.rollback_anchor(tid) if rng.random() < 0.85 else rng.randrange(K + 1)
        ok = rng.random() < 0.7
        outcomes.append((a, ok))
        live.record(tid, a, float(ok))
        restored.record(tid, a, float(ok))
        got.append(live.rollback_anchor(tid))
        if i % 7 == 3:  # checkpoint round trip through JSON, then continue on the restored copy
            state = json.loads(json.dumps(restored.state_dict()))
            restored = Resampler(cfg, experts[:1])
            restored.load_state_dict(state)
            assert restored.state_dict() == live.state_dict()
    assert got == reference_rollback(K, outcomes, 3, 0.6)
    assert got[-1] == 0 and restored.state_dict() == live.state_dict()
    other = Resampler(dataclasses.replace(cfg, mode="parallel"), experts[:1])
    with pytest.raises(ValueError, match="mode 'rollback'"):
        other.load_state_dict(live.state_dict())
    with pytest.raises(ValueError, match="has no expert"):
        Resampler(cfg, experts[1:2]).load_state_dict(live.state_dict())


def test_rollback_state_through_orbax_checkpoint(tmp_path, experts):
    import jax.numpy as jnp

    from ipa_jax.train.checkpoint import CheckpointConfig, Checkpointer

    @dataclasses.dataclass
    class State:  # the two methods and the step the Checkpointer uses of a TrainState
        step: Any
        x: Any

        def checkpoint_tree(self):
            return {"x": self.x}

        def replace_checkpoint_tree(self, tree):
            return State(self.step, tree["x"])

    cfg = ResampleConfig(mode="rollback", window=2, threshold=0.5)
    res = Resampler(cfg, experts)
    for tid in res.experts:
        for _ in range(3):
            res.record(tid, res.rollback_anchor(tid), 1.0)
    res.record(experts[0].task_id, K, 0.0)  # an outcome at a past anchor: kept for forks, no move
    ckpt = Checkpointer(str(tmp_path / "ckpt"), CheckpointConfig(async_save=False))
    ckpt.save(State(jnp.asarray(5), jnp.zeros(2)), {"resample": res.state_dict()})
    ckpt.close()
    _, host = Checkpointer(str(tmp_path / "ckpt"), CheckpointConfig(async_save=False)).restore(
        State(jnp.asarray(0), jnp.zeros(2))
    )
    back = Resampler(cfg, experts)
    back.load_state_dict(host["resample"])
    assert back.state_dict() == res.state_dict()
    assert [back.rollback_anchor(t) for t in back.experts] == [K - 1] * 3


# ---- IL fallback --------------------------------------------------------------------------------------------


def test_rollback_with_il_fallback_end_to_end(chat, tasks, experts):
    # The policy always fails at chunk 1 and never elsewhere: rollback walks K -> 1 and stops; at anchor 1
    # every sample fails, so one carrier is sampled at the fork (anchor 2) with the expert's fork chunk 1
    # expert-masked (chunk 0 is context); every other trajectory has its prefix as plain context.
    tid = tasks[0].task_id
    cfg = ResampleConfig(mode="rollback", window=2, threshold=1.0, samples_per_anchor=2, il_fallback=True)
    res = Resampler(cfg, experts[:1])
    engine = ScriptedEngine(chat, forking_script(chat, tasks, 1, 1.0, 0.0))
    batches = [run(resample_round(res, engine, chat, [tid])) for _ in range(K + 1)]
    assert res.rollback_anchor(tid) == 1
    replay = replay_expert(experts[0], chat)
    for batch in batches[:-2]:  # anchors K..2: all succeed, no IL
        assert len(batch) == 2 and all(t.reward == 1 and not t.expert_mask.any() for t in batch)
    # Anchor 1, twice (it never moves on): both samples fail, one carrier at the fork (anchor 2).
    for batch in batches[-2:]:
        samples, carriers = batch[:2], batch[2:]
        assert [t.info["resample"]["anchor"] for t in samples] == [1, 1] and all(t.reward == 0 for t in samples)
        assert not any(t.expert_mask.any() for t in samples)
        assert len(carriers) == 1 and carriers[0].info["resample"]["anchor"] == 2
        assert carriers[0].info["resample"]["il_target"] and carriers[0].reward == 1.0
        ref = np.zeros(len(carriers[0].tokens), bool)
        a, b = replay.chunk_spans[1]  # the expert's fork chunk 1 only
        ref[a:b] = True
        np.testing.assert_array_equal(carriers[0].expert_mask, ref)
    # The padded batch carries exactly those tokens as IL targets (the objective's NLL term).
    padded = pad_batch(batches[-1])
    assert padded.expert_mask.sum() == b - a
    assert res.metrics()["il_groups"] == 2 and res.fork_estimate(tid).crucial_fork == 2
    # Without the fallback: same samples, no carriers, no expert tokens.
    off = Resampler(dataclasses.replace(cfg, il_fallback=False), experts[:1])
    off.load_state_dict(res.state_dict())
    batch = run(resample_round(off, engine, chat, [tid]))
    assert len(batch) == 2 and not any(t.expert_mask.any() for t in batch)


def test_il_fallback_from_start_and_at_last_anchor(chat, tasks, experts):
    tid = tasks[0].task_id
    # Plain RL ("none") and a policy that never answers right: only anchor 0 is sampled, so no jump says which
    # decision fails and the fallback imitates nothing ...
    whole_cfg = ResampleConfig(mode="none", samples_per_anchor=2, il_fallback=True, il_whole_episode=True)
    fail_last = ScriptedEngine(chat, forking_script(chat, tasks, K, 1.0, 0.0))
    res = Resampler(dataclasses.replace(whole_cfg, il_whole_episode=False), experts[:1])
    batch = run(resample_round(res, fail_last, chat, [tid]))
    assert [t.info["resample"]["anchor"] for t in batch] == [0, 0] and not any(t.expert_mask.any() for t in batch)
    assert res.metrics()["il_groups"] == 1
    # ... unless asked (il_whole_episode): the carrier is then the expert's whole episode, its final answer
    # included (anchor K + 1: an imitation row, nothing sampled).
    res = Resampler(whole_cfg, experts[:1])
    batch = run(resample_round(res, fail_last, chat, [tid]))
    assert [t.info["resample"]["anchor"] for t in batch] == [0, 0, K + 1]
    assert [t.info["resample"]["il_target"] for t in batch] == [False, False, True]
    whole = batch[2]
    conversation = tasks[0].initial_messages() + list(experts[0].messages)
    assert whole.tokens.tolist() == chat.encode(chat.render(conversation, tasks[0].tools).rstrip("\n"))
    assert not whole.action_mask.any() and whole.reward == 1.0 and whole.info["task_id"] == f"{tid}@{K + 1}"
    targets = chat.decode(whole.tokens[whole.expert_mask].tolist())
    assert targets.count("<|im_end|>") == K + 1 and targets.endswith(tasks[0].answer + "<|im_end|>")
    assert res.metrics()["episodes"] == 2  # the expert's row is not an outcome of the policy
    # An expert without a final answer: the fallback imitates its K chunks (anchor K's prefix).
    no_answer = expert_from_messages(conversation[:-1], tasks[0])
    assert not no_answer.has_answer and experts[0].has_answer
    assert Resampler(whole_cfg, [no_answer]).il_carrier(tid, 0) == Planned(tid, K, il_from=0)
    # Two tasks: each task's carrier follows its own episodes (a batch of the first half carries IL rows).
    res = Resampler(whole_cfg, experts[:2])
    batch = run(resample_round(res, fail_last, chat, [experts[1].task_id, experts[0].task_id]))
    assert [(t.info["resample"]["task_id"], t.info["resample"]["anchor"]) for t in batch] == [
        (experts[1].task_id, 0)
    ] * 2 + [(experts[1].task_id, K + 1)] + [(experts[0].task_id, 0)] * 2 + [(experts[0].task_id, K + 1)]
    # Rollback at anchor K with every sample failing (the answer is what fails): the failed samples stay plain
    # context and the whole expert episode is imitated.
    res = Resampler(dataclasses.replace(whole_cfg, mode="rollback"), experts[:1])
    batch = run(resample_round(res, fail_last, chat, [tid]))
    assert [(t.info["resample"]["anchor"], t.info["resample"]["il_target"]) for t in batch] == [
        (K, False),
        (K, False),
        (K + 1, True),
    ]
    assert not batch[0].expert_mask.any() and batch[2].tokens.tolist() == whole.tokens.tolist()


def test_resample_source_feeds_the_learner_and_checkpoints(chat, tasks, experts):
    cfg = ResampleConfig(mode="rollback", window=2, threshold=0.5, samples_per_anchor=2, tasks_per_round=2)
    engine = ScriptedEngine(chat, expert_script(chat, tasks))
    src = ResampleSource(Resampler(cfg, build_experts(cfg, tasks, chat)), engine, chat, concurrency=4)
    got = src.next_trajectories(3) + src.next_trajectories(3)
    assert [e.messages for e in src.resampler.experts.values()] == [e.messages for e in experts]
    assert len(got) == 6 and len({t.uid for t in got}) == 6 and all(t.reward == 1.0 for t in got)
    for t in got:
        t.validate()
    state = json.loads(json.dumps(src.state_dict()))
    # Two rounds of two tasks: tasks 0, 1 then 2, 0; each round of 2 successes moves a task back one chunk.
    assert state["cursor"] == 1 and [s["anchor"] for s in state["resampler"]["tasks"].values()] == [K - 2, K - 1, K - 1]
    again = ResampleSource(Resampler(cfg, experts), engine, chat)
    again.load_state_dict(state)
    assert again.state_dict() == src.state_dict()
    src.close()
    again.close()


def test_embedded_engine_anchored_batch_logprobs_and_il_term(chat, tasks, experts):
    # A tiny random dense Qwen3 in the EmbeddedEngine: anchored rollouts at anchors 0, 2, K plus IL
    # carriers; the learner's forward over the padded batch reproduces the sampler's log-probs on the
    # tail (so the engine conditioned on exactly the prefilled expert prefix), and the IL term's
    # denominator counts exactly the carriers' expert tokens.
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from tiny_models import tiny_qwen3_config

    from ipa_jax.engines import EmbeddedEngine
    from ipa_jax.models import init_model, token_logprobs
    from ipa_jax.objectives import imitation_term

    model = init_model(tiny_qwen3_config(moe=False, vocab_size=len(chat.tokenizer)))
    engine = EmbeddedEngine(model, seed=0, max_len=512, max_batch=8, batch_buckets=(8,))
    cfg = ResampleConfig(
        mode="parallel", anchors=(0, 2, 1.0), samples_per_anchor=1, il_fallback=True, il_whole_episode=True
    )
    res = Resampler(cfg, experts[:2])
    batch = run(
        resample_round(
            res,
            engine,
            chat,
            [e.task_id for e in experts[:2]],
            AgentConfig(max_new_tokens=8, max_context=512),
            concurrency=8,
        )
    )
    assert [(t.info["resample"]["anchor"], t.info["resample"]["il_target"]) for t in batch] == [
        (0, False),
        (2, False),
        (K, False),
        (K + 1, True),
    ] * 2  # nothing solved: the whole expert is imitated
    for traj in batch:
        if traj.info["resample"]["anchor"] > K:
            continue
        e = res.expert(traj.info["resample"]["task_id"])
        replay = replay_expert(e, chat)
        P = replay.prefix_lengths[traj.info["resample"]["anchor"]]
        assert traj.tokens[:P].tolist() == replay.tokens[:P] and traj.action_mask[P]
    padded = pad_batch(batch, buckets=(512,))
    graphdef, state = nnx.split(model)
    lp, _, _ = jax.jit(lambda st, x, m: token_logprobs(nnx.merge(graphdef, st), x, m))(
        state, jnp.asarray(padded.tokens), jnp.asarray(padded.attention_mask)
    )
    lp = np.asarray(lp)
    np.testing.assert_allclose(lp[padded.action_mask], padded.behavior_logprobs[padded.action_mask], atol=2e-4)
    num, den = imitation_term(jnp.asarray(lp), jnp.asarray(padded.expert_mask))
    # Expert tokens: each whole-expert row's K chunks plus its answer (what follows anchor K's prefix).
    n_expert = 0
    for e in experts[:2]:
        replay = replay_expert(e, chat)
        full = chat.encode(chat.render(e.task.initial_messages() + list(e.messages), e.task.tools).rstrip("\n"))
        n_expert += sum(b - a for a, b in replay.chunk_spans) + len(full) - replay.prefix_lengths[-1]
    assert float(den) == n_expert == padded.expert_mask.sum()
    np.testing.assert_allclose(float(num), -lp[padded.expert_mask].astype(np.float64).sum(), rtol=1e-5)
