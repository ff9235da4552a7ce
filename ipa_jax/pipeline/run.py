"""`run(config)`: one training run from an experiment config to a run folder with its summary.

    config -> validate -> ExperimentConfig -> mesh, TrainState -> source (offline JSONL, or the online loop:
    engines, rollouts, queue, weight sync, evaluation) -> Learner.run() -> summary.json (+ hf/ export)

One trainer at a time: the run holds the folder's lock (`run_folder_lock`) from start to end, and a second one is
refused at once, naming the holder. Rerunning the same config resumes from the run folder's latest complete
checkpoint; rerunning a finished run says so and changes nothing; resuming with a different config is refused, naming
the changed keys, unless train.allow_config_change is set (the change is then recorded in config_changes.jsonl, once
the checkpoint's shapes are known to fit it). SIGINT / SIGTERM (Ctrl-C, a scheduler's preemption) stop the learner
at its next batch boundary with a checkpoint (`stop_on_signals`); after SIGTERM the process then exits with status
143, as one killed by it would. With several processes a signal to any one of them stops all of them at the same
boundary, with one checkpoint. A run that cannot go on (the rollout servers gone past their outage budget, no
admissible trajectory for too long, train.max_consecutive_skipped updates in a row skipped as non-finite) stops with a
checkpoint and raises `TrainingStopped` naming why.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import time
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np
from ml_collections import ConfigDict

from ipa_jax import storage
from ipa_jax.activity import ActivityClock
from ipa_jax.pipeline.build import build_learner, build_mesh, build_state
from ipa_jax.pipeline.config import ConfigError, ExperimentConfig, config_changes, config_from_dict, validate
from ipa_jax.pipeline.export import existing_tokenizer, export_policy
from ipa_jax.pipeline.online import OnlineSource
from ipa_jax.pipeline.run_folder import RunFolder, is_writer
from ipa_jax.pipeline.run_lock import run_folder_lock
from ipa_jax.train import JsonlSource, Learner, TrainState
from ipa_jax.train.checkpoint import checkpoint_mismatch
from ipa_jax.train.learner import LEARNER_ACTIVITIES

log = logging.getLogger(__name__)


def run(config: ExperimentConfig | ConfigDict) -> dict[str, Any]:
    """Trains `config` (validated first when given as a ConfigDict) into its run folder; returns the summary (also
    summary.json). Raises RunFolderBusy when another trainer holds the folder."""
    t_start = time.perf_counter()
    exp = validate(config) if isinstance(config, ConfigDict) else config
    with run_folder_lock(exp.run_dir):  # one trainer per run folder, for the run's life
        return run_in_folder(exp, RunFolder(exp.run_dir), t_start)


def run_in_folder(exp: ExperimentConfig, folder: RunFolder, t_start: float) -> dict[str, Any]:
    """`run` once the folder's lock is held."""
    if not exp.checkpoint.resume and folder.latest_checkpoint_step() is not None:
        raise ConfigError(
            "checkpoint.resume",
            f"False, but {folder.checkpoints_dir} holds checkpoints of an earlier "
            "run: resume it or choose another train.run_dir",
        )
    changes = {}
    if folder.has_config():
        changes = check_resume(exp, folder)
        if not changes and folder.has_summary():
            summary = folder.read_summary()
            if is_writer():
                print(
                    f"{folder.path} is finished: step {summary['steps']} of {summary['steps']}; nothing to do "
                    "(summary.json unchanged). To train on, raise train.steps and set train.allow_config_change.",
                    flush=True,
                )
            return summary
    mesh = build_mesh(exp.mesh)
    state = build_state(exp, mesh)
    if changes:  # only once the checkpoint is known to fit the changed config
        record_changes(folder, changes, state)
    folder.write_config(exp.to_dict())
    clock = ActivityClock()  # the learner's activities and the rollouts', on one clock (their overlap)
    if exp.online:
        source = OnlineSource(exp, state, folder, clock)
        hooks = dict(after_update=source.after_update, eval_fn=source.evaluate)
    else:
        source, hooks = JsonlSource(exp.train.data), {}
    learner = build_learner(exp, source, run_dir=folder.path, mesh=mesh, state=state, clock=clock, **hooks)
    try:
        with stop_on_signals(learner):
            state = learner.run()
    finally:
        source.close()  # online: stop rollouts, keep the finished trajectories
    rollout_stats = source.summary_stats() if exp.online else {}
    summary = write_summary(exp, learner, folder, time.perf_counter() - t_start, rollout_stats)
    if is_writer():
        print(format_summary(summary), flush=True)
    if exp.checkpoint.export_hf:  # every process: gathering the weights is collective; process 0 writes
        tokenizer = source.tokenizer if exp.online else existing_tokenizer(exp.model, folder)
        export_policy(state, tokenizer, folder.hf_dir)
    return summary


