"""Both notebooks execute headless (nbclient, the venv's python3 kernel) on a tiny run folder and a tiny ablation
folder made here, and show what the folders hold (not hard-coded outputs: the numbers come from the files).

The folders are synthetic (metrics.jsonl, summary.json, the last evaluation's per-task record, samples written with
ipa_jax.trajectory.write_jsonl, a tokenizer from build_tokenizer): the notebooks read files, so a training run would
only add minutes here; the ablation test (tests/analysis/test_analysis_sweep.py) covers folders made by real runs.
"""

from __future__ import annotations

import html
import json
import math
import os
import re

import nbformat
import numpy as np
import pytest
from nbclient import NotebookClient

from ipa_jax import analysis
from ipa_jax.chat import build_tokenizer
from ipa_jax.pipeline import RunFolder
from ipa_jax.trajectory import Trajectory, write_jsonl

NOTEBOOKS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "notebooks")
EVAL_STEPS = (0, 2, 6, 10, 14, 18, 20)
WARMUP = 2  # IL warm-start steps of the synthetic runs (success_before = held-out success at this step)
EVAL_TASKS = 16  # held-out tasks of the synthetic runs' last evaluation (per-task record), one sample each


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    corpus = [
        '<|im_start|>user\nWhat is the city of the friend of "alice"?<|im_end|>\n',
        '<tool_call>\n{"name": "lookup", "arguments": {"name": "alice"}}\n</tool_call>',
        '<tool_response>\n{"name": "alice", "friend": "bob", "city": "paris"}\n</tool_response>',
    ] * 4
    return build_tokenizer(corpus, vocab_size=300)


def _episode(tokenizer, uid: str, reward: float, split: str, expert_prefix: bool) -> Trajectory:
    """prompt | chunk 0 (a tool call; expert-prefilled if expert_prefix) | observation | chunk 1 (the answer)."""
    pieces = [
        ("context", '<|im_start|>user\nWhat is the city of the friend of "alice"?<|im_end|>\n<|im_start|>assistant\n'),
        (
            "expert" if expert_prefix else "action",
            '<tool_call>\n{"name": "lookup", "arguments": {"name": "alice"}}\n</tool_call>',
        ),
        (
            "context",
            '<|im_end|>\n<|im_start|>user\n<tool_response>\n{"name": "alice", "friend": "bob"}\n'
            "</tool_response><|im_end|>\n<|im_start|>assistant\n",
        ),
        ("action", "paris<|im_end|>"),
    ]
    tokens, kinds = [], []
    for kind, text in pieces:
        ids = tokenizer.encode(text, add_special_tokens=False)
        tokens += ids
        kinds += [kind] * len(ids)
    kinds_arr = np.array(kinds)
    action = kinds_arr == "action"
    chunk_ids = np.full(len(tokens), -1, np.int32)
    first_action_piece = 1 if not expert_prefix else 3
    starts = [sum(len(tokenizer.encode(t, add_special_tokens=False)) for _, t in pieces[:i]) for i in range(5)]
    for k, piece in enumerate(i for i in (1, 3) if i >= first_action_piece):
        chunk_ids[starts[piece] : starts[piece + 1]] = k
    rng = np.random.default_rng(len(uid))
    traj = Trajectory(
        uid=uid,
        tokens=np.array(tokens, np.int32),
        action_mask=action,
        behavior_logprobs=np.where(action, -rng.uniform(0.01, 3.0, len(tokens)), 0.0),
        chunk_ids=chunk_ids,
        expert_mask=kinds_arr == "expert",
        reward=reward,
        policy_version=3,
        info={"split": split, "task_id": uid, "env": "lookup", "num_tool_calls": 1, "finish_reason": "stop"},
    )
    traj.validate(vocab_size=len(tokenizer))
    return traj


