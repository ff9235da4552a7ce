"""Curves of one run and the per-run numbers of an ablation table (RL phase = after the IL warm start)."""

from __future__ import annotations

import dataclasses
import glob
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ipa_jax.analysis.stats import TaskOutcomes
from ipa_jax.pipeline import RunFolder

EVAL_SUCCESS = "eval/success"
# Curves of one run shown by explore_run.ipynb: (metrics key, label). Missing keys are skipped there.
RUN_CURVES: tuple[tuple[str, str], ...] = (
    ("reward_mean", "training reward"),
    (EVAL_SUCCESS, "held-out success"),
    ("loss", "loss"),
    ("il_greedy_match", "expert episodes greedy decoding reproduces (warm start)"),
    ("grad_norm", "grad norm"),
    ("mismatch_abs", "mismatch mean |log pi - log mu|"),
    ("mismatch_kl", "mismatch Bernoulli-KL"),
    ("admitted_fraction", "admitted fraction"),
    ("eval/tool_calls", "held-out tool calls / episode"),
    ("policy_lag_mean", "policy lag"),
)
# Per-run scalars of an ablation table averaged over seeds, in column order (run_scalars adds `collapsed`, counted).
SCALARS = ("success_before", "success_after", "auc", "steps_to_threshold", "wall_time_s", "admitted_fraction")
# A run collapsed when RL left its held-out success below this fraction of its warm start's: the breakdowns of
# stale or too-fast updates (the policy stops calling tools, or breaks its calls) that the mean over seeds hides.
COLLAPSE_FRACTION = 0.5


def runs_root(start: str | None = None) -> str:
    """The runs/ folder of `start` (default: the current directory) or of its nearest parent that has one: the
    repository's runs/ from the repository, from notebooks/ or from any folder inside it; `start`/runs when none
    does."""
    here = Path(start or os.getcwd()).absolute()
    for folder in (here, *here.parents):
        if (folder / "runs").is_dir():
            return str(folder / "runs")
    return str(here / "runs")


def newest_run(runs_root: str = "runs") -> str:
    """The run folder under `runs_root` (searched recursively) whose metrics.jsonl changed last."""
    paths = glob.glob(os.path.join(runs_root, "**", "metrics.jsonl"), recursive=True)
    if not paths:
        raise FileNotFoundError(f"no run folder (with metrics.jsonl) under {os.path.abspath(runs_root)}")
    return os.path.dirname(max(paths, key=os.path.getmtime))


def series(rows: Sequence[dict[str, Any]], key: str) -> tuple[np.ndarray, np.ndarray]:
    """(steps int64[N], values float64[N]) of the rows that hold a number under `key`, sorted by step; a step
    logged twice (a resumed run) keeps its last value."""
    points: dict[int, float] = {}
    for row in rows:
        value = row.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            points[int(row["step"])] = float(value)
    steps = np.array(sorted(points), dtype=np.int64)
    return steps, np.array([points[s] for s in steps], dtype=np.float64)


def curve_auc(steps: np.ndarray, values: np.ndarray) -> float:
    """Normalised area under a curve: (1 / (s_N - s_1)) * trapezoid(values, steps), the step-weighted mean of
    the curve (same units as values). nan without points; the single value with one point."""
    if len(steps) == 0:
        return math.nan
    if len(steps) == 1 or steps[-1] == steps[0]:
        return float(values[-1])
    return float(np.trapezoid(values, steps) / (steps[-1] - steps[0]))


def steps_to_threshold(steps: np.ndarray, values: np.ndarray, threshold: float) -> float:
    """The first step whose value is >= threshold; nan if the curve never reaches it."""
    hit = np.nonzero(values >= threshold)[0]
    return float(steps[hit[0]]) if hit.size else math.nan


