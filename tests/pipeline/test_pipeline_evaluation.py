"""Evaluating a trained policy: pass@k, the report's numbers (a scripted engine, then a trained policy),
experiments/evaluate.py, run folder vs HF export, a missing checkpoint step.

One tiny run (the MoE shape of test_pipeline_online.py: hidden 32, 2 layers; two IL steps, a checkpoint after each,
the HF export) is trained once for the module; the tests evaluate it on 4 held-out tasks."""

import asyncio
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from tiny_pipeline import QUICKSTART, REPO, tiny_config
from transformers import AutoTokenizer

from ipa_jax.chat import ChatFormat
from ipa_jax.engines import EmbeddedEngine, Engine, GenerationResult
from ipa_jax.engines.devserver import DevServer
from ipa_jax.envs import make_env
from ipa_jax.pipeline import RunFolder, load_config, run, validate
from ipa_jax.pipeline.evaluation import (
    EVAL_SEED,
    PolicyError,
    eval_tasks_record,
    eval_temperature,
    evaluate,
    evaluate_policy,
    load_hf_policy,
    load_run_policy,
    pass_at_k,
    write_report,
)
from ipa_jax.rollout import AgentConfig

SCRIPT = os.path.join(REPO, "experiments", "evaluate.py")


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory, tokenizer_dir):
    """A run folder: two IL steps, checkpoints 1 and 2, hf/, the tokenizer given (model.tokenizer)."""
    run_dir = str(tmp_path_factory.mktemp("runs") / "tiny")
    run(
        tiny_config(
            run_dir,
            **{
                "model.tokenizer": tokenizer_dir,
                "train.steps": 2,
                "train.il_warmup_steps": 2,
                "checkpoint.every": 1,
                "checkpoint.export_hf": True,
            },
        )
    )
    return run_dir


def test_pass_at_k_counts_tasks_with_any_success():
    assert pass_at_k([[True, False], [False, False], [False, True], [True, True]]) == 0.75
    assert pass_at_k([[False]] * 3) == 0.0 and pass_at_k([[True]]) == 1.0
    assert pass_at_k([[True, False, False], []]) == 0.5  # a task whose samples were all aborted has no success
    with pytest.raises(ValueError, match="no tasks"):
        pass_at_k([])


class AnsweringEngine(Engine):
    """Answers every task in one turn: right in its first `right[task_id]` episodes, wrong after; aborts the
    episodes of the tasks in `aborted`."""

    weight_version = 0

    def __init__(self, chat, tasks, right, aborted=()):
        self.chat, self.tasks, self.right, self.aborted = chat, tasks, dict(right), set(aborted)

    async def generate(self, prompts, params, session_ids=None, request_ids=None):
        (prompt,) = prompts
        text = self.chat.decode(prompt)
        (task,) = [t for t in self.tasks if t.prompt in text]
        if task.task_id in self.aborted:
            return [GenerationResult([], [], "abort", None, 0)]
        self.right[task.task_id] -= 1
        ids = self.chat.encode(task.answer if self.right[task.task_id] >= 0 else "wrong") + [self.chat.im_end_id]
        return [GenerationResult(ids, [-1.0] * len(ids), "stop", self.chat.im_end_id, 0)]

    async def update_weights(self, path, version):
        raise NotImplementedError

    async def pause(self):
        pass

    async def resume(self):
        pass

    async def health(self):
        return True

    async def close(self):
        pass


