"""Launchers: one training job on a Slurm cluster, a GKE JobSet (TPU slices, GPU node pools) or a Ray cluster,
rendered from a `LaunchSpec` (docs/launch.md); `run_local` runs the same per-process command as local processes."""

from ipa_jax.launch.local import run_local
from ipa_jax.launch.spec import LaunchSpec, job_name
from ipa_jax.launch.targets import TARGETS, Target, render_gke, render_ray, render_slurm

__all__ = ["TARGETS", "LaunchSpec", "Target", "job_name", "render_gke", "render_ray", "render_slurm", "run_local"]
