"""The learner loop: trajectories from a source -> validated, padded (or packed) batches -> train steps -> metrics,
evaluations, weight-sync hook and checkpoints.

One update per fresh batch by default (FlashREINFORCE); `epochs_per_batch` / `minibatches` > 1 exist for
comparison runs (advantages, and old log-probs under objective.old_logprobs = "recompute", are then computed on
the whole batch before its first update). The learner knows no engine: the experiment passes `after_update(state)`
to sync weights and `eval_fn(state)` to evaluate.
"""

import collections
import dataclasses
import hashlib
import logging
import math
import operator
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import jax
import numpy as np

from ipa_jax.activity import ActivityClock
from ipa_jax.objectives.composed import estimate_return_baselines
from ipa_jax.objectives.credit import credit_returns
from ipa_jax.train.checkpoint import Checkpointer
from ipa_jax.train.distributed import agreed_stop
from ipa_jax.train.metrics import CREDIT_POSITIONS, LoggingConfig, chunk_position_weights
from ipa_jax.train.progress import Progress
from ipa_jax.train.sources import TrajectorySource
from ipa_jax.train.state import TrainState
from ipa_jax.train.step import TrainStep, batch_advantages, batch_sequences
from ipa_jax.trajectory import DEFAULT_BUCKETS, DropLog, Trajectory, TrajectoryBatch, pack_batch, pad_batch

log = logging.getLogger(__name__)

# What the loop's thread does, each timed by Learner.clock: training steps, the reference policy's forward (the KL
# term's and penalty's log-probs, once per batch), the after_update hook (weight sync), evaluations, and waiting for
# the source's next batch (an online run's queue, or its warm start's expert episodes).
LEARNER_ACTIVITIES = ("learner_step", "reference_forward", "weight_sync", "evaluation", "batch_wait")


def policy_lag(step: int, trajectories: Sequence[Trajectory]) -> np.ndarray:
    """int[n]: how many updates old the weights that sampled each of the n sampled episodes are at `step`.
    A scripted expert's episode (imitation tokens only, no action token) was sampled by no policy: it is left out."""
    return step - np.asarray([tr.policy_version for tr in trajectories if tr.action_mask.any()], np.int64)


class TrainingStopped(RuntimeError):
    """Raised by a source or a hook when the run cannot go on (e.g. no rollout server for longer than its outage
    budget, no admissible trajectory for too long). The learner stops with a checkpoint at the step reached and
    re-raises it; the message says why."""