def test_evaluate_policy_counts_successes_per_task_and_leaves_out_aborted_episodes(tokenizer_dir):
    chat = ChatFormat(AutoTokenizer.from_pretrained(tokenizer_dir))
    env = make_env("calculator")
    tasks = env.tasks("eval", 5, seed=EVAL_SEED)
    right = dict(zip([t.task_id for t in tasks], [0, 1, 3, 2, 0]))
    engine = AnsweringEngine(chat, tasks, right, aborted=[tasks[4].task_id])
    report = asyncio.run(
        evaluate_policy(
            engine,
            chat,
            tasks,
            AgentConfig(max_new_tokens=32, temperature=0.5),
            lambda task: make_env("calculator"),
            k=3,
        )
    )
    assert report.tasks == 5 and report.k == 3 and report.episodes == 12 and report.aborted == 3
    assert [sum(t["successes"]) for t in report.per_task] == [0, 1, 3, 2, 0]
    assert [len(t["successes"]) for t in report.per_task] == [3, 3, 3, 3, 0]
    # Per family (the calculator's operation kinds): the successes of its tasks' finished episodes.
    families = [env.family(t) for t in tasks]
    assert [t["family"] for t in report.per_task] == families
    expected = {}
    for family, wins, samples in zip(families, [0, 1, 3, 2, 0], [3, 3, 3, 3, 0]):
        won, played = expected.get(family, (0, 0))
        expected[family] = (won + wins, played + samples)
    assert report.success_by_family == {f: pytest.approx(w / n) for f, (w, n) in sorted(expected.items()) if n}
    if len(report.success_by_family) > 1:
        assert report.scalars()[f"success_{families[0]}"] == report.success_by_family[families[0]]
    assert report.success == pytest.approx(6 / 12) and report.reward == pytest.approx(6 / 12)
    assert report.pass_at_k == pytest.approx(3 / 5)  # the aborted task counts as a failure
    assert report.turns == 1.0 and report.tool_calls == 0.0 and report.temperature == 0.5
    assert [e["sample"] for e in report.per_episode] == [0, 1, 2] * 4
    assert {e["finish_reason"] for e in report.per_episode} == {"answer"} and len(report.trajectories) == 12
    # The eval_tasks/ record: finished samples and successes per task (the aborted task: 0 of 0).
    record = eval_tasks_record(report)
    assert [(t["task_id"], t["family"], t["samples"], t["successes"]) for t in record["tasks"]] == list(
        zip([t.task_id for t in tasks], families, [3, 3, 3, 3, 0], [0, 1, 3, 2, 0])
    )
    assert (record["split"], record["task_seed"], record["samples_per_task"], record["temperature"]) == (
        "eval",
        EVAL_SEED,
        3,
        0.5,
    )
    assert (record["episodes"], record["aborted"], record["success"]) == (12, 3, report.success)
    json.dumps(record)  # JSON values only


def test_several_eval_samples_sample_at_the_rollout_temperature_unless_one_is_set():
    def temperature(**overrides):
        return eval_temperature(validate(tiny_config("/tmp/unused", **overrides)))

    assert temperature() == 0.0  # one sample: rollout.eval_temperature (greedy)
    assert temperature(**{"train.eval_samples": 4, "rollout.temperature": 0.8}) == 0.8
    assert temperature(**{"train.eval_samples": 4, "rollout.eval_temperature": 0.6}) == 0.6
    exp = validate(tiny_config("/tmp/unused", **{"train.eval_samples": 4}))
    assert eval_temperature(exp, samples=1) == 0.0  # evaluate(k=1) of that run: greedy
    with pytest.raises(ValueError, match="train.eval_samples"):
        validate(tiny_config("/tmp/unused", **{"train.eval_samples": 0}))


def test_report_numbers_are_those_of_its_episodes(trained_run, tmp_path):
    exp, policy = load_run_policy(trained_run)
    assert policy.step == 2 and policy.name == trained_run
    report = evaluate(exp, policy, episodes=4, k=2, temperature=1.0)
    path = str(tmp_path / "report.json")
    write_report(report, path)
    with open(path) as f:
        out = json.load(f)
    episodes, tasks = out["per_episode"], out["per_task"]
    # The held-out set the learner evaluates on, each task sampled k times.
    held_out = [t.task_id for t in make_env(exp.env.name, **dict(exp.env.kwargs)).tasks("eval", 4, seed=EVAL_SEED)]
    assert [t["task_id"] for t in tasks] == held_out and out["tasks"] == 4 and out["k"] == 2
    assert out["episodes"] == len(episodes) == 8 and out["aborted"] == 0
    assert [e["task_id"] for e in episodes] == [t for t in held_out for _ in range(2)]
    assert [e["sample"] for e in episodes] == [0, 1] * 4
    assert [s for t in tasks for s in t["successes"]] == [e["success"] for e in episodes]
    assert [e["success"] for e in episodes] == [e["reward"] >= 1.0 for e in episodes]
    assert out["success"] == pytest.approx(np.mean([e["success"] for e in episodes]))
    assert out["pass_at_k"] == pytest.approx(np.mean([any(t["successes"]) for t in tasks]))
    for key in ("reward", "tool_calls", "tool_errors", "turns"):
        assert out[key] == pytest.approx(np.mean([e[key] for e in episodes])), key
    assert out["temperature"] == 1.0 and out["split"] == "eval" and out["engine"] == "embedded"
    assert out["policy"] == trained_run and out["step"] == 2 and out["time_s"] > 0
    assert all(e["generated_tokens"] > 0 for e in episodes)
    # At the learner's settings (k=1, rollout.eval_temperature) the numbers are the run's last eval/.
    greedy = evaluate(exp, policy)
    logged = [r for r in RunFolder(trained_run).read_metrics() if "eval/success" in r][-1]
    assert logged["step"] == 2 and greedy.episodes == 4 and greedy.temperature == 0.0
    for key in ("success", "reward", "tool_calls", "tool_errors", "turns"):
        assert getattr(greedy, key) == pytest.approx(logged[f"eval/{key}"]), key
    # The learner stored each evaluation task by task (eval_tasks/): greedy, so the same outcomes as here.
    folder = RunFolder(trained_run)
    assert folder.eval_tasks_steps() == [0, 2]
    record = folder.read_eval_tasks(2)
    assert record["tasks"] == [
        {"task_id": t["task_id"], "family": t["family"], "samples": 1, "successes": sum(t["successes"])}
        for t in greedy.per_task
    ]
    assert record["success"] == pytest.approx(logged["eval/success"]) and record["samples_per_task"] == 1
    assert sum(t["successes"] for t in record["tasks"]) / sum(t["samples"] for t in record["tasks"]) == pytest.approx(
        logged["eval/success"]
    )


