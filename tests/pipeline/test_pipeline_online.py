"""Online training end to end: expert IL episodes; a shortened quickstart (one module run: IL warm start, then RL
steps fed through the trajectory queue by the embedded engine); one learner step fed by the SGLang client over real
HTTP (dev server); Ctrl-C; resampling; ROLL's preset on rollouts one update stale (forced lag); the README's
own-environment example.

Every run shares one tiny MoE shape (vocab 640 for the built tokenizer, hidden 32, 2 layers), batch 8 over the
8 fake CPU devices, so compiled steps and engine functions are reused within the module."""

import collections
import json
import os
import urllib.request

import numpy as np
import pytest
from server_process import ServerProcess, devserver_argv
from tiny_pipeline import REPO, tiny_config
from transformers import AutoTokenizer

from ipa_jax.analysis.sweep import seed_from_warm_start
from ipa_jax.chat import ChatFormat, template
from ipa_jax.envs import make_env
from ipa_jax.models import save_pretrained
from ipa_jax.pipeline import RunFolder, run, validate
from ipa_jax.pipeline.build import build_learner, build_mesh, build_state
from ipa_jax.pipeline.forks import probe_policy
from ipa_jax.pipeline.online import OnlineSource, expert_trajectory
from ipa_jax.pipeline.run import format_summary
from ipa_jax.trajectory import read_jsonl


