"""The RL phase under rollout.schedule async and lockstep, side by side from one warm start.

    python experiments/benchmarks/bench_schedule.py                      # the quickstart, 1 round (2 RL phases)
    python experiments/benchmarks/bench_schedule.py --rounds=2 --set=train.steps=400

Trains the config's IL warm start once (<out>/warm), then, per round, its RL phase from a copy of it under each
schedule, in alternating order (round r runs lockstep first when r is odd), each in a process of its own sharing one
XLA compilation cache (the first run of the benchmark compiles for both). Prints, per run, the RL phase's wall time
(summary.json's wall_time_s: the resumed process's, the RL phase and its evaluations), the learner's step time and
its wait for batches, episodes per second and held-out success after; then lockstep's time over async's per round
and their median. Writes it all to <out>/bench_schedule.json.
"""

import json
import os
import statistics
import sys

from absl import app, flags

from ipa_jax.analysis.sweep import run_overrides, seed_from_warm_start, train_one
from ipa_jax.pipeline import RunFolder, load_config, validate
from ipa_jax.pipeline.config import split_override

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
flags.DEFINE_string("config", os.path.join(REPO, "configs", "quickstart.py"), "The config whose RL phase is timed.")
flags.DEFINE_integer("rounds", 1, "Rounds: one RL phase under each schedule per round.", lower_bound=1)
flags.DEFINE_integer("seed", 0, "train.seed.")
flags.DEFINE_multi_string("set", [], "KEY=VALUE config override of every run (repeat).")
flags.DEFINE_string("out", os.path.join("runs", "bench_schedule"), "Output folder.")
FLAGS = flags.FLAGS
SCHEDULES = ("async", "lockstep")
TRAIN = [sys.executable, os.path.join(REPO, "experiments", "train.py")]


def summary(run_dir: str) -> dict:
    with open(RunFolder(run_dir).summary_path, encoding="utf-8") as f:
        return json.load(f)


def main(argv):
    del argv
    out = os.path.abspath(FLAGS.out)
    cache = os.path.join(out, "xla_cache")
    overrides = dict(split_override(s) for s in FLAGS.set)
    warm_dir = os.path.join(out, "warm")
    if not RunFolder(warm_dir).has_summary():
        os.makedirs(warm_dir, exist_ok=True)
        # The warm start stops where RL would start (train.steps = train.il_warmup_steps, as a sweep's).
        il_steps = validate(load_config(FLAGS.config, overrides)).train.il_warmup_steps
        warm = run_overrides(warm_dir, FLAGS.seed, overrides, steps=il_steps)
        print(f"warm start -> {warm_dir}", flush=True)
        train_one(FLAGS.config, warm, os.path.join(warm_dir, "train.log"), TRAIN, cache)
    rows = []
    for r in range(FLAGS.rounds):
        for schedule in SCHEDULES if r % 2 == 0 else SCHEDULES[::-1]:
            run_dir = os.path.join(out, f"{schedule}_{r}")
            if not RunFolder(run_dir).has_summary():
                os.makedirs(run_dir, exist_ok=True)
                if not os.path.exists(RunFolder(run_dir).checkpoints_dir):
                    seed_from_warm_start(warm_dir, run_dir)
                config = run_overrides(run_dir, FLAGS.seed, {**overrides, "rollout.schedule": schedule})
                train_one(FLAGS.config, config, os.path.join(run_dir, "train.log"), TRAIN, cache)
            s = summary(run_dir)
            rows.append(
                {
                    "round": r,
                    "schedule": schedule,
                    "wall_time_s": s["wall_time_s"],
                    "rl_steps": s["steps"] - RunFolder(run_dir).rl_start(),
                    "learner_step_s": s["time_learner_step_s"],
                    "batch_wait_s": s["time_batch_wait_s"],
                    "evaluation_s": s["time_evaluation_s"],
                    "episodes_per_s": s.get("episodes_per_s", float("nan")),
                    "success_before": s["success_before"],
                    "success_after": s["success_after"],
                }
            )
            print(_line(rows[-1]), flush=True)
    ratios = [
        _of(rows, r, "lockstep")["wall_time_s"] / _of(rows, r, "async")["wall_time_s"] for r in range(FLAGS.rounds)
    ]
    print(
        f"lockstep / async wall time per round: {', '.join(f'{x:.3f}' for x in ratios)}; median "
        f"{statistics.median(ratios):.3f}"
    )
    with open(os.path.join(out, "bench_schedule.json"), "w", encoding="utf-8") as f:
        json.dump(
            {"config": FLAGS.config, "overrides": overrides, "runs": rows, "lockstep_over_async": ratios}, f, indent=2
        )


def _of(rows: list[dict], r: int, schedule: str) -> dict:
    return next(row for row in rows if row["round"] == r and row["schedule"] == schedule)


def _line(row: dict) -> str:
    return (
        f"round {row['round']} {row['schedule']:8s}: RL phase {row['wall_time_s']:.0f} s for {row['rl_steps']} steps "
        f"(learner steps {row['learner_step_s']:.0f} s, waiting for batches {row['batch_wait_s']:.0f} s, evaluations "
        f"{row['evaluation_s']:.0f} s), {row['episodes_per_s']:.2f} episodes/s, held-out success "
        f"{100 * row['success_before']:.1f}% -> {100 * row['success_after']:.1f}%"
    )


if __name__ == "__main__":
    app.run(main)
