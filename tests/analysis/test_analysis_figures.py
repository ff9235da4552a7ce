"""A run's learning-curve figure (`analysis.figures.run_figure`, experiments/plot_run.py): every evaluation drawn at
its step and success, the full and the periodic (smaller) ones apart, each phase's training signal on its own steps."""

import json
import os
import subprocess
import sys

import numpy as np

from ipa_jax.analysis.figures import run_figure

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RL_START, STEPS = 6, 12


def _write_run(run_dir):
    """metrics.jsonl of a run: a warm start to step 6 (greedy match), RL to 12 (batch reward), evaluations on 8 tasks
    at 0, 6 and 12 and on 3 tasks at 8 and 10."""
    os.makedirs(run_dir)
    rows = [{"step": 0, "eval/success": 0.0, "eval/episodes": 8.0}]
    for s in range(1, STEPS + 1):
        signal = {"il_greedy_match": s / 10} if s <= RL_START else {"reward_mean": s / 20}
        rows.append({"step": s, "loss": 1.0, "rl_start": RL_START, **signal})
        if s in (RL_START, 8, 10, STEPS):
            rows.append({"step": s, "eval/success": s / 16, "eval/episodes": 8.0 if s in (RL_START, STEPS) else 3.0})
    with open(os.path.join(run_dir, "metrics.jsonl"), "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)


def test_the_figure_draws_every_evaluation_and_each_phases_signal(tmp_path):
    run_dir = str(tmp_path / "run")
    _write_run(run_dir)
    success_ax, signal_ax = run_figure(run_dir).axes
    lines = {line.get_label(): line for line in success_ax.get_lines()}
    full, periodic = lines["8 held-out tasks"], lines["3 held-out tasks"]
    np.testing.assert_array_equal(full.get_xdata(), [0, RL_START, STEPS])
    np.testing.assert_allclose(full.get_ydata(), [0.0, 100 * RL_START / 16, 100 * STEPS / 16])
    np.testing.assert_array_equal(periodic.get_xdata(), [8, 10])
    assert periodic.get_markerfacecolor() == "white"  # hollow: the smaller set
    signals = {line.get_label(): line.get_xdata() for line in signal_ax.get_lines()}
    np.testing.assert_array_equal(signals["expert episodes reproduced (warm start)"], range(1, RL_START + 1))
    np.testing.assert_array_equal(signals["batch reward (RL)"], range(RL_START + 1, STEPS + 1))
    assert all(RL_START in line.get_xdata() for ax in (success_ax, signal_ax) for line in ax.get_lines()[-1:])


def test_plot_run_writes_the_png(tmp_path):
    run_dir = str(tmp_path / "run")
    _write_run(run_dir)
    out = tmp_path / "figure.png"
    proc = subprocess.run(
        [sys.executable, os.path.join(REPO, "experiments", "plot_run.py"), f"--run={run_dir}", f"--out={out}"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
