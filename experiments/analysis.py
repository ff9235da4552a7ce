"""Reading run folders and ablation folders: metrics, summaries, sample episodes, tables and plots.

Shared by `experiments/ablate.py` and the notebooks (`notebooks/explore_run.ipynb`, `notebooks/ablations.ipynb`),
so a number in the table and a curve in a notebook come from the same code. Run folder layout:
/work/coord/CONTRACTS.md "Run folder layout" (config.json, metrics.jsonl, summary.json, samples/, tokenizer/).

An ablation folder (written by ablate.py) holds `ablation.json` = {"configs": {name: config path},
"seeds": [...], "runs": {name: [run_dir, ...]}, "threshold": float, ...}, the run folders under runs/<name>/seed_<s>,
table.md, table.csv, runs.csv and the PNG plots.

Plot functions draw on a matplotlib Axes given by the caller (pyplot in a notebook, a bare Figure in ablate.py),
so this module never picks a matplotlib backend.
"""

from __future__ import annotations

import csv
import glob
import html
import json
import math
import os
import re
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from ipa_jax.trajectory import Trajectory, read_jsonl

EVAL_SUCCESS = "eval/success"
# Curves of one run shown by explore_run.ipynb: (metrics key, label). Missing keys are skipped there.
RUN_CURVES: tuple[tuple[str, str], ...] = (
    ("reward_mean", "training reward"),
    (EVAL_SUCCESS, "held-out success"),
    ("loss", "loss"),
    ("il_greedy_match", "expert episodes greedy decoding reproduces (warm start)"),
    ("grad_norm", "grad norm"),
    ("mismatch_abs", "mismatch mean |log pi - log mu|"),
    ("mismatch_kl", "mismatch Bernoulli-KL"),
    ("admitted_fraction", "admitted fraction"),
    ("eval/tool_calls", "held-out tool calls / episode"),
    ("policy_lag_mean", "policy lag"),
)
# Per-run scalars of an ablation table, in column order.
SCALARS = ("success_before", "success_after", "auc", "steps_to_threshold", "wall_time_s", "admitted_fraction")


# ------------------------------------------------------------------------------------------------ one run
def load_metrics(run_dir: str) -> list[dict[str, Any]]:
    """Every complete line of <run_dir>/metrics.jsonl ("nan"/"inf" strings, JSON's spelling of non-finite
    floats in MetricsWriter, become floats again). A partial last line (a killed run) is skipped."""
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{run_dir}: no metrics.jsonl (not a run folder, or the run has not started)")
    rows = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            if "step" not in row:
                raise ValueError(f"{path}: a metrics line without 'step': {line[:120]!r}")
            rows.append({k: _number_or_value(v) for k, v in row.items()})
    return rows


def _number_or_value(value: Any) -> Any:
    if isinstance(value, str) and value.lower() in ("nan", "inf", "-inf", "+inf"):
        return float(value)
    return value


def series(rows: Sequence[dict[str, Any]], key: str) -> tuple[np.ndarray, np.ndarray]:
    """(steps int64[N], values float64[N]) of the rows that hold a number under `key`, sorted by step; a step
    logged twice (a resumed run) keeps its last value."""
    points: dict[int, float] = {}
    for row in rows:
        value = row.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            points[int(row["step"])] = float(value)
    steps = np.array(sorted(points), dtype=np.int64)
    return steps, np.array([points[s] for s in steps], dtype=np.float64)


def load_summary(run_dir: str) -> dict[str, Any]:
    """<run_dir>/summary.json (written when a run finishes)."""
    path = os.path.join(run_dir, "summary.json")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{run_dir}: no summary.json (the run did not finish)")
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def load_run_config(run_dir: str) -> dict[str, Any]:
    """<run_dir>/config.json: the resolved config the run used."""
    with open(os.path.join(run_dir, "config.json"), encoding="utf-8") as f:
        return json.load(f)


