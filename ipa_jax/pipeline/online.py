"""Online training: engines, environment, IL warm start, rollout workers -> queue -> learner, weight sync,
held-out evaluation and samples.

    learner step s < rl_start:              batches of scripted-expert episodes (IL only); rl_start is
                                            train.il_warmup_steps, or earlier once train.il_warmup_target is met
    learner step s >= rl_start:             batches from the TrajectoryQueue fed by a RolloutWorker
                                            (or from a ResampleSource, or more expert episodes: `rollout.source`)
    after every update:                     weights -> engines (every rollout.weight_sync_every steps;
                                            queue.forced_lag pushes the weights of step s - forced_lag)
    eval_fn:                                held-out tasks, success / reward / tool calls / turns

Process 0 runs all of it (`RolloutSource`: `ExpertSource`, `QueueSource` or `ResamplingSource`, one per
rollout.source, over the engines of `build_online_engines`); `OnlineSource`, on every process, hands its batches,
evaluations and weight-sync outcomes to all processes of a multi-host run, and gathers the weights for its pushes.

Expert episodes are token rows built from the expert's chat messages through the chat template (the same
bookkeeping as the agent loop): every assistant turn, the final answer and its `<|im_end|>` included, is an
imitation target (expert_mask). They have no action token (pure imitation rows: no RL term, advantage 0).

What it writes into the run folder (`RunFolder`): tokenizer/ (when built), samples/, eval_tasks/ (every
evaluation's per-task outcomes), trajectories/train.jsonl (every trajectory the learner consumed; on resume cut back
to what the restored checkpoint had consumed), trajectories/unconsumed.jsonl (finished ones still waiting at exit or
Ctrl-C), weights/v<version>/ (SGLang weight sync; the newest rollout.keep_weight_folders are kept) and, with
resampling, forks.json.

The run stops with a checkpoint (`TrainingStopped`) when the SGLang pool stays below rollout.min_sync_servers for
longer than rollout.outage_budget_s (a weight sync or a resampling round fails), when the rollout worker gives up,
and when the learner has waited queue.stall_timeout_s without the queue admitting a trajectory (the message names
the drop reasons).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import functools
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

import jax

from ipa_jax.activity import ActivityClock
from ipa_jax.chat import ChatFormat
from ipa_jax.engines import Engine, EngineError
from ipa_jax.engines.base import PartialCounts, PrefixCounts
from ipa_jax.engines.threads import LoopThread, OnLoop
from ipa_jax.envs import Env, Task, expert_errs
from ipa_jax.models.hf_io import gather_model
from ipa_jax.pipeline.build import build_online_engines
from ipa_jax.pipeline.config import ConfigError, EnvConfig, ExperimentConfig
from ipa_jax.pipeline.evaluation import EVAL_SEED, eval_agent_config, eval_tasks_record, evaluate_policy
from ipa_jax.pipeline.run_folder import RunFolder
from ipa_jax.pipeline.tokenizer import load_or_build_tokenizer
from ipa_jax.rollout import AgentConfig, GroupSampler, RolloutWorker, TrajectoryQueue
from ipa_jax.rollout.agent import expert_episode, run_episode
from ipa_jax.rollout.branch import SKIP_REASONS, Branching
from ipa_jax.rollout.lockstep import derive_seed, in_lockstep
from ipa_jax.rollout.queue import DROP_REASONS
from ipa_jax.rollout.resample import Resampler, ResampleSource, build_experts
from ipa_jax.train import TrainingStopped, TrainState
from ipa_jax.train.distributed import from_process_0
from ipa_jax.trajectory import Trajectory

log = logging.getLogger(__name__)

SAMPLES_PER_SPLIT = 4  # episodes of each split written to samples/step_*.jsonl
WAIT_POLL_S = 1.0  # the learner re-checks the rollout worker's health this often while waiting


# ---------------------------------------------------------------------------------------------- experts
def expert_trajectory(task: Task, env: Env, chat: ChatFormat, uid: str, mistaken: bool = False) -> Trajectory:
    """The scripted expert's episode of `task` (`env.expert`; `mistaken`: with its systematic mistake, a failure) as
    a pure imitation row (`expert_episode`)."""
    return expert_episode(task, env.expert(task, mistaken), env, chat, uid, info={"split": "train"})


def rollout_seed(exp: ExperimentConfig) -> int:
    """The seed lockstep rollouts derive every episode's from: of train.seed and rollout.seed_offset (an A/A control
    changes the latter alone)."""
    return derive_seed(exp.train.seed, exp.rollout.seed_offset)


def sampling_agent_config(exp: ExperimentConfig) -> AgentConfig:
    """How training episodes are sampled (exp.rollout's budgets and sampling parameters)."""
    r = exp.rollout
    return AgentConfig(
        max_new_tokens=r.max_new_tokens,
        max_turns=r.max_turns,
        max_context=r.max_context,
        temperature=r.temperature,
        top_p=r.top_p,
        top_k=r.top_k,
        return_routed_experts=exp.model.routing_replay,
    )


class ExpertStream:
    """Endless scripted-expert trajectories over a task stream, as the env config `demos` says: the expert errs on
    its share of the tasks (expert_error) and only tasks of expert_families are demonstrated. position = tasks drawn
    (checkpointed)."""

    def __init__(
        self, env_factory: Callable[[], Env], tasks: Iterator[Task], chat: ChatFormat, demos: EnvConfig | None = None
    ):
        self.env_factory, self.tasks, self.chat = env_factory, tasks, chat
        self.demos = demos or EnvConfig()
        self.count = 0

    def take(self, n: int, successes_only: bool = False) -> list[Trajectory]:
        """The next `n` demonstrations; `successes_only`: the failed (mistaken) ones are left out."""
        out = []
        while len(out) < n:
            task = next(self.tasks)
            self.count += 1
            env = self.env_factory()
            if self.demos.expert_families and env.family(task) not in self.demos.expert_families:
                continue
            mistaken = expert_errs(task, self.demos.expert_error)
            if mistaken and successes_only:
                continue  # its demonstration fails: filtered imitation leaves it out
            out.append(expert_trajectory(task, env, self.chat, uid=f"expert:{task.task_id}", mistaken=mistaken))
        return out

    def skip_to(self, count: int) -> None:
        while self.count < count:  # the stream is deterministic: replay the task draws
            next(self.tasks)
            self.count += 1


# ---------------------------------------------------------------------------------------------- engines
class EngineHost:
    """Process 0's engines (`build_online_engines`) and their weights. The control engine (evaluations, weight
    pushes) lives on a loop in a background thread, driven from the learner thread with `run`; the rollout worker
    (or the ResampleSource) uses `rollout` from its own loop: an engine of its own, or the control engine through an
    `OnLoop` view (one state of an SGLang pool's health and weights, whose probes go on while the learner computes)."""

    def __init__(self, exp: ExperimentConfig, tokenizer, folder: RunFolder):
        self.thread = LoopThread("engines")
        self.control, own_rollout = build_online_engines(exp, tokenizer, folder.weights_root)
        self.rollout: Engine = own_rollout or OnLoop(self.control, self.thread)
        self.pushed: tuple[Engine, ...] = (self.control,) + ((own_rollout,) if own_rollout else ())
        # A control engine of its own evaluates the current weights; a shared one serves the rollouts' weights.
        self.evaluates_current = own_rollout is not None
        self.version = -1
        self._counted = PartialCounts()  # the rollout engine's counts at the previous partial_metrics()
        self._prefix_counted = PrefixCounts()  # the rollout engine's counts at the previous prefix_metrics()

    def run(self, coro):
        """`await coro` on the control engine's loop, from the learner thread."""
        return self.thread.run(coro)

    @property
    def push_dtype(self) -> str | None:
        return self.control.push_dtype

    def push(self, model, version: int) -> None:
        """Serve `model`'s weights (addressable here: `gather_model`) as `version` on every engine."""
        for engine in self.pushed:
            try:
                self.run(engine.push_weights(model, version))
            except EngineError as e:  # the pool stayed down past its outage budget, or refused the weights
                raise TrainingStopped(f"weight sync to version {version} failed: {e}") from e
        self.version = version

    def serve_for_evaluation(self, model, step: int) -> None:
        """The control engine serves `model` (step `step`) when it evaluates the current weights."""
        if self.evaluates_current:
            self.run(self.control.push_weights(model, step))

    def partial_metrics(self) -> dict[str, float]:
        """Rollout requests that weight updates interrupted (rollout.partial = "abort_resume") and that continued on
        the new weights: per update since the previous call (one training line), and in total."""
        now = self.rollout.partial_counts()
        updates = max(now.updates - self._counted.updates, 1)
        out = {
            "partial_interrupted_per_update": (now.interrupted - self._counted.interrupted) / updates,
            "partial_resumed_per_update": (now.resumed - self._counted.resumed) / updates,
            "partial_interrupted": float(now.interrupted),
            "partial_resumed": float(now.resumed),
        }
        self._counted = now
        return out

    def prefix_metrics(self) -> dict[str, float]:
        """The share of the context tokens of the turns started since the previous call that came from a prefix (KV)
        cache instead of a prefill (the embedded engine's rows: rollout.prefix_cache; SGLang's radix cache, as its
        responses report it); nothing when the engine does not report it."""
        now = self.rollout.prefix_counts()
        if now is None:
            return {}
        prefilled = now.prefilled - self._prefix_counted.prefilled
        reused = now.reused - self._prefix_counted.reused
        self._prefix_counted = now
        return {"prefix_reused_fraction": reused / max(prefilled + reused, 1)}

    def close(self) -> None:
        self.run(self.control.close())
        self.thread.close()


# ---------------------------------------------------------------------------------------------- process 0's sources
class RolloutSource:
    """Process 0's half of the online source, one subclass per rollout.source: expert episodes during the IL warm
    start, then `_rl_trajectories` (the subclass's); the train log, weight pushes, evaluations and samples.
    `clock`: the run's ActivityClock (the learner's), where rollouts count their generation and tool time."""

    def __init__(self, exp: ExperimentConfig, folder: RunFolder, clock: ActivityClock):
        self.exp, self.folder, self.clock = exp, folder, clock
        t = exp.train
        if not exp.env.name:
            raise ConfigError(
                "env.name",
                "online training needs an environment (ipa_jax.envs.list_envs()), or "
                "offline trajectories in train.data",
            )
        self.env_factory = exp.env.make
        self.env = self.env_factory()
        self.tokenizer = load_or_build_tokenizer(exp.model, folder, exp.env)
        self.chat = ChatFormat(self.tokenizer, enable_thinking=exp.rollout.enable_thinking)
        self.engines = EngineHost(exp, self.tokenizer, folder)
        self.experts = ExpertStream(
            self.env_factory, self.env.task_stream("train", seed=t.seed + 1_000_000), self.chat, exp.env
        )
        self.eval_tasks = self.env.tasks("eval", t.eval_episodes, seed=EVAL_SEED)
        self.agent = sampling_agent_config(exp)
        self.eval_agent = dataclasses.replace(eval_agent_config(exp), record_messages=True)  # for samples/
        self.step = 0
        self.rl_start = t.il_warmup_steps  # the learner's state.rl_start, read in after_update
        self.history: collections.deque = collections.deque(maxlen=exp.queue.forced_lag + 1)
        self.last_train: list[Trajectory] = []
        self.train_logged = 0  # lines of trajectories/train.jsonl (checkpointed: a resume cuts the file back to it)
        self._train_log_checked = False
        self.wait_s = 0.0
        self.rl_started_at: float | None = None
        self.closed = False
        self.final_stats: dict[str, float] | None = None  # taken when the rollouts stop

    # ---- TrajectorySource ---------------------------------------------------------------------------
    def next_trajectories(self, n: int) -> list[Trajectory]:
        out = self.experts.take(n) if self.step < self.rl_start else self._rl_trajectories(n)
        for traj in out:
            traj.info.setdefault("split", "train")
        self.last_train = out[:SAMPLES_PER_SPLIT]
        self._log_train(out)
        return out

    def _rl_trajectories(self, n: int) -> list[Trajectory]:
        raise NotImplementedError

    def _log_train(self, trajs: list[Trajectory]) -> None:
        if not self._train_log_checked:  # first batch after any restore: drop what a killed run logged after it
            self.folder.truncate_trajectories("train", self.train_logged)
            self._train_log_checked = True
        self.folder.append_trajectories("train", trajs)
        self.train_logged += len(trajs)

    def state_dict(self) -> dict[str, Any]:
        return {"experts_taken": self.experts.count, "train_logged": self.train_logged}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.experts.skip_to(int(state["experts_taken"]))
        # A checkpoint written before the count was kept: the file as it is.
        self.train_logged = int(state.get("train_logged", self.folder.count_trajectories("train")))

    def metrics(self) -> dict[str, float]:
        """Logged by the learner as source/<name> on every training line."""
        if self.rl_started_at is None:
            return {}
        return {"learner_idle_fraction": self.wait_s / max(time.perf_counter() - self.rl_started_at, 1e-9)}

    def rollout_stats(self) -> dict[str, float]:
        """The rollouts' numbers for summary.json."""
        return {"learner_idle_fraction": self.metrics().get("learner_idle_fraction", 0.0)}

    def summary_stats(self) -> dict[str, float]:
        return self.final_stats or self.rollout_stats()

    def _busy_times(self) -> dict[str, float]:
        """Wall time with at least one episode generating / in its environment, and generating during steps."""
        return {
            "time_generation_s": self.clock.busy_s("generation"),
            "time_tools_s": self.clock.busy_s("tools"),
            "time_generation_during_steps_s": self.clock.busy_s("generation", "learner_step"),
        }

    # ---- hooks --------------------------------------------------------------------------------------
    def after_update(self, step: int, rl_start: int, model) -> None:
        """The learner reached `step`; `model` (None: no sync due) holds its weights, addressable here."""
        self.step, self.rl_start = step, rl_start
        if model is None:
            return
        if self.exp.queue.forced_lag == 0:
            self.engines.push(model, step)
            return
        # Staleness experiments: the engines serve the weights of step - forced_lag (host copies kept).
        self.history.append((step, model))
        version, lagged = self.history[0]
        self.engines.push(lagged, version)

    def evaluate(self, model, step: int, episodes: int | None = None) -> dict[str, float]:
        """Held-out episodes with the weights of `step` (`model`, when the control engine needs them pushed),
        train.eval_samples per task of the first `episodes` held-out tasks (None: all): success, reward, tool
        calls, turns (and samples/, and the per-task outcomes in eval_tasks/)."""
        if model is not None:
            self.engines.serve_for_evaluation(model, step)
        report = self.engines.run(
            evaluate_policy(
                self.engines.control,
                self.chat,
                self.eval_tasks[:episodes],
                self.eval_agent,
                lambda task: self.env_factory(),
                k=self.exp.train.eval_samples,
                lockstep=self.exp.rollout.schedule == "lockstep",
            )
        )
        done = list(report.trajectories)
        for traj in done:
            traj.info["split"] = "eval"
        self.folder.write_samples(step, done[:SAMPLES_PER_SPLIT] + self.last_train)
        self.folder.write_eval_tasks(step, eval_tasks_record(report))
        return report.scalars()

    # ---- shutdown -----------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the rollouts and the engines."""
        if self.closed:
            return
        self.closed = True
        self._stop_rollouts()
        self.engines.close()

    def _stop_rollouts(self) -> None:
        pass


class ExpertSource(RolloutSource):
    """rollout.source = "expert": fresh scripted-expert episodes after the warm start too (imitation only; with
    rollout.expert_successes_only the successful ones only)."""

    def _rl_trajectories(self, n: int) -> list[Trajectory]:
        return self.experts.take(n, successes_only=self.exp.rollout.expert_successes_only)


class QueueSource(RolloutSource):
    """rollout.source = "queue": a RolloutWorker (started with the first RL batch, from the warmed-up weights) feeds
    a TrajectoryQueue the learner takes whole batches from (with queue.dynamic_sampling, through a GroupSampler: whole
    groups whose rewards differ)."""

    def __init__(self, exp: ExperimentConfig, folder: RunFolder, clock: ActivityClock):
        if exp.queue.max_size < exp.train.batch_size:
            raise ConfigError(
                "queue.max_size",
                f"{exp.queue.max_size} < train.batch_size={exp.train.batch_size}; "
                "the learner takes whole batches from the queue",
            )
        super().__init__(exp, folder, clock)
        self.queue = TrajectoryQueue(
            exp.queue.max_size,
            exp.queue.max_policy_lag,
            vocab_size=exp.model.vocab_size,
            reward_range=exp.train.reward_range,
        )
        self.train_tasks = self.env.task_stream("train", seed=exp.train.seed)
        self.worker: RolloutWorker | None = None
        # queue.dynamic_sampling: whole groups with different rewards (`GroupSampler`), else the queue's order.
        self.groups = (
            GroupSampler(self.queue, exp.rollout.group_size, exp.queue.dynamic_sampling_max_batches)
            if exp.queue.dynamic_sampling
            else None
        )
        o = exp.objective
        self.branching = Branching(o.branch_samples, o.branch_fraction) if o.credit == "branch" else None

    def _rl_trajectories(self, n: int) -> list[Trajectory]:
        if self.worker is None:
            self.rl_started_at = time.perf_counter()
            self.worker = RolloutWorker(
                self.engines.rollout,
                self.chat,
                self.train_tasks,
                self.queue,
                self.agent,
                concurrency=self.exp.rollout.concurrency,
                group_size=self.exp.rollout.group_size,
                env_factory=lambda task: self.env_factory(),
                name="rollout",
                clock=self.clock,
                branch=self.branching,
            ).start()
        t0 = time.perf_counter()
        admitted, admitted_at = self.queue.stats()["admitted"], t0
        try:
            while True:
                self._check_worker()
                try:
                    return (self.groups or self.queue).take(n, timeout=WAIT_POLL_S)
                except TimeoutError:
                    pass
                stats = self.queue.stats()
                if stats["admitted"] != admitted:
                    admitted, admitted_at = stats["admitted"], time.perf_counter()
                stall = self.exp.queue.stall_timeout_s
                if stall and time.perf_counter() - admitted_at > stall:
                    raise TrainingStopped(self._stall_message(stall, stats))
        finally:
            self.wait_s += time.perf_counter() - t0

    def _check_worker(self) -> None:
        try:
            self.worker.check()
        except RuntimeError as e:
            raise TrainingStopped(f"{e}; the last: {e.__cause__}") from e
        if not self.worker.running:
            raise TrainingStopped("rollout worker stopped: no more training tasks")

    def _stall_message(self, stall_s: float, queue_stats: dict[str, Any]) -> str:
        w = self.worker.stats()
        reasons = ", ".join(f"{r} {queue_stats[f'dropped_{r}']}" for r in DROP_REASONS)
        message = (
            f"no trajectory admitted for {stall_s:g}s (queue.stall_timeout_s) while the learner waited: "
            f"{w['finished']} rollouts finished, {w['failed']} failed, {w['in_flight']} in flight; dropped "
            f"{queue_stats['dropped_total']} ({reasons})"
        )
        if queue_stats["last_invalid"]:
            message += f"; the last invalid: {queue_stats['last_invalid']}"
        return message

    def after_update(self, step: int, rl_start: int, model) -> None:
        self.queue.set_version(max(step, self.queue.version))
        super().after_update(step, rl_start, model)

    def metrics(self) -> dict[str, float]:
        out = super().metrics()
        q = self.queue.stats()
        out.update(
            {
                f"queue_{k}": float(q[k])
                for k in (
                    "depth",
                    "dropped_total",
                    "dropped_stale",
                    "dropped_invalid",
                    "dropped_duplicate",
                    "lag_taken_mean",
                    "put_per_s",
                )
            }
        )
        if self.worker is not None:
            w = self.worker.stats()
            out.update(
                {
                    k: float(w[k])
                    for k in ("episodes_per_s", "generated_tokens_per_s", "success_rate", "finished", "failed")
                }
            )
            # Admission by policy lag, per finished episode (the queue's own count includes retried puts).
            out["queue_admitted_fraction"] = w["admitted"] / max(w["admitted"] + w["dropped"], 1)
            out.update(self.engines.partial_metrics())
            out.update(self.engines.prefix_metrics())
            if self.groups is not None:
                out.update(self.groups.metrics())
            out.update(self._branch_stats(w))
        return out

    def _branch_stats(self, w: dict[str, float]) -> dict[str, float]:
        """The extra rollouts of credit "branch": episodes branched and skipped, continuations and their tokens,
        and the continuations' tokens per token of the episodes themselves (the generation cost factor - 1)."""
        if self.branching is None:
            return {}
        keys = ("branched", "branch_skipped", "branch_episodes", "branch_generated_tokens")
        keys += tuple(f"branch_{reason}" for reason in SKIP_REASONS)
        out = {k: float(w[k]) for k in keys}
        out["branch_extra_token_ratio"] = w["branch_generated_tokens"] / max(w["generated_tokens"], 1)
        return out

    def rollout_stats(self) -> dict[str, float]:
        out = super().rollout_stats()
        if self.worker is not None:
            if self.groups is not None:
                out.update({f"dynamic_{k}": v for k, v in dataclasses.asdict(self.groups.total).items()})
            w = self.worker.stats()
            out.update(
                episodes_per_s=w["episodes_per_s"],
                generated_tokens_per_s=w["generated_tokens_per_s"],
                rollout_episodes=w["finished"],
                rollout_success_rate=w["success_rate"],
            )
            out["queue_admitted_fraction"] = w["admitted"] / max(w["admitted"] + w["dropped"], 1)
            out.update(self._branch_stats(w))
            out.update(self._busy_times())
        return out

    def _stop_rollouts(self) -> None:
        """Finished trajectories not consumed go to trajectories/unconsumed.jsonl."""
        left: list[Trajectory] = []
        if self.worker is not None:
            self.worker.stop(abort_in_flight=True, timeout=60.0)
            self.final_stats = self.rollout_stats()
            left += self.worker.leftovers
        self.queue.close()
        left += self.queue.drain()
        if self.groups is not None:
            left += self.groups.leftovers()
        self.folder.append_trajectories("unconsumed", left)


class LockstepSource(RolloutSource):
    """rollout.source = "queue" with rollout.schedule = "lockstep": the batch of learner step t is played on the
    weights of step max(t - k, rl_start) (k = queue.max_policy_lag), all of its episodes at once in lockstep
    (`ipa_jax.rollout.lockstep`). Episode i of step t plays task i // group_size of the batch's tasks (the next ones
    of the seeded task stream), with seed derive_seed(rollout_seed, t, i) and uid <task id>#<t>.<i>; what a batch
    holds thus depends on the weights, the tasks and the seeds alone.

    One batch is played at a time, in a thread of its own: with k > 0 the batch of step t + k is played while the
    learner trains on step t's, and the weight sync after that update first waits for it (the engines change
    weights only between batches). Episodes that fail, or that the learner rejects, are replaced by more episodes of
    the same step (indices batch_size, batch_size + 1, ... over the batch's tasks again), played on the weights
    served then. A resumed run plays the batches it had in flight again, on the restored weights (the weights they
    were played with are not checkpointed)."""

    def __init__(self, exp: ExperimentConfig, folder: RunFolder, clock: ActivityClock):
        super().__init__(exp, folder, clock)
        t = exp.train
        self.lag, self.updates_per_batch = exp.queue.max_policy_lag, t.epochs_per_batch * t.minibatches
        self.seed = rollout_seed(exp)
        self.tasks = self.env.task_stream("train", seed=t.seed)
        self.tasks_taken = 0
        self.thread = LoopThread("lockstep")
        # Per batch step: its tasks, the tasks taken before them, episodes started (replacements go on from there),
        # and the episodes being played (a concurrent future of in_lockstep's outcomes; popped when consumed).
        self.batch_tasks: dict[int, list[Task]] = {}
        self.tasks_before: dict[int, int] = {}
        self.started: dict[int, int] = {}
        self.playing: dict[int, concurrent.futures.Future] = {}
        self._last: concurrent.futures.Future | None = None  # the newest play: the next one waits for it
        self.served_step: int | None = None
        self.counts = collections.Counter()
        self.last_error: BaseException | None = None
        self.last_prefix: PrefixCounts | None = None  # the prefix-cache counts of the play consumed last

    # ---- scheduling ----------------------------------------------------------------------------------
    def _is_batch_step(self, step: int) -> bool:
        return step >= self.rl_start and (step - self.rl_start) % self.updates_per_batch == 0

    def _start_batch(self, step: int) -> None:
        """Takes the batch's tasks and starts playing its batch_size episodes."""
        per_task = self.exp.rollout.group_size
        self.tasks_before[step] = self.tasks_taken
        self.batch_tasks[step] = [next(self.tasks) for _ in range(self.exp.train.batch_size // per_task)]
        self.tasks_taken += len(self.batch_tasks[step])
        self.started[step] = 0
        self.playing[step] = self._play(step, self.exp.train.batch_size)

    def _play(self, step: int, count: int) -> concurrent.futures.Future:
        """Plays the next `count` episodes of `step` after the play before it."""
        first = self.started[step]
        self.started[step] += count
        tasks = self.batch_tasks[step]
        per_task = self.exp.rollout.group_size
        plays = [
            functools.partial(self._episode, step, i, tasks[(i // per_task) % len(tasks)])
            for i in range(first, first + count)
        ]
        self._last = self.thread.submit(self._after(self._last, in_lockstep(self.engines.rollout, plays)))
        return self._last

    async def _after(self, previous: concurrent.futures.Future | None, play) -> tuple[list, PrefixCounts | None]:
        """`play`'s outcomes once `previous` has ended, and the rollout engine's prefix-cache counts of `play` alone
        (plays run one at a time: taken at its start and end, they are the same in every run)."""
        if previous is not None:  # its outcome is its own consumer's: here only its end matters
            await asyncio.wait([asyncio.wrap_future(previous)])
        before = self.engines.rollout.prefix_counts()
        outcomes = await play
        after = self.engines.rollout.prefix_counts()
        if before is None:
            return outcomes, None
        return outcomes, PrefixCounts(after.prefilled - before.prefilled, after.reused - before.reused)

    async def _episode(self, step: int, index: int, task: Task, engine: Engine) -> Trajectory | None:
        return await run_episode(
            engine,
            self.chat,
            task,
            self.agent,
            env=self.env_factory(),
            uid=f"{task.task_id}#{step}.{index}",
            clock=self.clock,
            seed=derive_seed(self.seed, step, index),
        )

    def _outcomes(self, future: concurrent.futures.Future) -> list[Trajectory]:
        """The played episodes of `future` (waited for); failed and aborted ones counted and left out."""
        out = []
        outcomes, self.last_prefix = future.result()
        for outcome in outcomes:
            if isinstance(outcome, Trajectory):
                out.append(outcome)
                self.counts["finished"] += 1
                self.counts["successes"] += int(outcome.reward > 0)
                self.counts["generated_tokens"] += outcome.info["generated_tokens"]
                continue
            self.counts["failed"] += 1
            if isinstance(outcome, BaseException):
                log.error("lockstep episode failed: %r", outcome)
                self.last_error = outcome
        if not out:
            raise TrainingStopped(f"every lockstep episode of a batch failed; the last: {self.last_error!r}")
        return out

    # ---- the learner's side --------------------------------------------------------------------------
    def _rl_trajectories(self, n: int) -> list[Trajectory]:
        step, t0 = self.step, time.perf_counter()
        self.rl_started_at = self.rl_started_at or t0
        try:
            if step == self.served_step:  # replacements of failed or rejected episodes of this step
                return self._outcomes(self._play(step, n))
            if step not in self.playing:  # RL's first batch, or the first after a restore: its weights play k more
                self._start_batch(step)
                for later in range(step + 1, step + self.lag + 1):
                    if self._is_batch_step(later):
                        self._start_batch(later)
            for done in [s for s in self.started if s < step]:  # consumed batches: no replacement comes any more
                del self.started[done], self.batch_tasks[done], self.tasks_before[done]
            self.served_step = step
            return self._outcomes(self.playing.pop(step))
        finally:
            self.wait_s += time.perf_counter() - t0

    def after_update(self, step: int, rl_start: int, model) -> None:
        self.step, self.rl_start = step, rl_start
        if model is None:
            return
        if self.playing:  # the batches of older weights are played before the engines change: waiting for rollouts
            with self.clock.active("batch_wait"):
                concurrent.futures.wait(list(self.playing.values()))
        self.engines.push(model, step)
        if (
            self.served_step is not None
            and self._is_batch_step(step + self.lag)
            and step + self.lag not in self.started
        ):
            self._start_batch(step + self.lag)

    def state_dict(self) -> dict[str, Any]:
        # The tasks before the next batch to consume: a resumed run plays it (and those after) again.
        next_batch = min(self.playing, default=None)
        taken = self.tasks_before[next_batch] if next_batch is not None else self.tasks_taken
        return {**super().state_dict(), "lockstep_tasks_taken": taken}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        for _ in range(int(state.get("lockstep_tasks_taken", 0))):
            next(self.tasks)
        self.tasks_taken = int(state.get("lockstep_tasks_taken", 0))

    # ---- reporting -----------------------------------------------------------------------------------
    def metrics(self) -> dict[str, float]:
        out = super().metrics()
        finished = self.counts["finished"]
        out.update(
            rollout_episodes=float(finished),
            rollout_failed=float(self.counts["failed"]),
            rollout_success_rate=self.counts["successes"] / max(finished, 1),
        )
        if self.last_prefix is not None:  # of the batch consumed last (the engine's own counter runs in the background)
            reused = self.last_prefix.reused
            out["prefix_reused_fraction"] = reused / max(self.last_prefix.prefilled + reused, 1)
        return out

    def rollout_stats(self) -> dict[str, float]:
        out = super().rollout_stats()
        elapsed = time.perf_counter() - self.rl_started_at if self.rl_started_at else 0.0
        finished = self.counts["finished"]
        out.update(
            episodes_per_s=finished / elapsed if elapsed else 0.0,
            generated_tokens_per_s=self.counts["generated_tokens"] / elapsed if elapsed else 0.0,
            rollout_episodes=float(finished),
            rollout_success_rate=self.counts["successes"] / max(finished, 1),
            **self._busy_times(),
        )
        return out

    def _stop_rollouts(self) -> None:
        """Batches played and not consumed go to trajectories/unconsumed.jsonl; those in play are cancelled."""
        left: list[Trajectory] = []
        for future in self.playing.values():
            if future.done() and not future.cancelled():
                left += [t for t in future.result()[0] if isinstance(t, Trajectory)]
            else:
                future.cancel()
        self.final_stats = self.rollout_stats()
        self.folder.append_trajectories("unconsumed", left)
        self.thread.close()


class ResamplingSource(RolloutSource):
    """rollout.source = "resample": synchronous resampling rounds (the learner waits while a round is sampled); the
    fork report goes to forks.json at the end."""

    def __init__(self, exp: ExperimentConfig, folder: RunFolder, clock: ActivityClock):
        super().__init__(exp, folder, clock)
        tasks = self.env.tasks("train", exp.resample.num_tasks or 8 * exp.resample.tasks_per_round, seed=exp.train.seed)
        self.resample = ResampleSource(
            Resampler(exp.resample, build_experts(exp.resample, tasks, self.chat, exp.env.expert_error)),
            self.engines.rollout,
            self.chat,
            self.agent,
            concurrency=exp.rollout.concurrency,
            lockstep_seed=rollout_seed(exp) if exp.rollout.schedule == "lockstep" else None,
        )

    def _rl_trajectories(self, n: int) -> list[Trajectory]:
        t0 = time.perf_counter()
        self.rl_started_at = self.rl_started_at or t0
        try:
            return self.resample.next_trajectories(n)
        except EngineError as e:  # e.g. the SGLang pool down past its outage budget
            raise TrainingStopped(f"resampling round failed: {e}") from e
        finally:
            self.wait_s += time.perf_counter() - t0

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "resample": self.resample.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        if "resample" in state:  # a warm start trained by another source has no resampler state: it starts fresh
            self.resample.load_state_dict(state["resample"])

    def metrics(self) -> dict[str, float]:
        out = super().metrics()
        out.update({f"resample_{k}": float(v) for k, v in self.resample.resampler.metrics().items()})
        out.update(self.engines.partial_metrics())
        out.update(self.engines.prefix_metrics())
        return out

    def _stop_rollouts(self) -> None:
        self.folder.write_forks(self.resample.resampler.fork_report())
        self.resample.close()


ROLLOUT_SOURCES: dict[str, type[RolloutSource]] = {
    "expert": ExpertSource,
    "queue": QueueSource,
    "resample": ResamplingSource,
}


def rollout_source_class(exp: ExperimentConfig) -> type[RolloutSource]:
    """Process 0's source of exp.online_source (the queue's under rollout.schedule = "lockstep": LockstepSource)."""
    if exp.online_source == "queue" and exp.rollout.schedule == "lockstep":
        return LockstepSource
    return ROLLOUT_SOURCES[exp.online_source]


# ---------------------------------------------------------------------------------------------- every process
class OnlineSource:
    """The learner's TrajectorySource on every process, with the weight-sync hook (`after_update`) and the
    evaluation function (`evaluate`). Process 0 owns the rollouts (`local`: a RolloutSource of exp.online_source:
    engines, rollout workers, queue, run-folder writes); the other processes hold none. Each batch, evaluation and
    outcome of a sync reaches every process from process 0 (`from_process_0`; an exception process 0 raises is
    raised everywhere), so all of them run the same steps; a weight sync first gathers the learner's weights to
    process 0 (collective), and no process returns from it before process 0's push is done. On one process the
    same code runs without a collective. `clock`: the learner's ActivityClock, for the rollouts' time (a clock of
    its own by default)."""

    def __init__(self, exp: ExperimentConfig, state: TrainState, folder: RunFolder, clock: ActivityClock | None = None):
        self.exp = exp
        self.local: RolloutSource | None = None

        def start() -> tuple[str | None, bool]:
            self.local = rollout_source_class(exp)(exp, folder, clock or ActivityClock())
            return self.local.engines.push_dtype, self.local.engines.evaluates_current

        # What the gathers need to know of process 0's engines; after it, process 0 has written the tokenizer.
        self.push_dtype, self.evaluates_current = from_process_0(start)
        self.tokenizer = self.local.tokenizer if self.local else load_or_build_tokenizer(exp.model, folder, exp.env)
        self.synced = False

    # ---- TrajectorySource ---------------------------------------------------------------------------
    def next_trajectories(self, n: int) -> list[Trajectory]:
        return from_process_0(lambda: self.local.next_trajectories(n))

    def state_dict(self) -> dict[str, Any]:
        return self.local.state_dict() if self.local else {}  # (process 0 writes the checkpoint's host state)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.local:
            self.local.load_state_dict(state)

    def metrics(self) -> dict[str, float]:
        return self.local.metrics() if self.local else {}

    # ---- hooks --------------------------------------------------------------------------------------
    def after_update(self, state: TrainState) -> None:
        """Weight sync. Runs before the first step (after any restore) and after every update; a sync every
        rollout.weight_sync_every steps."""
        step, rl_start = int(jax.device_get(state.step)), int(jax.device_get(state.rl_start))
        model = None
        if not self.synced or step % self.exp.rollout.weight_sync_every == 0:
            # Host copies when the engines serve older weights later (queue.forced_lag): the buffers are donated.
            model = gather_model(state.model(), self.push_dtype, to_host=self.exp.queue.forced_lag > 0)
            self.synced = True
        from_process_0(lambda: self.local.after_update(step, rl_start, model))

    def evaluate(self, state: TrainState, episodes: int | None = None) -> dict[str, float]:
        """Held-out episodes with the current weights (`RolloutSource.evaluate`)."""
        step = int(jax.device_get(state.step))
        model = gather_model(state.model(), self.push_dtype) if self.evaluates_current else None
        return from_process_0(lambda: self.local.evaluate(model, step, episodes))

    # ---- shutdown -----------------------------------------------------------------------------------
    def summary_stats(self) -> dict[str, float]:
        """The rollouts' numbers for summary.json (process 0's)."""
        return self.local.summary_stats() if self.local else {}

    def close(self) -> None:
        """Stop the rollouts; finished trajectories not consumed go to trajectories/unconsumed.jsonl; the
        resampler's fork report to forks.json."""
        if self.local:
            self.local.close()
