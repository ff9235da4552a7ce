"""Results files: per (config, seed) the numbers an ablation table reads, small enough to commit.

    <results>/<config>/seed_<seed>.jsonl    line 1: {"config", "config_sha", RunResult's numbers and curve};
                                            then one line per held-out task {task_id, family, samples, successes}

A sweep writes one as each run finishes (`write_result`); the tables are rebuilt from them alone (`load_result`
reads a results file or a run folder alike), and a sweep whose run folders are gone reuses a results file whose
`config_sha` matches the arm's resolved config instead of retraining it.
"""

from __future__ import annotations

import glob
import hashlib
import json
import math
import os
from collections.abc import Mapping
from typing import Any

from ipa_jax.analysis.curves import RunResult

RESULTS_SUFFIX = ".jsonl"
# Keys that cannot change what a finished run computed, left out of the fingerprint: where the run went, and the
# guards that only end a run early (a results file is written by a run that finished, so it computed the same under
# any value of them that did not stop it).
UNFINGERPRINTED = ("train.run_dir", "train.max_consecutive_skipped", "train.max_consecutive_zero_grad")


def result_path(results_dir: str, config: str, seed: int) -> str:
    return os.path.join(results_dir, config, f"seed_{seed}{RESULTS_SUFFIX}")


def config_sha(config_path: str, overrides: Mapping[str, Any] = ()) -> str:
    """A fingerprint of the resolved config of `config_path` with `overrides` (UNFINGERPRINTED left out)."""
    # imported here: validating a config imports JAX, which reading results (a notebook) must not pay for
    from ipa_jax.pipeline.config import flatten, load_config, validate

    flat = flatten(validate(load_config(config_path, dict(overrides))).to_dict())
    kept = {k: v for k, v in flat.items() if k not in UNFINGERPRINTED}
    return hashlib.sha256(json.dumps(kept, sort_keys=True, default=repr).encode()).hexdigest()[:16]


def _finite_or_none(value: Any) -> Any:
    return None if isinstance(value, float) and not math.isfinite(value) else value


def write_result(path: str, result: RunResult, config: str, sha: str) -> None:
    """The results file of one run (written whole, then renamed: an interrupted write leaves no partial file)."""
    head, *tasks = result.to_records()
    head = {"config": config, "config_sha": sha, **{k: _finite_or_none(v) for k, v in head.items()}}
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        for record in (head, *tasks):
            f.write(json.dumps(record, sort_keys=True) + "\n")
    os.replace(tmp, path)


def read_result(path: str) -> tuple[RunResult, dict[str, Any]]:
    """(the run's numbers, its header: config, config_sha) of a results file; ValueError naming the file when it
    is not one."""
    try:
        with open(path, encoding="utf-8") as f:
            records = [json.loads(line) for line in f if line.strip()]
        return RunResult.from_records(records), {k: records[0][k] for k in ("config", "config_sha")}
    except (ValueError, KeyError, IndexError, TypeError) as e:
        raise ValueError(f"{path}: not a results file ({e!r})") from None


def load_result(path: str) -> RunResult:
    """The numbers of a finished run: a results file (*.jsonl) or a run folder."""
    return read_result(path)[0] if path.endswith(RESULTS_SUFFIX) else RunResult.from_run(path)


def results_of(results_dir: str, configs: list[str], seeds: list[int] | None = None) -> dict[str, list[str]]:
    """{config: its results files, by seed} under `results_dir` (only `seeds` when given); configs without any are
    left out."""
    out = {}
    for config in configs:
        paths = sorted(glob.glob(os.path.join(results_dir, config, f"seed_*{RESULTS_SUFFIX}")))
        if seeds is not None:
            paths = [p for p in paths if any(p == result_path(results_dir, config, s) for s in seeds)]
        if paths:
            out[config] = paths
    return out
