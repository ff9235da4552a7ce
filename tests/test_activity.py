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
