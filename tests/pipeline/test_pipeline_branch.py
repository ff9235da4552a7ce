"""objective.credit = "branch" online: the quickstart setting (tiny) trains to its summary, which reports the extra
rollouts, and every branched trajectory the learner consumed carries one advantage per chunk."""

import os

from tiny_pipeline import tiny_config

from ipa_jax.pipeline import run
from ipa_jax.pipeline.run import format_summary
from ipa_jax.pipeline.run_folder import RunFolder
from ipa_jax.trajectory import read_jsonl


def test_branch_credit_trains_online_and_reports_the_extra_rollouts(tmp_path, tokenizer_dir):
    run_dir = tmp_path / "run"
    summary = run(
        tiny_config(
            run_dir,
            **{
                "model.tokenizer": tokenizer_dir,
                "train.steps": 2,
                "train.il_warmup_steps": 1,
                "objective.credit": "branch",
                "objective.branch_samples": 2,
                "objective.branch_fraction": 0.5,
            },
        )
    )
    assert summary["steps"] == 2
    assert summary["branched"] + summary["branch_skipped"] >= 1
    assert summary["branch_skipped"] == sum(summary[f"branch_{r}"] for r in ("unreplayable", "aborted", "failed"))
    assert summary["branch_episodes"] > 0 and summary["branch_generated_tokens"] > 0
    assert "branching: " in format_summary(summary) and "extra episodes" in format_summary(summary)
    rows = [r for r in RunFolder(run_dir).read_metrics() if "source/branch_episodes" in r]
    assert rows and rows[-1]["source/branch_episodes"] <= summary["branch_episodes"]
    consumed = [t for t in read_jsonl(os.path.join(run_dir, "trajectories", "train.jsonl")) if not t.info.get("expert")]
    assert len(consumed) == 8
    for traj in consumed:
        if traj.chunk_advantages is not None:
            assert traj.chunk_advantages.shape == (traj.num_chunks,)
            assert len(traj.info["branch_values"]) == traj.num_chunks