def test_expert_trajectory_is_the_chat_template_of_the_expert_conversation(tokenizer_dir):
    """In Qwen3's non-thinking mode (the quickstart's): the template's rendering of the expert conversation, with
    the empty think block every generation prompt carries (the template keeps it on the last turn only)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    chat = ChatFormat(tok, enable_thinking=False)
    env = make_env("lookup", hops=3)
    for task in env.tasks("train", 3, 0):
        traj = expert_trajectory(task, make_env("lookup", hops=3), chat, uid="e")
        traj.validate(vocab_size=len(tok))
        rendered = template.render(env.expert(task), tools=task.tools).rstrip("\n")
        head, last = rendered.rsplit("<|im_start|>assistant\n", 1)
        think = "<|im_start|>assistant\n<think>\n\n</think>\n\n"
        assert last.startswith("<think>\n\n</think>\n\n")
        assert traj.tokens.tolist() == tok.encode(
            head.replace("<|im_start|>assistant\n", think) + "<|im_start|>assistant\n" + last
        )
        # Imitation targets: exactly the assistant turns (text through <|im_end|>), the final answer's
        # <|im_end|> included (without it the policy never learns to stop after answering); no action token.
        assert not traj.action_mask.any() and traj.expert_mask[-1] and (traj.chunk_ids == -1).all()
        targets = tok.decode(traj.tokens[traj.expert_mask].tolist())
        assert targets.count("<tool_call>") == 3 and targets.count("<|im_end|>") == 4
        assert targets.endswith(task.answer + "<|im_end|>") and "<tool_response>" not in targets
        assert traj.reward == 1.0 and traj.num_chunks == 0


def _check_rl_steps(run_dir, steps, il_steps=0):
    """Steps il_steps + 1 .. steps took 8 policy episodes each from the queue; returns summary.json."""
    rows = RunFolder(run_dir).read_metrics()
    train = [r for r in rows if "loss" in r]
    assert [r["step"] for r in train] == list(range(1, steps + 1))
    assert all(np.isfinite(r["loss"]) and r["source/learner_idle_fraction"] >= 0 for r in train[il_steps:])
    consumed = read_jsonl(os.path.join(run_dir, "trajectories", "train.jsonl"))
    sampled = [t for t in consumed if not t.info.get("expert")]
    assert len(consumed) == 8 * steps and len(sampled) == 8 * (steps - il_steps)
    assert len({t.uid for t in consumed}) == len(consumed)
    for t in sampled:  # sampled by the policy (not experts), through the agent loop
        t.validate()
        assert t.action_mask.sum() == t.info["generated_tokens"] > 0 and not t.expert_mask.any()
        assert t.policy_version <= steps - 1
    summary = json.load(open(os.path.join(run_dir, "summary.json")))
    assert summary["steps"] == steps and summary["success_after"] is not None
    return summary


def test_one_learner_step_through_a_dev_server_with_the_sglang_client(tmp_path, tokenizer_dir):
    from ipa_jax.engines.devserver import DevServer
    from ipa_jax.engines.embedded import EmbeddedEngine
    from ipa_jax.models import from_pretrained

    # The policy's initial weights as an HF folder, served by the dev server and loaded by the learner.
    cfg = tiny_config(tmp_path / "init", **{"model.tokenizer": tokenizer_dir})
    exp = validate(cfg)
    state = build_state(exp, build_mesh(exp.mesh))
    init = str(tmp_path / "init_hf")
    save_pretrained(state.model(), init)
    server = DevServer(EmbeddedEngine(from_pretrained(init), max_len=448, max_batch=8), model_path=init)
    server.serve_in_thread()
    try:
        run_dir = tmp_path / "run"
        run(
            tiny_config(
                run_dir,
                **{
                    "model.tokenizer": tokenizer_dir,
                    "model.path": init,
                    "rollout.engine": "sglang",
                    "rollout.sglang_urls": (server.url,),
                    "train.steps": 1,
                    "train.il_warmup_steps": 0,
                },
            )
        )
    finally:
        server.shutdown()
    _check_rl_steps(run_dir, steps=1)
    # Weight sync wrote HF safetensors per version and the server loaded them (the version it reports).
    assert sorted(os.listdir(run_dir / "weights")) == ["v00000000", "v00000001"]
    assert os.path.exists(run_dir / "weights" / "v00000001" / "config.json")


@pytest.mark.slow
def test_one_learner_step_with_distributed_weight_sync_to_a_dev_server_process(tmp_path, tokenizer_dir):
    """rollout.weight_sync = "distributed" end to end: the learner pushes its weights over a gloo group (SGLang's
    /update_weights_from_distributed) to a dev server in its own process, which serves them (its version read back),
    and no weights folder is written."""
    pytest.importorskip("torch")
    cfg = tiny_config(tmp_path / "init", **{"model.tokenizer": tokenizer_dir})
    exp = validate(cfg)
    state = build_state(exp, build_mesh(exp.mesh))
    init = str(tmp_path / "init_hf")
    save_pretrained(state.model(), init)
    server = ServerProcess(devserver_argv(init, max_len=448, max_batch=8), start_timeout_s=120.0)
    try:
        run_dir = tmp_path / "run"
        run(
            tiny_config(
                run_dir,
                **{
                    "model.tokenizer": tokenizer_dir,
                    "model.path": init,
                    "rollout.engine": "sglang",
                    "rollout.sglang_urls": (server.url,),
                    "rollout.weight_sync": "distributed",
                    "train.steps": 1,
                    "train.il_warmup_steps": 0,
                },
            )
        )
        with urllib.request.urlopen(server.url + "/get_model_info", timeout=10) as response:
            assert int(json.load(response)["weight_version"]) == 1
    finally:
        server.close()
    _check_rl_steps(run_dir, steps=1)
    assert not os.path.exists(run_dir / "weights")


def test_disk_weight_sync_from_an_object_store_run_folder_is_a_config_error(tmp_path):
    from ipa_jax.pipeline.build import build_online_engines
    from ipa_jax.pipeline.config import ConfigError

    exp = validate(
        tiny_config(tmp_path / "run", **{"rollout.engine": "sglang", "rollout.sglang_urls": ("http://127.0.0.1:1",)})
    )
    with pytest.raises(ConfigError, match="rollout.weight_sync.*object store"):
        build_online_engines(exp, None, "gs://bucket/run/weights")


def test_ctrl_c_keeps_finished_trajectories_and_checkpoints(tmp_path, tokenizer_dir):
    run_dir = str(tmp_path / "run")
    exp = validate(
        tiny_config(run_dir, **{"model.tokenizer": tokenizer_dir, "train.steps": 5, "train.il_warmup_steps": 1})
    )
    mesh = build_mesh(exp.mesh)
    state = build_state(exp, mesh)
    source = OnlineSource(exp, state, RunFolder(run_dir))
    after_update = source.after_update

    def interrupt_after_step_2(st):
        after_update(st)
        if int(st.step) == 2:
            raise KeyboardInterrupt

    learner = build_learner(exp, source, run_dir=run_dir, mesh=mesh, state=state, after_update=interrupt_after_step_2)
    with pytest.raises(KeyboardInterrupt):
        try:
            learner.run()
        finally:
            source.close()
    assert learner.checkpointer.latest_step() == 2
    consumed = read_jsonl(os.path.join(run_dir, "trajectories", "train.jsonl"))
    assert len(consumed) == 16 and sum(t.info.get("expert", False) for t in consumed) == 8
    # Every finished rollout is either consumed (8), dropped as stale, or written out at exit.
    unconsumed = os.path.join(run_dir, "trajectories", "unconsumed.jsonl")
    left = read_jsonl(unconsumed) if os.path.exists(unconsumed) else []
    assert source.summary_stats()["rollout_episodes"] >= 8 + len(left)
    assert not source.local.worker.running and source.local.queue.closed


@pytest.fixture(scope="module")
def quickstart_run(tmp_path_factory):
    """The quickstart, shortened: its own tokenizer, 2 IL warm-start steps, 2 RL steps with the embedded engine."""
    run_dir = tmp_path_factory.mktemp("quickstart") / "run"
    run(tiny_config(run_dir, **{"train.steps": 4, "train.il_warmup_steps": 2}))
    return run_dir


@pytest.mark.slow
def test_rl_steps_through_the_queue_with_the_embedded_engine(quickstart_run):
    summary = _check_rl_steps(quickstart_run, steps=4, il_steps=2)
    assert summary["episodes_per_s"] > 0 and summary["generated_tokens_per_s"] > 0


@pytest.mark.slow
def test_shortened_quickstart_writes_metrics_checkpoint_samples_and_summary(quickstart_run):
    run_dir = quickstart_run
    summary = json.load(open(run_dir / "summary.json"))
    for key in (
        "success_before",
        "success_after",
        "tool_calls_before",
        "tool_calls_after",
        "steps",
        "wall_time_s",
        "run_dir",
        "name",
        "config",
        "seed",
        "admitted_fraction_mean",
    ):
        assert key in summary, key
    assert summary["steps"] == 4 and summary["run_dir"] == str(run_dir)
    assert [e["step"] for e in summary["eval_history"]] == [0, 2, 4]
    rows = RunFolder(run_dir).read_metrics()
    evals = [r for r in rows if "eval/success" in r]
    assert {"eval/success", "eval/reward", "eval/tool_calls", "eval/turns"} <= set(evals[-1])
    assert [r for r in rows if "loss" in r][0]["il_loss"] > 0 and os.path.isdir(run_dir / "checkpoints" / "4")
    assert os.path.exists(run_dir / "tokenizer" / "tokenizer_config.json")
    assert os.path.exists(run_dir / "hf" / "model.safetensors")  # where configs/resample_*.py start from
    # experiments/forks.py on the exported policy: every anchor 0..K of each task, `samples` episodes each.
    exp = validate(tiny_config(run_dir))
    estimates = probe_policy(exp, str(run_dir / "hf"), tokenizer=str(run_dir / "tokenizer"), num_tasks=2, samples=3)
    assert [e.task_id for e in estimates] == [
        t.task_id for t in make_env("calculator", **dict(exp.env.kwargs)).tasks("eval", 2, seed=0)
    ]
    assert all(e.anchors == (0, 1, 2) and e.samples == (3, 3, 3) for e in estimates)  # two calls, then the answer
    samples = read_jsonl(str(run_dir / "samples" / "step_00000004.jsonl"))
    assert {t.info["split"] for t in samples} == {"train", "eval"}
    assert all("messages" in t.info for t in samples if t.info["split"] == "eval")


def test_resampling_source_feeds_the_learner(tmp_path, tokenizer_dir):
    run_dir = tmp_path / "run"
    run(
        tiny_config(
            run_dir,
            **{
                "model.tokenizer": tokenizer_dir,
                "train.steps": 1,
                "train.il_warmup_steps": 0,
                "resample.mode": "rollback",
                "resample.tasks_per_round": 2,
                "resample.samples_per_anchor": 4,
                "resample.num_tasks": 5,
            },
        )
    )
    consumed = read_jsonl(os.path.join(run_dir, "trajectories", "train.jsonl"))
    # Rollback starts every task at its last chunk: the expert's tool-call turns are the (unmasked) prefix.
    assert len(consumed) == 8 and all(
        t.info["resample"]["anchor"] == t.info["resample"]["num_expert_chunks"] > 0 for t in consumed
    )
    rows = [r for r in RunFolder(run_dir).read_metrics() if "loss" in r]
    assert any(k.startswith("source/resample_") for k in rows[0])
    # forks.json: per task, the outcomes seen at each anchor (here the consumed episodes at the last anchor).
    with open(run_dir / "forks.json") as f:
        report = json.load(f)
    sampled = {e["task_id"]: e for e in report["tasks"] if e["anchors"]}
    by_task = collections.defaultdict(list)
    for t in consumed:
        by_task[t.info["resample"]["task_id"]].append(t)
    assert sampled.keys() == by_task.keys()
    for task_id, trajs in by_task.items():
        assert sampled[task_id]["anchors"] == [trajs[0].info["resample"]["anchor"]]
        assert sampled[task_id]["samples"] == [len(trajs)]
        assert sampled[task_id]["successes"] == [sum(t.reward >= 1.0 for t in trajs)]
    assert [row["tasks"] for row in report["anchors"]] == [len(by_task)]
    assert len(report["tasks"]) == 5  # resample.num_tasks: the pool of training tasks cycled over


def test_a_resampling_arm_resumes_from_a_queue_arms_warm_start(tmp_path, tokenizer_dir):
    """A sweep's shared warm start is trained by its first arm: a resampling arm (il_term_*) then resumes from a
    queue arm's checkpoint, which holds no resampler state (none ran before RL), and trains its RL steps."""
    common = {"model.tokenizer": tokenizer_dir, "train.il_warmup_steps": 1, "train.il_warmup_target": 0.0}
    warm_dir, arm_dir = tmp_path / "warm", tmp_path / "arm"
    run(tiny_config(warm_dir, **common, **{"train.steps": 1}))
    seed_from_warm_start(str(warm_dir), str(arm_dir))
    resampling = {"rollout.source": "resample", "resample.mode": "none", "resample.tasks_per_round": 8}
    run(tiny_config(arm_dir, **common, **resampling, **{"train.steps": 2}))
    rows = [r for r in RunFolder(str(arm_dir)).read_metrics() if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2] and any(k.startswith("source/resample_") for k in rows[-1])


