"""Held-out evaluation: the numbers of a set of finished episodes, and the evaluation of a trained policy.

    python experiments/evaluate.py --run=runs/quickstart [--step=N] [--k=4] [--temperature=1.0]

The held-out tasks are `env.tasks(split, episodes, seed=EVAL_SEED)`, the set the learner's evaluations play
(`OnlineSource.evaluate`): the same tasks for every run, whatever its config or train.seed, so arms and seeds of an
ablation are evaluated on the same tasks and compare task by task. The learner plays train.eval_samples episodes of
each at `eval_temperature` and writes their per-task outcomes to eval_tasks/ (`eval_tasks_record`); at k =
train.eval_samples and that temperature, `evaluate` measures what a run logs as eval/success. `load_run_policy` (a
run folder's Orbax checkpoint) and `load_hf_policy` (a Hugging Face folder) give the policy; `evaluate` plays k
episodes of every task with the embedded engine or SGLang servers (`evaluate_policy`) and returns an `EvalReport`:
success (mean over episodes = pass@1), pass@k (tasks with at least one success among their k samples), reward, tool
calls, tool errors, turns, and every task's and episode's outcome.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ipa_jax.chat import ChatFormat, load_tokenizer
from ipa_jax.engines import Engine
from ipa_jax.envs import Env, Task
from ipa_jax.models import Qwen3ForCausalLM, merge_lora
from ipa_jax.pipeline.build import build_engine, build_mesh, build_model, build_state
from ipa_jax.pipeline.config import ConfigError, ExperimentConfig, load_config, validate
from ipa_jax.pipeline.run_folder import RunFolder
from ipa_jax.rollout import AgentConfig, run_episodes
from ipa_jax.rollout.lockstep import derive_seed
from ipa_jax.train import Checkpointer
from ipa_jax.trajectory import Trajectory

log = logging.getLogger(__name__)

EVAL_SEED = 0  # the held-out task set is the same for every run (comparable across seeds and configs)
SUCCESS_REWARD = 1.0  # an episode succeeds iff its reward reaches this
DEFAULT_REPORT = os.path.join("runs", "evaluation.json")  # an HF folder's evaluation, with the other outputs


def episode_metrics(trajs: list[Trajectory]) -> dict[str, float]:
    """Mean success (reward >= SUCCESS_REWARD), reward, tool calls, tool errors and turns over the episodes."""
    if not trajs:
        raise RuntimeError("evaluation: every episode was aborted by the engine")
    return {
        "success": float(np.mean([t.reward >= SUCCESS_REWARD for t in trajs])),
        "reward": float(np.mean([t.reward for t in trajs])),
        "tool_calls": float(np.mean([t.info["num_tool_calls"] for t in trajs])),
        "tool_errors": float(np.mean([t.info["num_tool_errors"] for t in trajs])),
        "turns": float(np.mean([t.info["num_turns"] for t in trajs])),
        "episodes": float(len(trajs)),
    }


def pass_at_k(outcomes: Sequence[Sequence[bool]]) -> float:
    """The fraction of tasks with at least one success among their samples (`outcomes[i]`: task i's k samples).
    With n == k samples per task the unbiased estimator 1 - C(n-c, k) / C(n, k) is exactly this."""
    if not outcomes:
        raise ValueError("pass_at_k: no tasks")
    return float(np.mean([any(samples) for samples in outcomes]))


def eval_temperature(exp: ExperimentConfig, samples: int | None = None) -> float:
    """The temperature held-out episodes are sampled at: rollout.eval_temperature, except that with several samples
    per task (`samples`, default train.eval_samples) a greedy setting (0) becomes rollout.temperature, since greedy
    samples of one task would all be the same episode."""
    r = exp.rollout
    samples = exp.train.eval_samples if samples is None else samples
    return r.temperature if samples > 1 and r.eval_temperature == 0 else r.eval_temperature


def eval_agent_config(
    exp: ExperimentConfig, temperature: float | None = None, samples: int | None = None
) -> AgentConfig:
    """How held-out episodes are played: exp.rollout's budgets at `temperature` (default `eval_temperature(exp,
    samples)`), full support otherwise (no top-p / top-k), as in the learner's evaluations."""
    r = exp.rollout
    return AgentConfig(
        max_new_tokens=r.max_new_tokens,
        max_turns=r.max_turns,
        max_context=r.max_context,
        temperature=eval_temperature(exp, samples) if temperature is None else temperature,
    )


# ---------------------------------------------------------------------------------------------- the report
@dataclass(frozen=True)
class EvalReport:
    """The outcome of k episodes per task. `evaluate_policy` fills the numbers; `evaluate` adds what was evaluated
    (policy, step, engine, split, seed).

    success: mean over finished episodes (pass@1); success_by_family: the same per task family (`Env.family`);
    pass_at_k: `pass_at_k` over tasks; reward, tool_calls, tool_errors, turns: means over finished episodes;
    per_task: {task_id, family, successes, rewards} (the task's finished samples, in order); per_episode: {task_id,
    sample, reward, success, tool_calls, tool_errors, turns, finish_reason, generated_tokens}; aborted: episodes the
    engine aborted (left out of every number); trajectories: the finished episodes (not written to JSON).
    """

    k: int
    temperature: float
    tasks: int
    episodes: int
    aborted: int
    success: float
    pass_at_k: float
    reward: float
    tool_calls: float
    tool_errors: float
    turns: float
    time_s: float
    per_task: tuple[dict[str, Any], ...]
    per_episode: tuple[dict[str, Any], ...]
    policy: str = ""
    step: int | None = None
    engine: str = ""
    split: str = ""
    seed: int | None = None  # the embedded engine's sampling seed
    success_by_family: dict[str, float] = field(default_factory=dict)
    trajectories: tuple[Trajectory, ...] = field(default=(), repr=False, compare=False)

    def scalars(self) -> dict[str, float]:
        """The numbers a run logs as eval/<name> (pass_at_k with k > 1 only; success_<family> with several task
        families)."""
        names = ("success", "reward", "tool_calls", "tool_errors", "turns", "episodes", "time_s")
        out = {name: float(getattr(self, name)) for name in names}
        if len(self.success_by_family) > 1:
            out.update({f"success_{family}": rate for family, rate in self.success_by_family.items()})
        return {**out, "pass_at_k": self.pass_at_k} if self.k > 1 else out

    def to_dict(self) -> dict[str, Any]:
        """JSON values: every field but the trajectories, what was evaluated first."""
        names = [f.name for f in dataclasses.fields(self) if f.name != "trajectories"]
        first = ["policy", "step", "engine", "split", "seed"]
        out = {name: getattr(self, name) for name in first + [n for n in names if n not in first]}
        return {**out, "per_task": list(self.per_task), "per_episode": list(self.per_episode)}

    def task_outcomes(self) -> list[dict[str, Any]]:
        """[{task_id, family, samples, successes}] per task, in task order: finished samples and how many
        succeeded."""
        return [
            {
                "task_id": t["task_id"],
                "family": t["family"],
                "samples": len(t["successes"]),
                "successes": sum(t["successes"]),
            }
            for t in self.per_task
        ]


def eval_tasks_record(report: EvalReport) -> dict[str, Any]:
    """A learner evaluation's eval_tasks/ record (docs/run_folder.md): the held-out split and its task seed, samples
    per task, temperature, the episodes' counts and success, and `report.task_outcomes()` under "tasks"."""
    return {
        "split": "eval",
        "task_seed": EVAL_SEED,
        "samples_per_task": report.k,
        "temperature": report.temperature,
        "episodes": report.episodes,
        "aborted": report.aborted,
        "success": report.success,
        "tasks": report.task_outcomes(),
    }


def success_by_family(families: Sequence[str], by_task: Sequence[Sequence[Trajectory]]) -> dict[str, float]:
    """{family: mean success over the finished episodes of its tasks}, families sorted; task i is of `families[i]`
    with finished episodes `by_task[i]` (a family without any is left out)."""
    outcomes: dict[str, list[bool]] = {}
    for family, samples in zip(families, by_task):
        outcomes.setdefault(family, []).extend(t.reward >= SUCCESS_REWARD for t in samples)
    return {family: float(np.mean(o)) for family, o in sorted(outcomes.items()) if o}


def episode_record(traj: Trajectory, sample: int) -> dict[str, Any]:
    """One episode's outcome as JSON values (`EvalReport.per_episode`); `sample` is its index among its task's."""
    info = traj.info
    return {
        "task_id": info["task_id"],
        "sample": sample,
        "reward": traj.reward,
        "success": bool(traj.reward >= SUCCESS_REWARD),
        "tool_calls": info["num_tool_calls"],
        "tool_errors": info["num_tool_errors"],
        "turns": info["num_turns"],
        "finish_reason": info["finish_reason"],
        "generated_tokens": info["generated_tokens"],
    }


async def evaluate_policy(
    engine: Engine,
    chat: ChatFormat,
    tasks: Sequence[Task],
    agent_config: AgentConfig,
    env_factory: Callable[[Task], Env],
    k: int,
    *,
    concurrency: int | None = None,
    lockstep: bool = False,
) -> EvalReport:
    """Plays `k` episodes of every task with `engine`, all in flight at once (at most `concurrency`); returns the
    report of their outcomes (EvalReport; policy, step, engine, split and seed left empty). `lockstep`: all of them
    in lockstep (`ipa_jax.rollout.lockstep`) with seeds of EVAL_SEED and their place, the same in every evaluation:
    the outcomes depend on the weights alone. Raises RuntimeError when the engine aborted every episode."""
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    if not tasks:
        raise ValueError("evaluate_policy: no tasks")
    played = [task for task in tasks for _ in range(k)]  # a task's k samples side by side
    t0 = time.perf_counter()
    trajs = await run_episodes(
        engine,
        chat,
        played,
        agent_config,
        concurrency=concurrency or len(played),
        env_factory=env_factory,
        lockstep_seed=derive_seed(EVAL_SEED) if lockstep else None,
    )
    time_s = time.perf_counter() - t0
    slots = [trajs[i * k : (i + 1) * k] for i in range(len(tasks))]  # None: aborted
    by_task = [[t for t in samples if t is not None] for samples in slots]
    done = [t for samples in by_task for t in samples]
    metrics = episode_metrics(done)
    family_env = env_factory(tasks[0])
    try:
        families = [family_env.family(task) for task in tasks]
    finally:
        family_env.close()
    return EvalReport(
        k=k,
        temperature=agent_config.temperature,
        tasks=len(tasks),
        episodes=len(done),
        aborted=len(played) - len(done),
        success=metrics["success"],
        pass_at_k=pass_at_k([[t.reward >= SUCCESS_REWARD for t in samples] for samples in by_task]),
        reward=metrics["reward"],
        tool_calls=metrics["tool_calls"],
        tool_errors=metrics["tool_errors"],
        turns=metrics["turns"],
        time_s=time_s,
        per_task=tuple(
            {
                "task_id": task.task_id,
                "family": family,
                "successes": [bool(t.reward >= SUCCESS_REWARD) for t in samples],
                "rewards": [t.reward for t in samples],
            }
            for task, family, samples in zip(tasks, families, by_task)
        ),
        success_by_family=success_by_family(families, by_task),
        per_episode=tuple(episode_record(t, j) for samples in slots for j, t in enumerate(samples) if t is not None),
        trajectories=tuple(done),
    )


# ---------------------------------------------------------------------------------------------- policies
class PolicyError(ValueError):
    """A policy that cannot be loaded as asked: no such folder, no checkpoint of that step, no tokenizer."""


@dataclass(frozen=True)
class Policy:
    """A policy to evaluate. name: its run folder or HF folder; step: the checkpoint's learner step (None for an HF
    folder); model: its weights (None when SGLang servers serve them)."""

    name: str
    step: int | None
    tokenizer: Any
    model: Qwen3ForCausalLM | None = None


def load_run_policy(
    run_dir: str, *, step: int | None = None, overrides: Iterable[str] | Mapping[str, Any] = (), load_model: bool = True
) -> tuple[ExperimentConfig, Policy]:
    """The run folder's config (config.json with `overrides` applied) and policy: the checkpoint of `step`
    (default: the latest complete one) restored on the config's mesh, and the run's tokenizer (<run>/tokenizer,
    else model.tokenizer, else model.path). Raises PolicyError naming the available steps when `step` has no
    checkpoint."""
    folder = RunFolder(run_dir)
    if not folder.has_config():
        raise PolicyError(f"{run_dir}: not a run folder (no config.json)")
    exp = validate(load_config(folder.config_path, overrides))
    if not os.path.isdir(folder.checkpoints_dir):  # (Checkpointer would create it)
        raise PolicyError(f"{run_dir}: no checkpoints/ folder (the run saved no checkpoint)")
    checkpointer = Checkpointer(folder.checkpoints_dir, exp.checkpoint)
    try:
        steps = sorted(checkpointer.all_steps())  # complete checkpoints only
        if not steps:
            raise PolicyError(f"{folder.checkpoints_dir}: no complete checkpoint")
        step = steps[-1] if step is None else step
        if step not in steps:
            raise PolicyError(
                f"{folder.checkpoints_dir}: no checkpoint of step {step}; available steps: {', '.join(map(str, steps))}"
            )
        model = None
        if load_model:
            state, _ = checkpointer.restore(build_state(exp, build_mesh(exp.mesh)), step)
            model = merge_lora(state.model())  # engines serve plain models
    finally:
        checkpointer.close()
    tokenizer = _first_tokenizer(folder.tokenizer_dir, exp.model.tokenizer, exp.model.path)
    if tokenizer is None:
        raise PolicyError(f"{run_dir}: no tokenizer (no tokenizer/ folder, model.tokenizer or model.path)")
    return exp, Policy(folder.path, step, tokenizer, model)


def load_hf_policy(exp: ExperimentConfig, path: str, *, tokenizer: str = "", load_model: bool = True) -> Policy:
    """The HF folder `path` (loaded as exp.model says, on exp.mesh) with the tokenizer `tokenizer`, else the
    folder's, else exp.model.tokenizer."""
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise PolicyError(f"{path}: not a Hugging Face model folder (no config.json)")
    if tokenizer and not os.path.isdir(tokenizer):
        raise PolicyError(f"tokenizer {tokenizer}: no such folder")
    tok = _first_tokenizer(tokenizer, path, exp.model.tokenizer)
    if tok is None:
        raise PolicyError(f"{path}: no tokenizer in the folder; pass one (--tokenizer) or set model.tokenizer")
    model = None
    if load_model:
        plain = dataclasses.replace(exp.model, path=path, lora_rank=0, lora_experts=False)  # exported: merged weights
        model = build_model(plain, build_mesh(exp.mesh), exp.train.seed)
    return Policy(path, None, tok, model)


def _first_tokenizer(*paths: str):
    """The tokenizer of the first of `paths` that holds one, or None."""
    for path in paths:
        if path and os.path.exists(os.path.join(path, "tokenizer_config.json")):
            return load_tokenizer(path)
    return None


# ---------------------------------------------------------------------------------------------- evaluate
def evaluate(
    exp: ExperimentConfig,
    policy: Policy,
    *,
    episodes: int | None = None,
    k: int = 1,
    temperature: float | None = None,
    split: str = "eval",
    sglang_urls: Sequence[str] = (),
    seed: int = 0,
) -> EvalReport:
    """Plays `k` episodes of each of the first `episodes` (default train.eval_episodes) tasks of `split` (seed
    EVAL_SEED) of exp.env with exp.rollout's budgets at `temperature` (default `eval_temperature(exp, k)`), on the
    embedded engine (sampling seed `seed`) or on SGLang servers that already serve the policy; returns the report."""
    if not exp.env.name:
        raise ConfigError("env.name", "evaluation needs an environment (ipa_jax.envs.list_envs())")
    agent = eval_agent_config(exp, temperature, samples=k)
    if k > 1 and agent.temperature == 0:
        log.warning(
            "k=%d samples per task at temperature 0 (greedy): the samples will be identical and pass@%d "
            "will equal success; sample with a temperature > 0",
            k,
            k,
        )
    tasks = exp.env.make().tasks(split, exp.train.eval_episodes if episodes is None else episodes, seed=EVAL_SEED)
    kind = "sglang" if sglang_urls else "embedded"
    if kind == "embedded" and policy.model is None:
        raise ValueError(f"policy {policy.name} has no weights loaded and no SGLang server serves it")
    # Embedded: the batch the learner's evaluations ran with (rollout.eval_concurrency). SGLang: no weight sync here.
    engine = build_engine(
        exp,
        kind,
        tokenizer=policy.tokenizer,
        model=policy.model,
        seed=seed,
        max_batch=min(len(tasks) * k, exp.rollout.eval_concurrency),
        sglang_urls=tuple(sglang_urls),
        min_sync_servers=1,
    )

    async def play() -> EvalReport:
        try:
            chat = ChatFormat(policy.tokenizer, enable_thinking=exp.rollout.enable_thinking)
            return await evaluate_policy(
                engine, chat, tasks, agent, lambda task: exp.env.make(), k, lockstep=exp.rollout.schedule == "lockstep"
            )
        finally:
            await engine.close()

    report = asyncio.run(play())
    return dataclasses.replace(
        report,
        policy=policy.name,
        step=policy.step,
        engine=kind,
        split=split,
        seed=seed if kind == "embedded" else None,
    )  # the servers sample with their own


def report_path(run_dir: str | None, report: EvalReport) -> str:
    """Where a report goes by default: <run>/eval/step_<8 digits>_k<k>_t<temperature>.json for a run folder (one
    file per setting), else DEFAULT_REPORT."""
    if run_dir is None:
        return DEFAULT_REPORT
    return RunFolder(run_dir).eval_report_path(report.step, report.k, report.temperature)


def write_report(report: EvalReport, path: str) -> None:
    """The report as JSON (`EvalReport.to_dict`)."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(report.to_dict(), f, indent=1)


def format_report(report: EvalReport) -> str:
    """The report's numbers as an aligned two-column table."""
    step = "" if report.step is None else f" (step {report.step})"
    aborted = f", {report.aborted} aborted" if report.aborted else ""
    rows = [
        ("policy", f"{report.policy}{step}"),
        ("engine", report.engine),
        ("tasks", f"{report.tasks} {report.split} tasks x {report.k} samples = {report.episodes} episodes{aborted}"),
        ("temperature", f"{report.temperature:g}" + ("  (greedy)" if report.temperature == 0 else "")),
        ("success", f"{report.success:.4f}  (pass@1)"),
        *((f"  {family}", f"{rate:.4f}") for family, rate in report.success_by_family.items()),
        (f"pass@{report.k}", f"{report.pass_at_k:.4f}"),
        ("reward", f"{report.reward:.4f}"),
        ("tool calls", f"{report.tool_calls:.2f}"),
        ("tool errors", f"{report.tool_errors:.2f}"),
        ("turns", f"{report.turns:.2f}"),
        ("time", f"{report.time_s:.1f} s"),
    ]
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)
