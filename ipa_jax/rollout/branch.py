"""Chunk values by branching: Monte Carlo values of an episode's states at its chunk boundaries.

A sampled episode of K chunks passes through the states s_0 (the task's start) .. s_{K-1}, s_k being the state
before chunk k: the prompt, the episode's own chunks 0..k-1 and their tool responses. From each s_k, n more
continuations are sampled with the policy (`run_episode` with that prefix as prefill, the same turn budget, the
environment replayed through the prefix's calls); their mean final reward is the value estimate

    V(k) = (1/n) sum_j R_{k,j}                     (the episode itself is not one of the n: V(k) stays a baseline
                                                    independent of the episode's own chunks k, k+1, ...)
    A_k  = V(k+1) - V(k)  for k < K-1,   A_{K-1} = R - V(K-1)

so the chunk advantages of an episode add up to R - V(0), V(0) coming from n fresh episodes of the same task.
An episode costs n K extra episodes (each shorter than a whole one when k > 0: it starts after k chunks).
`branch_episode` samples them; the rollout worker (`RolloutWorker(branch=...)`) branches a fraction of its
episodes and stores the A_k in `Trajectory.chunk_advantages`; the objective's credit "branch" gives every token of
chunk k the credit A_k (objectives/credit.py, `branch_credit`).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from ipa_jax.activity import ActivityClock
from ipa_jax.chat import ChatFormat
from ipa_jax.engines.base import Engine
from ipa_jax.envs import Env, Task
from ipa_jax.rollout.agent import AgentConfig, run_episode
from ipa_jax.rollout.resample.experts import ExpertTrajectory, expert_from_trajectory
from ipa_jax.trajectory import Trajectory


def branch_values(continuation_rewards: np.ndarray) -> np.ndarray:
    """V(k) = mean_j R_{k,j}: the rewards of n continuations from each of K states, [K, n] -> float64 [K]."""
    rewards = np.asarray(continuation_rewards, np.float64)
    if rewards.ndim != 2 or rewards.shape[1] == 0:
        raise ValueError(f"continuation_rewards: must be [K, n] with n >= 1, got shape {rewards.shape}")
    return rewards.mean(axis=1)


def branch_advantages(values: np.ndarray, reward: float) -> np.ndarray:
    """A_k = V(k+1) - V(k) for k < K-1 and A_{K-1} = R - V(K-1): values [K], the episode's reward R -> float64 [K]."""
    v = np.asarray(values, np.float64)
    if v.ndim != 1 or v.size == 0:
        raise ValueError(f"values: must be [K] with K >= 1, got shape {v.shape}")
    return np.append(v[1:], float(reward)) - v


def is_branched(index: int, fraction: float) -> bool:
    """Whether the worker's episode number `index` (0, 1, ...) is branched: exactly floor(m f) of the first m
    episodes are, spread evenly (f = 1/2: every second one), with no random draw to reproduce."""
    return math.floor((index + 1) * fraction) > math.floor(index * fraction)


def continuation_uid(uid: str, state: int, sample: int) -> str:
    """The uid of continuation `sample` from state s_`state` of episode `uid` (the engine's request id)."""
    return f"{uid}~branch{state}.{sample}"


def branch_prefix(traj: Trajectory, task: Task, chat: ChatFormat) -> ExpertTrajectory:
    """The episode's first K-1 chunks as a conversation whose anchors 0..K-1 are the states s_0..s_{K-1}.

    Raises ValueError when the states cannot be reproduced token for token: a chunk before the last with no or a
    malformed tool call, a prefix the chat template does not re-render (`expert_from_trajectory`). The last chunk
    is never replayed, so a truncated or malformed last turn does not prevent branching."""
    K = traj.num_chunks
    if K == 0:
        raise ValueError(f"trajectory {traj.uid!r}: no chunk to branch")
    if K == 1:
        return ExpertTrajectory(uid=traj.uid, task=task, messages=(), chunk_ends=())
    end = int(np.argmax(traj.chunk_ids == K - 1))  # the first token of the last chunk
    head = Trajectory(
        uid=traj.uid,
        tokens=traj.tokens[:end],
        action_mask=traj.action_mask[:end],
        behavior_logprobs=traj.behavior_logprobs[:end],
        chunk_ids=traj.chunk_ids[:end],
        expert_mask=traj.expert_mask[:end],
        reward=traj.reward,
        policy_version=traj.policy_version,
    )
    return expert_from_trajectory(head, task, chat)