def rl_start_step(run_dir: str, rows: Sequence[dict[str, Any]] | None = None) -> int:
    """The step where RL updates start (steps 1..start are IL-only updates on expert episodes, whose reward and
    admitted fraction say nothing about the policy): the last `rl_start` in metrics.jsonl (the warm start may
    end early on train.il_warmup_target), else train.il_warmup_steps of the run's config.json. `rows`: the
    run's metrics if already loaded."""
    if rows is None:
        rows = load_metrics(run_dir) if os.path.exists(os.path.join(run_dir, "metrics.jsonl")) else []
    logged = [r["rl_start"] for r in rows if "rl_start" in r]
    return int(logged[-1]) if logged else int(load_run_config(run_dir)["train"]["il_warmup_steps"])


def load_samples(run_dir: str, split: str | None = None) -> list[tuple[int, Trajectory]]:
    """(step, trajectory) for every episode in <run_dir>/samples/step_<8 digits>.jsonl, in step order;
    `split` ("train" | "eval") keeps only episodes whose info["split"] matches."""
    if split not in (None, "train", "eval"):
        raise ValueError(f"split must be None, 'train' or 'eval', got {split!r}")
    out = []
    for path in sorted(glob.glob(os.path.join(run_dir, "samples", "step_*.jsonl"))):
        match = re.fullmatch(r"step_(\d+)\.jsonl", os.path.basename(path))
        if match is None:
            continue
        for traj in read_jsonl(path):
            if split is None or traj.info.get("split") == split:
                out.append((int(match.group(1)), traj))
    return out


def load_run_tokenizer(run_dir: str):
    """The tokenizer the run used: <run_dir>/tokenizer, else the config's model.tokenizer or model.path."""
    from transformers import AutoTokenizer

    candidates = [os.path.join(run_dir, "tokenizer")]
    if os.path.exists(os.path.join(run_dir, "config.json")):
        model = load_run_config(run_dir).get("model", {})
        candidates += [p for p in (model.get("tokenizer"), model.get("path")) if p]
    for path in candidates:
        if os.path.isdir(path):
            return AutoTokenizer.from_pretrained(path)
    raise FileNotFoundError(f"{run_dir}: no tokenizer found (looked in {candidates})")


def newest_run(runs_root: str = "runs") -> str:
    """The run folder under `runs_root` (searched recursively) whose metrics.jsonl changed last."""
    paths = glob.glob(os.path.join(runs_root, "**", "metrics.jsonl"), recursive=True)
    if not paths:
        raise FileNotFoundError(f"no run folder (with metrics.jsonl) under {os.path.abspath(runs_root)}")
    return os.path.dirname(max(paths, key=os.path.getmtime))


# ------------------------------------------------------------------------------------ episode rendering
# Chunk colours (light, so the text stays readable); chunk k takes _PALETTE[k % len].
_PALETTE = ("#cfe8ff", "#ffe0b3", "#d4f7d4", "#f7d4f0", "#fff5b3", "#d9d4f7", "#c8f0ee", "#ffd1d1")
_GREY = "#e6e6e6"


@dataclass(frozen=True)
class Segment:
    """A maximal run [start, end) of tokens of one kind: "context" (prompt and tool observations), "action"
    (sampled by the policy, chunk `chunk_id`) or "expert" (prefilled imitation targets)."""

    start: int
    end: int
    kind: str
    chunk_id: int


def episode_segments(traj: Trajectory) -> list[Segment]:
    """Splits a trajectory into Segments; segment boundaries fall wherever kind or chunk id changes."""
    kinds = np.where(traj.expert_mask, 2, np.where(traj.action_mask, 1, 0))
    chunks = np.where(traj.action_mask, traj.chunk_ids, -1)
    segments, start = [], 0
    for t in range(1, traj.length + 1):
        if t == traj.length or kinds[t] != kinds[start] or chunks[t] != chunks[start]:
            kind = ("context", "action", "expert")[int(kinds[start])]
            segments.append(Segment(start, t, kind, int(chunks[start])))
            start = t
    return segments


