"""ipa_jax.analysis.stats against independent references: the bootstrap's spread against the analytic variance of
the same resampling scheme (and the normal interval), the exact sign test against an enumeration of every sign
pattern and hand-computed binomial sums, and degenerate inputs (one seed, all-equal outcomes, no per-task records)
that must give clear output, not NaN warnings or crashes."""

from __future__ import annotations

import itertools
import math
import warnings

import numpy as np
import pytest

from ipa_jax.analysis import stats
from ipa_jax.analysis.stats import TaskOutcomes

Z95 = 1.959963984540054  # the standard normal's 97.5% quantile


def outcomes(successes, samples=None) -> TaskOutcomes:
    successes = np.asarray(successes, dtype=np.float64)
    samples = np.ones_like(successes) if samples is None else np.asarray(samples, dtype=np.float64)
    return TaskOutcomes(tuple(f"task/{i}" for i in range(len(successes))), successes, samples)


def bernoulli_runs(rates, tasks: int, seed: int) -> list[TaskOutcomes]:
    rng = np.random.default_rng(seed)
    return [outcomes(rng.random(tasks) < p) for p in rates]


# ------------------------------------------------------------------------------------ the sign test
def test_sign_test_matches_an_enumeration_of_every_sign_pattern():
    """p = P(a pattern of n fair signs is at least as unbalanced as the observed one), counted over all 2^n."""
    for n_pos, n_neg in [(0, 1), (3, 0), (5, 1), (4, 4), (7, 2), (1, 9), (6, 6)]:
        n = n_pos + n_neg
        observed = abs(n_pos - n_neg)
        extreme = sum(abs(2 * sum(p) - n) >= observed for p in itertools.product((0, 1), repeat=n))
        test = stats.sign_test([0.5] * n_pos + [-0.25] * n_neg + [0.0] * 3)
        assert (test.positive, test.negative, test.ties) == (n_pos, n_neg, 3)
        assert test.p_value == pytest.approx(extreme / 2**n, rel=1e-12)


def test_sign_test_hand_computed_values():
    # 9 of 10 positive: 2 * (C(10,0) + C(10,1)) / 2^10 = 22 / 1024.
    assert stats.sign_test([1] * 9 + [-1]).p_value == pytest.approx(22 / 1024, rel=1e-12)
    # 6 of 6: 2 / 64, the smallest two-sided p of six seeds.
    assert stats.sign_test([0.1] * 6).p_value == pytest.approx(2 / 64, rel=1e-12)
    # 2 of 2 seeds: p = 0.5 (two seeds can never reach 0.05).
    assert stats.sign_test([0.3, 0.1]).p_value == 0.5
    # A large n: the exact integer sum still works (k = 1000 of 2500 positive: far in the tail, no underflow to nan).
    big = stats.sign_test([1.0] * 1000 + [-1.0] * 1500)
    assert 0.0 <= big.p_value < 1e-20 and math.isfinite(big.p_value)
    nothing = stats.sign_test([0.0, 0.0])
    assert (nothing.positive, nothing.negative, nothing.ties, nothing.p_value) == (0, 0, 2, 1.0)


# ------------------------------------------------------------------------------------ the bootstrap
def test_single_seed_interval_is_the_normal_interval_of_a_proportion():
    """One seed of 2000 Bernoulli tasks: the task bootstrap of the mean approaches p +- z * sqrt(p (1 - p) / T)."""
    (run,) = bernoulli_runs([0.3], tasks=2000, seed=1)
    est = stats.arm_estimate([run], resamples=20_000, seed=3)
    p = run.successes.mean()
    half = Z95 * math.sqrt(p * (1 - p) / 2000)
    assert est.mean == pytest.approx(p, abs=1e-15) and est.seeds == 1 and est.tasks == 2000
    assert est.low == pytest.approx(p - half, abs=0.05 * half)
    assert est.high == pytest.approx(p + half, abs=0.05 * half)
    assert est.resampled == stats.SEEDS_AND_TASKS and "one seed" in est.note


