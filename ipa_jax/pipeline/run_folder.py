"""The run folder: its layout, and every reader and writer of the files in it (docs/run_folder.md).

    <run_dir>/
      trainer.lock                     the running trainer's lock (pipeline/run_lock.py): pid, host, start time
      config.json                      the resolved config (ExperimentConfig.to_dict())
      config_changes.jsonl             resumes with a changed config (train.allow_config_change): what changed
      metrics.jsonl                    one JSON object per logged step: {"step": s, name: value, ...}
      tb/                              TensorBoard events of the same scalars, grouped (`tensorboard_tag`)
      wandb/, wandb_id.txt             logging.wandb: W&B's local files, and the W&B run id a resumed run reuses
      summary.json                     written when the run finishes (success before/after, timings, ...)
      checkpoints/<step>/              Orbax checkpoints (train state + host JSON)
      tokenizer/                       the tokenizer built for the run (when none was given)
      samples/step_<8 digits>.jsonl    a few train and held-out episodes at every evaluation
      trajectories/train.jsonl         every trajectory the learner consumed (up to its latest checkpoint, on resume)
      trajectories/unconsumed.jsonl    finished rollouts still waiting when the run stopped
      forks.json                       resampling runs: success per expert anchor and crucial forks per task
      eval_tasks/step_<8 digits>.json  every held-out evaluation of the learner, task by task (samples, successes)
      eval/step_<8 digits>_k<k>_t<T>.json  experiments/evaluate.py's reports on a checkpoint of the run
      weights/v<8 digits>/             SGLang runs: the HF weights of the last synced versions
      hf/                              the final policy as a Hugging Face folder (checkpoint.export_hf)

Only process 0 of a multi-host run writes. metrics.jsonl stores non-finite floats as the strings "nan", "inf",
"-inf" (JSON has no such numbers); `read_metrics` turns them back into floats.

The run folder may be a local path or an object store's URI (gs://bucket/runs/x): every file operation goes through
etils.epath (`ipa_jax.storage`); W&B keeps its files in a local run folder only.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from etils import epath

from ipa_jax import storage
from ipa_jax.trajectory import Trajectory, jsonl_lines, parse_jsonl

if TYPE_CHECKING:  # the metrics sink's settings; imported where a writer makes one (ipa_jax.train imports JAX)
    from ipa_jax.train.metrics import LoggingConfig

TRAJECTORY_FILES = ("train", "unconsumed")


def is_writer() -> bool:
    """Whether this process writes run-folder files (process 0 of a multi-host run). A process that has not imported
    JAX is no part of a multi-host run (a notebook reading runs): it is its only process, so this module does not
    import JAX for it."""
    jax = sys.modules.get("jax")
    return jax is None or jax.process_index() == 0


@dataclass(frozen=True)
class RunFolder:
    """Paths and file I/O of one run folder (module doc)."""

    path: str

    def __post_init__(self) -> None:
        object.__setattr__(self, "path", os.fspath(self.path))

    def file(self, *parts: str) -> str:
        return os.path.join(self.path, *parts)

    @property
    def config_path(self) -> str:
        return self.file("config.json")

    @property
    def metrics_path(self) -> str:
        return self.file("metrics.jsonl")

    @property
    def summary_path(self) -> str:
        return self.file("summary.json")

    @property
    def checkpoints_dir(self) -> str:
        return self.file("checkpoints")

    @property
    def tokenizer_dir(self) -> str:
        return self.file("tokenizer")

    @property
    def hf_dir(self) -> str:
        return self.file("hf")

    @property
    def tensorboard_dir(self) -> str:
        return self.file("tb")

    @property
    def wandb_id_path(self) -> str:
        return self.file("wandb_id.txt")

    @property
    def forks_path(self) -> str:
        return self.file("forks.json")

    @property
    def weights_root(self) -> str:
        """Where the SGLang weight sync writes weights/v<version>/ (`SGLangEngine.push_weights`)."""
        return self.file("weights")

    def eval_report_path(self, step: int, k: int, temperature: float) -> str:
        return self.file("eval", f"step_{step:08d}_k{k}_t{temperature:g}.json")

    def eval_tasks_path(self, step: int) -> str:
        return self.file("eval_tasks", f"step_{step:08d}.json")

    def samples_path(self, step: int) -> str:
        return self.file("samples", f"step_{step:08d}.jsonl")

    def trajectories_path(self, kind: str) -> str:
        if kind not in TRAJECTORY_FILES:
            raise ValueError(f"trajectory file must be one of {TRAJECTORY_FILES}, got {kind!r}")
        return self.file("trajectories", f"{kind}.jsonl")

    # ---- config.json
    def write_config(self, values: dict[str, Any]) -> None:
        if is_writer():
            _write_json(self.config_path, values)

    def read_config(self) -> dict[str, Any]:
        return _read_json(self.config_path, "config.json (not a run folder?)")

    def has_config(self) -> bool:
        return epath.Path(self.config_path).exists()

    def latest_checkpoint_step(self) -> int | None:
        """The newest complete checkpoint's step (Orbax names a finished checkpoint by its step), or None."""
        return max((int(name) for name in _names(self.checkpoints_dir) if name.isdigit()), default=None)

    def record_config_change(self, step: int | None, changes: dict[str, tuple[Any, Any]]) -> None:
        """Appends {"time", "step" (the checkpoint resumed from), "changes": {key: [old, new]}} to
        config_changes.jsonl."""
        if is_writer():
            record = {
                "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
                "step": step,
                "changes": {k: list(v) for k, v in changes.items()},
            }
            storage.append_text(self.file("config_changes.jsonl"), json.dumps(record) + "\n")

    # ---- metrics.jsonl
    def read_metrics(self) -> list[dict[str, Any]]:
        """Every complete line of metrics.jsonl, non-finite floats restored; a partial last line (a killed run)
        is skipped. Raises FileNotFoundError when the run has not logged yet."""
        if not epath.Path(self.metrics_path).exists():
            raise FileNotFoundError(f"{self.path}: no metrics.jsonl (not a run folder, or the run has not started)")
        rows = []
        with epath.Path(self.metrics_path).open(encoding="utf-8") as f:
            for line in f:
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if "step" not in row:
                    raise ValueError(f"{self.metrics_path}: a metrics line without 'step': {line[:120]!r}")
                rows.append({k: _restore_float(v) for k, v in row.items()})
        return rows

    def metrics_log(self, logging: LoggingConfig | None = None, config: dict[str, Any] | None = None) -> MetricsLog:
        """The learner's metrics sink. logging: its settings (default LoggingConfig()); config: the resolved
        config (ExperimentConfig.to_dict()), shown as the W&B run's config."""
        from ipa_jax.train.metrics import LoggingConfig

        return MetricsLog(self, logging or LoggingConfig(), config)

    # ---- summary.json
    def write_summary(self, summary: dict[str, Any]) -> None:
        if is_writer():
            _write_json(self.summary_path, summary)

    def read_summary(self) -> dict[str, Any]:
        return _read_json(self.summary_path, "summary.json (the run did not finish)")

    def has_summary(self) -> bool:
        return epath.Path(self.summary_path).exists()

    # ---- samples/ and trajectories/
    def write_samples(self, step: int, trajs: list[Trajectory]) -> None:
        if is_writer():
            storage.write_text(self.samples_path(step), "".join(jsonl_lines(trajs)))

    def read_samples(self, split: str | None = None) -> list[tuple[int, Trajectory]]:
        """(step, trajectory) of every sampled episode, in step order; `split` ("train" | "eval") keeps only the
        episodes whose info["split"] matches."""
        if split not in (None, "train", "eval"):
            raise ValueError(f"split must be None, 'train' or 'eval', got {split!r}")
        out = []
        for name in sorted(_names(self.file("samples"))):
            match = re.fullmatch(r"step_(\d+)\.jsonl", name)
            if match is not None:
                out += [
                    (int(match.group(1)), t)
                    for t in _read_jsonl(self.file("samples", name))
                    if split is None or t.info.get("split") == split
                ]
        return out

    def append_trajectories(self, kind: str, trajs: list[Trajectory]) -> None:
        """Adds to trajectories/<kind>.jsonl ("train": consumed by the learner; "unconsumed": left at exit)."""
        if is_writer() and trajs:
            storage.append_text(self.trajectories_path(kind), "".join(jsonl_lines(trajs)))

    def read_trajectories(self, kind: str) -> list[Trajectory]:
        path = self.trajectories_path(kind)
        return _read_jsonl(path) if epath.Path(path).exists() else []

    def count_trajectories(self, kind: str) -> int:
        """Complete lines of trajectories/<kind>.jsonl (a line cut short by a kill does not count)."""
        path = epath.Path(self.trajectories_path(kind))
        if not path.exists():
            return 0
        with path.open(encoding="utf-8") as f:
            return sum(line.endswith("\n") for line in f)

    def truncate_trajectories(self, kind: str, count: int) -> None:
        """Keeps the first `count` lines of trajectories/<kind>.jsonl: on resume, what the restored checkpoint
        had consumed (a killed run may have logged a batch after it)."""
        path = self.trajectories_path(kind)
        if not is_writer() or not epath.Path(path).exists():
            return
        if not storage.is_local(path):  # an object is rewritten whole
            with epath.Path(path).open(encoding="utf-8") as f:
                kept = [line for line, _ in zip(f, range(count))]
            storage.write_text(path, "".join(kept))
            return
        with open(path, "rb+") as f:
            for _ in range(count):
                f.readline()
            f.truncate()

    # ---- eval_tasks/
    def write_eval_tasks(self, step: int, record: dict[str, Any]) -> None:
        """eval_tasks/step_<step>.json = {"step": step, **record}: the per-task outcomes of the held-out evaluation
        at `step` (`ipa_jax.pipeline.evaluation.eval_tasks_record`); evaluating a step again overwrites it."""
        if is_writer():
            _write_json(self.eval_tasks_path(step), {"step": int(step), **record})

    def read_eval_tasks(self, step: int) -> dict[str, Any]:
        return _read_json(self.eval_tasks_path(step), f"per-task record of the evaluation at step {step}")

    def eval_tasks_steps(self) -> list[int]:
        """The steps with a per-task evaluation record, ascending (none in run folders from before the records)."""
        return sorted(
            int(m.group(1))
            for name in _names(self.file("eval_tasks"))
            if (m := re.fullmatch(r"step_(\d+)\.json", name))
        )

    def drop_eval_tasks_after(self, step: int) -> None:
        """Deletes the per-task records of steps > `step`: what a killed run evaluated after the checkpoint it
        resumes from (-1: a fresh start drops them all)."""
        if is_writer():
            for later in (s for s in self.eval_tasks_steps() if s > step):
                epath.Path(self.eval_tasks_path(later)).unlink()

    # ---- forks.json
    def write_forks(self, report: dict[str, Any]) -> None:
        if is_writer():
            _write_json(self.forks_path, report)

    def read_forks(self) -> dict[str, Any]:
        return _read_json(self.forks_path, "forks.json (not a resampling run?)")

    # ---- derived facts
    def rl_start(self, rows: list[dict[str, Any]] | None = None) -> int:
        """The step where RL starts (steps 1..rl_start are IL warm-start updates): the last `rl_start` logged in
        metrics.jsonl (the warm start may end early on train.il_warmup_target), else train.il_warmup_steps of
        config.json. `rows`: the run's metrics if already read."""
        if rows is None:
            rows = self.read_metrics() if epath.Path(self.metrics_path).exists() else []
        logged = [r["rl_start"] for r in rows if "rl_start" in r]
        return int(logged[-1]) if logged else int(self.read_config()["train"]["il_warmup_steps"])