def write_synthetic_run(run_dir: str, tokenizer, seed: int, steps: int = 20, lift: float = 0.4) -> dict:
    """A finished run folder with the contract's files; held-out success rises by about `lift` over the run.
    The last evaluation's per-task record solves task t when a seed-determined uniform u_t < its success, so runs of
    one seed share u and a larger lift solves a superset of tasks. Returns the values written (for the tests to
    check the rendered outputs against)."""
    rng = np.random.default_rng(seed)
    os.makedirs(os.path.join(run_dir, "samples"), exist_ok=True)
    success = {s: float(np.clip(0.2 + lift * s / steps + rng.normal(0, 0.05), 0, 1)) for s in EVAL_STEPS}
    solved = rng.random(EVAL_TASKS) < success[steps]
    success[steps] = float(solved.mean())
    RunFolder(run_dir).write_eval_tasks(
        steps,
        {
            "tasks": [
                {"task_id": f"lookup/eval/0/{t}", "samples": 1, "successes": int(ok)} for t, ok in enumerate(solved)
            ]
        },
    )
    rows = []
    for s in range(1, steps + 1):
        rows.append(
            {
                "step": s,
                "loss": float(rng.normal(1.0, 0.1)),
                "grad_norm": float(rng.uniform(0.5, 2)),
                "lr": 1e-3,
                "reward_mean": float(rng.uniform(0, 1)),
                "admitted_fraction": float(rng.uniform(0.6, 1)),
                "mismatch_abs": float(rng.uniform(0, 0.01)),
                "mismatch_kl": "nan" if s == 3 else 1e-4,
                "policy_lag_mean": 0.0,
            }
        )
        if s in success:
            rows.append(
                {
                    "step": s,
                    "eval/success": success[s],
                    "eval/reward": success[s],
                    "eval/tool_calls": float(rng.uniform(1, 3)),
                    "eval/turns": 2.0,
                }
            )
    rows.insert(
        0, {"step": 0, "eval/success": success[0], "eval/reward": success[0], "eval/tool_calls": 1.0, "eval/turns": 2.0}
    )
    with open(os.path.join(run_dir, "metrics.jsonl"), "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
        f.write('{"step": 21, "loss": 0.')  # a killed writer's partial line: skipped
    summary = {
        "success_before": success[WARMUP],
        "success_after": success[steps],
        "tool_calls_before": 1.0,
        "tool_calls_after": 2.0,
        "steps": steps,
        "wall_time_s": float(rng.uniform(50, 60)),
        "run_dir": run_dir,
        "name": os.path.basename(run_dir),
        "seed": seed,
    }
    with open(os.path.join(run_dir, "summary.json"), "w", encoding="utf-8") as f:
        json.dump(summary, f)
    with open(os.path.join(run_dir, "config.json"), "w", encoding="utf-8") as f:
        json.dump(
            {
                "objective": {"preset": "custom", "credit": "chunk"},
                "model": {"tokenizer": "", "path": ""},
                "train": {"il_warmup_steps": WARMUP},
            },
            f,
        )
    tokenizer.save_pretrained(os.path.join(run_dir, "tokenizer"))
    episodes = [
        _episode(tokenizer, f"s{seed}-train-0", 1.0, "train", expert_prefix=True),
        _episode(tokenizer, f"s{seed}-eval-0", 0.0, "eval", expert_prefix=False),
    ]
    write_jsonl(os.path.join(run_dir, "samples", f"step_{steps:08d}.jsonl"), episodes)
    return {"success": success, "summary": summary, "episodes": episodes, "solved": solved}


def write_synthetic_ablation(out: str, tokenizer, configs: dict[str, float], seeds=(0, 1), threshold=0.4) -> dict:
    """An ablation folder as ablate.py leaves it (ablation.json, runs/<config>/seed_<s>), one lift per config."""
    manifest = {
        "configs": {c: f"configs/ablations/{c}.py" for c in configs},
        "seeds": list(seeds),
        "overrides": {},
        "threshold": threshold,
        "isolation": "inprocess",
        "runs": {},
        "failed": [],
        "wall_time_s": {},
    }
    written = {}
    for name, lift in configs.items():
        for seed in seeds:
            rel = os.path.join("runs", name, f"seed_{seed}")
            written[(name, seed)] = write_synthetic_run(os.path.join(out, rel), tokenizer, seed, lift=lift)
            manifest["runs"].setdefault(name, []).append(rel)
    with open(os.path.join(out, "ablation.json"), "w", encoding="utf-8") as f:
        json.dump(manifest, f)
    return written


def execute(name: str, env: dict[str, str], monkeypatch, cwd: str = NOTEBOOKS) -> nbformat.NotebookNode:
    """Runs the notebook with its kernel in `cwd` (Jupyter's choice: the notebook's folder)."""
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    nb = nbformat.read(os.path.join(NOTEBOOKS, name), as_version=4)
    assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code"), f"{name} is saved with outputs"
    NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": cwd}}).execute()
    return nb


def outputs_text(nb) -> str:
    """Every text / HTML / Markdown output of the executed notebook, concatenated."""
    parts = []
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            assert out.output_type != "error", out
            parts.append(out.get("text", ""))
            data = out.get("data", {})
            parts += [data.get("text/html", ""), data.get("text/markdown", "")]
    return "\n".join(parts)


def count_images(nb) -> int:
    return sum("image/png" in out.get("data", {}) for c in nb.cells for out in c.get("outputs", []))


def test_explore_run_notebook(tmp_path, tokenizer, monkeypatch):
    run_dir = str(tmp_path / "runs" / "tiny")
    written = write_synthetic_run(run_dir, tokenizer, seed=0)
    nb = execute("explore_run.ipynb", {"RUN_DIR": run_dir, "NUM_EPISODES": "1"}, monkeypatch)
    text = outputs_text(nb)
    assert os.path.abspath(run_dir) in text
    assert f"| success_after | {written['summary']['success_after']:.4g} |" in text
    assert count_images(nb) == 1  # the grid of curves
    for traj in written["episodes"]:
        assert traj.uid in text
    # Per episode: one span per chunk holding exactly that chunk's decoded tokens, the prompt folded, the expert
    # prefix of the train episode marked (its tokens are not a chunk: chunk 0 is the answer there).
    assert text.count('class="action" data-chunk="0"') == 2 and text.count('class="action" data-chunk="1"') == 1
    assert text.count('class="expert"') == 1
    for traj in written["episodes"]:
        for k in range(traj.num_chunks):
            (pos,) = np.nonzero(traj.chunk_ids == k)
            decoded = html.escape(tokenizer.decode(traj.tokens[pos].tolist()))
            assert f'title="chunk {k}, tokens {pos[0]}-{pos[-1]}">{decoded}</span>' in text
        first = int(np.argmax(traj.action_mask | traj.expert_mask))
        assert f"<summary>prompt ({first} tokens)</summary>" in text
    (expert_pos,) = np.nonzero(written["episodes"][0].expert_mask)
    assert f'title="expert, tokens {expert_pos[0]}-{expert_pos[-1]}">' in text


def test_runs_root_is_the_nearest_runs_folder_up_from_the_current_one(tmp_path, monkeypatch):
    (tmp_path / "repo" / "runs").mkdir(parents=True)
    (tmp_path / "repo" / "notebooks" / "deeper").mkdir(parents=True)
    runs = str(tmp_path / "repo" / "runs")
    for start in ("repo", "repo/runs/..", "repo/notebooks", "repo/notebooks/deeper"):
        assert os.path.realpath(analysis.runs_root(str(tmp_path / start))) == os.path.realpath(runs)
    monkeypatch.chdir(tmp_path / "repo" / "notebooks")
    assert os.path.realpath(analysis.runs_root()) == os.path.realpath(runs)
    assert analysis.runs_root(str(tmp_path)) == str(tmp_path / "runs")  # none: runs/ of the folder itself


def test_explore_run_notebook_finds_the_runs_from_the_repository_root(tmp_path, tokenizer, monkeypatch):
    """Started in the repository's root (not notebooks/) with neither RUN_DIR nor RUNS_ROOT set: the newest run
    under the root's runs/."""
    run_dir = str(tmp_path / "repo" / "runs" / "tiny")
    write_synthetic_run(run_dir, tokenizer, seed=0)
    for key in ("RUN_DIR", "RUNS_ROOT"):
        monkeypatch.delenv(key, raising=False)
    nb = execute("explore_run.ipynb", {"NUM_EPISODES": "1"}, monkeypatch, cwd=str(tmp_path / "repo"))
    assert f"run folder: {os.path.abspath(run_dir)}" in outputs_text(nb)


def test_ablations_notebook(tmp_path, tokenizer, monkeypatch):
    out = str(tmp_path / "ablations" / "tiny")
    written = write_synthetic_ablation(out, tokenizer, {"cfg_low": 0.1, "cfg_high": 0.6})
    nb = execute("ablations.ipynb", {"ABLATION_DIR": out}, monkeypatch)
    text = outputs_text(nb)
    assert count_images(nb) == len(analysis.ABLATION_PLOTS) + 2
    # The table row of each config: final success mean ± std over seeds, computed here with NumPy.
    for name in ("cfg_low", "cfg_high"):
        finals = np.array([written[(name, s)]["summary"]["success_after"] for s in (0, 1)])
        row = re.search(rf"\| {name} \| 2 \| [^|]+ \| ([0-9.]+) ± ([0-9.]+) \|", text)
        assert row is not None, text
        assert math.isclose(float(row.group(1)), finals.mean(), abs_tol=1e-3)
        assert math.isclose(float(row.group(2)), finals.std(ddof=1), abs_tol=1e-3)
    # The paired difference with the reference (the first config): from the per-task records, seed by seed.
    diffs = [written[("cfg_high", s)]["solved"].mean() - written[("cfg_low", s)]["solved"].mean() for s in (0, 1)]
    assert f"| cfg_high | 2 | {EVAL_TASKS} | {np.mean(diffs):+.3f} | [" in text
    assert "config - cfg_low (same seeds, same tasks)" in text and "reference: cfg_low" in text


def test_ablations_notebook_reads_results_files_alone(tmp_path, tokenizer, monkeypatch):
    """The tables from committed results files (no run folder): the same rows as from the run folders."""
    from ipa_jax.analysis.results import result_path, write_result
    from ipa_jax.analysis.sweep import tables_from_results

    written = write_synthetic_ablation(str(tmp_path / "runs_out"), tokenizer, {"cfg_low": 0.1, "cfg_high": 0.6})
    results = str(tmp_path / "results")
    for name, seed in written:
        run = analysis.RunResult.from_run(str(tmp_path / "runs_out" / "runs" / name / f"seed_{seed}"))
        write_result(result_path(results, name, seed), run, name, {})
    out = str(tmp_path / "tables")
    tables_from_results(["cfg_low", "cfg_high"], [0, 1], results, out)
    nb = execute("ablations.ipynb", {"ABLATION_DIR": out}, monkeypatch)
    text = outputs_text(nb)
    diffs = [written[("cfg_high", s)]["solved"].mean() - written[("cfg_low", s)]["solved"].mean() for s in (0, 1)]
    assert f"| cfg_high | 2 | {EVAL_TASKS} | {np.mean(diffs):+.3f} | [" in text
    assert open(os.path.join(out, "table.md"), encoding="utf-8").read().splitlines()[2] in text
