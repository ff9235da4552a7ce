"""configs/terminal_tiny.py end to end, shrunk: tokenizer from sandboxed expert episodes, IL warm start on the
reference solutions, RL with chunk-level resampling from the solutions' states, held-out evaluation in real
sandboxes, and no sandbox left behind. (Plain queue rollouts on sandboxes: tests/rollout/test_rollout_sandboxed.py.)"""

import json
import os

import pytest
from tiny_pipeline import REPO, TINY

from ipa_jax.chat import build_tokenizer
from ipa_jax.envs.sandbox import SandboxLimits, shared_backend
from ipa_jax.pipeline import RunFolder, load_config, run
from ipa_jax.pipeline.config import EnvConfig
from ipa_jax.pipeline.tokenizer import expert_corpus

TERMINAL = os.path.join(REPO, "configs", "terminal_tiny.py")


@pytest.fixture(scope="module")
def terminal_tokenizer(tmp_path_factory):
    """A tokenizer of the kind the config builds (built-in environments + the terminal suite's expert episodes),
    on 8 episodes per environment and split instead of 64: each terminal expert episode runs its solution."""
    path = str(tmp_path_factory.mktemp("terminal_tok"))
    exp_env = load_config(TERMINAL).env
    terminal = EnvConfig(name=exp_env.name, kwargs=dict(exp_env.kwargs))
    corpus = expert_corpus(episodes_per_env=8, extra_envs=[terminal.make])
    build_tokenizer(corpus, vocab_size=1024).save_pretrained(path)
    return path


@pytest.mark.slow
def test_terminal_tiny_runs_end_to_end_with_resampling(tmp_path, terminal_tokenizer):
    overrides = {
        **TINY,
        "train.run_dir": str(tmp_path / "run"),
        "model.tokenizer": terminal_tokenizer,
        "train.steps": 4,
        "train.il_warmup_steps": 2,
        "train.buckets": (512, 1024),
        "rollout.max_new_tokens": 24,
        "resample.mode": "rollback",
        "resample.num_tasks": 4,
        "resample.tasks_per_round": 2,
        "resample.samples_per_anchor": 4,
    }
    summary = run(load_config(TERMINAL, overrides))
    assert summary["steps"] == 4
    folder = RunFolder(tmp_path / "run")
    with open(os.path.join(folder.path, "trajectories", "train.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    rl_rows = [r for r in rows if not r["info"].get("expert")]
    assert rl_rows and all(r["info"]["env"] == "terminal" for r in rows)
    assert any(r["info"].get("resample") for r in rl_rows)  # anchored on the reference solutions' states
    root = shared_backend("bubblewrap", SandboxLimits()).root
    assert [d for d in os.listdir(root) if d.startswith(f"{os.getpid()}-")] == []
