"""Statistics that can separate ablation arms: confidence intervals that include seed-to-seed training variance,
paired comparisons of arms that share warm starts and held-out tasks, Holm's correction across a table and the
effect a comparison can detect (docs/statistics.md).

The data of one run (one seed of one arm) is its last held-out evaluation, task by task: `TaskOutcomes` =
(task ids, successes [T], samples [T]). A run's success rate is the ratio of sums sum(successes) / sum(samples),
the mean over its finished episodes (what the run logs as eval/success). An arm's estimate is the mean over
its seeds of that rate.

An arm's interval is a percentile interval of a hierarchical bootstrap: seeds are drawn with replacement, then,
within each drawn seed, held-out tasks with replacement (a task's samples travel with it), so the interval covers
both the training variance between seeds and the sampling noise of the held-out set. A run folder written before
per-task records existed counts as one pseudo-task holding its success rate (`TaskOutcomes.from_rate`): only seeds
are resampled then.

A paired difference (the verdict) is a t-interval on the per-seed differences d_s = rate_arm,s - rate_ref,s on the
tasks both runs of seed s played. Every seed plays the same held-out tasks, so a task's difficulty is shared by all
seeds and arms: d_s already holds each seed's task noise once, and the spread of the d_s over seeds holds both the
training variance and that noise. (A bootstrap that resamples tasks inside each seed counts the task noise a second
time: too wide where it dominates, too narrow where seed variance does; tests/analysis simulate both.) That spread
is floored at the task noise each seed measures on its own (`task_sampling_se`): a few seeds can spread less than
it by chance, down to identical differences (sd 0), which would give a zero-width interval and p = 0.

Everything is float64 NumPy (Student t quantiles from the closed-form CDF of integer degrees of freedom); the
bootstrap draws come from `numpy.random.default_rng(seed)`, so a table is the same every time it is written.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

DEFAULT_LEVEL = 0.95
DEFAULT_POWER = 0.8  # the power at which the minimum detectable effect is stated
DEFAULT_EFFECT = 0.05  # the effect of interest whose seed count a table states: 5 points of success
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
            raise ValueError(
                f"TaskOutcomes: need T >= 1 task ids with successes and samples of shape [T], got "
                f"{len(self.task_ids)} ids, {successes.shape}, {samples.shape}"
            )
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
    """arm - reference in success rate over the seeds both ran, paired by seed (on the tasks both runs played).

    mean: mean_s d_s of the seeds' differences d_s; low, high: its t-interval at `level` with `sd_used` (nan with
    fewer than two seeds or without any spread); sd: the sample std of the d_s (ddof 1; nan with one seed);
    sd_floor: the task-sampling floor sqrt(mean_s se_s^2) of that sd (`task_sampling_se`; nan without per-task
    records); p_value: the two-sided paired t-test's with `sd_used` (the sign test over the d_s when there is no
    spread; nan with one seed); seeds, tasks, note: as in Estimate; tasks_sign: the sign test over every (seed,
    task) pair of per-task success rates (descriptive: it treats pairs as independent; None without per-task
    records); seeds_sign: the sign test over the d_s."""

    mean: float
    low: float
    high: float
    level: float
    seeds: int
    tasks: int
    sd: float
    sd_floor: float
    p_value: float
    tasks_sign: SignTest | None
    seeds_sign: SignTest
    note: str = ""

    @property
    def sd_used(self) -> float:
        """The sd behind the interval, the p-value and the detectable effect: max(sd, sd_floor) (the floor 0 where
        missing); nan where that is 0 or nan (no spread to scale by)."""
        used = max(self.sd, self.sd_floor if math.isfinite(self.sd_floor) else 0.0)
        return used if used > 0.0 else math.nan

    def verdict(self, claim: str) -> str:
        """`verdict(self.low, self.high, claim)`."""
        return verdict(self.low, self.high, claim)

    def minimum_detectable_effect(self, power: float = DEFAULT_POWER, level: float | None = None) -> float:
        """`minimum_detectable_effect(self.sd_used, self.seeds, level=level, power=power)`, at self.level unless
        `level` is given (the verdict's, when a family of comparisons adjusts it)."""
        return minimum_detectable_effect(self.sd_used, self.seeds, level=level or self.level, power=power)


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


def student_t_cdf(t: float, dof: int) -> float:
    """P(T <= t) of Student's t with an integer number of degrees of freedom >= 1, from the closed form of
    P(|T| < |t|) in theta = atan(|t| / sqrt(dof)) (Abramowitz & Stegun 26.7.3-4): for odd dof
    (2 / pi) (theta + sin(theta) sum_{j=1}^{(dof-1)/2} c_j cos^{2j-1}(theta)), c_1 = 1, c_{j+1} = c_j 2j / (2j + 1);
    for even dof sin(theta) sum_{j=0}^{dof/2-1} e_j cos^{2j}(theta), e_0 = 1, e_{j+1} = e_j (2j + 1) / (2j + 2)."""
    if dof < 1 or int(dof) != dof:
        raise ValueError(f"student_t_cdf: an integer dof >= 1, got {dof}")
    if math.isinf(t):
        return 1.0 if t > 0 else 0.0
    theta = math.atan(abs(t) / math.sqrt(dof))
    sin, cos = math.sin(theta), math.cos(theta)
    if dof % 2:
        term, total = cos, 0.0
        for j in range(1, (dof - 1) // 2 + 1):
            total += term
            term *= cos * cos * 2 * j / (2 * j + 1)
        inside = 2.0 / math.pi * (theta + sin * total)
    else:
        term, total = 1.0, 0.0
        for j in range(dof // 2):
            total += term
            term *= cos * cos * (2 * j + 1) / (2 * j + 2)
        inside = sin * total
    return 0.5 + math.copysign(0.5 * inside, t)


def student_t_quantile(probability: float, dof: int) -> float:
    """The t with student_t_cdf(t, dof) = probability, probability in (0, 1), by bisection to float64 precision."""
    if not 0.0 < probability < 1.0:
        raise ValueError(f"student_t_quantile: a probability in (0, 1), got {probability}")
    if probability < 0.5:
        return -student_t_quantile(1.0 - probability, dof)
    low, high = 0.0, 1.0
    while student_t_cdf(high, dof) < probability:
        low, high = high, 2.0 * high
    for _ in range(200):
        middle = 0.5 * (low + high)
        if middle in (low, high):
            break
        low, high = (middle, high) if student_t_cdf(middle, dof) < probability else (low, middle)
    return 0.5 * (low + high)


def paired_t(
    differences: Sequence[float] | np.ndarray, level: float = DEFAULT_LEVEL, sd_floor: float = 0.0
) -> tuple[float, float, float, float]:
    """(low, high, sd, p) of n per-seed differences d: the t-interval mean(d) -+ t_{(1+level)/2, n-1} s / sqrt(n)
    and the two-sided p-value 2 (1 - F_{n-1}(|mean(d)| sqrt(n) / s)), with s = max(sd, sd_floor), sd the sample std
    (ddof 1, returned) and `sd_floor` a lower bound on it known from elsewhere (0: none). All nan for n < 2. When
    s = 0 (identical differences, up to rounding, and no floor) there is no spread to scale by: no interval (nan)
    and p from the exact sign test over d (`sign_test`: 1 when every d is 0, at best 2 / 2^n otherwise)."""
    _check_level(level)
    d = np.asarray(differences, dtype=np.float64)
    n = d.size
    if n < 2:
        return math.nan, math.nan, math.nan, math.nan
    mean, sd = float(d.mean()), float(d.std(ddof=1))
    spread = max(0.0 if sd < 1e-12 * abs(mean) else sd, sd_floor)  # identical up to rounding: no spread of its own
    if spread == 0.0:
        return math.nan, math.nan, sd, sign_test(d).p_value
    half = student_t_quantile((1.0 + level) / 2.0, n - 1) * spread / math.sqrt(n)
    p_value = 2.0 * (1.0 - student_t_cdf(abs(mean) * math.sqrt(n) / spread, n - 1))
    return mean - half, mean + half, sd, min(1.0, p_value)


def holm(p_values: Sequence[float]) -> list[float]:
    """Holm's step-down adjusted p-values: with the m finite p sorted ascending p_(1) <= ... <= p_(m),
    adj_(i) = min(1, max_{j <= i} (m - j + 1) p_(j)); nan stays nan and does not count in m. Rejecting where
    adj < alpha keeps the chance of any false rejection in the family at most alpha."""
    p = np.asarray(p_values, dtype=np.float64)
    finite = np.flatnonzero(np.isfinite(p))
    order = finite[np.argsort(p[finite], kind="stable")]
    m = order.size
    adjusted = np.full(p.shape, math.nan)
    running = 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (m - rank) * p[i]))
        adjusted[i] = running
    return adjusted.tolist()


def paired_t_power(noncentrality: float, dof: int, level: float = DEFAULT_LEVEL) -> float:
    """P(|T| > t_{(1+level)/2, dof}) for T = (Z + noncentrality) / sqrt(V / dof), Z standard normal, V chi-square
    with dof degrees of freedom (the noncentral t of a paired t-test whose true mean difference is noncentrality
    sd / sqrt(n)): E_W[Phi(noncentrality - c W) + Phi(-noncentrality - c W)] with c = t_crit / sqrt(dof) and
    W = sqrt(V), density 2 w^(dof-1) exp(-w^2 / 2) / (2^(dof/2) Gamma(dof/2)), integrated by the trapezoid rule."""
    critical = student_t_quantile((1.0 + level) / 2.0, dof) / math.sqrt(dof)
    w = np.linspace(0.0, math.sqrt(dof) + 14.0, 4001)
    log_density = (
        (dof - 1) * np.log(np.maximum(w, 1e-300))
        - w * w / 2  # w^0 = 1 at w = 0 for one dof
        - (dof / 2 - 1) * math.log(2)
        - math.lgamma(dof / 2)
    )
    normal_sf = np.frompyfunc(lambda x: 0.5 * math.erfc(x / math.sqrt(2.0)), 1, 1)
    rejected = (normal_sf(critical * w - noncentrality) + normal_sf(critical * w + noncentrality)).astype(np.float64)
    values = np.exp(log_density) * rejected
    return float(np.sum((values[1:] + values[:-1]) / 2) * (w[1] - w[0]))


@functools.cache
def _detectable_noncentrality(dof: int, level: float, power: float) -> float:
    """The noncentrality whose paired_t_power is `power`, by bisection (the power grows with it)."""
    low, high = 0.0, 1.0
    while paired_t_power(high, dof, level) < power:
        low, high = high, 2.0 * high
    for _ in range(50):
        middle = 0.5 * (low + high)
        low, high = (middle, high) if paired_t_power(middle, dof, level) < power else (low, middle)
    return 0.5 * (low + high)


def minimum_detectable_effect(
    sd: float, seeds: int, *, level: float = DEFAULT_LEVEL, power: float = DEFAULT_POWER
) -> float:
    """The smallest true mean difference that a two-sided paired t-test at 1 - level over n = `seeds` seeds
    detects with probability `power` when the seeds' differences spread with std `sd`: delta sd / sqrt(n), delta
    the noncentrality with paired_t_power(delta, n - 1) = power (about (t_{(1+level)/2, n-1} + t_{power, n-1})
    sd / sqrt(n)). nan for n < 2 or a nan sd."""
    _check_level(level)
    if not 0.0 < power < 1.0:
        raise ValueError(f"power must be in (0, 1), got {power}")
    if seeds < 2 or not math.isfinite(sd):
        return math.nan
    return _detectable_noncentrality(seeds - 1, level, power) * sd / math.sqrt(seeds)


def seeds_needed(
    effect: float, sd: float, *, level: float = DEFAULT_LEVEL, power: float = DEFAULT_POWER, most: int = 10_000
) -> int | None:
    """The fewest seeds n >= 2 whose minimum_detectable_effect(sd, n) is at most |effect|; None for a nan sd or
    more than `most` seeds."""
    if not math.isfinite(sd) or effect == 0.0:
        return None
    if sd == 0.0:
        return 2
    low, high = 2, 2
    while minimum_detectable_effect(sd, high, level=level, power=power) > abs(effect):
        if high >= most:
            return None
        low, high = high, min(most, 2 * high)
    while low < high:  # the effect shrinks as n grows: bisect for the first n that reaches it
        middle = (low + high) // 2
        if minimum_detectable_effect(sd, middle, level=level, power=power) <= abs(effect):
            high = middle
        else:
            low = middle + 1
    return high


def hierarchical_bootstrap(
    counts: Sequence[np.ndarray],
    statistic: Callable[[np.ndarray], np.ndarray],
    *,
    resamples: int = DEFAULT_RESAMPLES,
    seed: int = 0,
) -> np.ndarray:
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
            values[start : start + size] = statistic(table[:, tasks].sum(axis=2).T)  # [K, m, T_s] -> [m, K] -> [m]
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


def _interval(
    counts: Sequence[np.ndarray],
    statistic: Callable[[np.ndarray], np.ndarray],
    per_task: bool,
    level: float,
    resamples: int,
    seed: int,
) -> tuple[float, float]:
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
        notes.append(
            "one seed: no interval" if tasks_not_resampled else "one seed: no training variance in the interval"
        )
    return "; ".join(notes)


def arm_estimate(
    runs: Sequence[TaskOutcomes], *, level: float = DEFAULT_LEVEL, resamples: int = DEFAULT_RESAMPLES, seed: int = 0
) -> Estimate:
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
    return Estimate(
        float(np.mean([r.rate for r in runs])),
        low,
        high,
        level,
        len(runs),
        min(len(r.task_ids) for r in runs) if per_task else 0,
        SEEDS_AND_TASKS if per_task else SEEDS_ONLY,
        _note(len(runs), "" if per_task else NO_RECORDS),
    )


def _paired_counts(reference: TaskOutcomes, arm: TaskOutcomes) -> np.ndarray:
    """float64 [4, T] of the tasks both runs played (reference order): reference successes, samples, arm
    successes, samples; [4, 0] without a common task."""
    index = {task: i for i, task in enumerate(arm.task_ids)}
    common = [(i, index[task]) for i, task in enumerate(reference.task_ids) if task in index]
    ref_idx = np.array([i for i, _ in common], dtype=np.int64)
    arm_idx = np.array([j for _, j in common], dtype=np.int64)
    return np.stack(
        [reference.successes[ref_idx], reference.samples[ref_idx], arm.successes[arm_idx], arm.samples[arm_idx]]
    )


def task_sampling_se(counts: np.ndarray) -> float:
    """The standard error that one seed's difference d = R_a - R_r owes to its T held-out tasks (which tasks, and
    their samples' outcomes), from counts float64 [4, T]: reference successes s_r and samples n_r, arm successes s_a
    and samples n_a per task (`_paired_counts`); R = sum_t s_t / sum_t n_t is a run's rate, m = sum_t n_t / T its
    mean samples per task. The ratio of sums linearised: se^2 = sum_t u_t^2 / (T (T - 1)) with
    u_t = (s_a,t - R_a n_a,t) / m_a - (s_r,t - R_r n_r,t) / m_r; with equal samples u_t = x_t - mean(x) for the
    per-task differences x_t = s_a,t / n_a,t - s_r,t / n_r,t, so se^2 = var_t(x_t) / T. nan for T < 2."""
    s_r, n_r, s_a, n_a = counts
    tasks = s_r.size
    if tasks < 2:
        return math.nan
    # u_t = (s_a,t - R_a n_a,t) / m_a - (s_r,t - R_r n_r,t) / m_r
    u = (s_a - s_a.sum() / n_a.sum() * n_a) / n_a.mean() - (s_r - s_r.sum() / n_r.sum() * n_r) / n_r.mean()
    return math.sqrt(float(np.sum(u * u)) / (tasks * (tasks - 1)))


def paired_difference(
    reference: Mapping[int, TaskOutcomes], arm: Mapping[int, TaskOutcomes], *, level: float = DEFAULT_LEVEL
) -> PairedDifference:
    """arm - reference over the seeds both have ({seed: outcomes} each): the seeds' differences d_s = rate_arm,s -
    rate_ref,s on the tasks both runs of seed s played, their mean, t-interval, std and paired t-test (`paired_t`:
    the interval the verdict uses) with the std floored at the task-sampling noise sqrt(mean_s se_s^2)
    (`task_sampling_se`: the d_s cannot truly spread less than their evaluation noise), the sign test over (seed,
    task) pairs of per-task rates and the one over seeds. Without per-task records in every run (or without a
    common task in some seed) each run counts as its rate alone, there is no floor and no task sign test. Raises
    ValueError when the arms share no seed."""
    seeds = sorted(set(reference) & set(arm))
    if not seeds:
        raise ValueError(f"paired_difference: no seed in common (reference {sorted(reference)}, arm {sorted(arm)})")
    counts = [_paired_counts(reference[s], arm[s]) for s in seeds]
    records = all(reference[s].per_task and arm[s].per_task for s in seeds)
    per_task = records and all(c.shape[1] for c in counts)
    if not per_task:
        counts = [np.array([[reference[s].rate], [1.0], [arm[s].rate], [1.0]]) for s in seeds]
    seed_differences = np.array([_rate_difference(c.sum(axis=1)) for c in counts])
    sd_floor = math.sqrt(np.mean([task_sampling_se(c) ** 2 for c in counts])) if per_task else math.nan
    low, high, sd, p_value = paired_t(seed_differences, level, sd_floor if math.isfinite(sd_floor) else 0.0)
    tasks_sign = sign_test(np.concatenate([c[2] / c[3] - c[0] / c[1] for c in counts])) if per_task else None
    common_tasks = min(c.shape[1] for c in counts) if per_task else 0
    notes = (
        []
        if per_task
        else [f"{NO_RECORDS if not records else 'no held-out task in common in some seed'}: no task sign test"]
    )
    if len(seeds) == 1:
        notes.append("one seed: no interval")
    elif sd_floor > sd:  # (False for a nan floor)
        notes.append(f"seeds' sd {sd:.3g} below the task-sampling floor {sd_floor:.3g}: the floor is used")
    elif math.isnan(low):
        notes.append("no spread over seeds or tasks: no interval, p from the sign test over seeds")
    if per_task and any(
        c.shape[1] < min(len(reference[s].task_ids), len(arm[s].task_ids)) for s, c in zip(seeds, counts)
    ):
        notes.append(f"paired on the tasks both arms played ({common_tasks} in the smallest seed)")
    return PairedDifference(
        mean=float(seed_differences.mean()),
        low=low,
        high=high,
        level=level,
        seeds=len(seeds),
        tasks=common_tasks,
        sd=sd,
        sd_floor=sd_floor,
        p_value=p_value,
        tasks_sign=tasks_sign,
        seeds_sign=sign_test(seed_differences),
        note="; ".join(notes),
    )
