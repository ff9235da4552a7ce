"""Trajectory sources for the learner: anything with next_trajectories / state_dict / load_state_dict.

The online trajectory queue (ipa_jax.rollout) implements the same protocol; `JsonlSource` reads
Trajectory JSONL files (offline training, tests) and can be checkpointed mid-epoch.
"""

import glob
import logging
import os
from collections.abc import Sequence
from typing import Any, Protocol

from ipa_jax.trajectory import Trajectory

log = logging.getLogger(__name__)


class TrajectorySource(Protocol):
    def next_trajectories(self, n: int) -> list[Trajectory]:
        """The next n trajectories (blocking until available). Validation is the learner's job."""

    def state_dict(self) -> dict[str, Any]:
        """A JSON-serialisable position, saved in checkpoints."""

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a position returned by state_dict."""


def expand_paths(patterns: Sequence[str]) -> list[str]:
    """Globs expanded (sorted within each pattern); a pattern matching nothing is an error."""
    paths = []
    for pattern in patterns:
        matched = sorted(glob.glob(os.path.expanduser(pattern)))
        if not matched:
            raise ValueError(f"config key 'train.data': no file matches {pattern!r}")
        paths.extend(matched)
    return paths


class JsonlSource:
    """Reads Trajectory JSONL files in order, looping over them (epochs), with a byte-offset position.

    A line that does not parse as a Trajectory is skipped and counted in `num_unparsable` (the learner adds
    it to its dropped count); it never stops training.
    """

    def __init__(self, patterns: Sequence[str], *, loop: bool = True):
        self.paths = expand_paths(patterns)
        self.loop = loop
        self.epoch = 0
        self.file_index = 0
        self.offset = 0
        self.num_unparsable = 0
        self.parsed_in_epoch = 0

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "file_index": self.file_index,
            "offset": self.offset,
            "num_unparsable": self.num_unparsable,
            "parsed_in_epoch": self.parsed_in_epoch,
            "paths": self.paths,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if list(state["paths"]) != self.paths:
            raise ValueError(f"JsonlSource: checkpoint was taken over files {state['paths']}, now {self.paths}")
        self.epoch = int(state["epoch"])
        self.file_index = int(state["file_index"])
        self.offset = int(state["offset"])
        self.num_unparsable = int(state["num_unparsable"])
        self.parsed_in_epoch = int(state["parsed_in_epoch"])

    def close(self) -> None:
        """Nothing to stop (the online sources stop their rollouts here)."""

    def next_trajectories(self, n: int) -> list[Trajectory]:
        out: list[Trajectory] = []
        while len(out) < n:
            if self.file_index >= len(self.paths):
                if not self.loop:
                    raise StopIteration("JsonlSource: all files consumed")
                if self.parsed_in_epoch == 0:  # a whole pass without one trajectory would loop forever
                    raise ValueError(f"JsonlSource: no parsable trajectory in {self.paths}")
                self.epoch += 1
                self.file_index, self.offset, self.parsed_in_epoch = 0, 0, 0
            with open(self.paths[self.file_index], "rb") as f:
                f.seek(self.offset)
                while len(out) < n:
                    line = f.readline()
                    if not line:
                        break
                    self.offset = f.tell()
                    if not line.strip():
                        continue
                    try:
                        out.append(Trajectory.from_json(line.decode("utf-8")))
                        self.parsed_in_epoch += 1
                    except (ValueError, KeyError, TypeError) as e:
                        self.num_unparsable += 1
                        log.warning("skipping unparsable line in %s: %s", self.paths[self.file_index], e)
                else:
                    continue  # n reached inside this file: keep the position
            self.file_index, self.offset = self.file_index + 1, 0
        return out
