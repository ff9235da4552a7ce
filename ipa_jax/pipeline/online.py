"""Online training: engines, environment, IL warm start, rollout workers -> queue -> learner, weight sync,
held-out evaluation and samples.

    learner step s < rl_start:              batches of scripted-expert episodes (IL only); rl_start is
                                            train.il_warmup_steps, or earlier once train.il_warmup_target is met
    learner step s >= rl_start:             batches from the TrajectoryQueue fed by a RolloutWorker
                                            (or from a ResampleSource, or more expert episodes: `rollout.source`)
    after every update:                     weights -> engines (every rollout.weight_sync_every steps;
                                            queue.forced_lag pushes the weights of step s - forced_lag)
    eval_fn:                                held-out tasks, success / reward / tool calls / turns

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

import collections
import dataclasses
import logging
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

import jax
from flax import nnx

from ipa_jax.engines import EngineError, SGLangEngine
from ipa_jax.engines.base import PartialCounts, PrefixCounts
from ipa_jax.engines.threads import LoopThread, OnLoop
from ipa_jax.envs import Env, Task
from ipa_jax.models import save_pretrained
from ipa_jax.pipeline.config import ConfigError, ExperimentConfig
from ipa_jax.pipeline.evaluation import EVAL_SEED, eval_agent_config, eval_tasks_record, evaluate_policy
from ipa_jax.pipeline.run_folder import RunFolder
from ipa_jax.pipeline.tokenizer import load_or_build_tokenizer
from ipa_jax.rollout import AgentConfig, ChatFormat, RolloutWorker, TrajectoryQueue
from ipa_jax.rollout.agent import expert_episode
from ipa_jax.rollout.queue import DROP_REASONS
from ipa_jax.rollout.resample import Resampler, ResampleSource, build_experts
from ipa_jax.train import TrainingStopped, TrainState
from ipa_jax.trajectory import Trajectory

log = logging.getLogger(__name__)

SAMPLES_PER_SPLIT = 4  # episodes of each split written to samples/step_*.jsonl
WAIT_POLL_S = 1.0  # the learner re-checks the rollout worker's health this often while waiting


# ---------------------------------------------------------------------------------------------- experts
def expert_trajectory(task: Task, env: Env, chat: ChatFormat, uid: str) -> Trajectory:
    """The scripted expert's episode of `task` (`env.expert`) as a pure imitation row (`expert_episode`)."""
    return expert_episode(task, env.expert(task), env, chat, uid, info={"split": "train"})


def sampling_agent_config(exp: ExperimentConfig) -> AgentConfig:
    """How training episodes are sampled (exp.rollout's budgets and sampling parameters)."""
    r = exp.rollout
    return AgentConfig(max_new_tokens=r.max_new_tokens, max_turns=r.max_turns, max_context=r.max_context,
                       temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                       return_routed_experts=exp.model.routing_replay)


class ExpertStream:
    """Endless scripted-expert trajectories over a task stream; position = number yielded (checkpointed)."""

    def __init__(self, env_factory: Callable[[], Env], tasks: Iterator[Task], chat: ChatFormat):
        self.env_factory, self.tasks, self.chat = env_factory, tasks, chat
        self.count = 0

    def take(self, n: int) -> list[Trajectory]:
        out = []
        for _ in range(n):
            task = next(self.tasks)
            out.append(expert_trajectory(task, self.env_factory(), self.chat, uid=f"expert:{task.task_id}"))
            self.count += 1
        return out

    def skip_to(self, count: int) -> None:
        while self.count < count:  # the stream is deterministic: replay the task draws
            next(self.tasks)
            self.count += 1


