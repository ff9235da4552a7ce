"""experiments/benchmarks/timing.py, time_round_robin: warm-up, interleaved rounds, the pause before each timed
call."""

import time

from benchmark_modules import load_benchmark_module

time_round_robin = load_benchmark_module("timing").time_round_robin


def test_round_robin_times_each_call_after_a_pause_without_counting_it():
    calls = []

    def work(name, seconds):
        def fn():
            calls.append((name, time.perf_counter()))
            time.sleep(seconds)

        return fn

    times = time_round_robin({"a": work("a", 0.01), "b": work("b", 0.03)}, rounds=3, pause_s=0.05)
    assert [name for name, _ in calls] == ["a", "b"] * 4  # one warm-up call each, then 3 interleaved rounds
    assert {name: len(t) for name, t in times.items()} == {"a": 3, "b": 3}
    assert all(0.01 <= t < 0.05 for t in times["a"]) and all(0.03 <= t < 0.07 for t in times["b"])  # pause excluded
    starts = [t for _, t in calls[2:]]
    assert all(later - earlier >= 0.05 for earlier, later in zip(starts, starts[1:]))  # the pause before each
