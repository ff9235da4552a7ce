"""What a launcher starts: the training command every process runs, on how many nodes, with which accelerators."""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field

TRAIN_SCRIPT = "experiments/train.py"
# Kubernetes object names (RFC 1035 labels); JobSet appends "-workers-<job>-<pod>-<suffix>" to pod names.
NAME_PATTERN = re.compile(r"[a-z]([-a-z0-9]{0,38}[a-z0-9])?")


def job_name(text: str) -> str:
    """`text` (e.g. train.name) as a name every target accepts: lower case, runs of other characters -> "-"."""
    name = re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")[:40].rstrip("-")
    return name if name[:1].isalpha() else f"ipa-{name}".rstrip("-")


@dataclass(frozen=True)
class LaunchSpec:
    """One training job: `python experiments/train.py --config=CONFIG OVERRIDES...` on every process.

    config: the training config file, relative to `workdir` on the nodes; overrides: its --config.KEY=VALUE flags.
    name: the job's name (Slurm job, JobSet, Ray job; `job_name` makes one from any text).
    nodes: hosts; processes_per_node: processes on each (Slurm tasks per node: one per GPU is jax's convention,
      each task then drives the GPU of its SLURM_LOCALID; GKE and Ray run one process per node).
    accelerator: "" (CPU); GPUs: "gpu", or a type (Slurm's GPU type, e.g. "h100"; GKE's, e.g. "nvidia-h100-80gb");
      TPUs (GKE only): the GKE TPU type ("tpu-v5p-slice"). accelerators_per_node: GPUs or TPU chips per node;
      tpu_topology: the slice's topology ("2x2x2"; TPU only).
    workdir: the repository root on the nodes (the image's working directory on GKE); python: its interpreter.
    env: extra environment variables of every process.
    coordinator_port: the port of jax's coordinator service on the first process (GKE, Ray; under Slurm jax
      derives it from the job id).
    partition, account, time: Slurm's; image: the GKE container image; max_restarts: JobSet restarts of the whole
      job after a failure (each run resumes from the run folder's latest checkpoint).
    """

    config: str
    name: str
    nodes: int = 1
    overrides: tuple[str, ...] = ()
    processes_per_node: int = 1
    accelerator: str = ""
    accelerators_per_node: int = 0
    tpu_topology: str = ""
    workdir: str = "."
    python: str = "python"
    env: dict[str, str] = field(default_factory=dict)
    coordinator_port: int = 8476
    partition: str = ""
    account: str = ""
    time: str = "24:00:00"
    image: str = ""
    max_restarts: int = 0

    def __post_init__(self) -> None:
        if not NAME_PATTERN.fullmatch(self.name):
            raise ValueError(
                f"launch name {self.name!r}: lower-case letters, digits and '-', starting with a letter, "
                f"at most 40 characters (job_name() makes one)"
            )
        for key in ("nodes", "processes_per_node"):
            if getattr(self, key) < 1:
                raise ValueError(f"launch {key}: must be >= 1, got {getattr(self, key)}")
        if self.accelerators_per_node < 0 or bool(self.accelerator) != (self.accelerators_per_node > 0):
            raise ValueError(
                f"launch accelerator {self.accelerator!r} with accelerators_per_node="
                f"{self.accelerators_per_node}: give both (a type and a count > 0) or neither"
            )
        if bool(self.tpu_topology) != self.is_tpu:
            raise ValueError(
                f"launch tpu_topology {self.tpu_topology!r}: required with a TPU accelerator, and only then"
            )
        if not 0 < self.coordinator_port < 65536:
            raise ValueError(f"launch coordinator_port: not a port: {self.coordinator_port}")
        bad = [a for a in self.overrides if not a.startswith("--config.")]
        if bad:
            raise ValueError(f"launch overrides: each must be --config.KEY=VALUE, got {bad}")
        bad = [k for k in self.env if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", k)]
        if bad:
            raise ValueError(f"launch env: not environment variable names: {bad}")

    @property
    def is_tpu(self) -> bool:
        return self.accelerator.startswith("tpu")

    @property
    def num_processes(self) -> int:
        return self.nodes * self.processes_per_node

    def train_argv(self) -> list[str]:
        """The command every process runs."""
        return [self.python, TRAIN_SCRIPT, f"--config={self.config}", *self.overrides]

    def train_command(self) -> str:
        return shlex.join(self.train_argv())