@dataclass(frozen=True)
class TrainConfig:
    """The learner loop.

    steps: optimizer updates in all (the IL warm start's included).
    batch_size: trajectories per batch, global over all processes.
    microbatches: gradient accumulation per update; gives the same update as the full batch.
    epochs_per_batch: passes over one batch (> 1 only for comparison runs: FlashREINFORCE makes one update).
    minibatches: optimizer updates per pass over one batch.
    seed: seed of the initial weights, sampling and task streams.
    name: the run's name; the run folder is runs/<name> unless run_dir is set.
    run_dir: the run folder; "" = runs/<name>.
    eval_every: RL steps between held-out evaluations, counted from the warm start's end; 0 = only at the
      start, at the end of the warm start and at the end.
    eval_episodes: held-out tasks per evaluation.
    eval_every_episodes: held-out tasks of the evaluations every train.eval_every RL steps (the first ones of the
      train.eval_episodes, all of them when those are fewer: a subset of the same tasks), for a denser, cheaper
      curve; the evaluations at the start, at the warm start's end and at the end play all train.eval_episodes.
      0 = all of them every time.
    eval_samples: episodes per held-out task in each evaluation (success = their mean, pass@1 with less noise); > 1
      samples at rollout.eval_temperature, or at rollout.temperature when that is 0 (greedy samples are identical).
    il_warmup_steps: at most this many IL-only updates on scripted expert episodes first (the warm start).
    il_warmup_target: > 0: end the warm start once greedy decoding would reproduce this fraction of fresh expert
      episodes (mean il_greedy_match over il_warmup_window batches); RL then still runs steps - il_warmup_steps.
    il_warmup_window: batches averaged for il_warmup_target and il_warmup_patience.
    il_warmup_patience: > 0: end the warm start at the imitation plateau, once the mean il_greedy_match over
      il_warmup_window batches has not risen PLATEAU_MIN_GAIN above its best for this many steps, counted once the
      mean has reached PLATEAU_MIN_GAIN (the target, when set too, ends it if reached first).
    data: offline Trajectory JSONL files (globs allowed); empty = online rollouts.
    buckets: padded sequence lengths (a small set bounds recompilation); a longer trajectory is dropped.
    packing: pack several trajectories into each row of the bucket length (first-fit decreasing; attention and
      every per-trajectory term of the objective stay within each trajectory: the same loss and gradient as one
      trajectory per row) instead of padding every trajectory to the bucket; with minibatches > 1 a minibatch
      is a set of packed rows.
    share_prefix: with packing, a trajectory that begins like its row's first holds only its other tokens and
      attends to the first's as its prefix (agentic episodes share the system prompt and tool schema; samples of
      one task the whole prompt): the same loss and gradient from fewer positions; the row length is then the
      bucket whose rows hold the fewest positions (`pack_batch`).
    reward_range: (low, high): a trajectory whose reward is outside it is dropped as invalid (a reward that a float32
      loss cannot represent would make every batch holding it a skipped update).
    allow_config_change: resume a run folder whose config.json differs from this config (the changes are
      recorded in config_changes.jsonl); off, such a resume is refused with the list of changed keys.
    max_consecutive_skipped: stop the run (with a checkpoint, TrainingStopped) after this many updates in a row
      skipped as non-finite: a run that learns nothing fails instead of ending as a success; 0 = never stop.
    max_consecutive_zero_grad: likewise after this many RL updates in a row with a gradient of exactly 0 (every
      advantage 0: e.g. all rewards equal and no baseline), with a warning at the first; the warm start's updates
      do not count; 0 = never stop.
    reward_flip_fraction: a graded positive control: this share of the RL phase's trajectories (chosen by a hash of
      their uid, `reward_flipped`) reach the objective with reward 1 - R (for 0/1 rewards: success and failure
      swapped); 0 = off.
    """

    steps: int = 100
    batch_size: int = 8
    microbatches: int = 1
    epochs_per_batch: int = 1
    minibatches: int = 1
    seed: int = 0
    name: str = "run"
    run_dir: str = ""
    eval_every: int = 0
    eval_episodes: int = 32
    eval_every_episodes: int = 0
    eval_samples: int = 1
    il_warmup_steps: int = 0
    il_warmup_target: float = 0.0
    il_warmup_window: int = 10
    il_warmup_patience: int = 0
    data: tuple[str, ...] = ()
    buckets: tuple[int, ...] = DEFAULT_BUCKETS
    packing: bool = False
    share_prefix: bool = False
    reward_range: tuple[float, float] = (-1e6, 1e6)
    allow_config_change: bool = False
    max_consecutive_skipped: int = 10
    max_consecutive_zero_grad: int = 10
    reward_flip_fraction: float = 0.0

    def __post_init__(self):
        for name in (
            "steps",
            "batch_size",
            "microbatches",
            "epochs_per_batch",
            "minibatches",
            "eval_episodes",
            "eval_samples",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"train.{name}: must be >= 1, got {getattr(self, name)}")
        if self.batch_size % self.minibatches:
            raise ValueError(f"train.minibatches: {self.minibatches} must divide train.batch_size={self.batch_size}")
        if (self.batch_size // self.minibatches) % self.microbatches:
            raise ValueError(
                f"train.microbatches: {self.microbatches} must divide the minibatch size "
                f"{self.batch_size // self.minibatches} (train.batch_size / train.minibatches)"
            )
        if self.eval_every < 0:
            raise ValueError(f"train.eval_every: must be >= 0, got {self.eval_every}")
        if self.eval_every_episodes < 0:
            raise ValueError(f"train.eval_every_episodes: must be >= 0 (0 = all), got {self.eval_every_episodes}")
        for name in ("max_consecutive_skipped", "max_consecutive_zero_grad"):
            if getattr(self, name) < 0:
                raise ValueError(f"train.{name}: must be >= 0 (0 = never stop), got {getattr(self, name)}")
        if not 0 <= self.il_warmup_steps <= self.steps:
            raise ValueError(
                f"train.il_warmup_steps: must be in [0, train.steps={self.steps}], got {self.il_warmup_steps}"
            )
        if not 0.0 <= self.il_warmup_target <= 1.0:
            raise ValueError(f"train.il_warmup_target: must be in [0, 1] (0 = off), got {self.il_warmup_target}")
        if self.il_warmup_window < 1:
            raise ValueError(f"train.il_warmup_window: must be >= 1, got {self.il_warmup_window}")
        if self.il_warmup_patience < 0:
            raise ValueError(f"train.il_warmup_patience: must be >= 0 (0 = off), got {self.il_warmup_patience}")
        if not self.buckets or any(b < 2 for b in self.buckets):
            raise ValueError(f"train.buckets: must be non-empty lengths >= 2, got {self.buckets}")
        for name in ("packing", "share_prefix"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"train.{name}: must be True or False, got {getattr(self, name)!r}")
        if self.share_prefix and not self.packing:
            raise ValueError("train.share_prefix: needs train.packing=True (a shared prefix lives in a packed row)")
        if not self.name:
            raise ValueError("train.name: must be non-empty")
        if not 0.0 <= self.reward_flip_fraction <= 1.0:  # also rejects NaN
            raise ValueError(
                f"train.reward_flip_fraction: must be in [0, 1] (0 = off), got {self.reward_flip_fraction}"
            )
        r = self.reward_range
        if len(r) != 2 or not np.isfinite(r).all() or r[0] > r[1]:
            raise ValueError(f"train.reward_range: must be (low, high), finite, low <= high, got {self.reward_range}")

    @property
    def resolved_run_dir(self) -> str:
        return self.run_dir or os.path.join("runs", self.name)


def reward_flipped(uid: str, fraction: float) -> bool:
    """Whether train.reward_flip_fraction = `fraction` flips the reward of trajectory `uid`: the first 8 bytes of
    sha256(uid), as a number in [0, 1), fall below `fraction`. The same trajectory gets the same choice on any
    machine and after a resume, and a larger fraction flips a superset."""
    return int.from_bytes(hashlib.sha256(uid.encode()).digest()[:8], "big") / 2.0**64 < fraction


def flip_rewards(trajs: list[Trajectory], fraction: float) -> list[Trajectory]:
    """The trajectories with reward 1 - R where `reward_flipped(uid, fraction)`; the list itself when fraction is 0."""
    if fraction == 0.0:
        return trajs
    return [dataclasses.replace(t, reward=1.0 - t.reward) if reward_flipped(t.uid, fraction) else t for t in trajs]


@dataclass
class Streak:
    """Updates in a row that meet a condition; `limit` of them (0 = no limit) make the run stop at the next batch
    boundary, where its checkpoint is exact."""

    limit: int
    count: int = 0

    def add(self, hit: bool) -> bool:
        """Counts one update's outcome; True exactly when this update makes the streak reach the limit."""
        self.count = self.count + 1 if hit else 0
        return bool(self.limit) and self.count == self.limit


PLATEAU_MIN_GAIN = 0.01  # a rise of the windowed greedy match smaller than this is no progress (batch noise)


@dataclass
class Plateau:
    """The imitation plateau: windowed means of il_greedy_match that have not risen PLATEAU_MIN_GAIN above their
    best for `patience` steps in a row (0 = never), counted from the first mean of at least PLATEAU_MIN_GAIN: a
    policy that matches no whole episode yet has reached no level (a multi-call task's match stays at 0 for the
    first ~100-300 steps while the format and the copying are learned)."""

    patience: int
    best: float = -math.inf

    def __post_init__(self) -> None:
        self._flat = Streak(self.patience)

    def add(self, mean: float) -> bool:
        """Counts one windowed mean; True exactly when it completes `patience` steps without a rise."""
        if self.best == -math.inf and mean < PLATEAU_MIN_GAIN:  # still at zero: no level reached yet
            return False
        risen = mean > self.best + PLATEAU_MIN_GAIN
        if risen:  # a slow creep counts once it adds up to the gain
            self.best = mean
        return self._flat.add(not risen)


class MetricsSink(Protocol):
    """Where the learner's per-step metrics go (the run folder's metrics.jsonl and TensorBoard)."""

    def start(self, resume_step: int | None) -> None:
        """Open for writing; resuming from `resume_step` drops what a killed run logged after it, None starts
        afresh."""

    def write(self, step: int, metrics: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


@dataclass
class Learner:
    """Owns the loop. `run()` returns the final state; metrics go to `metrics_log` every logging.every steps.

    step_fn: the jitted TrainStep; warmup_step_fn: the IL-only step used before state.rl_start (the first
    train.il_warmup_steps steps, fewer when the warm start reaches train.il_warmup_target; `rl_start`).
    after_update(state) (weight sync) runs once before the first step (after any restore) and after every update;
    the state's buffers are donated to the next step, so the hook must copy what it keeps.
    eval_fn(state, episodes) -> {name: value} runs before training, after the IL warm start, every
    train.eval_every steps after it (on train.eval_every_episodes tasks, when set) and at the end (episodes None:
    all of the held-out tasks); results go to metrics.jsonl as eval/<name> and to `eval_history` (checkpointed).
    flops_per_token(seq_len) gives the model's training FLOPs per token (for MFU); peak_flops is per device.
    `extra` is arbitrary JSON state saved in checkpoints and restored (e.g. resampling statistics).
    reference_at_rl_start: the reference policy (state.ref_params; objective.kl_weight / kl_penalty) becomes a copy
    of the weights when RL begins (before the first RL update, after the IL warm start), recorded as
    extra["reference_step"] so that a resume keeps the checkpointed copy; otherwise it is what the state holds.
    `clock` measures the loop's LEARNER_ACTIVITIES (disjoint: the loop runs one at a time); the run's remaining
    wall time is setup, batch building, logging and checkpoints.
    """

    state: TrainState
    step_fn: TrainStep
    source: TrajectorySource
    config: TrainConfig
    metrics_log: MetricsSink | None = None
    logging_config: LoggingConfig = field(default_factory=LoggingConfig)
    checkpointer: Checkpointer | None = None
    vocab_size: int | None = None
    warmup_step_fn: TrainStep | None = None
    eval_fn: Callable[[TrainState, int | None], dict[str, float]] | None = None
    after_update: Callable[[TrainState], None] | None = None
    flops_per_token: Callable[[int], float] | None = None
    peak_flops: float = 0.0
    requires_routed_experts: bool = False
    extra: dict[str, Any] = field(default_factory=dict)
    clock: ActivityClock = field(default_factory=ActivityClock)
    reference_at_rl_start: bool = False

    def __post_init__(self):
        self.dropped_total = 0
        self.eval_history: list[dict[str, Any]] = []
        self.resumed_from: int | None = None
        self.stop_requested: str | None = None
        self._skipped = Streak(self.config.max_consecutive_skipped)
        self._zero_grad = Streak(self.config.max_consecutive_zero_grad)
        self._zero_grad_warned = False  # the first zero-gradient RL update warns, once per run
        self._streak_stop: str | None = None  # why the run stops at the batch boundary (a Streak reached its limit)
        self._drop_log = DropLog(log, "learner")
        self._greedy_match: collections.deque = collections.deque(maxlen=self.config.il_warmup_window)
        self._plateau = Plateau(self.config.il_warmup_patience)
        self._rl_start = int(jax.device_get(self.state.rl_start))
        self._progress = Progress(self.config.steps, 0, self.logging_config.console_every)  # replaced when run() starts

    @property
    def rl_start(self) -> int:
        """The step where the warm start ends and RL begins (train.il_warmup_steps until the target ends it)."""
        return self._rl_start

    @property
    def total_steps(self) -> int:
        """rl_start + the RL steps (train.steps - train.il_warmup_steps): train.steps unless the warm start
        ended early."""
        return self.rl_start + self.config.steps - self.config.il_warmup_steps

    def planned_done(self, step: int) -> int:
        """Planned steps (of train.steps) done after update `step`: a warm start that ended early counts in full."""
        return step + self.config.il_warmup_steps - self.rl_start if step >= self.rl_start else step

    def _warm_start_done(self, step: int, metrics: dict[str, Any]) -> bool:
        """After update `step` of the warm start: has the window's mean il_greedy_match reached the target, or
        stopped rising (the plateau)?"""
        cfg = self.config
        if (cfg.il_warmup_target <= 0 and cfg.il_warmup_patience == 0) or step >= self.rl_start:
            return False
        self._greedy_match.append(float(metrics["il_greedy_match"]))
        if len(self._greedy_match) < cfg.il_warmup_window:
            return False
        mean = float(np.mean(self._greedy_match))
        reached = cfg.il_warmup_target > 0 and mean >= cfg.il_warmup_target
        return self._plateau.add(mean) or reached

    def _end_warm_start(self, step: int) -> None:
        rl_start = self.state.rl_start
        self.state = self.state.replace(rl_start=jax.device_put(np.int32(step), rl_start.sharding))
        self._rl_start = step
        mean, target = float(np.mean(self._greedy_match)), self.config.il_warmup_target
        why = (
            f">= {target}"
            if target > 0 and mean >= target
            else f"(its plateau: no rise of {PLATEAU_MIN_GAIN} for {self._plateau.patience} steps)"
        )
        self._progress.write(
            f"IL warm start ends at step {step}: greedy match {mean:.3f} over "
            f"the last {len(self._greedy_match)} batches {why}; RL runs to step {self.total_steps}"
        )

    def _count_skipped(self, step: int, metrics: dict[str, Any]) -> None:
        """After update `step`: counts the updates skipped as non-finite in a row; at train.max_consecutive_skipped
        the run is to stop (at the batch boundary, where its checkpoint is exact) naming why."""
        if self._skipped.add(bool(metrics["skipped"])):
            n, limit = self._skipped.count, self._skipped.limit
            loss, grad_norm = float(metrics["loss"]), float(metrics["grad_norm"])
            cause = (
                "the loss is not finite"
                if not np.isfinite(loss)
                else "the gradient is not finite"
                if not np.isfinite(grad_norm)
                else f"the update would not be finite at lr {float(metrics['lr']):.3g}"
            )
            self._streak_stop = self._streak_stop or (
                f"the last {n} updates (steps {step - n + 1}-{step}) were all skipped as non-finite "
                f"(at step {step}: {cause}; loss {loss:.4g}, grad_norm {grad_norm:.4g}); "
                f"train.max_consecutive_skipped = {limit}"
            )

    def _count_zero_grad(self, step: int, metrics: dict[str, Any]) -> None:
        """After update `step`: counts the RL updates with a gradient of exactly 0 in a row (the first of the run
        warns); at train.max_consecutive_zero_grad the run is to stop, naming the remedy."""
        zero = step > self.rl_start and not metrics["skipped"] and float(metrics["grad_norm"]) == 0.0
        reward = float(metrics.get("reward_mean", np.nan))
        if zero and not self._zero_grad_warned:
            self._zero_grad_warned = True
            log.warning(
                "RL update %d has a zero gradient (every advantage 0: batch reward mean %.3g); "
                "train.max_consecutive_zero_grad = %d in a row stop the run",
                step,
                reward,
                self._zero_grad.limit,
            )
        if self._zero_grad.add(zero):
            n, limit = self._zero_grad.count, self._zero_grad.limit
            self._streak_stop = self._streak_stop or (
                f"the last {n} RL updates (steps {step - n + 1}-{step}) had a zero gradient (every advantage 0, "
                f"batch reward mean {reward:.3g}): use a baseline (objective.baseline=batch_mean) or a longer warm "
                f"start (train.il_warmup_steps) so that rewards differ; train.max_consecutive_zero_grad = {limit}"
            )

    def request_stop(self, reason: str) -> None:
        """Stop at the next batch boundary (where a checkpoint is exact) as if interrupted; safe to call from a
        signal handler."""
        self.stop_requested = reason

    # ---------------------------------------------------------------------------------------------- resume
    def restore_latest(self) -> int | None:
        """Restores the newest complete checkpoint (state, source position, counters, extra); returns its
        step or None when there is none."""
        if self.checkpointer is None or self.checkpointer.latest_step() is None:
            return None
        self.state, host = self.checkpointer.restore(self.state)
        self.source.load_state_dict(host["source"])
        self.dropped_total = int(host["dropped_total"])
        self.eval_history = list(host["eval_history"])
        self.extra.clear()  # in place: callers may hold a reference to it
        self.extra.update(host["extra"])
        self.resumed_from = int(jax.device_get(self.state.step))
        self._rl_start = int(jax.device_get(self.state.rl_start))
        log.warning("resumed from step %d (%s)", self.resumed_from, self.checkpointer.directory)
        return self.resumed_from

    def host_state(self) -> dict[str, Any]:
        return {
            "source": self.source.state_dict(),
            "dropped_total": self.dropped_total,
            "eval_history": self.eval_history,
            "extra": self.extra,
        }

    def save_checkpoint(self) -> None:
        if self.checkpointer is not None:
            self.checkpointer.save(self.state, self.host_state())

    # ---------------------------------------------------------------------------------------------- data
    def _check(self, traj: Trajectory) -> None:
        traj.validate(self.vocab_size, reward_range=self.config.reward_range)
        if traj.length > max(self.config.buckets):
            raise ValueError(
                f"trajectory {traj.uid!r}: field 'tokens': length {traj.length} exceeds the largest "
                f"bucket {max(self.config.buckets)}"
            )
        if self.requires_routed_experts and traj.routed_experts is None:
            raise ValueError(f"trajectory {traj.uid!r}: field 'routed_experts': required by model.routing_replay")

    def next_batch(self) -> tuple[list[Trajectory], int]:
        """B valid trajectories (bad ones are dropped, counted and replaced) and the number dropped."""
        b, good, dropped, last_error = self.config.batch_size, [], 0, ""
        while len(good) < b:
            for traj in self.source.next_trajectories(b - len(good)):
                try:
                    self._check(traj)
                    good.append(traj)
                except ValueError as e:
                    dropped += 1
                    last_error = str(e)
                    self._drop_log.add("invalid", last_error)
            if dropped > 10 * b + 100:  # a source that yields nothing usable is a bug to report, not to spin on
                raise TrainingStopped(
                    f"{dropped} invalid trajectories from {type(self.source).__name__} while "
                    f"filling one batch (the last: {last_error})"
                )
        return good, dropped

    # ---------------------------------------------------------------------------------------------- loop
    def _step_fn(self, step: int) -> TrainStep:
        if step < self.rl_start and self.warmup_step_fn is not None:
            return self.warmup_step_fn
        return self.step_fn

    def _evaluate(self, step: int, episodes: int | None = None) -> None:
        if self.eval_fn is None or any(e["step"] == step for e in self.eval_history):
            return
        with self.clock.active("evaluation"):
            results = {k: float(v) for k, v in self.eval_fn(self.state, episodes).items()}
        self.eval_history.append({"step": step, **results})
        if self.metrics_log is not None:
            self.metrics_log.write(step, {f"eval/{k}": v for k, v in results.items()})
        self._progress.evaluated(step, results)

    def make_batch(self, trajs: list[Trajectory]) -> TrajectoryBatch:
        """One trajectory per row (pad_batch), or packed rows (train.packing) in a row count the minibatches,
        microbatches and data-parallel devices divide."""
        cfg = self.config
        if not cfg.packing:
            return pad_batch(trajs, cfg.buckets)
        multiple = cfg.minibatches * cfg.microbatches * self.step_fn.data_parallel_size
        return pack_batch(trajs, cfg.buckets, row_multiple=multiple, share_prefix=cfg.share_prefix)[0]

    def _updates(self, batch: TrajectoryBatch, step: int, state: TrainState, reference: "BatchReference"):
        """(device batch, device advantages | None, device old log-probs | None, rows | None, device return
        baselines | None) for each update made from one batch (rows: the batch's rows in the update, None = all);
        `state` is the one before the batch's first update, `reference` the batch's reference log-probs."""
        cfg = self.config
        if cfg.epochs_per_batch == 1 and cfg.minibatches == 1:
            # the step computes the advantages and return baselines; its own forward gives any old log-probs
            yield self.step_fn.put_batch(batch), None, None, None, None
            return
        # Advantages from the whole batch, then per-epoch shuffled minibatches of rows (seeded: resumable). A KL
        # reward penalty needs the reference log-probs unless every update of the batch is in the warm start (whose
        # step has none); when train.il_warmup_target ends the warm start inside a batch, that batch's RL updates
        # get advantages without the penalty.
        objective = self.step_fn.options.objective
        if step + cfg.epochs_per_batch * cfg.minibatches <= self.rl_start:
            objective = self._step_fn(step).options.objective
        # (with a reward penalty, a batch holding the warm start's last updates and RL's first takes its reference
        # snapshot here, at the batch's start: the advantages of all its RL updates need it)
        ref = reference(max(step, self.rl_start)) if objective.kl_penalty > 0 else None
        # Old log-probs once per batch, with the parameters before its first update, reused by every update on it
        # (and read by a KL reward penalty with kl_penalty_logprobs "recompute").
        old = self.step_fn.old_log_probs(state, batch) if self.step_fn.options.objective.needs_old_log_probs else None
        adv = np.asarray(batch_advantages(batch, objective, ref, old))
        # A return baseline is a statistic of the whole batch too (baseline_stage "return"; None otherwise)
        base = estimate_return_baselines(
            adv, batch.action_mask, batch.chunk_ids, batch.group_ids, objective, batch.segment_ids, batch.truncated
        )
        rng = np.random.default_rng([cfg.seed, step])
        num_rows = batch.tokens.shape[0]
        size = num_rows // cfg.minibatches
        for _ in range(cfg.epochs_per_batch):
            order = rng.permutation(num_rows)
            for j in range(cfg.minibatches):
                rows = np.sort(order[j * size : (j + 1) * size])
                sub = jax.tree.map(operator.itemgetter(rows), batch)
                yield (
                    self.step_fn.put_batch(sub),
                    self.step_fn.put_batch(adv[rows]),
                    None if old is None else self.step_fn.put_batch(old[rows]),
                    rows,
                    None if base is None else self.step_fn.put_batch(np.asarray(base)[rows]),
                )

    def run(self) -> TrainState:
        cfg = self.config
        if self.checkpointer is not None and self.resumed_from is None and self.checkpointer.latest_step() is not None:
            if not self.checkpointer.config.resume:
                raise ValueError(
                    f"config key 'checkpoint.resume': False, but {self.checkpointer.directory} holds "
                    "checkpoints of an earlier run: resume it or choose a new train.run_dir"
                )
            self.restore_latest()
        if self.metrics_log is not None:
            self.metrics_log.start(self.resumed_from)
        step = last_saved = int(jax.device_get(self.state.step))
        every = self.checkpointer.config.every if self.checkpointer is not None else 0
        self._progress = Progress(
            cfg.steps, step, self.logging_config.console_every, rl_steps=cfg.steps - cfg.il_warmup_steps
        )
        save_at_exit = False
        try:
            if self.after_update is not None:  # engines start from the learner's (possibly restored) weights
                with self.clock.active("weight_sync"):
                    self.after_update(self.state)
            if step == 0:
                self._evaluate(step)
            while step < self.total_steps:
                with self.clock.active("batch_wait"):
                    trajs, dropped = self.next_batch()
                if step >= self.rl_start:  # the warm start learns from the true rewards
                    trajs = flip_rewards(trajs, cfg.reward_flip_fraction)
                self.dropped_total += dropped
                batch = self.make_batch(trajs)
                credit = self._credit_weights(batch) if step >= self.rl_start else {}
                lag = policy_lag(step, trajs)
                reference = BatchReference(self, batch)
                for device_batch, adv, old, rows, base in self._updates(batch, step, self.state, reference):
                    step_fn, extras = self._step_fn(step), {}
                    if step_fn.options.objective.needs_reference:  # a KL term or penalty (never the warm start's)
                        ref = reference(step)
                        extras = step_fn.put_batch({"ref_log_probs": ref if rows is None else ref[rows]})
                    t0 = time.perf_counter()
                    with self.clock.active("learner_step"):
                        self.state, metrics = step_fn(self.state, device_batch, adv, old, extras, base)
                        metrics = jax.device_get(metrics)
                    if extras:  # the batch's reference forward (once per batch), in the metrics of its updates
                        metrics["reference_forward_s"] = reference.seconds
                    dt = time.perf_counter() - t0
                    step += 1
                    if self._warm_start_done(step, metrics):
                        self._end_warm_start(step)
                    if metrics["il_rows"] == 0:  # no imitation rows: nothing to match (not a match rate of 0)
                        del metrics["il_greedy_match"]
                    metrics.update(self._host_metrics(metrics, device_batch, dropped, lag, dt), **credit)
                    self._count_skipped(step, metrics)
                    self._count_zero_grad(step, metrics)
                    total = self.total_steps
                    if self.metrics_log is not None and (step % self.logging_config.every == 0 or step == total):
                        self.metrics_log.write(step, metrics)
                    self._progress.step(step, metrics, warm_start=step <= self.rl_start, done=self.planned_done(step))
                    if self.after_update is not None:  # also tells the source where RL starts (state.rl_start)
                        with self.clock.active("weight_sync"):
                            self.after_update(self.state)
                    since_rl = step - self.rl_start
                    if since_rl == 0:
                        self._evaluate(step)
                    elif cfg.eval_every and since_rl > 0 and since_rl % cfg.eval_every == 0 and step < total:
                        # (the last step's evaluation is the final one, on every task)
                        self._evaluate(step, min(cfg.eval_every_episodes, cfg.eval_episodes) or None)
                    if step >= total:
                        break
                if self._streak_stop:
                    raise TrainingStopped(self._streak_stop)
                # Multi-host: every process stops at the same boundary (a signal may reach only one of them). A
                # request that arrives during the exchange stays for the next boundary.
                if agreed := agreed_stop(self.stop_requested):
                    self.stop_requested = agreed
                    raise KeyboardInterrupt(agreed)
                # Checkpoints only between batches (the source position is exact there).
                if every and step // every > last_saved // every:
                    self.save_checkpoint()
                    last_saved = step
            self._evaluate(step)
            save_at_exit = True
        except KeyboardInterrupt:
            log.warning("interrupted at step %d: saving a checkpoint", step)
            save_at_exit = True
            raise
        except TrainingStopped as e:
            log.error("stopping at step %d with a checkpoint: %s", step, e)
            save_at_exit = True
            raise
        finally:
            # At exit (normal end or Ctrl-C): a final checkpoint; always wait for async writes to finish.
            if self.checkpointer is not None:
                if save_at_exit:
                    self.save_checkpoint()
                self.checkpointer.wait()
            if self.metrics_log is not None:
                self.metrics_log.close()
            self._progress.close()
        return self.state

    def _credit_weights(self, batch: TrajectoryBatch) -> dict[str, float]:
        """credit_weight_chunk<k>: the mean credit weight of the batch's chunks at position k (the discount of a
        unit advantage: `credit_returns` of ones, `chunk_position_weights`), for k < CREDIT_POSITIONS; none
        without an RL term."""
        objective = self.step_fn.options.objective
        if objective.rl_weight == 0:
            return {}
        units = np.ones(batch.rewards.shape, np.float32)
        returns = credit_returns(
            units, batch.action_mask, batch.chunk_ids, objective.credit, objective.gamma, batch_sequences(batch)
        )
        weights = chunk_position_weights(
            np.asarray(returns), batch.action_mask, batch.chunk_ids, batch.segment_ids, CREDIT_POSITIONS
        )
        return {f"credit_weight_chunk{k}": float(w) for k, w in enumerate(weights) if np.isfinite(w)}

    def _host_metrics(
        self, metrics: dict[str, Any], device_batch: TrajectoryBatch, dropped: int, lag: np.ndarray, dt: float
    ) -> dict[str, float]:
        b, t = device_batch.tokens.shape
        out = {
            "step_time_s": dt,
            "dropped_trajectories": float(dropped),
            "dropped_total": float(self.dropped_total + getattr(self.source, "num_unparsable", 0)),
            "seq_len": float(t),
            "rl_start": float(self.rl_start),
        }
        if lag.size:  # absent on pure imitation batches (no sampled episode, no lag)
            out.update(policy_lag_mean=float(np.mean(lag)), policy_lag_max=float(np.max(lag)))
        # the trajectories' tokens: a shared prefix counts in every trajectory that reads it
        out["tokens_per_s"] = float((metrics["real_tokens"] + metrics.get("shared_prefix_tokens", 0.0)) / dt)
        if self.flops_per_token is not None and self.peak_flops > 0:
            flops = self.flops_per_token(t) * b * t  # padded tokens: the work the devices actually do
            out["mfu"] = flops / dt / (self.peak_flops * jax.device_count())
        source_metrics = getattr(self.source, "metrics", None)
        if callable(source_metrics):
            out.update({f"source/{k}": float(v) for k, v in source_metrics().items()})
        return out


@dataclass
class BatchReference:
    """The reference policy's log-probs of one batch: `reference(step)` -> [B, T] (host), computed at the first
    call (timed as the learner's reference_forward activity, `seconds`) and reused by the batch's later updates.
    With learner.reference_at_rl_start, the run's first call at or after RL's start first makes the reference a
    copy of the weights then (extra["reference_step"])."""

    learner: Learner
    batch: TrajectoryBatch
    log_probs: np.ndarray | None = None
    seconds: float = 0.0

    def __call__(self, step: int) -> np.ndarray:
        """The log-probs, for the update at `step` (the first RL step when a reward penalty needs them earlier)."""
        learner = self.learner
        if self.log_probs is None:
            if learner.reference_at_rl_start and "reference_step" not in learner.extra and step >= learner.rl_start:
                learner.state = learner.state.with_reference(learner.state.params)
                learner.extra["reference_step"] = step
                log.info("reference policy: the weights at step %d (RL's start)", step)
            t0 = time.perf_counter()
            with learner.clock.active("reference_forward"):
                self.log_probs = learner.step_fn.reference_log_probs(learner.state, self.batch)
            self.seconds = time.perf_counter() - t0
        return self.log_probs
