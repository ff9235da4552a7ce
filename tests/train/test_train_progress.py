"""The learner's console output: compact lines off a terminal with a fixed total and an ETA from the recent rate,
evaluation lines, and no library INFO noise."""

import io
import os
import re
import subprocess
import sys

from cpu_env import xla_flags
from train_helpers import REPO, TINY_CONFIG, synthetic_trajectories

from ipa_jax.train.progress import Progress, RecentRate, format_duration
from ipa_jax.trajectory import write_jsonl


def test_format_duration():
    assert [format_duration(s) for s in (0, 12.4, 60, 185, 7300)] == ["0s", "12s", "1m00s", "3m05s", "2h01m"]


def test_lines_every_n_steps_and_at_the_end_off_a_terminal():
    out = io.StringIO()  # not a TTY: lines, no bar
    progress = Progress(total=7, initial=0, every=3, stream=out)
    progress.evaluated(0, {"success": 0.25, "reward": 0.25, "episodes": 8, "time_s": 3.0})
    for step in range(1, 8):
        progress.step(
            step,
            {"loss": 0.5, "il_greedy_match": 0.125, "reward_mean": 0.75, "tokens_per_s": 1234.5},
            warm_start=step <= 3,
        )
    progress.close()
    lines = out.getvalue().splitlines()
    assert lines[0] == "eval at step 0: success 0.25, reward 0.25 (8 episodes, 3s)"
    steps = [line for line in lines if line.startswith("step ")]
    assert [line.split()[1] for line in steps] == ["3/7", "6/7", "7/7"]
    assert "IL warm start" in steps[0] and "greedy 0.125" in steps[0] and "reward" not in steps[0]
    assert "RL" in steps[1] and "reward 0.75" in steps[1] and "success 0.25" in steps[1] and "tok/s 1234" in steps[1]
    assert "ETA" in steps[-1]


