"""Timing for the benchmarks (experiments/benchmarks/), which compare implementations side by side in one process."""

import time
from collections.abc import Callable, Sequence

import numpy as np

# Idle time before each timed call. PyTorch's OpenMP threads spin-wait after its step and take cores from whatever
# runs next: on a 2-core machine at batch 2 x 256 the ipa_jax train step (bench_learner) measured 0.28-0.30 s in 4
# of 5 processes without the pause, and 0.21-0.23 s in 10 of 12 with it.
PAUSE_S = 0.2


def time_round_robin(
    fns: dict[str, Callable[[], object]], rounds: int, pause_s: float = PAUSE_S
) -> dict[str, list[float]]:
    """{name: seconds of each round}: one warm-up (compiling) call of every fn, then `rounds` rounds that time each
    fn once, interleaved so that a shared machine's load spreads over all of them; each timed call starts after
    `pause_s` of sleep, so it does not compete with the previous one's idle threads. Each fn must block until its
    work is done."""
    for fn in fns.values():
        fn()
    times = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            time.sleep(pause_s)
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return times


def paired_ratio(
    numerators: Sequence[float], denominators: Sequence[float], confidence: float = 0.95, resamples: int = 10_000
) -> dict[str, float]:
    """The median over rounds of numerators[i] / denominators[i] (two implementations' times in the same round of
    `time_round_robin`: the pairing cancels the load that a shared machine puts on a whole round) with a bootstrap
    percentile interval of that median (rounds resampled with replacement, a fixed seed): {"median", "low",
    "high"}."""
    if len(numerators) != len(denominators) or not numerators:
        raise ValueError(
            f"paired_ratio: needs two equally long, non-empty sequences, got {len(numerators)} and {len(denominators)}"
        )
    ratios = np.asarray(numerators, float) / np.asarray(denominators, float)
    draws = np.random.default_rng(0).choice(ratios, size=(resamples, ratios.size), replace=True)
    low, high = np.quantile(np.median(draws, axis=1), [(1 - confidence) / 2, (1 + confidence) / 2])
    return {"median": float(np.median(ratios)), "low": float(low), "high": float(high)}
