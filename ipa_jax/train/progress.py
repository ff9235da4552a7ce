"""The learner's console output: a progress bar on a terminal, one compact line every few steps otherwise.

Both show the step out of a total fixed for the run (train.steps: a warm start that ends early on its target counts
as done in full, so the bar jumps there rather than the total shrinking), the phase (IL warm start or RL), the loss,
the phase's own signal (greedy match of expert episodes during the warm start, the batch reward during RL), the
latest held-out success, tokens/s, trajectories dropped (stale: policy lag above queue.max_policy_lag; dropped: any
other reason) once there are any, under dynamic sampling the groups kept of those drawn for the batch, and the time
left from the median time of the phase's last steps (after its first, which compiles; a median, so that a step that
compiles a new shape or waits for an evaluation does not make it jump): during the warm start, the most its
imitation steps can still take (RL steps cost otherwise: they wait for rollouts, so their time is not guessed from
the warm start's), then the RL phase's from its own steps. Evaluations and events (the warm start ending, a resume)
get a line of their own. Only process 0 writes; everything goes to stderr, so stdout holds just the run's summary.
"""

from __future__ import annotations

import collections
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any, TextIO

import jax


def format_duration(seconds: float) -> str:
    """12 -> '12s', 185 -> '3m05s', 7300 -> '2h01m'."""
    seconds = max(int(round(seconds)), 0)
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


class RecentRate:
    """The time a step takes, as the median over the last `window` steps, and the time left at it. A median, not a
    mean: a step that compiles a new shape or waits for an evaluation is an outlier that would make the time left
    jump; and none before `MIN_STEPS` steps, so that a phase's second step (often a compile too) sets no ETA alone."""

    MIN_STEPS = 3

    def __init__(self, window: int, step: int, now: float):
        self._last = (step, now)
        self._per_step: collections.deque[float] = collections.deque(maxlen=window)

    def add(self, step: int, now: float) -> None:
        (last, t0), self._last = self._last, (step, now)
        if step > last:
            self._per_step.append((now - t0) / (step - last))

    def eta(self, remaining: int) -> float | None:
        """Seconds for `remaining` more steps; None before MIN_STEPS steps."""
        return remaining * statistics.median(self._per_step) if len(self._per_step) >= self.MIN_STEPS else None


class Progress:
    """Console progress of one learner run from step `initial` towards `total` planned steps, the last `rl_steps`
    of them RL (the rest a warm start). `step(done=...)` says how many planned steps are done when that differs from
    the step (after a warm start that ended early). `clock`: seconds, for the elapsed time and the rates."""

    ETA_WINDOW = 20  # steps

    def __init__(
        self,
        total: int,
        initial: int,
        every: int,
        stream: TextIO | None = None,
        rl_steps: int = 0,
        clock: Callable[[], float] = time.perf_counter,
    ):
        self.stream = stream or sys.stderr
        self.enabled = jax.process_index() == 0
        self.total, self.every, self.rl_steps = total, every, rl_steps
        self.success: float | None = None  # the latest held-out success
        self._clock = clock
        self._start_time = clock()
        self._rate = RecentRate(self.ETA_WINDOW, initial, self._start_time)
        self._in_warm_start: bool | None = None  # the phase of the last step (None: no step yet)
        self._terminal = self.enabled and self.stream.isatty()
        self._bar = None  # created at the first step, so that constructing a Progress draws nothing

    def step(self, step: int, metrics: dict[str, Any], warm_start: bool, done: int | None = None) -> None:
        """After update `step` (`done` planned steps of `total` done: `step` unless the warm start ended early):
        the bar moves (on a terminal) or, every `every` steps and at the end, a line."""
        if not self.enabled:
            return
        done = step if done is None else done
        now = self._clock()
        if warm_start != self._in_warm_start:  # a phase's first step compiles its program: its rate starts after it
            self._rate = RecentRate(self.ETA_WINDOW, step, now)
        else:
            self._rate.add(step, now)
        self._in_warm_start = warm_start
        if warm_start:
            eta = self._rate.eta(self.total - self.rl_steps - done)
            then = f" to RL (then {self.rl_steps} RL steps)" if self.rl_steps else ""
            left = "" if eta is None else f"ETA <= {format_duration(eta)}{then}"
        else:
            eta = self._rate.eta(self.total - done)
            left = "" if eta is None else f"ETA {format_duration(eta)}"
        fields = {"loss": metrics.get("loss")}
        if warm_start:
            fields["greedy"] = metrics.get("il_greedy_match")
        else:
            fields["reward"] = metrics.get("reward_mean")
        fields["success"] = self.success
        fields["skipped"] = metrics.get("skipped_total") or None  # shown once an update was skipped
        fields["tok/s"] = metrics.get("tokens_per_s")
        stale = metrics.get("source/queue_dropped_stale", 0.0)
        fields["stale"] = stale or None
        fields["dropped"] = (
            metrics.get("dropped_total", 0.0) + metrics.get("source/queue_dropped_total", stale) - stale
        ) or None
        counts = ("tok/s", "skipped", "stale", "dropped")
        shown = {k: f"{float(v):.0f}" if k in counts else f"{float(v):.3g}" for k, v in fields.items() if v is not None}
        if "source/dynamic_groups_drawn" in metrics:  # dynamic sampling: groups kept of those drawn for this batch
            drawn = metrics["source/dynamic_groups_drawn"]
            kept = drawn - metrics["source/dynamic_groups_dropped"]
            bound = " (draw bound)" if metrics.get("source/dynamic_bound_hit") else ""
            shown["groups kept"] = f"{kept:.0f}/{drawn:.0f}{bound}"
        phase = "IL warm start" if warm_start else "RL"
        pairs = "  ".join(f"{k} {v}" for k, v in shown.items())
        if self._terminal and self._bar is None:
            from tqdm import tqdm

            self._bar = tqdm(
                total=self.total,
                initial=done - 1,
                unit="step",
                dynamic_ncols=True,
                file=self.stream,
                bar_format="{desc}{n_fmt}/{total_fmt} |{bar}| {elapsed} elapsed{postfix}",
            )
        if self._bar is not None:
            self._bar.set_description(f"step {step} {phase}", refresh=False)
            self._bar.set_postfix_str("  ".join(x for x in (left, pairs) if x), refresh=False)
            self._bar.update(done - self._bar.n)
        elif step % self.every == 0 or done >= self.total:
            counter = f"{step}/{self.total}" if done == step else f"{step} ({done}/{self.total})"
            elapsed = format_duration(now - self._start_time)
            self.write(f"step {counter} {phase}  {pairs}  ({elapsed} elapsed{', ' + left if left else ''})")

    def evaluated(self, step: int, results: dict[str, float]) -> None:
        self.success = results.get("success", self.success)
        numbers = ", ".join(f"{k} {v:.3g}" for k, v in results.items() if k not in ("episodes", "time_s"))
        sizes = [f"{results['episodes']:.0f} episodes"] if "episodes" in results else []
        sizes += [format_duration(results["time_s"])] if "time_s" in results else []
        self.write(f"eval at step {step}: {numbers}" + (f" ({', '.join(sizes)})" if sizes else ""))

    def write(self, line: str) -> None:
        """A line of its own (above the bar on a terminal)."""
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.write(line, file=self.stream)
        else:
            print(line, file=self.stream, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