# TensorBoard and W&B group the flat metric names of metrics.jsonl by the tag's first path segment.
# Exact names first, then the first matching prefix (replaced by its tag prefix); anything else is train/<name>.
TAG_NAMES = {
    "step_time_s": "perf/step_time_s",
    "tokens_per_s": "perf/tokens_per_s",
    "mfu": "perf/mfu",
    "seq_len": "perf/seq_len",
    "source/learner_idle_fraction": "queue/learner_idle_fraction",
}
TAG_PREFIXES = (
    ("eval/", "eval/"),
    ("source/queue_", "queue/"),
    ("source/", "rollout/"),
)


def is_timing_metric(name: str) -> bool:
    """Whether a metrics.jsonl name measures wall time or speed (seconds, rates, MFU, the learner's idle share): what
    two runs of one lockstep command may differ in; every other metric is a function of the config alone."""
    return name.endswith("_s") or name in ("mfu", "source/learner_idle_fraction")


def tensorboard_tag(name: str) -> str:
    """The grouped TensorBoard / W&B tag of a metrics.jsonl name: train/, eval/, rollout/, queue/ or perf/."""
    if name in TAG_NAMES:
        return TAG_NAMES[name]
    for prefix, tag in TAG_PREFIXES:
        if name.startswith(prefix):
            return tag + name[len(prefix) :]
    return "train/" + name


