"""The verdict interval's coverage, simulated: 4-seed experiments whose two arms have the same true success
(difference 0), so the interval should hold 0 in about 95% of them. Every seed and arm plays the same held-out
tasks: a task's difficulty (its logit) is drawn once per experiment and shared by all seeds and both arms; each
(seed, arm) run adds its own training effect to the logit; outcomes are Bernoulli draws per sample. Two regimes:
task noise dominates (no seed effect to speak of, few tasks, one sample) and seed variance dominates (a large seed
effect, many tasks). The paired t-interval must cover >= 93% in both; the hierarchical bootstrap that resamples
tasks inside seeds does not (too narrow where seeds dominate), which shows the test can fail."""

from __future__ import annotations

import numpy as np
import pytest

from ipa_jax.analysis import stats
from ipa_jax.analysis.stats import TaskOutcomes

SEEDS = 4
# name: (seed-effect sd, task-difficulty sd, tasks, samples per task) on the logit scale.
REGIMES = {"task noise dominates": (0.02, 1.5, 32, 1), "seed variance dominates": (0.4, 1.0, 256, 2)}


def simulate(regime: str, experiments: int, seed: int) -> np.ndarray:
    """Successes [experiments, SEEDS, 2 arms, tasks] with the same true success for both arms."""
    seed_sd, task_sd, tasks, samples = REGIMES[regime]
    rng = np.random.default_rng(seed)
    task = rng.normal(0.0, task_sd, (experiments, 1, 1, tasks))  # shared by every seed and arm
    run = rng.normal(0.0, seed_sd, (experiments, SEEDS, 2, 1))  # a run's training effect
    return rng.binomial(samples, 1.0 / (1.0 + np.exp(-(task + run)))).astype(np.float64)


def as_runs(successes: np.ndarray, samples: int) -> list[dict[int, TaskOutcomes]]:
    """(reference, arm) {seed: TaskOutcomes} of one experiment's successes [SEEDS, 2, tasks]."""
    ids = tuple(f"task/{t}" for t in range(successes.shape[-1]))
    total = np.full(successes.shape[-1], float(samples))
    return [{s: TaskOutcomes(ids, successes[s, a], total) for s in range(SEEDS)} for a in (0, 1)]


@pytest.mark.parametrize("regime", list(REGIMES))
def test_the_verdict_interval_covers_a_zero_difference(regime):
    samples = REGIMES[regime][3]
    experiments = simulate(regime, 1000, seed=0)
    covered = [(d.low <= 0.0 <= d.high) for d in (stats.paired_difference(*as_runs(e, samples)) for e in experiments)]
    assert np.mean(covered) >= 0.93


def test_the_nested_bootstrap_undercovers_where_seed_variance_dominates():
    samples = REGIMES["seed variance dominates"][3]
    covered = []
    for i, experiment in enumerate(simulate("seed variance dominates", 200, seed=1)):
        reference, arm = as_runs(experiment, samples)
        counts = [
            np.stack([reference[s].successes, reference[s].samples, arm[s].successes, arm[s].samples])
            for s in range(SEEDS)
        ]
        draws = stats.hierarchical_bootstrap(
            counts, lambda sums: sums[..., 2] / sums[..., 3] - sums[..., 0] / sums[..., 1], resamples=500, seed=i
        )
        low, high = stats.percentile_interval(draws)
        covered.append(low <= 0.0 <= high)
    assert np.mean(covered) < 0.9