def test_ipa_roll_preset_trains_online_on_forced_lag_and_logs_both_ratios(tmp_path, tokenizer_dir):
    """ROLL's recipe (recomputed old log-probs, sign by reward, kept-token row mean) through the queue, on
    trajectories one update stale (queue.forced_lag: the engines serve the weights of one update before): the policy
    ratio is the learner's own (1 with one update per batch), the mismatch ratio (old / behaviour) carries the
    staleness. (The one IL step moves the weights: the random policy's rewards are all 0, so its RL steps would
    not.)"""
    run_dir = tmp_path / "run"
    run(
        tiny_config(
            run_dir,
            **{
                "model.tokenizer": tokenizer_dir,
                "train.steps": 3,
                "train.il_warmup_steps": 1,
                "objective.preset": "ipa_roll",
                "queue.forced_lag": 1,
                "queue.max_policy_lag": 1,
                "optimizer.warmup_steps": 0,
                "optimizer.warmup_ratio": 0.0,
            },
        )
    )
    rows = [r for r in RunFolder(run_dir).read_metrics() if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2, 3] and rows[0]["il_loss"] > 0 and rows[0]["lr"] > 0
    assert "policy_lag_mean" not in rows[0]  # the IL step trains on scripted expert episodes: no sampling policy
    for r in rows[1:]:  # RL on trajectories of the weights one update before the learner's
        assert r["policy_lag_mean"] == 1.0 and np.isfinite(r["loss"]) and r["skipped"] == 0
        assert r["is_ratio_mean"] == 1.0 and r["clip_fraction"] == 0
        assert 0 < r["mismatch_ratio_mean"] < np.inf
        assert 0 <= r["mismatch_masked_fraction"] <= 1 and r["mismatch_capped_fraction"] == 0  # no weight cap
    # The IL step moved the learner away from the sampler's weights. The drift shows in the mean |log old - log mu|,
    # not in the mean ratio: that is ~1 by construction (E_mu[old / mu] = 1 over the sampled tokens).
    assert rows[1]["mismatch_abs"] > 1e-4
    # Step 2 (learner at version 1) took episodes of version 0, step 3 of version 1.
    consumed = read_jsonl(os.path.join(run_dir, "trajectories", "train.jsonl"))
    assert [t.policy_version for t in consumed if not t.info.get("expert")] == [0] * 8 + [1] * 8