def render_episode_html(traj: Trajectory, tokenizer, title: str | None = None, collapse_prompt: bool = True) -> str:
    """One episode as HTML: action tokens on a background colour per chunk id (hover: chunk, positions),
    context (prompt, tool observations) grey, expert tokens gold and underlined; the prompt (the context before
    the first generated or expert token: system turn, tool specs, question) folded into a <details> element when
    `collapse_prompt`. Each segment is decoded as a whole, so multi-byte characters split across tokens render."""
    info = traj.info
    head = title or traj.uid
    facts = [f"reward {traj.reward:g}", f"{traj.num_chunks} chunks", f"{int(traj.action_mask.sum())} action tokens"]
    facts += [f"{k} {info[k]}" for k in ("split", "finish_reason", "num_tool_calls", "num_tool_errors") if k in info]
    parts = [
        '<div style="font-family:monospace;font-size:12px;margin:8px 0">',
        f"<div><b>{html.escape(str(head))}</b> &middot; {html.escape(' · '.join(map(str, facts)))}</div>",
        '<div style="white-space:pre-wrap;border:1px solid #ccc;padding:4px">',
    ]
    for seg in episode_segments(traj):
        text = html.escape(tokenizer.decode(traj.tokens[seg.start:seg.end].tolist(), skip_special_tokens=False))
        where = f"tokens {seg.start}-{seg.end - 1}"
        if seg.kind == "action":
            style = f"background:{_PALETTE[seg.chunk_id % len(_PALETTE)]}"
            label = f"chunk {seg.chunk_id}, {where}"
        elif seg.kind == "expert":
            style = "background:#ffd54f;text-decoration:underline"
            label = f"expert, {where}"
        else:
            style = f"background:{_GREY};color:#555"
            label = f"context, {where}"
        span = f'<span class="{seg.kind}" data-chunk="{seg.chunk_id}" style="{style}" title="{label}">{text}</span>'
        if collapse_prompt and seg.start == 0 and seg.kind == "context":
            span = f"<details><summary>prompt ({seg.end} tokens)</summary>{span}</details>"
        parts.append(span)
    parts.append("</div></div>")
    return "".join(parts)


# ------------------------------------------------------------------------------------- per-run scalars
def curve_auc(steps: np.ndarray, values: np.ndarray) -> float:
    """Normalised area under a curve: (1 / (s_N - s_1)) * trapezoid(values, steps), the step-weighted mean of
    the curve (same units as values). nan without points; the single value with one point."""
    if len(steps) == 0:
        return math.nan
    if len(steps) == 1 or steps[-1] == steps[0]:
        return float(values[-1])
    return float(np.trapezoid(values, steps) / (steps[-1] - steps[0]))


def steps_to_threshold(steps: np.ndarray, values: np.ndarray, threshold: float) -> float:
    """The first step whose value is >= threshold; nan if the curve never reaches it."""
    hit = np.nonzero(values >= threshold)[0]
    return float(steps[hit[0]]) if hit.size else math.nan


def run_scalars(run_dir: str, threshold: float) -> dict[str, float]:
    """The per-run numbers of an ablation table (RL phase = after the IL warm start, see rl_start_step):
    success_before / success_after (summary.json: held-out success after the warm start / at the end); auc =
    curve_auc of the held-out success curve over the RL phase; steps_to_threshold = RL steps (counted from the end
    of the warm start, whose length depends on the seed) to held-out success >= threshold; wall_time_s (summary.json);
    admitted_fraction = mean over RL steps (metrics.jsonl; nan if never logged)."""
    summary, rows = load_summary(run_dir), load_metrics(run_dir)
    start = rl_start_step(run_dir, rows)
    steps, success = series(rows, EVAL_SUCCESS)
    rl = steps >= start
    admitted_steps, admitted = series(rows, "admitted_fraction")
    admitted = admitted[admitted_steps > start]
    for key in ("success_before", "success_after", "wall_time_s"):
        if summary.get(key) is None:
            raise ValueError(f"{run_dir}/summary.json: no value for {key!r}")
    return {
        "success_before": float(summary["success_before"]),
        "success_after": float(summary["success_after"]),
        "auc": curve_auc(steps[rl], success[rl]),
        "steps_to_threshold": steps_to_threshold(steps[rl] - start, success[rl], threshold),
        "wall_time_s": float(summary["wall_time_s"]),
        "admitted_fraction": float(np.mean(admitted)) if admitted.size else math.nan,
    }