def test_cli_on_a_run_folder_prints_the_table_and_writes_the_report(trained_run):
    proc = subprocess.run(
        [sys.executable, SCRIPT, f"--run={trained_run}", "--episodes=4", "--k=2", "--temperature=1.0", "--step=1"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    path = os.path.join(trained_run, "eval", "step_00000001_k2_t1.json")
    assert f"report: {path}" in proc.stdout
    lines = proc.stdout.splitlines()
    assert any(line.split() == ["pass@2", f"{json.load(open(path))['pass_at_k']:.4f}"] for line in lines)
    assert any(line.startswith("success") for line in lines) and f"{trained_run} (step 1)" in proc.stdout
    with open(path) as f:
        out = json.load(f)
    assert out["step"] == 1 and out["k"] == 2 and out["episodes"] == 8 and len(out["per_task"]) == 4


def test_cli_on_an_hf_folder_writes_its_report_under_runs(trained_run, tmp_path):
    hf_dir = RunFolder(trained_run).hf_dir
    proc = subprocess.run(
        [sys.executable, SCRIPT, f"--policy={hf_dir}", f"--config={QUICKSTART}", "--episodes=2"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    # Nothing outside the ignored runs/ folder of where it ran.
    assert os.listdir(tmp_path) == ["runs"] and os.listdir(tmp_path / "runs") == ["evaluation.json"]
    with open(tmp_path / "runs" / "evaluation.json") as f:
        assert json.load(f)["policy"] == hf_dir


def test_cli_usage_errors():
    def fails(*args):
        proc = subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, timeout=300)
        assert proc.returncode != 0
        return proc.stdout + proc.stderr

    assert "exactly one of --run" in fails("--run=a", "--policy=b")
    assert "/nonexistent/run: not a run folder" in fails("--run=/nonexistent/run")


def test_greedy_run_checkpoint_hf_export_and_sglang_server_agree(trained_run):
    hf_dir = RunFolder(trained_run).hf_dir
    exp, from_run = load_run_policy(trained_run)
    from_hf = load_hf_policy(exp, hf_dir, tokenizer=exp.model.tokenizer)
    a, b = (evaluate(exp, p, episodes=4, temperature=0.0) for p in (from_run, from_hf))
    assert a.step == 2 and b.step is None and b.policy == hf_dir and b.engine == "embedded"
    assert [t["successes"] for t in a.per_task] == [t["successes"] for t in b.per_task]
    # Same weights, greedy: the same episodes token for token.
    tokens = [t.tokens.tolist() for t in a.trajectories]
    assert [t.tokens.tolist() for t in b.trajectories] == tokens
    # --sglang_urls: a server already serving the export (the dev server: SGLang's HTTP contract); no weights loaded.
    server = DevServer(EmbeddedEngine(from_hf.model, max_len=exp.rollout.max_context, max_batch=4), model_path=hf_dir)
    server.serve_in_thread()
    try:
        served = load_hf_policy(exp, hf_dir, tokenizer=exp.model.tokenizer, load_model=False)
        c = evaluate(exp, served, episodes=4, temperature=0.0, sglang_urls=[server.url])
    finally:
        server.shutdown()
    assert served.model is None and c.engine == "sglang" and c.seed is None
    assert [t.tokens.tolist() for t in c.trajectories] == tokens


def test_a_missing_step_names_the_available_ones(trained_run):
    with pytest.raises(PolicyError, match=r"no checkpoint of step 7; available steps: 1, 2"):
        load_run_policy(trained_run, step=7)
    exp, policy = load_run_policy(trained_run, step=1, load_model=False)
    assert (
        policy.step == 1 and policy.model is None and validate(load_config(RunFolder(trained_run).config_path)) == exp
    )
