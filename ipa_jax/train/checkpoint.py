"""Orbax checkpoints of the learner: every N steps and at exit, keep the last K, async, atomic.

Orbax writes each step into a temporary folder and renames it when the save is complete, so a checkpoint
cut short by SIGKILL is never listed by `latest_step()` and never loaded. A checkpoint holds the train
state (params, optimizer state, step, skipped count, RNG) and a JSON document for everything host-side
(the data source's position, learner counters, any extra state such as resampling statistics).

A complete checkpoint can still be damaged afterwards (a disk error, a truncated copy, a file edited by hand).
`restore()` then falls back to the newest checkpoint that loads, logging which step it skipped and why, and moves
the damaged ones aside to `<step>.damaged-<time>` (kept for inspection, no longer listed), so that the run
saves those steps again; when none loads it raises, naming each step's error, and moves nothing.
"""

import logging
import os
import time
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from etils import epath

from ipa_jax import storage
from ipa_jax.train.state import TrainState

log = logging.getLogger(__name__)


class CheckpointError(RuntimeError):
    """No checkpoint of the folder can be restored; the message names each step and its error."""


@dataclass(frozen=True)
class CheckpointConfig:
    """Orbax checkpoints under <run_dir>/checkpoints.

    every: learner steps between checkpoints; 0 = only at exit (the end, Ctrl-C or SIGTERM).
    keep: the newest checkpoints kept on disk.
    async_save: write checkpoints in the background while training goes on.
    resume: restore the latest complete checkpoint of the run folder when there is one.
    export_hf: also write the final policy as a Hugging Face folder to <run_dir>/hf.
    """

    every: int = 100
    keep: int = 3
    async_save: bool = True
    resume: bool = True
    export_hf: bool = False

    def __post_init__(self):
        if self.every < 0:
            raise ValueError(f"checkpoint.every: must be >= 0 (0 = only at exit), got {self.every}")
        if self.keep < 1:
            raise ValueError(f"checkpoint.keep: must be >= 1, got {self.keep}")


def checkpoint_mismatch(directory: str, step: int, template: TrainState) -> str | None:
    """How checkpoint `step` under `directory` does not fit `template`: its first array whose shape differs (the
    parameters first), or that only one side has, as 'name: stored float32[64, 32], requested float32[64, 64]'.
    None when every shape fits, and when the metadata cannot be read (`Checkpointer.restore` then deals with the
    damaged checkpoint). Reads the checkpoint's metadata only, no array. A dtype alone may differ: a restore casts
    (model.param_dtype may change between runs)."""
    try:
        stored_tree = ocp.StandardCheckpointHandler().metadata(epath.Path(directory) / str(step) / "state")
    except Exception as e:  # noqa: BLE001 - a damaged or foreign checkpoint: the restore reports it
        log.warning(
            "checkpoint %d in %s: its metadata cannot be read (%s: %s)",
            step,
            directory,
            type(e).__name__,
            (str(e).strip().splitlines() or [""])[0][:300],
        )
        return None
    stored = {leaf.name: leaf for leaf in jax.tree.leaves(stored_tree)}
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, template.checkpoint_tree())
    names = jax.tree.leaves(ocp.tree.get_param_names(abstract, include_empty_nodes=False))
    requested = dict(zip(names, jax.tree.leaves(abstract), strict=True))
    for name in sorted(stored.keys() | requested.keys(), key=lambda n: (not n.startswith("params."), n)):
        have, want = stored.get(name), requested.get(name)
        if have is None or want is None or tuple(have.shape) != tuple(want.shape):
            return f"{name}: stored {_describe(have)}, requested {_describe(want)}"
    return None


def _describe(array: Any) -> str:
    return "nothing" if array is None else f"{jnp.dtype(array.dtype).name}{list(array.shape)}"


class Checkpointer:
    """A thin wrapper over `ocp.CheckpointManager` for TrainState + JSON host state. `directory`: a local path or an
    object store's URI (gs://bucket/run/checkpoints), handed to Orbax as an etils.epath.Path."""

    def __init__(self, directory: str | os.PathLike, config: CheckpointConfig):
        self.config = config
        self.directory = epath.Path(storage.absolute(directory))
        self._manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(
                max_to_keep=config.keep, enable_async_checkpointing=config.async_save, create=True
            ),
        )

    def latest_step(self) -> int | None:
        """The newest complete checkpoint (partial ones are invisible), or None."""
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self._manager.all_steps())

    def save(self, state: TrainState, host_state: dict[str, Any]) -> bool:
        """Saves at `state.step` unless that step is already saved. Returns whether it saved."""
        step = int(jax.device_get(state.step))
        if step in self._manager.all_steps():
            return False
        self._manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state.checkpoint_tree()), host=ocp.args.JsonSave(host_state)
            ),
            force=True,
        )
        return True

    def restore(self, template: TrainState, step: int | None = None) -> tuple[TrainState, dict[str, Any]]:
        """Restores `step` into the shapes, dtypes and shardings of `template`; by default the newest checkpoint
        that loads (module doc)."""
        if step is not None:
            return self._restore_step(template, step)
        steps = sorted(self.all_steps(), reverse=True)
        if not steps:
            raise FileNotFoundError(f"no complete checkpoint in {self.directory}")
        damaged: list[tuple[int, str]] = []
        for step in steps:
            try:
                restored = self._restore_step(template, step)
            except Exception as e:  # noqa: BLE001 - Orbax and TensorStore raise many types for a damaged folder
                why = f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:300]}"
                log.warning("checkpoint %d in %s cannot be restored (%s)", step, self.directory, why)
                damaged.append((step, why))
                continue
            if damaged:
                self._set_aside([s for s, _ in damaged])
                log.warning(
                    "restored checkpoint %d, the newest that loads; damaged and moved aside: %s",
                    step,
                    "; ".join(f"step {s} ({why})" for s, why in damaged),
                )
            return restored
        raise CheckpointError(
            f"no checkpoint in {self.directory} can be restored: " + "; ".join(f"step {s}: {why}" for s, why in damaged)
        )

    def _set_aside(self, steps: list[int]) -> None:
        """Renames damaged step folders to <step>.damaged-<time> (Orbax lists only integer names)."""
        self.wait()
        stamp = time.strftime("%Y%m%d-%H%M%S")
        if jax.process_index() == 0:
            for step in steps:
                path = self.directory / str(step)
                path.rename(path.with_name(f"{step}.damaged-{stamp}"))
        self._manager.reload()

    def _restore_step(self, template: TrainState, step: int) -> tuple[TrainState, dict[str, Any]]:
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, template.checkpoint_tree())
        restored = self._manager.restore(
            step,
            args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract), host=ocp.args.JsonRestore()),
        )
        return template.replace_checkpoint_tree(restored.state), dict(restored.host)

    def wait(self) -> None:
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.wait_until_finished()
        self._manager.close()