class MetricsLog:
    """Appends `{"step": s, **metrics}` lines to metrics.jsonl (flat names) and the scalars, under their grouped
    `tensorboard_tag`, to TensorBoard and (logging.wandb) Weights & Biases: the learner's metrics sink.

    `start(resume_step)`: resuming from step s removes the lines with step > s (written after the checkpoint by
    a killed run), the TensorBoard events and the eval_tasks/ records after it, so the files read as one
    uninterrupted run, and continues the W&B run of wandb_id.txt; None = a fresh start, which drops whatever a run
    killed before its first checkpoint wrote and starts a new W&B run. Non-finite values go to metrics.jsonl only.
    """

    def __init__(self, folder: RunFolder, logging: LoggingConfig, config: dict[str, Any] | None = None):
        self.folder, self.logging, self.config = folder, logging, config
        self._started = False
        self._file = None
        self._tb = None
        self._wandb = None

    def start(self, resume_step: int | None) -> None:
        if not is_writer():
            return
        epath.Path(self.folder.path).mkdir(parents=True, exist_ok=True)
        self._truncate(-1 if resume_step is None else resume_step)
        self.folder.drop_eval_tasks_after(-1 if resume_step is None else resume_step)
        self._started = True
        if storage.is_local(self.folder.metrics_path):  # an object store's object is rewritten per line instead
            self._file = open(self.folder.metrics_path, "a", encoding="utf-8")
        if self.logging.tensorboard:
            from tensorboardX import SummaryWriter

            purge = None if resume_step is None else resume_step + 1
            self._tb = SummaryWriter(self.folder.tensorboard_dir, purge_step=purge)
        if self.logging.wandb:
            self._wandb = self._start_wandb(resume_step)

    def write(self, step: int, metrics: dict[str, Any]) -> None:
        if not self._started:
            return
        row = {"step": int(step), **{k: _to_json_value(v) for k, v in metrics.items()}}
        if self._file is not None:
            self._file.write(json.dumps(row) + "\n")
            self._file.flush()
        else:
            storage.append_text(self.folder.metrics_path, json.dumps(row) + "\n")
        scalars = {
            tensorboard_tag(k): v
            for k, v in row.items()
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)
        }
        if self._tb is not None:
            for tag, value in scalars.items():
                self._tb.add_scalar(tag, value, step)
        if self._wandb is not None and scalars:
            self._wandb.log(scalars, step=int(step))

    def close(self) -> None:
        self._started = False
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None

    def _start_wandb(self, resume_step: int | None):
        try:
            import wandb
        except ImportError as e:
            raise ImportError("logging.wandb needs the wandb package: pip install 'ipa_jax[wandb]'") from e
        if not storage.is_local(self.folder.path):
            raise ValueError(
                f"logging.wandb: W&B keeps its files in the run folder, which must be local; got "
                f"{self.folder.path} (turn logging.wandb off, or sync a local run folder)"
            )
        # One W&B run per run folder: a resumed run reuses the stored id; a fresh start (its metrics.jsonl just
        # emptied) takes a new one, so the W&B run holds no steps that metrics.jsonl dropped.
        path = self.folder.wandb_id_path
        if resume_step is not None and os.path.exists(path):
            with open(path, encoding="utf-8") as f:
                run_id = f.read().strip()
        else:
            run_id = uuid.uuid4().hex[:16]
            with open(path, "w", encoding="utf-8") as f:
                f.write(run_id + "\n")
        return wandb.init(
            project=self.logging.wandb_project,
            entity=self.logging.wandb_entity or None,
            name=os.path.basename(os.path.abspath(self.folder.path)),
            dir=self.folder.path,
            config=self.config,
            resume="allow",
            id=run_id,
        )

    def _truncate(self, last_step: int) -> None:
        """Keeps only the complete lines with step <= last_step (atomic rewrite)."""
        path = self.folder.metrics_path
        if not epath.Path(path).exists():
            return
        kept = [
            line if line.endswith("\n") else line + "\n"
            for line, row in _parsed_lines(path)
            if row is not None and row.get("step", math.inf) <= last_step
        ]
        storage.write_text(path, "".join(kept))


