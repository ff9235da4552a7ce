"""One run's learning curve as a figure (the README's, `experiments/plot_run.py`): held-out success at every
evaluation beside the training signal of each phase, the warm start's end marked.

Drawn on a bare matplotlib Figure (no pyplot state, no display), as the ablation plots are."""

from __future__ import annotations

import os

import numpy as np

from ipa_jax.analysis.curves import EVAL_SUCCESS, series, smooth
from ipa_jax.pipeline import RunFolder

SIGNAL_WINDOW = 10  # steps of the training signal's moving average


def run_figure(run_dir: str, title: str | None = None):
    """A Figure of the run in `run_dir`: left, held-out success at each evaluation (filled: on all the held-out
    tasks; hollow: the smaller periodic set, train.eval_every_episodes); right, the share of expert episodes greedy
    decoding reproduces during the warm start and the batch reward during RL (moving averages); the step where RL
    starts dotted in both."""
    from matplotlib.figure import Figure

    folder = RunFolder(run_dir)
    rows = folder.read_metrics()
    rl_start = folder.rl_start(rows)
    fig = Figure(figsize=(10, 3.6), dpi=110)
    success_ax, signal_ax = fig.subplots(1, 2)
    evals = [r for r in rows if EVAL_SUCCESS in r]
    tasks = np.array([r.get("eval/episodes", np.nan) for r in evals])
    full = tasks == np.nanmax(tasks) if len(evals) and not np.isnan(tasks).all() else np.ones(len(evals), bool)
    steps, success = np.array([r["step"] for r in evals]), 100 * np.array([r[EVAL_SUCCESS] for r in evals])
    success_ax.plot(steps, success, color="C0", alpha=0.5)
    success_ax.plot(steps[full], success[full], "o", color="C0", label=_tasks_label(tasks[full]))
    if (~full).any():
        label = _tasks_label(tasks[~full])
        success_ax.plot(steps[~full], success[~full], "o", mfc="white", color="C0", label=label)
    success_ax.set(title="held-out success (%)", xlabel="step", ylim=(0, 100))
    for key, label, color, phase in (
        ("il_greedy_match", "expert episodes reproduced (warm start)", "C2", lambda s: s <= rl_start),
        ("reward_mean", "batch reward (RL)", "C1", lambda s: s > rl_start),
    ):
        at, values = series(rows, key)
        keep = phase(at)
        if keep.any():
            signal_ax.plot(at[keep], smooth(values[keep], SIGNAL_WINDOW), color=color, label=label)
    signal_ax.set(title=f"training signal (moving average of {SIGNAL_WINDOW})", xlabel="step", ylim=(0, 1))
    for ax in (success_ax, signal_ax):
        ax.axvline(rl_start, color="grey", linestyle=":")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8, loc="lower right")
    fig.suptitle(title or f"{os.path.basename(os.path.normpath(run_dir))}: RL from step {rl_start} (dotted)")
    fig.tight_layout()
    return fig


def _tasks_label(tasks: np.ndarray) -> str:
    return "held-out tasks" if np.isnan(tasks).all() else f"{int(np.nanmax(tasks))} held-out tasks"