def test_hierarchical_bootstrap_spread_matches_its_analytic_variance():
    """S seeds with different success rates, T tasks each (n = 1). One bootstrap slot is a seed drawn uniformly,
    then its task mean over T drawn tasks, so Var(slot) = mean_s p_s (1 - p_s) / T + var_s(p_s) (ddof 0, over the
    observed rates p_s), and the mean of S independent slots has variance Var(slot) / S."""
    rates = np.linspace(0.2, 0.8, 12)
    runs = bernoulli_runs(rates, tasks=60, seed=2)
    observed = np.array([r.successes.mean() for r in runs])
    within = np.mean(observed * (1 - observed) / 60)
    between = observed.var()
    analytic_sd = math.sqrt((within + between) / len(runs))
    counts = [np.stack([r.successes, r.samples]) for r in runs]
    draws = stats.hierarchical_bootstrap(counts, lambda sums: sums[..., 0] / sums[..., 1], resamples=20_000, seed=5)
    assert draws.dtype == np.float64 and draws.shape == (20_000,)
    assert draws.mean() == pytest.approx(observed.mean(), abs=0.02 * analytic_sd)
    assert draws.std() == pytest.approx(analytic_sd, rel=0.03)
    # Seed variance dominates here: an interval of tasks alone would be far too narrow.
    assert between > 5 * within
    est = stats.arm_estimate(runs, resamples=20_000, seed=5)
    assert est.high - est.low == pytest.approx(2 * Z95 * analytic_sd, rel=0.06)


def test_ratio_of_sums_weights_tasks_by_their_finished_samples():
    run = outcomes([3, 0, 1], samples=[4, 2, 1])  # 4 successes of 7 finished episodes
    assert run.rate == pytest.approx(4 / 7)
    assert stats.arm_estimate([run, outcomes([1, 1])], resamples=200).mean == pytest.approx((4 / 7 + 1) / 2)


def test_paired_difference_is_the_t_interval_of_the_seeds_differences():
    """Four seeds, both arms on the same tasks: the interval, sd and p are scipy's paired t-test on the seeds' rate
    differences; the task sign test counts every (seed, task) pair."""
    scipy_stats = pytest.importorskip("scipy.stats")
    rng = np.random.default_rng(4)
    base = {s: rng.random(200) < 0.3 + 0.1 * s for s in range(4)}
    better = {s: base[s] | (rng.random(200) < 0.05 + 0.05 * s) for s in range(4)}  # fixes tasks, breaks none
    diff = stats.paired_difference(
        {s: outcomes(b) for s, b in base.items()}, {s: outcomes(b) for s, b in better.items()}
    )
    d = np.array([better[s].mean() - base[s].mean() for s in range(4)])
    low, high = scipy_stats.t.interval(0.95, 3, loc=d.mean(), scale=d.std(ddof=1) / 2)
    assert diff.mean == pytest.approx(d.mean(), abs=1e-15) and diff.sd == pytest.approx(d.std(ddof=1), rel=1e-12)
    assert (diff.low, diff.high) == pytest.approx((low, high), rel=1e-10)
    assert diff.p_value == pytest.approx(scipy_stats.ttest_1samp(d, 0.0).pvalue, rel=1e-9)
    assert diff.low > 0 and diff.verdict("higher") == "supported" and diff.verdict("lower") == "contradicted"
    fixed = int(sum((better[s] & ~base[s]).sum() for s in range(4)))
    assert (diff.tasks_sign.positive, diff.tasks_sign.negative) == (fixed, 0)
    assert diff.tasks_sign.p_value == pytest.approx(2 * 0.5**fixed, rel=1e-12)
    assert diff.minimum_detectable_effect() == stats.minimum_detectable_effect(diff.sd, 4)