# ---------------------------------------------------------------------------------------------- engines
class EngineHost:
    """Engines built from exp.rollout, and weight sync. The control engine (evaluation, weight updates) lives on a
    loop in a background thread, driven from the learner thread with `run`. Embedded: two in-process engines
    sharing compiled functions, the rollout one on the rollout worker's loop (or the ResampleSource's). SGLang: one
    client of the pool, whose view `OnLoop` the rollout worker uses from its loop: one state of the pool's health
    and weights, and its probes go on while the learner computes."""

    def __init__(self, exp: ExperimentConfig, state: TrainState, folder: RunFolder, tokenizer):
        r = exp.rollout
        self.kind, self.folder, self.keep_weight_folders = r.engine, folder, r.keep_weight_folders
        self.thread = LoopThread("engines")
        if r.engine == "embedded":
            from ipa_jax.engines import EmbeddedEngine

            model = _engine_model(state)
            kw = dict(max_len=r.max_context, max_batch=max(r.concurrency, 1), tokenizer=tokenizer, partial=r.partial,
                      prefix_cache=r.prefix_cache)
            self.rollout = EmbeddedEngine(model, seed=exp.train.seed, **kw)
            self.control = EmbeddedEngine(model, seed=exp.train.seed + 1,
                                          **{**kw, "max_batch": max(exp.train.eval_episodes, 1)})
        else:
            self.control = SGLangEngine(list(r.sglang_urls), partial=r.partial, **r.sglang_client_options())
            self.rollout = OnLoop(self.control, self.thread)
        self.version = -1
        self._counted = PartialCounts()  # the rollout engine's counts at the previous partial_metrics()
        self._prefix_counted = PrefixCounts()  # the rollout engine's counts at the previous prefix_metrics()

    def run(self, coro):
        """`await coro` on the control engine's loop, from the learner thread."""
        return self.thread.run(coro)

    def push(self, state, version: int) -> None:
        """Serve `state`'s weights as `version` on every engine (copies: the state's buffers are donated)."""
        if self.kind == "embedded":
            params = _engine_params(state)
            self.rollout.set_params_from_model(params, version)
            self.control.set_params_from_model(params, version)
        else:
            path = os.path.abspath(self.folder.weights_dir(version))  # the servers may run in another directory
            save_pretrained(state.model(), path)
            try:
                self.run(self.control.update_weights(path, version))
            except EngineError as e:  # the pool stayed down past its outage budget, or refused the weights
                raise TrainingStopped(f"weight sync to version {version} failed: {e}") from e
            self.folder.prune_weights(keep=self.keep_weight_folders, current=version)
        self.version = version

    def partial_metrics(self) -> dict[str, float]:
        """Rollout requests that weight updates interrupted (rollout.partial = "abort_resume") and that continued on
        the new weights: per update since the previous call (one training line), and in total."""
        now = self.rollout.partial_counts()
        updates = max(now.updates - self._counted.updates, 1)
        out = {"partial_interrupted_per_update": (now.interrupted - self._counted.interrupted) / updates,
               "partial_resumed_per_update": (now.resumed - self._counted.resumed) / updates,
               "partial_interrupted": float(now.interrupted), "partial_resumed": float(now.resumed)}
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


def _engine_params(state: TrainState) -> nnx.State:
    """The policy's parameters in their mesh placement (the model's sharding constraints name the mesh); the
    engine copies them."""
    return nnx.state(state.model())


def _engine_model(state: TrainState):
    graphdef, params = nnx.split(state.model())
    return nnx.merge(graphdef, jax.tree.map(jax.numpy.copy, params))