def changes_since(exp: ExperimentConfig, folder: RunFolder) -> dict[str, tuple[Any, Any]]:
    """{dotted key: (the run folder's value, `exp`'s value)} where `exp` differs from the folder's config.json."""
    # Through the base config first: keys added to ipa_jax since the folder was written take their defaults.
    return config_changes(validate(config_from_dict(folder.read_config())).to_dict(), exp.to_dict())


def describe_changes(changes: dict[str, tuple[Any, Any]]) -> str:
    return "; ".join(f"{k}: {old!r} -> {new!r}" for k, (old, new) in changes.items())


def check_resume(exp: ExperimentConfig, folder: RunFolder) -> dict[str, tuple[Any, Any]]:
    """The keys where `exp` differs from the run folder's config.json. Raises ConfigError listing them unless
    train.allow_config_change is set (`record_changes` then records them, once the checkpoint is known to fit)."""
    changes = changes_since(exp, folder)
    if changes and not exp.train.allow_config_change:
        raise ConfigError(
            "train.allow_config_change",
            f"{folder.path} was trained with a different config "
            f"({describe_changes(changes)}). Rerun it unchanged, choose another train.run_dir, or set "
            "train.allow_config_change=True to continue with the change",
        )
    return changes


def record_changes(folder: RunFolder, changes: dict[str, tuple[Any, Any]], state: TrainState) -> None:
    """Appends an allowed config change to config_changes.jsonl, after checking that the latest checkpoint's arrays
    have `state`'s shapes (from its metadata alone): a change the checkpoint cannot take is refused on one line,
    the folder unchanged, so the original command still resumes it."""
    step = folder.latest_checkpoint_step()
    mismatch = None if step is None else checkpoint_mismatch(folder.checkpoints_dir, step, state)
    if mismatch is not None:
        raise ConfigError(
            "train.allow_config_change",
            f"the checkpoint of step {step} in {folder.checkpoints_dir} "
            f"does not fit the changed config ({mismatch}); nothing was changed: rerun with the "
            "folder's config, or choose another train.run_dir",
        )
    log.warning("resuming %s with a changed config: %s", folder.path, describe_changes(changes))
    folder.record_config_change(step, changes)


@contextlib.contextmanager
def stop_on_signals(learner: Learner) -> Iterator[None]:
    """SIGINT / SIGTERM ask `learner` to stop at its next batch boundary with a checkpoint; a second signal
    interrupts at once. Installed explicitly: a shell starts background jobs with SIGINT ignored (Python then never
    raises KeyboardInterrupt), and SIGTERM would kill the process without the checkpoint. After SIGTERM the
    learner's KeyboardInterrupt becomes SystemExit(143) (128 + SIGTERM: what a scheduler expects of a preempted
    job); after SIGINT it stays a KeyboardInterrupt. With several processes a second signal interrupts its own
    process only: the others fail in their next collective (`ipa_jax.train.distributed`)."""
    received: list[int] = []

    def stop(signum, frame) -> None:
        received.append(signum)
        name = signal.Signals(signum).name
        if learner.stop_requested:
            raise KeyboardInterrupt(name)
        learner.request_stop(f"received {name}")

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    except KeyboardInterrupt:
        # Multi-host: a process whose peer got the SIGTERM stopped with the peer's reason (the learner agrees on
        # stops), and exits the same way.
        if signal.SIGTERM in received or learner.stop_requested == "received SIGTERM":
            raise SystemExit(128 + signal.SIGTERM) from None
        raise
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def write_summary(
    exp: ExperimentConfig,
    learner: Learner,
    folder: RunFolder,
    wall_time_s: float,
    rollout_stats: dict[str, float] | None = None,
) -> dict[str, Any]:
    """summary.json (docs/run_folder.md) from the learner's eval history and metrics.jsonl, and an online run's
    `rollout_stats` (OnlineSource.summary_stats); returns it."""
    evals = [e for e in learner.eval_history if "success" in e]
    warm = learner.rl_start
    before = next((e for e in evals if e["step"] == warm), None)
    after = evals[-1] if evals else None
    rows = folder.read_metrics() if is_writer() else []
    rl_rows = [r for r in rows if "admitted_fraction" in r and r["step"] > warm]

    def at(evaluation: dict[str, Any] | None, key: str) -> float | None:
        return None if evaluation is None else evaluation[key]

    def by_family(evaluation: dict[str, Any] | None) -> dict[str, float]:  # success_<family> (several families)
        return {k.removeprefix("success_"): v for k, v in (evaluation or {}).items() if k.startswith("success_")}

    summary = {
        "success_before": at(before, "success"),
        "success_after": at(after, "success"),
        "success_by_family_before": by_family(before),
        "success_by_family_after": by_family(after),
        "tool_calls_before": at(before, "tool_calls"),
        "tool_calls_after": at(after, "tool_calls"),
        "reward_before": at(before, "reward"),
        "reward_after": at(after, "reward"),
        "steps": int(jax.device_get(learner.state.step)),
        "il_warmup_steps": warm,
        "skipped_updates": int(jax.device_get(learner.state.skipped)),
        "wall_time_s": wall_time_s,
        **time_breakdown(learner, wall_time_s),
        "run_dir": storage.absolute(folder.path),
        "name": exp.train.name,
        "config": storage.absolute(folder.config_path),
        "seed": exp.train.seed,
        "env": exp.env.name,
        "eval_episodes": exp.train.eval_episodes,
        "admitted_fraction_mean": float(np.mean([r["admitted_fraction"] for r in rl_rows])) if rl_rows else None,
        "reward_mean_rl": float(np.mean([r["reward_mean"] for r in rl_rows])) if rl_rows else None,
        "eval_history": evals,
    }
    summary.update(rollout_stats or {})
    folder.write_summary(summary)
    return summary