def test_paired_difference_pairs_by_seed_and_task_id():
    """Seeds present in one arm only and tasks played by one arm only are left out; task order does not matter."""
    ref = {0: outcomes([1, 0, 1, 0]), 1: outcomes([0, 0, 1, 1]), 2: outcomes([1, 1, 1, 1])}
    swapped = TaskOutcomes(("task/3", "task/2", "task/1", "task/9"), np.array([1.0, 1, 1, 1]), np.ones(4))
    arm = {0: swapped, 1: outcomes([1, 0, 1, 1]), 5: outcomes([0, 0, 0, 0])}
    diff = stats.paired_difference(ref, arm)
    # Seed 0 on tasks 1..3: ref (0, 1, 0) -> arm (1, 1, 1): +2/3; seed 1 on tasks 0..3: +1/4.
    assert diff.seeds == 2 and diff.tasks == 3
    assert diff.mean == pytest.approx((2 / 3 + 1 / 4) / 2)
    assert (diff.tasks_sign.positive, diff.tasks_sign.negative, diff.tasks_sign.ties) == (3, 0, 4)
    assert (diff.seeds_sign.positive, diff.seeds_sign.negative) == (2, 0)
    assert "paired on the tasks both arms played" in diff.note
    with pytest.raises(ValueError, match="no seed in common"):
        stats.paired_difference({0: ref[0]}, {1: arm[1]})


def test_repeated_tasks_are_merged_and_aborted_tasks_dropped():
    run = TaskOutcomes.from_records(
        [
            {"task_id": "a", "samples": 2, "successes": 1},
            {"task_id": "b", "samples": 0, "successes": 0},
            {"task_id": "a", "samples": 2, "successes": 2},
        ]
    )
    assert run.task_ids == ("a",) and run.successes.tolist() == [3.0] and run.samples.tolist() == [4.0]
    with pytest.raises(ValueError, match="no task with a finished sample"):
        TaskOutcomes.from_records([{"task_id": "a", "samples": 0, "successes": 0}])
    with pytest.raises(ValueError, match="distinct"):
        TaskOutcomes(("a", "a"), np.ones(2), np.ones(2))
    with pytest.raises(ValueError, match="successes <= samples"):
        outcomes([2], samples=[1])


# ------------------------------------------------------------------------------------ verdicts, degenerate cases
@pytest.mark.parametrize(
    "low, high, claim, expected",
    [
        (0.01, 0.2, "higher", "supported"),
        (0.01, 0.2, "lower", "contradicted"),
        (-0.3, -0.1, "higher", "contradicted"),
        (-0.3, -0.1, "lower", "supported"),
        (-0.1, 0.2, "higher", "inconclusive"),
        (0.0, 0.2, "higher", "inconclusive"),
        (0.0, 0.0, "lower", "inconclusive"),
        (math.nan, math.nan, "higher", "inconclusive"),
    ],
)
def test_verdict(low, high, claim, expected):
    assert stats.verdict(low, high, claim) == expected


def test_verdict_rejects_an_unknown_claim():
    with pytest.raises(ValueError, match="claim must be one of"):
        stats.verdict(0.1, 0.2, "better")


