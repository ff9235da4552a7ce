"""Timing for the benchmarks (experiments/benchmarks/), which compare implementations side by side in one process."""

import time
from collections.abc import Callable

# Idle time before each timed call. PyTorch's OpenMP threads spin-wait after its step and take cores from whatever
# runs next: measured on a 2-core machine, the ipa_jax train step right after a torch step took 0.28-0.29 s against
# 0.21 s after a pause (batch 2 x 256).
PAUSE_S = 0.2


def time_round_robin(fns: dict[str, Callable[[], object]], rounds: int,
                     pause_s: float = PAUSE_S) -> dict[str, list[float]]:
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
