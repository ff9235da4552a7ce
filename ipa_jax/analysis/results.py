"""Results files: per (config, seed) the numbers an ablation table reads, small enough to commit.

    <results>/<config>/seed_<seed>.jsonl    line 1: {"config", "config_sha", "config_resolved", RunResult's numbers
                                            and curve}; then one line per held-out task {task_id, family, samples,
                                            successes}

A sweep writes one as each run finishes (`write_result`); the tables are rebuilt from them alone (`load_result`
reads a results file or a run folder alike), and a sweep whose run folders are gone reuses a results file whose
resolved config (`config_resolved`, fingerprinted by `config_sha`) is the arm's, instead of retraining it. A key
added to the configs since the file was written counts as the same config at its default: new settings are off by
default, so the run did what the default does (`result_changes`).
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


def resolved_config(config_path: str, overrides: Mapping[str, Any] = ()) -> dict[str, Any]:
    """The resolved config of `config_path` with `overrides`, as {dotted key: JSON value} without UNFINGERPRINTED:
    what a results file records of the run that wrote it."""
    # imported here: validating a config imports JAX, which reading results (a notebook) must not pay for
    from ipa_jax.pipeline.config import load_config, validate

    return _recorded(validate(load_config(config_path, dict(overrides))))


def _recorded(exp: Any) -> dict[str, Any]:
    from ipa_jax.pipeline.config import flatten

    flat = flatten(exp.to_dict())
    return json.loads(json.dumps({k: v for k, v in flat.items() if k not in UNFINGERPRINTED}, default=repr))


def fingerprint(resolved: Mapping[str, Any]) -> str:
    return hashlib.sha256(json.dumps(resolved, sort_keys=True).encode()).hexdigest()[:16]


def config_sha(config_path: str, overrides: Mapping[str, Any] = ()) -> str:
    """The fingerprint of `resolved_config(config_path, overrides)`."""
    return fingerprint(resolved_config(config_path, overrides))


def result_changes(stored: Mapping[str, Any], resolved: Mapping[str, Any]) -> dict[str, tuple[Any, Any]]:
    """{dotted key: (stored value, `resolved`'s)} where the resolved config a results file recorded (`stored`)
    differs from an arm's now (`resolved`); as for a resumed run folder, keys added to ipa_jax since the file was
    written take their defaults (new settings are off by default: the run did what the default does). ConfigError
    for a key that no longer exists."""
    from ipa_jax.pipeline.config import config_changes, config_from_dict, validate

    return config_changes(_recorded(validate(config_from_dict(stored))), resolved)


def _finite_or_none(value: Any) -> Any:
    return None if isinstance(value, float) and not math.isfinite(value) else value


def write_result(path: str, result: RunResult, config: str, resolved: Mapping[str, Any]) -> None:
    """The results file of one run of `config` (its name) with the `resolved` config (`resolved_config`), written
    whole, then renamed: an interrupted write leaves no partial file."""
    head, *tasks = result.to_records()
    head = {
        "config": config,
        "config_sha": fingerprint(resolved),
        "config_resolved": dict(resolved),
        **{k: _finite_or_none(v) for k, v in head.items()},
    }
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        for record in (head, *tasks):
            f.write(json.dumps(record, sort_keys=True) + "\n")
    os.replace(tmp, path)


def read_result(path: str) -> tuple[RunResult, dict[str, Any]]:
    """(the run's numbers, its header: config, config_sha, config_resolved (None in a file written without it)) of
    a results file; ValueError naming the file when it is not one."""
    try:
        with open(path, encoding="utf-8") as f:
            records = [json.loads(line) for line in f if line.strip()]
        head = {k: records[0][k] for k in ("config", "config_sha")}
        return RunResult.from_records(records), {**head, "config_resolved": records[0].get("config_resolved")}
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