def test_degenerate_inputs_give_clear_output_without_nan_warnings():
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a 0/0 or an empty mean would raise here
        # All tasks solved by both arms, one seed: zero-width intervals at 1 and at 0, every pair tied.
        solved = outcomes(np.ones(16))
        est = stats.arm_estimate([solved], resamples=300)
        assert (est.mean, est.low, est.high) == (1.0, 1.0, 1.0) and "one seed" in est.note
        diff = stats.paired_difference({3: solved}, {3: solved})
        assert diff.mean == 0.0 and math.isnan(diff.low) and math.isnan(diff.p_value) and "one seed" in diff.note
        assert diff.verdict("higher") == "inconclusive" and math.isnan(diff.minimum_detectable_effect())
        assert diff.tasks_sign.ties == 16 and diff.tasks_sign.p_value == 1.0 and diff.seeds_sign.p_value == 1.0
        # Two seeds with the same difference: no spread over seeds, but the tasks' (x = [1, 0] and [0, 1]:
        # se^2 = var(x) / 2 = 1/4 in each seed) floors it at 0.5 (test_identical_seed_differences_... below).
        same = stats.paired_difference(
            {0: outcomes([0, 1]), 1: outcomes([1, 0])}, {0: outcomes([1, 1]), 1: outcomes([1, 1])}
        )
        assert (same.mean, same.sd, same.sd_floor, same.sd_used) == (0.5, 0.0, 0.5, 0.5)
        assert same.low < 0 < 0.5 < same.high and same.verdict("higher") == "inconclusive"
        # Identical outcomes everywhere: no spread at all, so no interval, and p from the sign test over seeds.
        tied = stats.paired_difference({0: solved, 1: solved}, {0: solved, 1: solved})
        assert math.isnan(tied.low) and math.isnan(tied.high) and tied.p_value == 1.0 and tied.sd_floor == 0.0
        assert "no spread over seeds or tasks" in tied.note and math.isnan(tied.minimum_detectable_effect())
        # No per-task records, one seed: no interval at all, said so; two seeds: the seeds' range.
        old = stats.arm_estimate([TaskOutcomes.from_rate(0.4)], resamples=300)
        assert old.mean == 0.4 and math.isnan(old.low) and math.isnan(old.high) and old.tasks == 0
        assert old.resampled == stats.SEEDS_ONLY and "no interval" in old.note and stats.NO_RECORDS in old.note
        two = stats.arm_estimate([TaskOutcomes.from_rate(0.4), TaskOutcomes.from_rate(0.6)], resamples=300)
        assert two.mean == pytest.approx(0.5) and (two.low, two.high) == (0.4, 0.6)
        # A run without records makes its arm's pairs seed-level: no task sign test.
        mixed = stats.paired_difference(
            {0: outcomes([1, 0]), 1: outcomes([1, 1])}, {0: TaskOutcomes.from_rate(1.0), 1: outcomes([1, 1])}
        )
        assert mixed.tasks_sign is None and mixed.tasks == 0 and mixed.seeds == 2 and mixed.low < 0 < mixed.high
        assert mixed.mean == pytest.approx(0.25) and stats.NO_RECORDS in mixed.note
        # Same tasks, different ids in every seed: nothing to pair task by task.
        disjoint = stats.paired_difference({0: outcomes([1, 0])}, {0: TaskOutcomes(("x",), np.ones(1), np.ones(1))})
        assert disjoint.tasks_sign is None and "no held-out task in common" in disjoint.note
        assert math.isnan(disjoint.low) and disjoint.mean == pytest.approx(0.5)


def task_floor(reference: list[np.ndarray], arm: list[np.ndarray], samples: int) -> float:
    """sqrt(mean_s var_t(x_s,t) / T), x_s,t = arm rate - reference rate of task t in seed s (equal samples)."""
    x = [(a - r) / samples for r, a in zip(reference, arm)]
    return math.sqrt(np.mean([np.var(xs, ddof=1) / xs.size for xs in x]))


def test_identical_seed_differences_are_floored_at_the_task_sampling_noise():
    """Two seeds of 128 tasks in which the arm fixes exactly one task: d_s = 1/128 in both, sd 0 over seeds. The
    t-test then rests on the task-sampling floor sqrt(mean_s var_t(x_t) / T) (x_t: the per-task differences): its
    interval is the t-interval with that sd, wide enough to hold 0 and the observed difference (inconclusive, where
    a zero sd would have made it 'supported' at p = 0)."""
    scipy_stats = pytest.importorskip("scipy.stats")
    tasks, rng = 128, np.random.default_rng(7)
    reference = [(rng.random(tasks) < 0.5).astype(np.float64) for _ in range(2)]
    arm = [r.copy() for r in reference]
    for a in arm:
        a[np.flatnonzero(a == 0)[0]] = 1.0  # its one win: a task the reference failed
    diff = stats.paired_difference(dict(enumerate(map(outcomes, reference))), dict(enumerate(map(outcomes, arm))))
    floor = task_floor(reference, arm, samples=1)
    assert diff.mean == pytest.approx(1 / 128) and diff.sd == 0.0
    assert diff.sd_floor == pytest.approx(floor, rel=1e-12) and diff.sd_used == diff.sd_floor
    low, high = scipy_stats.t.interval(0.95, 1, loc=1 / 128, scale=floor / math.sqrt(2))
    assert (diff.low, diff.high) == pytest.approx((low, high), rel=1e-10)
    assert diff.p_value == pytest.approx(2 * scipy_stats.t.sf(1 / 128 * math.sqrt(2) / floor, 1), rel=1e-9)
    assert diff.low < 0 < diff.mean < diff.high and diff.verdict("higher") == "inconclusive"
    assert "below the task-sampling floor" in diff.note
    assert diff.minimum_detectable_effect() == stats.minimum_detectable_effect(floor, 2)


