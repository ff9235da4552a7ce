"""ActivityClock: per-kind busy time and overlaps, against intervals written out by hand."""

import threading

from ipa_jax.activity import ActivityClock


class FakeTime:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_busy_time_counts_each_kind_once_and_the_overlap_of_two():
    now = FakeTime()
    clock = ActivityClock(now)
    now.t = 1.0
    with clock.active("generation"):  # generation [1, 6], twice at once in [2, 4]; step [3, 8]; tools [9, 10]
        now.t = 2.0
        with clock.active("generation"):
            now.t = 3.0
            step = clock.active("step")
            step.__enter__()
            now.t = 4.0
        now.t = 6.0
    now.t = 8.0
    step.__exit__(None, None, None)
    now.t = 9.0
    with clock.active("tools"):
        now.t = 10.0
    assert clock.busy_s("generation") == 5.0
    assert clock.busy_s("step") == 5.0
    assert clock.busy_s("generation", "step") == 3.0
    assert clock.busy_s("tools") == 1.0 and clock.busy_s("tools", "step") == 0.0
    assert clock.busy_s("step", without=("generation",)) == 2.0  # [6, 8]
    assert clock.busy_s("generation", without=("step", "tools")) == 2.0  # [1, 3]
    with clock.active("step"):  # still running: counts to now
        now.t = 12.0
        assert clock.busy_s("step") == 7.0


def test_activities_from_several_threads():
    now = FakeTime()
    clock = ActivityClock(now)
    entered, release = threading.Barrier(5), threading.Event()

    def work():
        with clock.active("generation"):
            entered.wait()
            release.wait()

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    entered.wait()
    now.t = 2.5
    release.set()
    for t in threads:
        t.join()
    now.t = 7.0
    assert clock.busy_s("generation") == 2.5


def test_a_wait_for_rollouts_inside_a_weight_sync_counts_as_waiting_not_syncing():
    """A lockstep sync first waits for the batches in flight (batch_wait within weight_sync): the run's breakdown
    gives that wait to batch_wait, and the parts still add up to the wall time."""
    from types import SimpleNamespace

    from ipa_jax.pipeline.run import time_breakdown

    now = FakeTime()
    clock = ActivityClock(now)
    with clock.active("learner_step"):  # [0, 2]
        now.t = 2.0
    with clock.active("weight_sync"):  # [2, 7], of which [2, 6] waiting for the rollouts in flight
        with clock.active("batch_wait"):
            now.t = 6.0
        now.t = 7.0
    now.t = 10.0
    parts = time_breakdown(SimpleNamespace(clock=clock), wall_time_s=10.0)
    assert parts["time_learner_step_s"] == 2.0
    assert parts["time_weight_sync_s"] == 1.0 and parts["time_batch_wait_s"] == 4.0
    assert parts["time_other_s"] == 3.0 and sum(parts.values()) == 10.0