def test_training_console_is_progress_not_library_logs(tmp_path):
    data = tmp_path / "data.jsonl"
    write_jsonl(data, synthetic_trajectories(16))
    cmd = [
        sys.executable,
        os.path.join(REPO, "experiments", "train.py"),
        f"--config={TINY_CONFIG}",
        f"--config.train.data=('{data}',)",
        "--config.train.steps=2",
        "--config.checkpoint.every=1",
        "--config.logging.console_every=1",
        "--config.logging.tensorboard=False",
        f"--config.train.run_dir={tmp_path / 'run'}",
    ]
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": xla_flags(1)}
    quiet = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert quiet.returncode == 0, quiet.stderr[-3000:]
    info = re.compile(r"^I\d{4} ", re.M)  # absl's INFO prefix (Orbax logs every checkpoint step at INFO)
    assert not info.search(quiet.stderr), quiet.stderr[:2000]
    assert re.search(r"^step 1/2 RL .*loss", quiet.stderr, re.M) and re.search(r"^step 2/2 RL", quiet.stderr, re.M)
    assert "steps: 2" in quiet.stdout  # the summary, on stdout
    verbose = subprocess.run(
        cmd[:-1] + [f"--config.train.run_dir={tmp_path / 'run2'}", "--verbosity=0"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert verbose.returncode == 0 and info.search(verbose.stderr)  # --verbosity=0 brings the INFO logs back


def test_skipped_updates_show_once_there_are_any():
    out = io.StringIO()
    progress = Progress(total=2, initial=0, every=1, stream=out)
    progress.step(1, {"loss": 0.5, "reward_mean": 0.5, "skipped_total": 0}, warm_start=False)
    progress.step(2, {"loss": 0.5, "reward_mean": 0.5, "skipped_total": 1}, warm_start=False)
    first, second = out.getvalue().splitlines()
    assert "skipped" not in first and "skipped 1 " in second


def test_the_eta_is_the_median_step_of_the_last_steps():
    """Steps of 1 s with a 100 s compile among them: the ETA stays at 1 s a step (a mean would jump to ~34 s a step);
    none before 3 steps; over a window of 4 steps, a change of pace shows once it is most of the window."""
    rate = RecentRate(window=4, step=0, now=0.0)
    durations = [1.0, 100.0, 1.0, 1.0, 1.0, 3.0, 3.0, 3.0]
    etas, now = [], 0.0
    for step, seconds in enumerate(durations, start=1):
        now += seconds
        rate.add(step, now)
        etas.append(rate.eta(10))
    assert etas[:2] == [None, None]
    assert etas[2:5] == [10.0, 10.0, 10.0]
    assert etas[5:] == [10.0, 20.0, 30.0]  # medians of (1, 1, 1, 3), (1, 1, 3, 3), (1, 3, 3, 3)


def test_the_eta_counts_steps_between_calls():
    """Calls every 2 steps (a console line every few steps): the time per step, not per call."""
    rate = RecentRate(window=4, step=0, now=0.0)
    for step in (2, 4, 6):
        rate.add(step, float(step))
    assert rate.eta(5) == 5.0


def test_the_total_is_fixed_when_the_warm_start_ends_early():
    """train.steps = 10 with a warm start of at most 4 that ends at step 2: the RL steps (3..8) count from the
    planned warm start's end (5..10 of 10), so the last line is 10/10 and the total never changes."""
    out = io.StringIO()
    progress = Progress(total=10, initial=0, every=1, stream=out)
    for step in range(1, 9):
        done = step if step < 2 else step + 4 - 2
        progress.step(step, {"loss": 0.5}, warm_start=step <= 2, done=done)
    lines = [line.split("  ")[0] for line in out.getvalue().splitlines()]
    assert lines == ["step 1/10 IL warm start", "step 2 (4/10) IL warm start"] + [
        f"step {s} ({s + 2}/10) RL" for s in range(3, 9)
    ]


def test_dropped_and_stale_trajectories_show_on_the_line_once_there_are_any():
    out = io.StringIO()
    progress = Progress(total=3, initial=0, every=1, stream=out)
    progress.step(1, {"loss": 0.5, "dropped_total": 0.0, "source/queue_dropped_total": 0.0}, warm_start=False)
    progress.step(
        2,
        {"loss": 0.5, "dropped_total": 1.0, "source/queue_dropped_total": 5.0, "source/queue_dropped_stale": 4.0},
        warm_start=False,
    )
    first, second = out.getvalue().splitlines()
    assert "stale" not in first and "dropped" not in first
    assert "stale 4  dropped 2  " in second


def test_the_eta_does_not_carry_the_warm_starts_rate_into_rl():
    """Imitation steps of 1 s, RL steps of 3 s (they wait for rollouts), each phase's first step 20 s (it compiles)
    and RL's second 12 s (another shape), a warm start of at most 6 of 14 steps that ends at step 5: the warm start's
    lines bound its own time only; RL's take their time from RL's steps after its first, with no jump at the change."""
    out, now = io.StringIO(), [0.0]
    progress = Progress(total=14, initial=0, every=1, stream=out, rl_steps=8, clock=lambda: now[0])
    seconds = (20.0, 1.0, 1.0, 1.0, 1.0, 20.0, 12.0, 3.0, 3.0, 3.0)
    for step, dt in enumerate(seconds, start=1):
        now[0] += dt
        progress.step(step, {"loss": 0.5}, warm_start=step <= 5, done=step if step < 5 else step + 1)
    etas = [line.split("elapsed")[1] for line in out.getvalue().splitlines()]
    # steps 1-3: fewer than 3 timed steps; step 4: 2 warm-start steps left at 1 s; step 5: the warm start ended
    assert etas[:5] == [")", ")", ")", ", ETA <= 2s to RL (then 8 RL steps))", ", ETA <= 0s to RL (then 8 RL steps))"]
    # RL: nothing until 3 timed steps after its first; then 4, then 3 steps left at the median 3 s (not 6 s, the mean)
    assert etas[5:] == [")", ")", ")", ", ETA 12s)", ", ETA 9s)"]