def test_the_floor_weights_tasks_by_their_samples():
    """Unequal samples per task: se^2 = sum_t u_t^2 / (T (T - 1)), u_t the linearised ratio of sums, written out
    here; with equal samples it is var_t(x_t) / T."""
    rng = np.random.default_rng(3)
    n_r, n_a = rng.integers(1, 5, 40).astype(np.float64), rng.integers(1, 5, 40).astype(np.float64)
    s_r, s_a = rng.binomial(n_r.astype(int), 0.4).astype(np.float64), rng.binomial(n_a.astype(int), 0.6)
    rate_r, rate_a = s_r.sum() / n_r.sum(), s_a.sum() / n_a.sum()
    u = (s_a - rate_a * n_a) / n_a.mean() - (s_r - rate_r * n_r) / n_r.mean()
    counts = np.stack([s_r, n_r, s_a, n_a])
    assert stats.task_sampling_se(counts) == pytest.approx(math.sqrt(np.sum(u**2) / (40 * 39)), rel=1e-12)
    equal = np.stack([s_r, 4 * np.ones(40), s_a, 4 * np.ones(40)])
    x = (s_a - s_r) / 4
    assert stats.task_sampling_se(equal) == pytest.approx(math.sqrt(np.var(x, ddof=1) / 40), rel=1e-12)
    assert math.isnan(stats.task_sampling_se(counts[:, :1]))


def test_a_seed_spread_above_the_floor_is_left_as_it_was():
    """Seeds whose differences spread well beyond their task noise: the floor is below the sd, and the interval and
    p are the plain paired t-test's on the seeds' differences (scipy), as without a floor."""
    scipy_stats = pytest.importorskip("scipy.stats")
    rng = np.random.default_rng(11)
    reference = [(rng.random(200) < 0.4).astype(np.float64) for _ in range(5)]
    arm = [np.where(rng.random(200) < shift, 1.0, r) for r, shift in zip(reference, (0.0, 0.1, 0.3, 0.05, 0.5))]
    diff = stats.paired_difference(dict(enumerate(map(outcomes, reference))), dict(enumerate(map(outcomes, arm))))
    d = np.array([a.mean() - r.mean() for r, a in zip(reference, arm)])
    assert diff.sd_floor == pytest.approx(task_floor(reference, arm, samples=1), rel=1e-12)
    assert diff.sd_floor < d.std(ddof=1) / 2 and diff.sd_used == diff.sd == pytest.approx(d.std(ddof=1), rel=1e-12)
    interval = scipy_stats.t.interval(0.95, 4, loc=d.mean(), scale=d.std(ddof=1) / math.sqrt(5))
    assert (diff.low, diff.high) == pytest.approx(interval, rel=1e-10)
    assert diff.p_value == pytest.approx(scipy_stats.ttest_1samp(d, 0.0).pvalue, rel=1e-9)
    assert "floor" not in diff.note


def test_without_records_a_zero_spread_takes_the_sign_test():
    """Runs without per-task records have no floor: identical differences give no interval and the sign test's p
    over seeds (2 / 2^3 for three seeds of one sign), never p = 0."""
    reference = {s: TaskOutcomes.from_rate(0.5) for s in range(3)}
    arm = {s: TaskOutcomes.from_rate(0.75) for s in range(3)}
    diff = stats.paired_difference(reference, arm)
    assert diff.mean == 0.25 and diff.sd == 0.0 and math.isnan(diff.sd_floor) and math.isnan(diff.sd_used)
    assert math.isnan(diff.low) and math.isnan(diff.high) and diff.p_value == 2 / 2**3
    assert diff.verdict("higher") == "inconclusive" and "p from the sign test over seeds" in diff.note
    assert stats.paired_t([0.25, 0.25, 0.25])[3] == 0.25 and stats.paired_t([0.0, 0.0])[3] == 1.0


