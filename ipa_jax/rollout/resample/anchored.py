"""Episodes that start from an expert prefix: `run_anchored` prefills the state after the expert's first
`anchor` chunks and samples the tail with the policy; `whole_expert_episode` is the expert's whole episode, its
final answer included, as an imitation row (anchor K + 1, nothing sampled)."""

from __future__ import annotations

import uuid

from ipa_jax.chat import ChatFormat
from ipa_jax.engines.base import Engine
from ipa_jax.envs import Env, make_env
from ipa_jax.rollout.agent import AgentConfig, expert_episode, run_episode
from ipa_jax.rollout.resample.experts import ExpertTrajectory
from ipa_jax.trajectory import Trajectory


async def run_anchored(
    engine: Engine,
    chat: ChatFormat,
    expert: ExpertTrajectory,
    anchor: int,
    config: AgentConfig = AgentConfig(),
    *,
    env: Env | None = None,
    uid: str | None = None,
    seed: int | None = None,
) -> Trajectory | None:
    """One episode from the state after the expert's first `anchor` chunks (None if the engine aborted); `seed` as
    in `run_episode`.

    The prefix has expert_mask 1 and action_mask 0; the tail's chunk ids start at 0. info["resample"] =
    {task_id, anchor, num_expert_chunks, expert_uid, il_target: False}; info["task_id"] becomes
    "<task_id>@<anchor>" for anchor > 0: an anchored start state is its own group for group baselines."""
    expert.check_anchor(anchor)
    task = expert.task
    uid = uid or f"{task.task_id}@{anchor}#{uuid.uuid4().hex[:12]}"
    traj = await run_episode(
        engine, chat, task, config, env=env, uid=uid, prefill=expert.prefill(anchor) or None, seed=seed
    )
    if traj is None:
        return None
    traj.info["resample"] = {
        "task_id": task.task_id,
        "anchor": int(anchor),
        "num_expert_chunks": expert.num_chunks,
        "expert_uid": expert.uid,
        "il_target": False,
    }
    if anchor:
        traj.info["task_id"] = f"{task.task_id}@{anchor}"
    return traj


def whole_expert_episode(expert: ExpertTrajectory, chat: ChatFormat, env: Env | None = None) -> Trajectory:
    """The expert's whole episode, final answer included, as an imitation row (`expert_episode`: every expert
    turn expert-masked, no action token); info["resample"] as run_anchored's with anchor K + 1."""
    if not expert.has_answer:
        raise ValueError(f"expert {expert.uid!r} has no final answer: its whole episode is anchor K's prefix")
    task = expert.task
    K = expert.num_chunks
    messages = task.initial_messages() + [dict(m) for m in expert.messages]
    return expert_episode(
        task,
        messages,
        env if env is not None else make_env(task.env),
        chat,
        uid=f"{task.task_id}@{K + 1}#{uuid.uuid4().hex[:12]}",
        info={
            "task_id": f"{task.task_id}@{K + 1}",
            "resample": {
                "task_id": task.task_id,
                "anchor": K + 1,
                "num_expert_chunks": K,
                "expert_uid": expert.uid,
                "il_target": True,
            },
        },
    )
