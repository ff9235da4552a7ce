"""`ResampleConfig`: the settings of chunk-level initialized resampling, validated on construction.

The class docstring is also the per-field help text (read line by line elsewhere): keep exactly one entry
per field, `    name: help` with the first line a summary that reads on its own and continuation lines
indented further.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

MODES = ("none", "rollback", "parallel", "fork")
WEIGHTINGS = ("uniform", "variance")


@dataclass(frozen=True)
class ResampleConfig:
    """Where resampled episodes start (the start state or an expert prefix) and what the batch carries.

    mode: where episodes start: "none", "rollback", "parallel" or "fork".
      "none": every episode from the start state; "rollback": per task the anchor starts at the last chunk K and
      moves one chunk earlier once the success rate over the last `window` samples at it reaches `threshold`;
      "parallel": sample at several anchors at once; "fork": per task, from the state just before its estimated
      crucial fork (re-estimated every round from the recent outcomes): anchor f - 1 for a fork f, the midpoint
      of a span whose jump is not yet attributed to one chunk (bisection), and parallel's anchors while no jump
      is seen.
    anchors: parallel mode's anchor positions, as fractions of K or chunk counts (fork mode's probes).
      A float in [0, 1] is a fraction of the task's K chunks (anchor = floor(f * K + 0.5)), an int >= 0 an
      absolute chunk count (capped at K).
    samples_per_anchor: episodes per task and anchor in one round (rollback/none/fork: per task).
    threshold: rollback moves when the windowed success rate at the current anchor is >= threshold.
    window: number of recent outcomes kept per (task, anchor): rollback's window and the fork estimates.
    fork_jump: a jump is a success rate exceeding the previous sampled anchor's by >= this.
      Between adjacent anchors f - 1 and f it is a fork (expert chunk f - 1 decides); between anchors further
      apart a span (one of the chunks between them decides).
    il_fallback: imitate the expert at the fork where every sample of a task at an anchor failed.
      The fork is the largest jump after the failing anchor in the estimate from the recent outcomes: rollouts at
      its later anchor q keep the expert's chunks at the jump (chunk q - 1 for a fork, chunks p..q-1 for a span
      (p, q)) as imitation targets; every other expert token is plain context.
    il_samples: how many rollouts at most carry the imitation targets of one fork.
      The round's own rollouts at the fork if it sampled there, else this many new ones.
    il_whole_episode: with no jump after the failing anchor, imitate the expert's whole episode instead of nothing.
      One whole expert episode, its final answer included (an imitation row, nothing sampled). Plain RL (mode
      "none") sees no jumps, so there the fallback imitates whole episodes only with this switch.
    weighting: parallel mode's split of the round's budget over anchors: "uniform" or "variance".
      The budget is samples_per_anchor per kept anchor; "variance" allocates it proportionally to p(1-p),
      p the smoothed success rate (s+1)/(n+2): anchors with mixed outcomes, where the learning signal is,
      get more samples.
    select_top: parallel: keep only the select_top anchors of highest p(1-p) (ties: the earlier); 0 = all.
    success_reward: an episode succeeds iff its reward >= success_reward.
      Also outside resampling: the train step labels a row failed iff its reward < success_reward (the rows whose
      tokens the objective's entropy filter, objective.negative_token_fraction < 1, selects).
    experts: where the expert trajectories come from: "scripted" or a JSONL path.
      "scripted": each training task's scripted expert (`env.expert(task)`); a path: a JSONL file of expert
      trajectories (chat or Trajectory format, see `load_experts`).
    tasks_per_round: tasks sampled per round by `ResampleSource`.
    num_tasks: training tasks (each with its expert) the online source cycles over; 0 = 8 * tasks_per_round.
      The source takes tasks_per_round of them per round. Fewer tasks: more visits per task (rollback moves
      need `window` outcomes at a task's anchor); more tasks: more varied data.
    """

    mode: str = "none"
    anchors: tuple[float | int, ...] = (0.0, 0.5, 1.0)
    samples_per_anchor: int = 4
    threshold: float = 0.5
    window: int = 8
    fork_jump: float = 0.5
    il_fallback: bool = False
    il_samples: int = 1
    il_whole_episode: bool = False
    weighting: str = "uniform"
    select_top: int = 0
    success_reward: float = 1.0
    experts: str = "scripted"
    tasks_per_round: int = 4
    num_tasks: int = 0

    def __post_init__(self) -> None:
        def bad(field: str, problem: str) -> ValueError:
            return ValueError(f"ResampleConfig.{field}: {problem}")

        if self.mode not in MODES:
            raise bad("mode", f"must be one of {MODES}, got {self.mode!r}")
        if self.weighting not in WEIGHTINGS:
            raise bad("weighting", f"must be one of {WEIGHTINGS}, got {self.weighting!r}")
        anchors = tuple(self.anchors)
        object.__setattr__(self, "anchors", anchors)
        if self.mode in ("parallel", "fork") and not anchors:
            raise bad("anchors", f"mode {self.mode!r} needs at least one anchor")
        for a in anchors:
            if isinstance(a, bool) or not isinstance(a, (int, float)):
                raise bad("anchors", f"entries must be floats in [0, 1] or ints >= 0, got {a!r}")
            if isinstance(a, float) and not 0.0 <= a <= 1.0:
                raise bad("anchors", f"a float anchor is a fraction of the chunks and must be in [0, 1], got {a}")
            if isinstance(a, int) and a < 0:
                raise bad("anchors", f"an int anchor is a chunk count and must be >= 0, got {a}")
        for field in ("samples_per_anchor", "window", "il_samples", "tasks_per_round"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise bad(field, f"must be an int >= 1, got {value!r}")
        if (
            isinstance(self.num_tasks, bool)
            or not isinstance(self.num_tasks, int)
            or not (self.num_tasks == 0 or self.num_tasks >= self.tasks_per_round)
        ):
            raise bad(
                "num_tasks",
                f"must be 0 (8 * tasks_per_round) or an int >= tasks_per_round="
                f"{self.tasks_per_round}, got {self.num_tasks!r}",
            )
        if isinstance(self.select_top, bool) or not isinstance(self.select_top, int) or self.select_top < 0:
            raise bad("select_top", f"must be an int >= 0 (0 = all anchors), got {self.select_top!r}")
        for field in ("threshold", "fork_jump"):
            value = getattr(self, field)
            if not isinstance(value, (int, float)) or not 0.0 < value <= 1.0:
                raise bad(field, f"must be a rate in (0, 1], got {value!r}")
        for field in ("il_fallback", "il_whole_episode"):
            if not isinstance(getattr(self, field), bool):
                raise bad(field, f"must be a bool, got {getattr(self, field)!r}")
        if not isinstance(self.success_reward, (int, float)) or not math.isfinite(self.success_reward):
            raise bad("success_reward", f"must be a finite number, got {self.success_reward!r}")
        if not isinstance(self.experts, str) or not self.experts:
            raise bad("experts", f"must be 'scripted' or a JSONL path, got {self.experts!r}")

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ResampleConfig:
        """From a (ConfigDict) mapping; an unknown key is an error."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"ResampleConfig: unknown key(s) {unknown}; known: {sorted(names)}")
        d = dict(d)
        if "anchors" in d:
            d["anchors"] = tuple(d["anchors"])
        return cls(**d)