@dataclass(frozen=True)
class RunResult:
    """What an ablation table reads of one finished run, from its run folder (`from_run`) or a results file
    (`from_records`: small, committed, rebuilt into the same tables without the run folder).

    seed: train seed; success_before / success_after: held-out success after the warm start / at the end
    (summary.json); wall_time_s; admitted_fraction: mean over RL steps (nan if never logged); curve: (RL step counted
    from the warm start's end, held-out success) of every evaluation from the warm start's end on; tasks: the last
    evaluation's per-task records {task_id, family, samples, successes} (() for a run from before per-task records).
    """

    seed: int
    success_before: float
    success_after: float
    wall_time_s: float
    admitted_fraction: float
    curve: tuple[tuple[int, float], ...]
    tasks: tuple[dict[str, Any], ...]

    @classmethod
    def from_run(cls, run_dir: str) -> RunResult:
        """The numbers of a finished run folder (RL phase = after the IL warm start, see RunFolder.rl_start)."""
        folder = RunFolder(run_dir)
        summary, rows = folder.read_summary(), folder.read_metrics()
        for key in ("success_before", "success_after", "wall_time_s"):
            if summary.get(key) is None:
                raise ValueError(f"{run_dir}/summary.json: no value for {key!r}")
        start = folder.rl_start(rows)
        steps, success = series(rows, EVAL_SUCCESS)
        admitted_steps, admitted = series(rows, "admitted_fraction")
        admitted = admitted[admitted_steps > start]
        history = summary.get("eval_history") or [{"step": summary["steps"]}]
        last = int(history[-1]["step"])
        tasks = folder.read_eval_tasks(last)["tasks"] if os.path.exists(folder.eval_tasks_path(last)) else []
        return cls(
            seed=int(summary["seed"]),
            success_before=float(summary["success_before"]),
            success_after=float(summary["success_after"]),
            wall_time_s=float(summary["wall_time_s"]),
            admitted_fraction=float(np.mean(admitted)) if admitted.size else math.nan,
            curve=tuple((int(s - start), float(v)) for s, v in zip(steps, success) if s >= start),
            tasks=tuple(tasks),
        )

    def scalars(self, threshold: float) -> dict[str, float]:
        """The per-run numbers of an ablation table: success_before, success_after, wall_time_s, admitted_fraction;
        auc = curve_auc of the held-out success curve over the RL phase; steps_to_threshold = RL steps to held-out
        success >= threshold; collapsed = 1.0 when success_after < COLLAPSE_FRACTION * success_before, else 0.0."""
        steps = np.array([s for s, _ in self.curve], dtype=np.int64)
        success = np.array([v for _, v in self.curve], dtype=np.float64)
        return {
            "success_before": self.success_before,
            "success_after": self.success_after,
            "auc": curve_auc(steps, success),
            "steps_to_threshold": steps_to_threshold(steps, success, threshold),
            "wall_time_s": self.wall_time_s,
            "admitted_fraction": self.admitted_fraction,
            "collapsed": float(self.success_after < COLLAPSE_FRACTION * self.success_before),
        }

    def outcomes(self) -> TaskOutcomes:
        """The last evaluation task by task; without per-task records the run's success_after as one pseudo-task
        (`TaskOutcomes.from_rate`: only seeds can then be resampled)."""
        if self.tasks:
            return TaskOutcomes.from_records(self.tasks)
        return TaskOutcomes.from_rate(self.success_after)

    def success_by_family(self) -> dict[str, float]:
        """{family: successes / samples over its tasks} of the last evaluation, families sorted ({} without records
        of families)."""
        won: dict[str, list[float]] = {}
        for t in self.tasks:
            if "family" in t:
                counts = won.setdefault(t["family"], [0.0, 0.0])
                counts[0] += float(t["successes"])
                counts[1] += float(t["samples"])
        return {f: w / n for f, (w, n) in sorted(won.items()) if n > 0}

    def to_records(self) -> list[dict[str, Any]]:
        """JSON lines: the run's numbers first (with its curve), then one line per task."""
        head = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "tasks"}
        head["curve"] = [list(point) for point in self.curve]
        return [head, *self.tasks]

    @classmethod
    def from_records(cls, records: Sequence[dict[str, Any]]) -> RunResult:
        head, *tasks = records
        values = {f.name: head[f.name] for f in dataclasses.fields(cls) if f.name != "tasks"}
        values["curve"] = tuple((int(s), float(v)) for s, v in values["curve"])
        values["admitted_fraction"] = math.nan if values["admitted_fraction"] is None else values["admitted_fraction"]
        return cls(**values, tasks=tuple(tasks))


def run_scalars(run_dir: str, threshold: float) -> dict[str, float]:
    """The per-run numbers of an ablation table of a run folder (`RunResult.scalars`)."""
    return RunResult.from_run(run_dir).scalars(threshold)


def final_outcomes(run_dir: str) -> tuple[int, TaskOutcomes]:
    """(train seed, outcomes of the run's last held-out evaluation task by task) of a run folder: eval_tasks/ at the
    step of the last evaluation in summary.json (`RunResult.outcomes`)."""
    result = RunResult.from_run(run_dir)
    return result.seed, result.outcomes()


def smooth(values: np.ndarray, window: int) -> np.ndarray:
    """Trailing moving average over up to `window` points (the first points average what exists)."""
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    csum = np.cumsum(np.insert(values.astype(np.float64), 0, 0.0))
    idx = np.arange(1, len(values) + 1)
    lo = np.maximum(idx - window, 0)
    return (csum[idx] - csum[lo]) / (idx - lo)


def seed_band(curves: Sequence[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(steps, mean, std) over seeds, on the steps every seed logged; std is the sample std (ddof=1, as in the
    table), 0 for a single seed."""
    curves = [c for c in curves if len(c[0])]
    if not curves:
        return np.zeros(0, np.int64), np.zeros(0), np.zeros(0)
    common = curves[0][0]
    for steps, _ in curves[1:]:
        common = np.intersect1d(common, steps)
    stacked = np.stack([vals[np.searchsorted(steps, common)] for steps, vals in curves])
    std = stacked.std(axis=0, ddof=1) if len(stacked) > 1 else np.zeros(len(common))
    return common, stacked.mean(axis=0), std