def time_breakdown(learner: Learner, wall_time_s: float) -> dict[str, float]:
    """The learner thread's wall time by activity (`LEARNER_ACTIVITIES`), as time_<activity>_s, and the rest
    (setup, compiling outside the steps, batch building, logging, checkpoints) as time_other_s: they add up to
    wall_time_s. A lockstep weight sync first waits for the batches in flight (batch_wait within weight_sync): that
    wait counts as waiting for batches."""
    parts = {
        f"time_{kind}_s": learner.clock.busy_s(kind, without=() if kind == "batch_wait" else ("batch_wait",))
        for kind in LEARNER_ACTIVITIES
    }
    return {**parts, "time_other_s": wall_time_s - sum(parts.values())}


def format_summary(s: dict[str, Any]) -> str:
    """The summary as the few lines printed at the end of a run."""

    def pct(x):
        return "n/a" if x is None else f"{100 * x:.1f}%"

    def num(x):
        return "n/a" if x is None else f"{x:.2f}"

    def share(key):  # of the wall time
        return f"{100 * s[key] / max(s['wall_time_s'], 1e-9):.0f}%"

    lines = [
        f"held-out success: {pct(s['success_before'])} ({'after IL warm start' if s['il_warmup_steps'] else 'start'})"
        f" -> {pct(s['success_after'])} (end)",
        f"tool calls / episode: {num(s['tool_calls_before'])} -> {num(s['tool_calls_after'])}",
        f"steps: {s['steps']} ({s['il_warmup_steps']} IL warm start, {s['skipped_updates']} skipped as non-finite)"
        f"   time: {s['wall_time_s']:.0f} s",
    ]
    if "time_learner_step_s" in s:  # (summaries written before the breakdown existed have none)
        lines.append(
            f"wall time: learner steps {share('time_learner_step_s')}, "
            + (f"reference forward {share('time_reference_forward_s')}, " if s.get("time_reference_forward_s") else "")
            + f"weight sync "
            f"{share('time_weight_sync_s')}, evaluation {share('time_evaluation_s')}, waiting for batches "
            f"{share('time_batch_wait_s')}, other {share('time_other_s')}"
        )
    if "episodes_per_s" in s:
        lines.append(
            f"rollouts: {s['episodes_per_s']:.2f} episodes/s, {s['generated_tokens_per_s']:.0f} tokens/s; "
            f"learner idle {100 * s['learner_idle_fraction']:.0f}% waiting for rollouts"
        )
    if "time_generation_s" in s:
        during = s["time_generation_during_steps_s"] / max(s["time_learner_step_s"], 1e-9)
        lines.append(
            f"rollout threads busy: generating {share('time_generation_s')}, in tools "
            f"{share('time_tools_s')} of the wall time; generating during {100 * during:.0f}% of the "
            "learner's step time"
        )
    if "dynamic_groups_drawn" in s:
        lines.append(
            f"dynamic sampling: {s['dynamic_groups_drawn']} groups drawn, {s['dynamic_groups_dropped']} dropped "
            f"with equal rewards, {s['dynamic_stale_episodes']} episodes of incomplete groups dropped as stale; "
            f"the draw bound hit on {s['dynamic_bound_hit']} batches ({s['dynamic_groups_filled']} groups with "
            "equal rewards trained on)"
        )
    if "branch_episodes" in s:  # objective.credit = "branch": the continuations' cost
        lines.append(
            f"branching: {s['branched']:.0f} of {s['rollout_episodes']:.0f} episodes branched "
            f"({s['branch_skipped']:.0f} skipped: {s['branch_unreplayable']:.0f} unreplayable, "
            f"{s['branch_aborted']:.0f} aborted, {s['branch_failed']:.0f} failed), {s['branch_episodes']:.0f} extra "
            "episodes, "
            f"{s['branch_generated_tokens']:.0f} extra generated tokens "
            f"({s['branch_extra_token_ratio']:.1f}x the episodes' own)"
        )
    lines.append(f"run folder: {s['run_dir']}  (summary.json, metrics.jsonl, samples/)")
    return "\n".join(lines)