def test_the_same_seed_gives_the_same_interval():
    runs = bernoulli_runs([0.4, 0.6, 0.5], tasks=32, seed=0)
    a, b = (stats.arm_estimate(runs, resamples=1000, seed=7) for _ in range(2))
    assert (a.low, a.high) == (b.low, b.high)
    assert stats.arm_estimate(runs, resamples=1000, seed=8).low != a.low


# ------------------------------------------------------------------------------------ t, Holm, power
@pytest.mark.parametrize("dof", [1, 2, 3, 4, 7, 30])
def test_student_t_cdf_and_quantile_match_scipy(dof):
    scipy_stats = pytest.importorskip("scipy.stats")
    for t in (-40.0, -3.1, -0.7, 0.0, 0.4, 2.2, 12.0):
        assert stats.student_t_cdf(t, dof) == pytest.approx(scipy_stats.t.cdf(t, dof), abs=1e-13)
    for q in (0.01, 0.2, 0.5, 0.8, 0.975, 0.999):
        assert stats.student_t_quantile(q, dof) == pytest.approx(scipy_stats.t.ppf(q, dof), rel=1e-11, abs=1e-13)
    with pytest.raises(ValueError, match="integer dof"):
        stats.student_t_cdf(1.0, 0)


def test_holm_rejects_what_the_step_down_procedure_rejects():
    """Holm's procedure at alpha: walk the p-values up from the smallest, reject while p_(i) <= alpha / (m - i + 1)
    (i from 1), stop at the first that is not; the adjusted p-values must reject exactly those at every alpha."""
    p = [0.04, 0.001, 0.03, 0.5, math.nan, 0.012, 0.2]
    adjusted = stats.holm(p)
    assert math.isnan(adjusted[4])
    finite = sorted((v, i) for i, v in enumerate(p) if math.isfinite(v))
    for alpha in (0.005, 0.01, 0.05, 0.07, 0.1, 0.3, 0.6, 1.0):
        rejected = set()
        for rank, (value, i) in enumerate(finite):
            if value > alpha / (len(finite) - rank):
                break
            rejected.add(i)
        assert {i for i, a in enumerate(adjusted) if a <= alpha} == rejected
    assert adjusted[1] == pytest.approx(6 * 0.001) and adjusted[3] == 0.5 and adjusted[6] == pytest.approx(0.4)
    assert stats.holm([]) == [] and stats.holm([0.02]) == [0.02]


@pytest.mark.parametrize("seeds, alpha", [(3, 0.05), (4, 0.05), (8, 0.05), (40, 0.05), (8, 0.05 / 3)])
def test_minimum_detectable_effect_has_the_stated_power(seeds, alpha):
    """At the detectable effect the paired t-test's power at two-sided `alpha` (scipy's noncentral t) is 80%;
    seeds_needed is the first seed count whose detectable effect reaches the effect (a plain loop over n)."""
    scipy_stats = pytest.importorskip("scipy.stats")
    sd, level = 0.07, 1 - alpha
    effect = stats.minimum_detectable_effect(sd, seeds, level=level)
    critical = scipy_stats.t.ppf(1 - alpha / 2, seeds - 1)
    noncentrality = effect * math.sqrt(seeds) / sd
    power = scipy_stats.nct.sf(critical, seeds - 1, noncentrality) + scipy_stats.nct.cdf(
        -critical, seeds - 1, noncentrality
    )
    assert power == pytest.approx(0.8, abs=1e-5)
    assert stats.seeds_needed(effect, sd, level=level) == seeds
    assert stats.seeds_needed(0.05, sd, level=level) == next(
        n for n in range(2, 200) if stats.minimum_detectable_effect(sd, n, level=level) <= 0.05
    )
    assert math.isnan(stats.minimum_detectable_effect(sd, 1)) and stats.seeds_needed(0.05, math.nan) is None