# ------------------------------------------------------------------------------------- ablation folders
def load_ablation(ablation_dir: str) -> dict[str, Any]:
    """<ablation_dir>/ablation.json, with run folders made absolute (they are stored relative to the folder)."""
    path = os.path.join(ablation_dir, "ablation.json")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{ablation_dir}: no ablation.json (not an ablation folder)")
    with open(path, encoding="utf-8") as f:
        manifest = json.load(f)
    manifest["runs"] = {name: [os.path.join(ablation_dir, d) for d in dirs] for name, dirs in manifest["runs"].items()}
    return manifest


def newest_ablation(root: str = os.path.join("runs", "ablations")) -> str:
    """The ablation folder under `root` (searched recursively) whose ablation.json changed last."""
    paths = glob.glob(os.path.join(root, "**", "ablation.json"), recursive=True)
    if not paths:
        raise FileNotFoundError(f"no ablation folder (with ablation.json) under {os.path.abspath(root)}")
    return os.path.dirname(max(paths, key=os.path.getmtime))


def _mean_std(values: Sequence[float]) -> tuple[float, float]:
    """Mean and sample std (ddof=1) over the finite values; std nan with fewer than two."""
    finite = np.array([v for v in values if math.isfinite(v)], dtype=np.float64)
    if finite.size == 0:
        return math.nan, math.nan
    return float(finite.mean()), float(finite.std(ddof=1)) if finite.size > 1 else math.nan


def ablation_rows(runs: dict[str, list[str]], threshold: float) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(per-config rows, per-run rows). A per-config row holds n_seeds, <scalar>_mean and <scalar>_std for each
    of SCALARS (over seeds), and threshold_reached = how many seeds reached `threshold` (steps_to_threshold is
    averaged over those only)."""
    config_rows, run_rows = [], []
    for name, run_dirs in runs.items():
        per_run = [run_scalars(d, threshold) for d in run_dirs]
        for d, scalars in zip(run_dirs, per_run):
            run_rows.append({"config": name, "run_dir": d, **scalars})
        row: dict[str, Any] = {"config": name, "n_seeds": len(per_run)}
        for key in SCALARS:
            row[f"{key}_mean"], row[f"{key}_std"] = _mean_std([s[key] for s in per_run])
        row["threshold_reached"] = sum(math.isfinite(s["steps_to_threshold"]) for s in per_run)
        config_rows.append(row)
    return config_rows, run_rows


def _fmt(mean: float, std: float, digits: int) -> str:
    if not math.isfinite(mean):
        return "-"
    return f"{mean:.{digits}f}" if not math.isfinite(std) else f"{mean:.{digits}f} ± {std:.{digits}f}"


def table_markdown(rows: Sequence[dict[str, Any]], threshold: float) -> str:
    """The per-config rows as a Markdown table (mean ± sample std over seeds)."""
    header = ["config", "seeds", "success before", "success after", "AUC success",
              f"RL steps to {threshold:g}", "wall time (s)", "admitted"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in rows:
        reached = f"{_fmt(r['steps_to_threshold_mean'], r['steps_to_threshold_std'], 0)} " \
                  f"({r['threshold_reached']}/{r['n_seeds']})"
        cells = [r["config"], str(r["n_seeds"]),
                 _fmt(r["success_before_mean"], r["success_before_std"], 3),
                 _fmt(r["success_after_mean"], r["success_after_std"], 3),
                 _fmt(r["auc_mean"], r["auc_std"], 3), reached,
                 _fmt(r["wall_time_s_mean"], r["wall_time_s_std"], 0),
                 _fmt(r["admitted_fraction_mean"], r["admitted_fraction_std"], 3)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def write_csv(path: str, rows: Sequence[dict[str, Any]]) -> None:
    """Rows (dicts with the same keys) as CSV; non-finite numbers as empty cells."""
    if not rows:
        raise ValueError(f"{path}: no rows to write")
    with open(path, "w", encoding="utf-8", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        for row in rows:
            writer.writerow({k: "" if isinstance(v, float) and not math.isfinite(v) else v for k, v in row.items()})


def write_tables(ablation_dir: str, runs: dict[str, list[str]], threshold: float) -> list[dict[str, Any]]:
    """table.md, table.csv (per config) and runs.csv (per run) in `ablation_dir`; returns the per-config rows."""
    config_rows, run_rows = ablation_rows(runs, threshold)
    with open(os.path.join(ablation_dir, "table.md"), "w", encoding="utf-8") as f:
        f.write(table_markdown(config_rows, threshold))
    write_csv(os.path.join(ablation_dir, "table.csv"), config_rows)
    write_csv(os.path.join(ablation_dir, "runs.csv"),
              [{**r, "run_dir": os.path.relpath(r["run_dir"], ablation_dir)} for r in run_rows])
    return config_rows


# --------------------------------------------------------------------------------------------- plots
def smooth(values: np.ndarray, window: int) -> np.ndarray:
    """Trailing moving average over up to `window` points (the first points average what exists)."""
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    csum = np.cumsum(np.insert(values.astype(np.float64), 0, 0.0))
    idx = np.arange(1, len(values) + 1)
    lo = np.maximum(idx - window, 0)
    return (csum[idx] - csum[lo]) / (idx - lo)


def seed_band(curves: Sequence[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(steps, mean, std) over seeds, on the steps every seed logged; std is the sample std (ddof=1, as in the
    table), 0 for a single seed."""
    curves = [c for c in curves if len(c[0])]
    if not curves:
        return np.zeros(0, np.int64), np.zeros(0), np.zeros(0)
    common = curves[0][0]
    for steps, _ in curves[1:]:
        common = np.intersect1d(common, steps)
    stacked = np.stack([vals[np.searchsorted(steps, common)] for steps, vals in curves])
    std = stacked.std(axis=0, ddof=1) if len(stacked) > 1 else np.zeros(len(common))
    return common, stacked.mean(axis=0), std


