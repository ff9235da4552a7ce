"""Ablation folders (written by `ipa_jax.analysis.sweep`): the manifest, the comparison tables and the plots.

An ablation folder holds `ablation.json` = {"configs": {name: config path}, "seeds": [...], "runs": {name:
[run_dir, ...]}, "threshold": float, ...}, the run folders under runs/<name>/seed_<s>, table.md, table.csv,
runs.csv and the PNG plots. Plot functions draw on a matplotlib Axes given by the caller (pyplot in a notebook, a
bare Figure in write_plots), so this module never picks a matplotlib backend.
"""

from __future__ import annotations

import csv
import glob
import json
import math
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from ipa_jax.analysis.curves import EVAL_SUCCESS, SCALARS, run_scalars, seed_band, series, smooth
from ipa_jax.pipeline import RunFolder


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


def plot_band(ax, runs: dict[str, list[str]], key: str, *, window: int = 1, ylabel: str | None = None,
              include_rl_start: bool = False) -> None:
    """One line per config (mean over its seeds of metrics[key], smoothed over `window` points) with a ±1 std
    band, over RL steps: x = step - rl_start, so that seeds whose warm starts ended at different steps line up;
    include_rl_start keeps x = 0 (an evaluation at the end of the warm start). Configs that never logged `key`
    are left out."""
    for i, (name, run_dirs) in enumerate(runs.items()):
        curves = []
        for d in run_dirs:
            folder = RunFolder(d)
            rows = folder.read_metrics()
            steps, vals = series(rows, key)
            start = folder.rl_start(rows)
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