def test_readme_environment_example_trains_from_the_command_line_keys(tmp_path, tokenizer_dir):
    """The README's own-environment example, as written there, registered through env.module (a file path) and
    trained for one IL and one RL step."""
    readme = open(os.path.join(REPO, "README.md"), encoding="utf-8").read()
    section = readme[readme.index("## Your own environment") :]
    code = section[
        section.index("```python\n") + len("```python\n") : section.index("```\n", section.index("```python"))
    ]
    module = tmp_path / "my_envs.py"
    module.write_text(code)
    run_dir = tmp_path / "run"
    summary = run(
        tiny_config(
            run_dir,
            **{
                "model.tokenizer": tokenizer_dir,
                "env.module": str(module),
                "env.name": "reverse",
                "env.kwargs": {},
                "train.steps": 2,
                "train.il_warmup_steps": 1,
            },
        )
    )
    assert summary["env"] == "reverse" and summary["steps"] == 2
    consumed = read_jsonl(os.path.join(run_dir, "trajectories", "train.jsonl"))
    assert {t.info["task_id"].split("/")[0] for t in consumed} == {"reverse"}
    expert = next(t for t in consumed if t.info.get("expert"))
    assert "Reverse" in ChatFormat(AutoTokenizer.from_pretrained(tokenizer_dir)).decode(expert.tokens.tolist())


@pytest.mark.slow
def test_summary_accounts_for_the_wall_time(quickstart_run):
    """The learner thread's activities and the rest add up to the wall time, none counted twice (the rest is not
    negative); the rollouts' generation and tool time, and generation during the steps, are within their bounds."""
    summary = RunFolder(quickstart_run).read_summary()
    parts = [summary[f"time_{kind}_s"] for kind in ("learner_step", "weight_sync", "evaluation", "batch_wait", "other")]
    assert abs(sum(parts) - summary["wall_time_s"]) < 1e-6 * summary["wall_time_s"]
    assert all(p > 0 for p in parts), parts  # 4 steps, syncs, 3 evaluations, batches; setup
    assert 0 < summary["time_generation_s"] < summary["wall_time_s"] and 0 < summary["time_tools_s"]
    assert (
        0
        <= summary["time_generation_during_steps_s"]
        <= min(summary["time_generation_s"], summary["time_learner_step_s"])
    )
    lines = format_summary(summary)
    assert "wall time: learner steps" in lines and "rollout threads busy: generating" in lines