SKIP_REASONS = ("unreplayable", "aborted", "failed")


@dataclass(frozen=True)
class BranchOutcome:
    """What branching one episode gave: chunk_advantages float32[K] and values float64[K] V(k), or None when it was
    not branched (`skipped`: one of SKIP_REASONS, `detail` the first error), and the continuations finished and
    their generated tokens (the extra cost, counted either way)."""

    chunk_advantages: np.ndarray | None
    values: np.ndarray | None
    continuations: int
    generated_tokens: int
    skipped: str = ""
    detail: str = ""


async def branch_episode(
    engine: Engine,
    chat: ChatFormat,
    task: Task,
    traj: Trajectory,
    samples: int,
    config: AgentConfig = AgentConfig(),
    *,
    env_factory: Callable[[Task], Env] | None = None,
    clock: ActivityClock | None = None,
) -> BranchOutcome:
    """Samples `samples` continuations from each state s_0..s_{K-1} of `traj` (an episode of `task` sampled from its
    start state), all at once, and returns their values and the chunk advantages (module doc). The episode is not
    branched (chunk_advantages None) when its states cannot be replayed (a chunk before the last with a malformed or
    no tool call), or a continuation was aborted (a shutdown) or raised; the continuations that finished are
    counted either way. Continuation request ids: `continuation_uid`."""
    if samples < 1:
        raise ValueError(f"samples: must be >= 1, got {samples}")
    try:
        prefix = branch_prefix(traj, task, chat)
    except ValueError as e:
        return BranchOutcome(None, None, 0, 0, "unreplayable", str(e))
    K = traj.num_chunks

    async def one(state: int, sample: int) -> Trajectory | None:
        env = env_factory(task) if env_factory is not None else None
        uid = continuation_uid(traj.uid, state, sample)
        prefill = prefix.prefill(state) or None
        return await run_episode(engine, chat, task, config, env=env, uid=uid, prefill=prefill, clock=clock)

    jobs = [(k, j) for k in range(K) for j in range(samples)]
    results = await asyncio.gather(*(one(k, j) for k, j in jobs), return_exceptions=True)
    done = [r for r in results if isinstance(r, Trajectory)]
    tokens = sum(int(r.info["generated_tokens"]) for r in done)
    failed = [r for r in results if isinstance(r, BaseException)]
    if failed:
        return BranchOutcome(None, None, len(done), tokens, "failed", repr(failed[0]))
    if len(done) < len(jobs):
        return BranchOutcome(None, None, len(done), tokens, "aborted")
    values = branch_values(np.asarray([r.reward for r in results], np.float64).reshape(K, samples))
    advantages = branch_advantages(values, traj.reward).astype(np.float32)
    return BranchOutcome(advantages, values, len(done), tokens)


@dataclass(frozen=True)
class Branching:
    """The rollout worker's branching: `samples` continuations per state, a `fraction` of the episodes (is_branched)."""

    samples: int
    fraction: float

    def __post_init__(self) -> None:
        if isinstance(self.samples, bool) or not isinstance(self.samples, int) or self.samples < 1:
            raise ValueError(f"Branching.samples: must be an int >= 1, got {self.samples!r}")
        if not 0.0 < self.fraction <= 1.0:
            raise ValueError(f"Branching.fraction: must be in (0, 1], got {self.fraction!r}")

    def continuation_uids(self, traj: Trajectory) -> Sequence[str]:
        """The request ids of an episode's continuations (the worker aborts them at shutdown)."""
        return [continuation_uid(traj.uid, k, j) for k in range(traj.num_chunks) for j in range(self.samples)]
