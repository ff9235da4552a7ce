"""The learner's console output: a progress bar on a terminal, one compact line every few steps otherwise.

Both show the step, the phase (IL warm start or RL), the loss, the phase's own signal (greedy match of expert
episodes during the warm start, the batch reward during RL), the latest held-out success, tokens/s and the time left.
Evaluations and events (the warm start ending, a resume) get a line of their own. Only process 0 writes; everything
goes to stderr, so stdout holds just the run's summary.
"""

from __future__ import annotations

import sys
import time
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


class Progress:
    """Console progress of one learner run from step `initial` to `total` (which may shrink when the warm start
    ends early: `set_total`)."""

    def __init__(self, total: int, initial: int, every: int, stream: TextIO | None = None):
        self.stream = stream or sys.stderr
        self.enabled = jax.process_index() == 0
        self.total, self.every = total, every
        self.success: float | None = None  # the latest held-out success
        self._start_step, self._start_time = initial, time.perf_counter()
        self._terminal = self.enabled and self.stream.isatty()
        self._bar = None  # created at the first step, so that constructing a Progress draws nothing

    def set_total(self, total: int) -> None:
        self.total = total
        if self._bar is not None:
            self._bar.total = total
            self._bar.refresh()

    def step(self, step: int, metrics: dict[str, Any], warm_start: bool) -> None:
        """After update `step`: the bar moves (on a terminal) or, every `every` steps and at the end, a line."""
        if not self.enabled:
            return
        fields = {"loss": metrics.get("loss")}
        if warm_start:
            fields["greedy"] = metrics.get("il_greedy_match")
        else:
            fields["reward"] = metrics.get("reward_mean")
        fields["success"] = self.success
        fields["skipped"] = metrics.get("skipped_total") or None  # shown once an update was skipped
        fields["tok/s"] = metrics.get("tokens_per_s")
        shown = {k: f"{float(v):.0f}" if k in ("tok/s", "skipped") else f"{float(v):.3g}" for k, v in fields.items()
                 if v is not None}
        phase = "IL" if warm_start else "RL"
        if self._terminal and self._bar is None:
            from tqdm import tqdm

            self._bar = tqdm(total=self.total, initial=step - 1, unit="step", dynamic_ncols=True, file=self.stream)
        if self._bar is not None:
            self._bar.set_description(phase, refresh=False)
            self._bar.set_postfix(shown, refresh=False)
            self._bar.update(1)
        elif step % self.every == 0 or step >= self.total:
            done = step - self._start_step
            elapsed = time.perf_counter() - self._start_time
            eta = elapsed / done * (self.total - step) if done else 0.0
            pairs = "  ".join(f"{k} {v}" for k, v in shown.items())
            self.write(f"step {step}/{self.total} {phase}  {pairs}  ({format_duration(elapsed)} elapsed, "
                       f"ETA {format_duration(eta)})")

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