def _read_jsonl(path: str) -> list[Trajectory]:
    with epath.Path(path).open(encoding="utf-8") as f:
        return parse_jsonl(f, path)


def _names(folder: str) -> list[str]:
    """The names in `folder`; none when it does not exist."""
    path = epath.Path(folder)
    return [child.name for child in path.iterdir()] if path.is_dir() else []


def _parsed_lines(path: str):
    with epath.Path(path).open(encoding="utf-8") as f:
        for line in f:
            try:
                yield line, json.loads(line)
            except json.JSONDecodeError:
                yield line, None  # a line cut short by a kill


def _to_json_value(value: Any) -> Any:
    if hasattr(value, "item") and getattr(value, "ndim", 0) == 0:
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no nan/inf
    return value


def _restore_float(value: Any) -> Any:
    if isinstance(value, str) and value.lower() in ("nan", "inf", "-inf", "+inf"):
        return float(value)
    return value


def _write_json(path: str, values: Any) -> None:
    storage.write_text(path, json.dumps(values, indent=2))


def _read_json(path: str, what: str) -> Any:
    if not epath.Path(path).exists():
        raise FileNotFoundError(f"{os.path.dirname(path)}: no {what}")
    with epath.Path(path).open(encoding="utf-8") as f:
        return json.load(f)
