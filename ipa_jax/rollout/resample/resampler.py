"""`Resampler`: the bookkeeping of resampling, pure Python, no engine. Which anchors to sample, the outcomes
seen there, rollback anchors, imitation targets and the checkpoint state.

Batch semantics (`Resampler.finalize`): the expert prefix of an anchored rollout is plain context (its
expert_mask is cleared) unless it carries the imitation fallback. When every sample of a task at anchor a
fails, the fork is the largest jump after a in the task's fork estimate: a fork f (chunk f-1 decides) or a
span (p, q) (one of chunks p..q-1 decides). Up to `il_samples` rollouts at its later anchor q (those of this
round, or new ones) keep expert_mask on the expert's chunks at the jump only, chunk f-1 or chunks p..q-1, so
those become NLL targets (ObjectiveConfig.il_weight against rl_weight); a carrier also has sampled actions of
its own (its tail), so one row trains both terms. With no jump after a, nothing is known about which decision
fails: the fallback imitates nothing, or with `il_whole_episode` the expert's whole episode with its answer
(anchor K + 1: an imitation row without sampled tail; imitating only the K calls would never teach the answer:
measured on the hard task, 200 updates learned the three calls but not to answer after them).

Fork mode (`fork_anchors`) samples each task where its largest jump is: just before the decisive chunk of a
fork, at the midpoint of a span (bisection), at parallel's anchors while no jump is seen. The estimate comes
from the recent outcomes at every anchor, so it moves as the policy improves: once chunk f-1 is learned the
jump at f disappears and the next one (usually earlier) takes its place.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter, deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ipa_jax.rollout.resample.config import ResampleConfig
from ipa_jax.rollout.resample.experts import ExpertTrajectory
from ipa_jax.rollout.resample.forks import ForkEstimate, estimate_forks, forks_by_anchor
from ipa_jax.trajectory import Trajectory

STATE_VERSION = 1  # of state_dict()'s format


@dataclass(frozen=True)
class Planned:
    """One episode to sample: the task, the anchor and, for a carrier of the imitation fallback, the first expert
    chunk it imitates (it keeps expert_mask on the expert's chunks il_from..anchor-1; None: not a carrier)."""

    task_id: str
    anchor: int
    il_from: int | None = None


def expert_chunk_index(expert_mask: np.ndarray) -> np.ndarray:
    """bool[T] -> int[T]: k on the tokens of the k-th run of expert tokens, -1 elsewhere. In an anchored rollout
    (and a whole expert episode) run k is the expert's chunk k: tool responses separate the expert's turns."""
    starts = expert_mask & ~np.concatenate([[False], expert_mask[:-1]])
    return np.where(expert_mask, np.cumsum(starts) - 1, -1)


class Resampler:
    """Which anchors to sample, the outcomes seen there, rollback anchors and IL targets; no engine.

    Outcomes are kept per (task, anchor) as the last `window` successes (bools). Rollback keeps per task its
    current anchor (starting at K) and the outcomes seen at it since it got there; results for any other
    anchor (e.g. episodes started before the move, still in flight) never count towards a move.
    """

    def __init__(self, config: ResampleConfig, experts: Sequence[ExpertTrajectory]):
        self.config = config
        self.experts: dict[str, ExpertTrajectory] = {}
        for e in experts:
            if e.task_id in self.experts:
                raise ValueError(f"two experts for task {e.task_id!r}: {self.experts[e.task_id].uid!r} and {e.uid!r}")
            self.experts[e.task_id] = e
        self._outcomes: dict[str, dict[int, deque[bool]]] = {t: {} for t in self.experts}
        self._anchor = {t: e.num_chunks for t, e in self.experts.items()}
        self._window: dict[str, deque[bool]] = {t: deque(maxlen=config.window) for t in self.experts}
        self._moves = {t: 0 for t in self.experts}
        self.totals = {"episodes": 0, "successes": 0, "il_groups": 0, "moves": 0}

    def expert(self, task_id: str) -> ExpertTrajectory:
        if task_id not in self.experts:
            raise ValueError(f"no expert trajectory for task {task_id!r}")
        return self.experts[task_id]

    # ---- planning ----
    def rollback_anchor(self, task_id: str) -> int:
        """The task's current rollback anchor (K at the start, moving towards 0)."""
        self.expert(task_id)
        return self._anchor[task_id]

    def parallel_anchors(self, task_id: str) -> list[int]:
        """config.anchors resolved for this task's K (fractions rounded half up, ints capped), ascending."""
        K = self.expert(task_id).num_chunks
        out = {min(a, K) if isinstance(a, int) else int(math.floor(a * K + 0.5)) for a in self.config.anchors}
        return sorted(out)

    def success_rate(self, task_id: str, anchor: int) -> float | None:
        """Success rate over the recent outcomes at (task, anchor); None if none were seen."""
        self.expert(task_id)
        seen = self._outcomes[task_id].get(anchor)
        return sum(seen) / len(seen) if seen else None

    def _smoothed(self, task_id: str, anchor: int) -> float:
        # p = (s + 1) / (n + 2): the posterior mean under a uniform prior, never exactly 0 or 1.
        seen = self._outcomes[task_id].get(anchor, ())
        return (sum(seen) + 1) / (len(seen) + 2)

    def allocation(self, task_id: str) -> dict[int, int]:
        """anchor -> number of episodes this round (parallel mode)."""
        anchors = self.parallel_anchors(task_id)
        weight = {a: self._smoothed(task_id, a) * (1 - self._smoothed(task_id, a)) for a in anchors}
        if self.config.select_top:
            anchors = sorted(sorted(anchors, key=lambda a: (-weight[a], a))[: self.config.select_top])
        n = self.config.samples_per_anchor
        if self.config.weighting == "uniform":
            return {a: n for a in anchors}
        # Largest-remainder apportionment of budget = n * #anchors proportionally to p(1-p).
        budget = n * len(anchors)
        total = sum(weight[a] for a in anchors)
        quota = {a: budget * weight[a] / total for a in anchors}
        alloc = {a: int(math.floor(q)) for a, q in quota.items()}
        for a in sorted(anchors, key=lambda a: (-(quota[a] - alloc[a]), a))[: budget - sum(alloc.values())]:
            alloc[a] += 1
        return alloc

    def fork_anchors(self, task_id: str) -> dict[int, int]:
        """anchor -> number of episodes this round (fork mode), from the largest jump (p, q) of the task's current
        estimate: samples_per_anchor at (p + q) // 2, which is p = f - 1, the state just before the decisive chunk,
        for a fork f = q = p + 1, and splits a span (bisection); parallel's allocation while there is no jump."""
        jump = self.fork_estimate(task_id).largest_jump()
        if jump is None:
            return self.allocation(task_id)
        return {sum(jump) // 2: self.config.samples_per_anchor}

    def plan(self, task_ids: Iterable[str]) -> list[Planned]:
        """The episodes of one round for these tasks, grouped by task, anchors ascending."""
        out: list[Planned] = []
        n = self.config.samples_per_anchor
        for t in task_ids:
            self.expert(t)
            if self.config.mode == "none":
                out += [Planned(t, 0)] * n
            elif self.config.mode == "rollback":
                out += [Planned(t, self._anchor[t])] * n
            else:
                alloc = self.allocation(t) if self.config.mode == "parallel" else self.fork_anchors(t)
                for a, m in alloc.items():
                    out += [Planned(t, a)] * m
        return out

    # ---- outcomes ----
    def is_success(self, reward: float) -> bool:
        return reward >= self.config.success_reward

    def record(self, task_id: str, anchor: int, reward: float) -> bool:
        """Adds one outcome; returns True if it moved the task's rollback anchor (one chunk earlier)."""
        self.expert(task_id).check_anchor(anchor)
        ok = self.is_success(reward)
        self._outcomes[task_id].setdefault(anchor, deque(maxlen=self.config.window)).append(ok)
        self.totals["episodes"] += 1
        self.totals["successes"] += ok
        if self.config.mode != "rollback" or anchor != self._anchor[task_id]:
            return False
        window = self._window[task_id]
        window.append(ok)
        if (
            len(window) == self.config.window
            and sum(window) / len(window) >= self.config.threshold
            and self._anchor[task_id] > 0
        ):
            self._anchor[task_id] -= 1
            window.clear()
            self._moves[task_id] += 1
            self.totals["moves"] += 1
            return True
        return False

    def fork_estimate(self, task_id: str) -> ForkEstimate:
        """Crucial forks of a task from the recent outcomes per anchor."""
        self.expert(task_id)
        counts = {a: (sum(seen), len(seen)) for a, seen in self._outcomes[task_id].items()}
        return estimate_forks(task_id, counts, self.config.fork_jump)

    def fork_report(self) -> dict[str, Any]:
        """JSON for the run folder's forks.json: {"anchors": forks_by_anchor(...), "tasks": [ForkEstimate dicts]}
        from the recent outcomes of every task."""
        estimates = [self.fork_estimate(t) for t in self.experts]
        return {"anchors": forks_by_anchor(estimates), "tasks": [e.to_dict() for e in estimates]}

    def il_carrier(self, task_id: str, anchor: int) -> Planned | None:
        """Where the imitation fallback goes when every sample at `anchor` failed: at the later anchor q of the
        largest jump (p, q) after it, imitating the expert's chunks p..q-1. Without such a jump, None, or with
        il_whole_episode the expert's whole episode (anchor K + 1; anchor K for an expert without final answer)."""
        jump = self.fork_estimate(task_id).largest_jump(after=anchor)
        if jump is not None:
            return Planned(task_id, jump[1], il_from=jump[0])
        if not self.config.il_whole_episode:
            return None
        expert = self.expert(task_id)
        return Planned(task_id, expert.num_chunks + 1 if expert.has_answer else expert.num_chunks, il_from=0)

    def il_targets(self, results: Sequence[tuple[Planned, float]]) -> tuple[dict[tuple[str, int], int], list[Planned]]:
        """The imitation fallback for one round's outcomes [(planned, reward)]: each group (task, a) whose samples
        all failed gets its il_carrier. Returns {(task, q): p} for the carriers' anchors this round sampled (their
        rollouts carry chunks p..q-1, see finalize) and the carriers to sample for the others: `il_samples` new
        episodes at q, or the whole expert episode once (nothing left to sample). Nothing when the fallback is
        off."""
        if not self.config.il_fallback:
            return {}, []
        solved: dict[tuple[str, int], bool] = {}
        for p, reward in results:
            key = (p.task_id, p.anchor)
            solved[key] = solved.get(key, False) or self.is_success(reward)
        targets: dict[tuple[str, int], int] = {}
        for (t, a), ok in solved.items():
            if not ok:
                self.totals["il_groups"] += 1
                carrier = self.il_carrier(t, a)
                if carrier is not None:
                    targets[(t, carrier.anchor)] = carrier.il_from
        sampled = {key: first for key, first in targets.items() if key in solved}
        carriers = [
            Planned(t, q, il_from=first)
            for (t, q), first in sorted(targets.items())
            if (t, q) not in solved
            for _ in range(1 if self.is_whole_expert(t, q) else self.config.il_samples)
        ]
        return sampled, carriers

    def is_whole_expert(self, task_id: str, anchor: int) -> bool:
        """Anchor K + 1: the expert's whole episode, its final answer included (an IL row, nothing sampled)."""
        return anchor == self.expert(task_id).num_chunks + 1

    def finalize(
        self, results: Sequence[tuple[Planned, Trajectory]], il_groups: Mapping[tuple[str, int], int] | None = None
    ) -> list[Trajectory]:
        """The batch: carriers keep expert_mask on the expert's chunks il_from..anchor-1, and so do the first
        `il_samples` trajectories of each (task, anchor) group in `il_groups` (-> its first chunk, from
        il_targets); everywhere else expert_mask is cleared, so the expert prefix is plain context."""
        il_groups = il_groups or {}
        carried: Counter[tuple[str, int]] = Counter()
        out = []
        for p, traj in results:
            key = (p.task_id, p.anchor)
            il_from = p.il_from
            if il_from is None and key in il_groups and carried[key] < self.config.il_samples:
                il_from = il_groups[key]
                carried[key] += 1
            chunk = expert_chunk_index(traj.expert_mask)
            if chunk.max(initial=-1) + 1 != p.anchor:
                raise ValueError(
                    f"{traj.uid}: {chunk.max(initial=-1) + 1} expert turns in a rollout at anchor {p.anchor}"
                )
            info = dict(traj.info)
            info["resample"] = {**info.get("resample", {}), "il_target": il_from is not None}
            mask = np.zeros_like(traj.expert_mask) if il_from is None else chunk >= il_from
            out.append(dataclasses.replace(traj, expert_mask=mask, info=info))
        return out

    # ---- reporting and checkpoints ----
    def metrics(self) -> dict[str, float]:
        anchors = [self._anchor[t] / max(e.num_chunks, 1) for t, e in self.experts.items()]
        return {
            "episodes": float(self.totals["episodes"]),
            "success_rate": self.totals["successes"] / max(self.totals["episodes"], 1),
            "il_groups": float(self.totals["il_groups"]),
            "rollback_moves": float(self.totals["moves"]),
            "rollback_anchor_frac": float(np.mean(anchors)) if anchors else 0.0,
            "tasks_at_start": float(sum(a == 0 for a in self._anchor.values())),
        }

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable state (for the checkpoint's host JSON)."""
        return {
            "version": STATE_VERSION,
            "mode": self.config.mode,
            "totals": dict(self.totals),
            "tasks": {
                t: {
                    "num_chunks": e.num_chunks,
                    "anchor": self._anchor[t],
                    "window": [int(x) for x in self._window[t]],
                    "moves": self._moves[t],
                    "outcomes": {str(a): [int(x) for x in seen] for a, seen in sorted(self._outcomes[t].items())},
                }
                for t, e in self.experts.items()
            },
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restores `state_dict()`'s output. Raises ValueError if it was taken with another mode, a task has
        no expert here or its expert has a different number of chunks."""
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"resample state: version {state.get('version')!r}, expected {STATE_VERSION}")
        if state.get("mode") != self.config.mode:
            raise ValueError(f"resample state: taken with mode {state.get('mode')!r}, config has {self.config.mode!r}")
        W = self.config.window
        for t, s in state["tasks"].items():
            if t not in self.experts:
                raise ValueError(f"resample state: task {t!r} has no expert trajectory here")
            K = self.experts[t].num_chunks
            if int(s["num_chunks"]) != K:
                raise ValueError(f"resample state: task {t!r} had {s['num_chunks']} expert chunks, its expert has {K}")
            if not 0 <= int(s["anchor"]) <= K:
                raise ValueError(f"resample state: task {t!r} anchor {s['anchor']} outside [0, {K}]")
            self._anchor[t] = int(s["anchor"])
            self._window[t] = deque((bool(x) for x in s["window"]), maxlen=W)
            self._moves[t] = int(s["moves"])
            self._outcomes[t] = {int(a): deque((bool(x) for x in seen), maxlen=W) for a, seen in s["outcomes"].items()}
        self.totals = {k: int(v) for k, v in state["totals"].items()}