# ---------------------------------------------------------------------------------------------- the source
class OnlineSource:
    """The learner's TrajectorySource: expert episodes during the IL warm start, then rollouts (queue or
    resampling). Also the weight-sync hook (`after_update`) and the evaluation function (`evaluate`)."""

    def __init__(self, exp: ExperimentConfig, state: TrainState, folder: RunFolder):
        self.exp, self.folder = exp, folder
        r, t = exp.rollout, exp.train
        if exp.queue.max_size < t.batch_size:
            raise ConfigError("queue.max_size", f"{exp.queue.max_size} < train.batch_size={t.batch_size}; the learner "
                                                "takes whole batches from the queue")
        if not exp.env.name:
            raise ConfigError("env.name", "online training needs an environment (ipa_jax.envs.list_envs()), or "
                                          "offline trajectories in train.data")
        self.env_factory = exp.env.make
        env = self.env_factory()
        self.tokenizer = load_or_build_tokenizer(exp.model, folder, exp.env)
        self.chat = ChatFormat(self.tokenizer, enable_thinking=exp.rollout.enable_thinking)
        self.engines = EngineHost(exp, state, folder, self.tokenizer)
        self.experts = ExpertStream(self.env_factory, env.task_stream("train", seed=t.seed + 1_000_000), self.chat)
        self.eval_tasks = env.tasks("eval", t.eval_episodes, seed=EVAL_SEED)
        self.agent = sampling_agent_config(exp)
        self.eval_agent = dataclasses.replace(eval_agent_config(exp), record_messages=True)  # for samples/
        source = exp.online_source
        self.kind = source
        self.queue: TrajectoryQueue | None = None
        self.worker: RolloutWorker | None = None
        self.resample: ResampleSource | None = None
        if source == "queue":
            self.queue = TrajectoryQueue(exp.queue.max_size, exp.queue.max_policy_lag, vocab_size=exp.model.vocab_size,
                                         reward_range=t.reward_range)
            self.train_tasks = env.task_stream("train", seed=t.seed)
        elif source == "resample":
            tasks = env.tasks("train", exp.resample.num_tasks or 8 * exp.resample.tasks_per_round, seed=t.seed)
            self.resample = ResampleSource(Resampler(exp.resample, build_experts(exp.resample, tasks, self.chat)),
                                           self.engines.rollout, self.chat, self.agent, concurrency=r.concurrency)
        self.step = 0
        self.rl_start = t.il_warmup_steps  # the learner's state.rl_start, read in after_update
        self.history: collections.deque = collections.deque(maxlen=exp.queue.forced_lag + 1)
        self.last_train: list[Trajectory] = []
        self.train_logged = 0  # lines of trajectories/train.jsonl (checkpointed: a resume cuts the file back to it)
        self._train_log_checked = False
        self.wait_s = 0.0
        self.rl_started_at: float | None = None
        self.closed = False
        self.final_rollout_stats: dict[str, float] | None = None  # taken when the rollouts stop

    # ---- TrajectorySource ---------------------------------------------------------------------------
    def next_trajectories(self, n: int) -> list[Trajectory]:
        if self.step < self.rl_start or self.kind == "expert":
            out = self.experts.take(n)
        elif self.resample is not None:  # synchronous: the learner waits while a round is sampled
            t0 = time.perf_counter()
            self.rl_started_at = self.rl_started_at or t0
            try:
                out = self.resample.next_trajectories(n)
            except EngineError as e:  # e.g. the SGLang pool down past its outage budget
                raise TrainingStopped(f"resampling round failed: {e}") from e
            self.wait_s += time.perf_counter() - t0
        else:
            out = self._take(n)
        for traj in out:
            traj.info.setdefault("split", "train")
        self.last_train = out[:SAMPLES_PER_SPLIT]
        self._log_train(out)
        return out

    def _log_train(self, trajs: list[Trajectory]) -> None:
        if not self._train_log_checked:  # first batch after any restore: drop what a killed run logged after it
            self.folder.truncate_trajectories("train", self.train_logged)
            self._train_log_checked = True
        self.folder.append_trajectories("train", trajs)
        self.train_logged += len(trajs)

    def _take(self, n: int) -> list[Trajectory]:
        if self.worker is None:  # rollouts start with the first RL batch, from the warmed-up weights
            self.rl_started_at = time.perf_counter()
            self.worker = RolloutWorker(self.engines.rollout, self.chat, self.train_tasks, self.queue, self.agent,
                                        concurrency=self.exp.rollout.concurrency,
                                        group_size=self.exp.rollout.group_size,
                                        env_factory=lambda task: self.env_factory(), name="rollout").start()
        t0 = time.perf_counter()
        admitted, admitted_at = self.queue.stats()["admitted"], t0
        try:
            while True:
                self._check_worker()
                try:
                    return self.queue.take(n, timeout=WAIT_POLL_S)
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
        message = (f"no trajectory admitted for {stall_s:g}s (queue.stall_timeout_s) while the learner waited: "
                   f"{w['finished']} rollouts finished, {w['failed']} failed, {w['in_flight']} in flight; dropped "
                   f"{queue_stats['dropped_total']} ({reasons})")
        if queue_stats["last_invalid"]:
            message += f"; the last invalid: {queue_stats['last_invalid']}"
        return message

    def state_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"experts_taken": self.experts.count, "train_logged": self.train_logged}
        if self.resample is not None:
            out["resample"] = self.resample.state_dict()
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.experts.skip_to(int(state["experts_taken"]))
        # A checkpoint written before the count was kept: the file as it is.
        self.train_logged = int(state.get("train_logged", self.folder.count_trajectories("train")))
        if self.resample is not None:
            self.resample.load_state_dict(state["resample"])

    def metrics(self) -> dict[str, float]:
        """Logged by the learner as source/<name> on every training line."""
        out: dict[str, float] = {}
        if self.rl_started_at is not None:
            out["learner_idle_fraction"] = self.wait_s / max(time.perf_counter() - self.rl_started_at, 1e-9)
        if self.queue is not None:
            q = self.queue.stats()
            out.update({f"queue_{k}": float(q[k]) for k in ("depth", "dropped_total", "dropped_stale",
                                                             "dropped_invalid", "dropped_duplicate",
                                                             "lag_taken_mean", "put_per_s")})
        if self.worker is not None:
            w = self.worker.stats()
            out.update({k: float(w[k]) for k in ("episodes_per_s", "generated_tokens_per_s", "success_rate",
                                                  "finished", "failed")})
            # Admission by policy lag, per finished episode (the queue's own count includes retried puts).
            out["queue_admitted_fraction"] = w["admitted"] / max(w["admitted"] + w["dropped"], 1)
        if self.resample is not None:
            out.update({f"resample_{k}": float(v) for k, v in self.resample.resampler.metrics().items()})
        if self.worker is not None or self.resample is not None:
            out.update(self.engines.partial_metrics())
            out.update(self.engines.prefix_metrics())
        return out

    # ---- hooks --------------------------------------------------------------------------------------
    def after_update(self, state: TrainState) -> None:
        """Weight sync. Runs before the first step (after any restore) and after every update."""
        self.step = int(jax.device_get(state.step))
        self.rl_start = int(jax.device_get(state.rl_start))
        if self.queue is not None:
            self.queue.set_version(max(self.step, self.queue.version))
        sync_every = self.exp.rollout.weight_sync_every
        if self.engines.version >= 0 and self.step % sync_every:
            return
        lag = self.exp.queue.forced_lag
        if lag == 0:
            self.engines.push(state, self.step)
            return
        # Staleness experiments: the engines serve the weights of step - forced_lag (copies kept on the host).
        self.history.append((self.step, jax.device_get(nnx.state(state.model()))))
        version, params = self.history[0]
        self.engines.push(_HostState(state, params), version)

    def evaluate(self, state: TrainState) -> dict[str, float]:
        """Held-out episodes with the current weights, train.eval_samples per task: success, reward, tool calls,
        turns (and samples/, and the per-task outcomes in eval_tasks/)."""
        step = int(jax.device_get(state.step))
        if self.engines.kind == "embedded":
            self.engines.control.set_params_from_model(_engine_params(state), step)
        report = self.engines.run(evaluate_policy(
            self.engines.control, self.chat, self.eval_tasks, self.eval_agent, lambda task: self.env_factory(),
            k=self.exp.train.eval_samples))
        done = list(report.trajectories)
        for traj in done:
            traj.info["split"] = "eval"
        self.folder.write_samples(step, done[:SAMPLES_PER_SPLIT] + self.last_train)
        self.folder.write_eval_tasks(step, eval_tasks_record(report))
        return report.scalars()

    # ---- shutdown -----------------------------------------------------------------------------------
    def rollout_stats(self) -> dict[str, float]:
        out = {"learner_idle_fraction": self.metrics().get("learner_idle_fraction", 0.0)}
        if self.worker is not None:
            w = self.worker.stats()
            out.update(episodes_per_s=w["episodes_per_s"], generated_tokens_per_s=w["generated_tokens_per_s"],
                       rollout_episodes=w["finished"], rollout_success_rate=w["success_rate"])
            out["queue_admitted_fraction"] = w["admitted"] / max(w["admitted"] + w["dropped"], 1)
        return out

    def close(self) -> None:
        """Stop the rollouts; finished trajectories not consumed go to trajectories/unconsumed.jsonl; the
        resampler's fork report to forks.json."""
        if self.closed:
            return
        self.closed = True
        left: list[Trajectory] = []
        if self.worker is not None:
            self.worker.stop(abort_in_flight=True, timeout=60.0)
            self.final_rollout_stats = self.rollout_stats()
            left += self.worker.leftovers
        if self.queue is not None:
            self.queue.close()
            left += self.queue.drain()
        self.folder.append_trajectories("unconsumed", left)
        if self.resample is not None:
            self.folder.write_forks(self.resample.resampler.fork_report())
            self.resample.close()
        self.engines.close()


class _HostState:
    """A TrainState stand-in whose model() has older parameters (forced policy lag)."""

    def __init__(self, state, params: nnx.State):
        self._graphdef, self._params = state.graphdef, params
        self._rest = state.rest

    def model(self):
        return nnx.merge(self._graphdef, self._params, self._rest)