def plot_band(ax, runs: dict[str, list[str]], key: str, *, window: int = 1, ylabel: str | None = None,
              include_rl_start: bool = False) -> None:
    """One line per config (mean over its seeds of metrics[key], smoothed over `window` points) with a ±1 std
    band, over RL steps: x = step - rl_start, so that seeds whose warm starts ended at different steps line up;
    include_rl_start keeps x = 0 (an evaluation at the end of the warm start). Configs that never logged `key`
    are left out."""
    for i, (name, run_dirs) in enumerate(runs.items()):
        curves = []
        for d in run_dirs:
            rows = load_metrics(d)
            steps, vals = series(rows, key)
            start = rl_start_step(d, rows)
            keep = steps >= start if include_rl_start else steps > start
            steps, vals = steps[keep] - start, vals[keep]
            curves.append((steps, smooth(vals, window) if len(vals) else vals))
        steps, mean, std = seed_band(curves)
        if not len(steps):
            continue
        color = f"C{i % 10}"
        ax.plot(steps, mean, color=color, label=f"{name} (n={len(run_dirs)})", marker="o" if len(steps) < 30 else None)
        ax.fill_between(steps, mean - std, mean + std, color=color, alpha=0.2, linewidth=0)
    ax.set_xlabel("RL step (0 = end of the IL warm start)")
    ax.set_ylabel(ylabel or key)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)


# (file name, metrics key, y label, smoothing window, include the warm start's last step)
ABLATION_PLOTS = (
    ("eval_success.png", EVAL_SUCCESS, "held-out success", 1, True),
    ("train_reward.png", "reward_mean", "training reward (moving average of 5)", 5, False),
    ("admitted_fraction.png", "admitted_fraction", "admitted fraction (moving average of 5)", 5, False),
)


def write_plots(ablation_dir: str, runs: dict[str, list[str]]) -> list[str]:
    """The ABLATION_PLOTS as PNG files in `ablation_dir` (a bare Figure: no pyplot state, no display needed)."""
    from matplotlib.figure import Figure

    paths = []
    for filename, key, ylabel, window, include_rl_start in ABLATION_PLOTS:
        fig = Figure(figsize=(7, 4.5), dpi=100)
        ax = fig.add_subplot()
        plot_band(ax, runs, key, window=window, ylabel=ylabel, include_rl_start=include_rl_start)
        ax.set_title(ylabel.split(" (")[0] + " vs RL step (mean ± std over seeds)")
        fig.tight_layout()
        path = os.path.join(ablation_dir, filename)
        fig.savefig(path)
        paths.append(path)
    return paths
