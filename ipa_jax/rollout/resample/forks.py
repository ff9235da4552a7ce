"""Crucial forks: per task, the success rate by anchor and the anchors where it jumps by at least `fork_jump`
over the sampled anchor before. A jump between adjacent anchors f - 1 and f is a fork: expert chunk f - 1 is a
decision the policy has not mastered. A jump between sampled anchors p and q > p + 1 is a span: the decision is
one of chunks p..q-1, and which one is not known until an anchor between them is sampled. `probe_forks`
measures them for any policy by sampling at every anchor."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ipa_jax.chat import ChatFormat
from ipa_jax.engines.base import Engine
from ipa_jax.rollout.agent import AgentConfig
from ipa_jax.rollout.resample.anchored import run_anchored
from ipa_jax.rollout.resample.experts import ExpertTrajectory
from ipa_jax.trajectory import Trajectory


@dataclass(frozen=True)
class ForkEstimate:
    """Per-task success by anchor. anchors ascending (those with samples); rates[i] = successes/samples;
    jumps[i] = rates[i] - rates[i-1] (0 for the first); forks: anchors f with jump >= fork_jump over f - 1 (an
    adjacent sampled anchor); spans: (p, q) for a jump >= fork_jump between sampled anchors p < q - 1, not
    attributed to one chunk; crucial_fork: the fork with the largest jump (ties: the earliest), None if none."""

    task_id: str
    anchors: tuple[int, ...]
    successes: tuple[int, ...]
    samples: tuple[int, ...]
    rates: tuple[float, ...]
    jumps: tuple[float, ...]
    forks: tuple[int, ...]
    spans: tuple[tuple[int, int], ...]
    crucial_fork: int | None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def largest_jump(self, after: int = 0) -> tuple[int, int] | None:
        """(p, q): the fork (p = q - 1) or span whose jump is the largest among those with p >= after (ties: the
        earliest); None if there is none. The expert's decisive chunk is one of p..q-1."""
        pairs = [(p, q) for p, q in [(f - 1, f) for f in self.forks] + list(self.spans) if p >= after]
        return max(pairs, key=lambda pq: (self.jumps[self.anchors.index(pq[1])], -pq[1]), default=None)


def estimate_forks(task_id: str, counts: Mapping[int, tuple[int, int]], fork_jump: float) -> ForkEstimate:
    """counts: anchor -> (successes, samples). rate_j = s_j / n_j; jump_j = rate_j - rate_{previous anchor}."""
    if not 0.0 < fork_jump <= 1.0:
        raise ValueError(f"fork_jump must be in (0, 1], got {fork_jump}")
    for a, (s, n) in counts.items():
        if not 0 <= s <= n:
            raise ValueError(f"task {task_id!r}, anchor {a}: successes {s} must be in [0, samples={n}]")
    anchors = tuple(sorted(int(a) for a, (_, n) in counts.items() if n > 0))
    succ = tuple(int(counts[a][0]) for a in anchors)
    n = tuple(int(counts[a][1]) for a in anchors)
    rates = tuple(s / m for s, m in zip(succ, n))
    jumps = tuple(0.0 if i == 0 else rates[i] - rates[i - 1] for i in range(len(rates)))
    eps = 1e-9  # rates are ratios of small ints: a jump equal to the threshold must count
    jumping = [(anchors[i - 1], a) for i, a in enumerate(anchors) if i and jumps[i] >= fork_jump - eps]
    forks = tuple(q for p, q in jumping if q == p + 1)
    spans = tuple((p, q) for p, q in jumping if q > p + 1)
    crucial = max(forks, key=lambda a: (jumps[anchors.index(a)], -a)) if forks else None
    return ForkEstimate(task_id, anchors, succ, n, rates, jumps, forks, spans, crucial)


def forks_by_anchor(estimates: Sequence[ForkEstimate]) -> list[dict[str, Any]]:
    """Per anchor (ascending): the tasks estimated there, their mean success rate, and how many tasks have
    their crucial fork there."""
    anchors = sorted({a for e in estimates for a in e.anchors})
    out = []
    for a in anchors:
        rates = [e.rates[e.anchors.index(a)] for e in estimates if a in e.anchors]
        out.append(
            {
                "anchor": a,
                "tasks": len(rates),
                "success": float(np.mean(rates)),
                "crucial_forks": sum(e.crucial_fork == a for e in estimates),
            }
        )
    return out


async def probe_forks(
    engine: Engine,
    chat: ChatFormat,
    experts: Sequence[ExpertTrajectory],
    samples: int,
    fork_jump: float,
    config: AgentConfig = AgentConfig(),
    *,
    anchors: Sequence[int] | None = None,
    success_reward: float = 1.0,
    concurrency: int = 8,
) -> list[ForkEstimate]:
    """Samples `samples` episodes at each anchor (default every anchor 0..K) of each expert; one
    ForkEstimate per expert."""
    if samples < 1 or concurrency < 1:
        raise ValueError(f"samples and concurrency must be >= 1, got {samples} and {concurrency}")
    sem = asyncio.Semaphore(concurrency)

    async def one(expert: ExpertTrajectory, a: int) -> Trajectory | None:
        async with sem:
            return await run_anchored(engine, chat, expert, a, config)

    jobs = [
        (e, a)
        for e in experts
        for a in (anchors if anchors is not None else range(e.num_chunks + 1))
        for _ in range(samples)
    ]
    results = await asyncio.gather(*(one(e, a) for e, a in jobs))
    counts: dict[str, dict[int, list[int]]] = {e.task_id: {} for e in experts}
    for (e, a), traj in zip(jobs, results):
        if traj is not None:
            c = counts[e.task_id].setdefault(a, [0, 0])
            c[0] += traj.reward >= success_reward
            c[1] += 1
    return [
        estimate_forks(e.task_id, {a: (s, n) for a, (s, n) in counts[e.task_id].items()}, fork_jump) for e in experts
    ]
