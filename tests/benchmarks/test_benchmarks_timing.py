"""experiments/benchmarks/timing.py: time_round_robin (warm-up, interleaved rounds, the pause before each timed
call) on a fake clock, and paired_ratio against NumPy."""

import numpy as np
import pytest
from benchmark_modules import load_benchmark_module

timing = load_benchmark_module("timing")


class FakeClock:
    """time.perf_counter and time.sleep of a clock that only the work and the pauses move."""

    def __init__(self):
        self.now = 0.0
        self.sleeps = []

    def perf_counter(self):
        return self.now

    def sleep(self, seconds):
        self.sleeps.append(seconds)
        self.now += seconds


def test_round_robin_times_each_call_after_a_pause_without_counting_it(monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(timing, "time", clock)
    calls = []

    def work(name, seconds):
        def fn():
            calls.append((name, clock.now))
            clock.now += seconds

        return fn

    times = timing.time_round_robin({"a": work("a", 0.01), "b": work("b", 0.03)}, rounds=3, pause_s=0.05)
    assert [name for name, _ in calls] == ["a", "b"] * 4  # one warm-up call each, then 3 interleaved rounds
    assert times == {"a": [pytest.approx(0.01)] * 3, "b": [pytest.approx(0.03)] * 3}  # the pause is not counted
    assert clock.sleeps == [0.05] * 6  # one pause before each timed call, none before the warm-up calls
    starts = [t for _, t in calls[2:]]
    assert all(later - earlier >= 0.05 for earlier, later in zip(starts, starts[1:]))


def test_paired_ratio_is_the_median_of_the_rounds_ratios_with_a_bootstrap_interval():
    rng = np.random.default_rng(1)
    load = rng.uniform(1.0, 2.0, 15)  # what slows a whole round slows both implementations in it
    torch_times, ours = 1.1 * load * rng.uniform(0.99, 1.01, 15), load
    got = timing.paired_ratio(list(torch_times), list(ours))
    ratios = torch_times / ours
    assert got["median"] == pytest.approx(np.median(ratios))
    assert got["low"] <= got["median"] <= got["high"]
    assert ratios.min() <= got["low"] and got["high"] <= ratios.max()
    assert 1.08 < got["low"] and got["high"] < 1.12  # the pairing cancels the load's 2x spread
    # the control: resampling each implementation's rounds on their own, the ratio of medians carries the spread
    draws = np.random.default_rng(2).integers(0, 15, size=(2, 2000, 15))
    unpaired = np.median(torch_times[draws[0]], axis=1) / np.median(ours[draws[1]], axis=1)
    low, high = np.quantile(unpaired, [0.025, 0.975])
    assert high - low > 5 * (got["high"] - got["low"])


def test_paired_ratio_rejects_unpaired_times():
    with pytest.raises(ValueError, match="equally long"):
        timing.paired_ratio([1.0, 2.0], [1.0])
    with pytest.raises(ValueError, match="non-empty"):
        timing.paired_ratio([], [])
