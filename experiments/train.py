"""Train a policy from a config file.

    python experiments/train.py --config=configs/offline_tiny.py --config.objective.gamma=0.9 \\
        --config.train.data='("trajs.jsonl",)' [--config.train.run_dir=PATH]

Writes the resolved config (config.json), metrics.jsonl, TensorBoard events and Orbax checkpoints into the run
folder (runs/<train.name>/ unless train.run_dir is set); rerunning the same command resumes from the latest
complete checkpoint. Ctrl-C or SIGTERM (a scheduler's preemption) stops with a checkpoint. Multi-host: pass
--coordinator_address/--num_processes/--process_id (or the JAX_* environment variables, or nothing on TPU pods /
SLURM) and run the same command on every host.
"""

import json
import os
import signal
import sys
import time

import jax
from absl import app, flags
from ml_collections import config_flags

# Config files import `configs.base`: the repository root must be importable.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from experiments.online import format_summary, write_summary  # noqa: E402
from experiments.online import make_online_source_and_hooks as make_online  # noqa: E402
from ipa_jax.config import ExperimentConfig, resolved_dict, to_typed, validate  # noqa: E402
from ipa_jax.train import JsonlSource, TrainState, export_hf  # noqa: E402
from ipa_jax.train import distributed  # noqa: E402
from ipa_jax.train.build import build_learner, build_mesh, build_state  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file("config", None, "Experiment config file (configs/*.py).",
                                          lock_config=True)
flags.DEFINE_string("coordinator_address", None, "jax.distributed coordinator host:port (multi-host).")
flags.DEFINE_integer("num_processes", None, "Number of processes (multi-host).")
flags.DEFINE_integer("process_id", None, "This process's id (multi-host).")
FLAGS = flags.FLAGS


def make_online_source_and_hooks(exp: ExperimentConfig, state: TrainState, run_dir: str) -> tuple:
    """The online pipeline: (trajectory queue source, after_update weight-sync hook, eval_fn).

    Plug point for the rollout layer (issues 5/6): build the engines from exp.rollout (initial weights from
    `state`), the environment from exp.env, rollout workers feeding a bounded queue (exp.queue), and return
    the queue as a TrajectorySource, a hook that syncs weights to the engines (the learner calls it once
    before the first step, after any checkpoint restore, then after every update: sync every
    exp.rollout.weight_sync_every steps, copying what it keeps), and an evaluation function over
    exp.train.eval_episodes held-out tasks.
    """
    return make_online(exp, state, run_dir)


def write_resolved_config(config, run_dir: str) -> None:
    os.makedirs(run_dir, exist_ok=True)
    with open(os.path.join(run_dir, "config.json"), "w", encoding="utf-8") as f:
        json.dump(resolved_dict(config), f, indent=2, sort_keys=True)


def run(config) -> TrainState:
    """Validates `config`, wires the learner and trains; returns the final state."""
    t_start = time.perf_counter()
    validate(config)
    exp = to_typed(config)
    run_dir = exp.train.resolved_run_dir
    if jax.process_index() == 0:
        write_resolved_config(config, run_dir)
    mesh = build_mesh(exp.mesh)
    state = build_state(exp, mesh)
    if exp.train.data:
        source, hooks = JsonlSource(exp.train.data), {}
    else:
        source, after_update, eval_fn = make_online_source_and_hooks(exp, state, run_dir)
        hooks = dict(after_update=after_update, eval_fn=eval_fn)
    learner = build_learner(exp, source, run_dir=run_dir, mesh=mesh, state=state, **hooks)
    _RUNNING["learner"] = learner
    try:
        state = learner.run()
    finally:
        _RUNNING.pop("learner", None)
        if hasattr(source, "close"):  # online: stop rollouts, keep the finished trajectories
            source.close()
    summary = write_summary(exp, learner, run_dir, time.perf_counter() - t_start,
                            source=None if exp.train.data else source)
    if jax.process_index() == 0:
        print(format_summary(summary), flush=True)
    if exp.checkpoint.export_hf and jax.process_index() == 0:
        export_hf(state, os.path.join(run_dir, "hf"))
    return state


_RUNNING: dict = {}  # the learner being trained, for the signal handler


def _stop_on_signal(signum, frame) -> None:
    """SIGINT / SIGTERM: the learner stops at its next batch boundary with a checkpoint; a second signal (or
    one before training starts) interrupts at once."""
    name = signal.Signals(signum).name
    learner = _RUNNING.get("learner")
    if learner is None or learner.stop_requested:
        raise KeyboardInterrupt(name)
    learner.request_stop(f"received {name}")


def main(argv):
    del argv
    # Installed explicitly: a shell starts background jobs with SIGINT ignored, and Python then never raises
    # KeyboardInterrupt; SIGTERM would kill the process without the checkpoint the learner saves on interrupt.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _stop_on_signal)
    distributed.initialize(FLAGS.coordinator_address, FLAGS.num_processes, FLAGS.process_id)
    run(_CONFIG.value)


if __name__ == "__main__":
    flags.mark_flags_as_required(["config"])
    app.run(main)
