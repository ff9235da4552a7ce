"""Statistics that can separate ablation arms: confidence intervals that include seed-to-seed training variance,
and paired comparisons of arms that share warm starts and held-out tasks (docs/statistics.md).

The data of one run (one seed of one arm) is its last held-out evaluation, task by task: `TaskOutcomes` =
(task ids, successes [T], samples [T]). A run's success rate is the ratio of sums sum(successes) / sum(samples),
the mean over its finished episodes (what the run logs as eval/success). An arm's estimate is the mean over
its seeds of that rate.

Intervals are percentile intervals of a hierarchical bootstrap: seeds are drawn with replacement, then, within
each drawn seed, held-out tasks with replacement (a task's samples travel with it), so the interval covers both
the training variance between seeds and the sampling noise of the held-out set. A paired difference resamples the
same seeds and the same tasks for both arms, so what the arms share (the warm start of a seed, the task's
difficulty) cancels. A run folder written before per-task records existed counts as one pseudo-task holding its
success rate (`TaskOutcomes.from_rate`): only seeds are resampled then.

Everything is float64 NumPy; the bootstrap draws come from `numpy.random.default_rng(seed)`, so a table is the
same every time it is written.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

DEFAULT_LEVEL = 0.95
DEFAULT_RESAMPLES = 10_000
BLOCK_ELEMENTS = 2**20  # task draws made at once (bounds the [draws, tasks] index matrix and its gather)
CLAIMS = ("higher", "lower")  # the claimed direction of (arm - reference)
SEEDS_AND_TASKS, SEEDS_ONLY = "seeds, tasks", "seeds"  # what an interval resamples
NO_RECORDS = "run folders without per-task records"  # why only seeds are resampled (folders from before them)


# ---------------------------------------------------------------------------------------------- data
@dataclass(frozen=True)
class TaskOutcomes:
    """One run's held-out outcomes. task_ids: T distinct ids; successes, samples: float64 [T], every task with at
    least one finished sample; per_task: False for a whole run folded into one pseudo-task (`from_rate`)."""

    task_ids: tuple[str, ...]
    successes: np.ndarray
    samples: np.ndarray
    per_task: bool = True

    def __post_init__(self) -> None:
        successes = np.asarray(self.successes, dtype=np.float64)
        samples = np.asarray(self.samples, dtype=np.float64)
        if not len(self.task_ids) or successes.shape != (len(self.task_ids),) or samples.shape != successes.shape:
            raise ValueError(f"TaskOutcomes: need T >= 1 task ids with successes and samples of shape [T], got "
                             f"{len(self.task_ids)} ids, {successes.shape}, {samples.shape}")
        if len(set(self.task_ids)) != len(self.task_ids):
            raise ValueError("TaskOutcomes: task ids must be distinct (merge repeated tasks with from_records)")
        if not (samples > 0).all() or not ((successes >= 0) & (successes <= samples)).all():
            raise ValueError("TaskOutcomes: need samples > 0 and 0 <= successes <= samples for every task")
        object.__setattr__(self, "task_ids", tuple(self.task_ids))
        object.__setattr__(self, "successes", successes)
        object.__setattr__(self, "samples", samples)

    @classmethod
    def from_records(cls, records: Iterable[Mapping[str, Any]]) -> TaskOutcomes:
        """From per-task records {task_id, samples, successes} (a run folder's eval_tasks/ file): a task listed
        more than once (a finite dataset repeats its tasks to fill the held-out set) is one task with the samples
        summed; tasks whose samples were all aborted are left out. Raises ValueError when nothing finished."""
        successes: dict[str, float] = {}
        samples: dict[str, float] = {}
        for record in records:
            task = str(record["task_id"])
            successes[task] = successes.get(task, 0.0) + float(record["successes"])
            samples[task] = samples.get(task, 0.0) + float(record["samples"])
        kept = [task for task in samples if samples[task] > 0]
        if not kept:
            raise ValueError("TaskOutcomes.from_records: no task with a finished sample")
        return cls(tuple(kept), np.array([successes[t] for t in kept]), np.array([samples[t] for t in kept]))

    @classmethod
    def from_rate(cls, rate: float) -> TaskOutcomes:
        """A run without per-task records as one pseudo-task whose success rate is `rate` (resampling tasks is then
        a no-op: only seeds vary)."""
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"TaskOutcomes.from_rate: a success rate in [0, 1], got {rate}")
        return cls(("<run>",), np.array([rate]), np.array([1.0]), per_task=False)

    @property
    def rate(self) -> float:
        """sum(successes) / sum(samples): the mean success over the run's finished episodes."""
        return float(self.successes.sum() / self.samples.sum())


@dataclass(frozen=True)
class Estimate:
    """An arm's success rate: mean over seeds, and its percentile interval [low, high] at `level`.

    seeds: runs; tasks: held-out tasks per seed (the smallest; 0 without per-task records); resampled:
    SEEDS_AND_TASKS or SEEDS_ONLY; note: what the interval does not cover, or why it is missing (low = high = nan),
    "" when nothing needs saying."""

    mean: float
    low: float
    high: float
    level: float
    seeds: int
    tasks: int
    resampled: str
    note: str = ""


@dataclass(frozen=True)
class SignTest:
    """Exact two-sided sign test: positive / negative / tied differences, and the p-value of the positive-negative
    split under "either sign is equally likely" (ties dropped)."""

    positive: int
    negative: int
    ties: int
    p_value: float


@dataclass(frozen=True)
class PairedDifference:
    """arm - reference in success rate over the seeds both ran, resampled in pairs (same seeds, same tasks).

    mean, low, high, level, seeds, tasks, resampled, note: as in Estimate, of the difference; tasks_sign: the sign
    test over every (seed, task) pair of per-task success rates (None when only seeds are resampled); seeds_sign:
    the sign test over the seeds' differences."""

    mean: float
    low: float
    high: float
    level: float
    seeds: int
    tasks: int
    resampled: str
    tasks_sign: SignTest | None
    seeds_sign: SignTest
    note: str = ""

    def verdict(self, claim: str) -> str:
        """`verdict(self.low, self.high, claim)`."""
        return verdict(self.low, self.high, claim)


# ---------------------------------------------------------------------------------------------- primitives
def sign_test(differences: Sequence[float] | np.ndarray) -> SignTest:
    """Exact two-sided sign test of differences d [N]: with n = n+ + n- non-zero ones and k = min(n+, n-),
    p = min(1, 2 * sum_{i<=k} C(n, i) / 2^n); p = 1 when every difference is 0 (no evidence either way)."""
    d = np.asarray(differences, dtype=np.float64)
    positive, negative = int((d > 0).sum()), int((d < 0).sum())
    n, k = positive + negative, min(positive, negative)
    # Exact integers, then one division: no overflow or cancellation for any n.
    tail = sum(math.comb(n, i) for i in range(k + 1))
    p_value = 1.0 if n == 0 else min(1.0, 2 * tail / 2**n)
    return SignTest(positive, negative, int(d.size) - n, p_value)


def hierarchical_bootstrap(counts: Sequence[np.ndarray], statistic: Callable[[np.ndarray], np.ndarray], *,
                           resamples: int = DEFAULT_RESAMPLES, seed: int = 0) -> np.ndarray:
    """Bootstrap distribution float64 [R] of mean_s statistic(sum_t counts[s][:, t]).

    counts[s]: float64 [K, T_s], seed s's per-task counts (K kinds, e.g. successes and samples); statistic maps
    task sums [..., K] to values [...]. Each draw picks S seeds with replacement and, for each pick, T_s tasks of
    that seed with replacement (sum over the drawn task indices i_1..i_T of counts[s][:, i]); a seed picked twice
    gets two independent task draws."""
    if not counts:
        raise ValueError("hierarchical_bootstrap: no seeds")
    if resamples < 1:
        raise ValueError(f"hierarchical_bootstrap: resamples must be >= 1, got {resamples}")
    rng = np.random.default_rng(seed)
    num_seeds = len(counts)
    picks = rng.integers(0, num_seeds, size=(resamples, num_seeds))  # [R, S]: which seed fills each slot
    slot_values = np.empty((resamples, num_seeds), dtype=np.float64)
    for s, table in enumerate(counts):
        table = np.asarray(table, dtype=np.float64)
        num_tasks = table.shape[1]
        where = picks == s
        values = np.empty(int(where.sum()), dtype=np.float64)
        block = max(1, BLOCK_ELEMENTS // num_tasks)
        for start in range(0, values.size, block):
            size = min(block, values.size - start)
            tasks = rng.integers(0, num_tasks, size=(size, num_tasks))  # [m, T_s]
            values[start:start + size] = statistic(table[:, tasks].sum(axis=2).T)  # [K, m, T_s] -> [m, K] -> [m]
        slot_values[where] = values
    return slot_values.mean(axis=1)


def percentile_interval(distribution: np.ndarray, level: float = DEFAULT_LEVEL) -> tuple[float, float]:
    """The central `level` percentile interval (q_{(1-level)/2}, q_{(1+level)/2}) of a bootstrap distribution [R]."""
    _check_level(level)
    low, high = np.quantile(distribution, [(1.0 - level) / 2.0, (1.0 + level) / 2.0])
    return float(low), float(high)


def _check_level(level: float) -> None:
    if not 0.0 < level < 1.0:
        raise ValueError(f"level must be in (0, 1), got {level}")


def verdict(low: float, high: float, claim: str) -> str:
    """How an interval [low, high] of (arm - reference) bears on a claimed direction (`claim` "higher": the arm is
    better; "lower": the reference is): "supported" when it lies wholly on the claimed side of 0, "contradicted"
    when wholly on the other, "inconclusive" when it holds 0 or is missing (nan)."""
    if claim not in CLAIMS:
        raise ValueError(f"claim must be one of {CLAIMS}, got {claim!r}")
    if not (math.isfinite(low) and math.isfinite(high)) or low <= 0.0 <= high:
        return "inconclusive"
    arm_higher = low > 0.0
    return "supported" if arm_higher == (claim == "higher") else "contradicted"


# ---------------------------------------------------------------------------------------------- arms
def _rate(sums: np.ndarray) -> np.ndarray:
    """successes / samples of task sums [..., 2]."""
    return sums[..., 0] / sums[..., 1]


def _rate_difference(sums: np.ndarray) -> np.ndarray:
    """arm rate - reference rate of task sums [..., 4] = (reference successes, samples, arm successes, samples)."""
    return _rate(sums[..., 2:]) - _rate(sums[..., :2])


def _interval(counts: Sequence[np.ndarray], statistic: Callable[[np.ndarray], np.ndarray], per_task: bool,
              level: float, resamples: int, seed: int) -> tuple[float, float]:
    """The percentile interval of `hierarchical_bootstrap(counts, statistic)`; (nan, nan) for one seed without
    per-task records (nothing varies)."""
    _check_level(level)
    if not per_task and len(counts) == 1:
        return math.nan, math.nan
    return percentile_interval(hierarchical_bootstrap(counts, statistic, resamples=resamples, seed=seed), level)


def _note(seeds: int, tasks_not_resampled: str) -> str:
    """What an interval leaves out: `tasks_not_resampled` (why tasks were not resampled, "" if they were), and the
    training variance of a single seed."""
    notes = [f"{tasks_not_resampled}: seeds resampled, tasks not"] if tasks_not_resampled else []
    if seeds == 1:
        notes.append("one seed: no interval" if tasks_not_resampled
                     else "one seed: no training variance in the interval")
    return "; ".join(notes)



def arm_estimate(runs: Sequence[TaskOutcomes], *, level: float = DEFAULT_LEVEL,
                 resamples: int = DEFAULT_RESAMPLES, seed: int = 0) -> Estimate:
    """An arm's mean success over its runs (one per seed), mean_s rate_s, with the hierarchical-bootstrap interval
    (seeds, then tasks within seed). When some run has no per-task records every run counts as its rate alone
    (seeds resampled only); one such seed has no interval (nan, said in the note)."""
    if not runs:
        raise ValueError("arm_estimate: no runs")
    per_task = all(r.per_task for r in runs)
    if not per_task:
        runs = [TaskOutcomes.from_rate(r.rate) for r in runs]
    counts = [np.stack([r.successes, r.samples]) for r in runs]
    low, high = _interval(counts, _rate, per_task, level, resamples, seed)
    return Estimate(float(np.mean([r.rate for r in runs])), low, high, level, len(runs),
                    min(len(r.task_ids) for r in runs) if per_task else 0, SEEDS_AND_TASKS if per_task else SEEDS_ONLY,
                    _note(len(runs), "" if per_task else NO_RECORDS))


def _paired_counts(reference: TaskOutcomes, arm: TaskOutcomes) -> np.ndarray:
    """float64 [4, T] of the tasks both runs played (reference order): reference successes, samples, arm
    successes, samples; [4, 0] without a common task."""
    index = {task: i for i, task in enumerate(arm.task_ids)}
    common = [(i, index[task]) for i, task in enumerate(reference.task_ids) if task in index]
    ref_idx = np.array([i for i, _ in common], dtype=np.int64)
    arm_idx = np.array([j for _, j in common], dtype=np.int64)
    return np.stack([reference.successes[ref_idx], reference.samples[ref_idx],
                     arm.successes[arm_idx], arm.samples[arm_idx]])


def paired_difference(reference: Mapping[int, TaskOutcomes], arm: Mapping[int, TaskOutcomes], *,
                      level: float = DEFAULT_LEVEL, resamples: int = DEFAULT_RESAMPLES,
                      seed: int = 0) -> PairedDifference:
    """arm - reference over the seeds both have ({seed: outcomes} each): mean_s (rate_arm,s - rate_ref,s) on the
    tasks both runs of seed s played, its paired hierarchical-bootstrap interval (the same seeds and the same tasks
    drawn for both arms), the sign test over (seed, task) pairs of per-task rates and the one over seeds. Without
    per-task records in every run (or without a common task in some seed) each run counts as its rate alone and
    only seeds are resampled. Raises ValueError when the arms share no seed."""
    seeds = sorted(set(reference) & set(arm))
    if not seeds:
        raise ValueError(f"paired_difference: no seed in common (reference {sorted(reference)}, arm {sorted(arm)})")
    counts = [_paired_counts(reference[s], arm[s]) for s in seeds]
    records = all(reference[s].per_task and arm[s].per_task for s in seeds)
    per_task = records and all(c.shape[1] for c in counts)
    if not per_task:
        counts = [np.array([[reference[s].rate], [1.0], [arm[s].rate], [1.0]]) for s in seeds]
    seed_differences = np.array([_rate_difference(c.sum(axis=1)) for c in counts])
    low, high = _interval(counts, _rate_difference, per_task, level, resamples, seed)
    tasks_sign = sign_test(np.concatenate([c[2] / c[3] - c[0] / c[1] for c in counts])) if per_task else None
    common_tasks = min(c.shape[1] for c in counts) if per_task else 0
    why = "" if per_task else NO_RECORDS if not records else "no held-out task in common in some seed"
    notes = [_note(len(seeds), why)]
    if per_task and any(c.shape[1] < min(len(reference[s].task_ids), len(arm[s].task_ids))
                        for s, c in zip(seeds, counts)):
        notes.append(f"paired on the tasks both arms played ({common_tasks} in the smallest seed)")
    return PairedDifference(float(seed_differences.mean()), low, high, level, len(seeds), common_tasks,
                            SEEDS_AND_TASKS if per_task else SEEDS_ONLY, tasks_sign, sign_test(seed_differences),
                            "; ".join(n for n in notes if n))
