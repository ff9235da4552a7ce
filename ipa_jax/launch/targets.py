"""The launchers, one render function per target, and the environment each target's cluster gives a process.

Slurm: an sbatch script; srun starts the tasks and jax.distributed.initialize() reads the coordinator (the first
node), the process count and each task's id from srun's SLURM_* variables (`ipa_jax.train.distributed`).
GKE: a JobSet manifest (the conventions of xpk): one indexed Job of `nodes` pods behind the JobSet's headless
service; the coordinator is the first pod's DNS name, set with the process count and id as JAX_* variables.
Ray: a Ray job script: one task per node (a STRICT_SPREAD placement group); the first node's address is the
coordinator, passed to every task as JAX_* variables.
"""

from __future__ import annotations

import shlex
import string
from collections.abc import Callable
from dataclasses import dataclass

import yaml

from ipa_jax.launch.spec import LaunchSpec

REPLICATED_JOB = "workers"


def coordinator_env(address: str, num_processes: int, process_id: int | str) -> dict[str, str]:
    """The variables that give ipa_jax.train.distributed.initialize its coordinator and place explicitly."""
    return {
        "JAX_COORDINATOR_ADDRESS": address,
        "JAX_NUM_PROCESSES": str(num_processes),
        "JAX_PROCESS_ID": str(process_id),
    }


def slurm_env(host: str, port: int, num_processes: int, process_id: int) -> dict[str, str]:
    """What srun gives a task of a one-node step, as jax's Slurm detection reads it (JAX_COORDINATOR_PORT: the
    port jax would otherwise derive from the job id)."""
    return {
        "SLURM_JOB_ID": "0",
        "SLURM_STEP_NODELIST": host,
        "SLURM_NTASKS": str(num_processes),
        "SLURM_PROCID": str(process_id),
        "SLURM_LOCALID": str(process_id),
        "JAX_COORDINATOR_PORT": str(port),
    }


def explicit_env(host: str, port: int, num_processes: int, process_id: int) -> dict[str, str]:
    return coordinator_env(f"{host}:{port}", num_processes, process_id)


def _one_process_per_node(spec: LaunchSpec, target: str) -> None:
    if spec.processes_per_node != 1:
        raise ValueError(
            f"launch target {target}: one process per node (got processes_per_node="
            f"{spec.processes_per_node}); the process drives all accelerators of its node"
        )


def render_slurm(spec: LaunchSpec) -> str:
    if spec.is_tpu:
        raise ValueError(f"launch target slurm: GPU or CPU nodes, not {spec.accelerator!r} (TPU slices: gke)")
    options = [f"--job-name={spec.name}", f"--nodes={spec.nodes}", f"--ntasks-per-node={spec.processes_per_node}"]
    if spec.accelerator:
        gpu_type = "" if spec.accelerator == "gpu" else f"{spec.accelerator}:"
        options.append(f"--gpus-per-node={gpu_type}{spec.accelerators_per_node}")
    options += [f"--{key}={getattr(spec, key)}" for key in ("partition", "account", "time") if getattr(spec, key)]
    options += ["--exclusive", "--output=%x-%j.out"]
    lines = [
        "#!/bin/bash",
        *(f"#SBATCH {option}" for option in options),
        f"# {spec.num_processes} processes. jax.distributed.initialize() finds the coordinator (the first node),",
        "# the process count and each task's id in srun's SLURM_* variables; one failed task ends the step.",
        "set -euo pipefail",
        f"cd {shlex.quote(spec.workdir)}",
        *(f"export {key}={shlex.quote(value)}" for key, value in spec.env.items()),
        f"srun --kill-on-bad-exit=1 {spec.train_command()}",
    ]
    return "\n".join(lines) + "\n"


def render_gke(spec: LaunchSpec) -> str:
    _one_process_per_node(spec, "gke")
    if not spec.image:
        raise ValueError("launch target gke: an image is required (the container with the repository at workdir)")
    coordinator = f"{spec.name}-{REPLICATED_JOB}-0-0.{spec.name}:{spec.coordinator_port}"
    values = {**spec.env, **coordinator_env(coordinator, spec.nodes, 0)}
    env = [{"name": k, "value": v} for k, v in values.items() if k != "JAX_PROCESS_ID"]
    env.append(
        {
            "name": "JAX_PROCESS_ID",
            "valueFrom": {
                "fieldRef": {  # the pod's index in its indexed Job
                    "fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"
                }
            },
        }
    )
    container = {
        "name": "train",
        "image": spec.image,
        "command": spec.train_argv(),
        "env": env,
        "ports": [{"containerPort": spec.coordinator_port}],
    }
    if spec.workdir != ".":  # else the image's working directory
        container["workingDir"] = spec.workdir
    pod = {"restartPolicy": "Never", "containers": [container]}
    annotations = {}
    if spec.is_tpu:
        pod["nodeSelector"] = {
            "cloud.google.com/gke-tpu-accelerator": spec.accelerator,
            "cloud.google.com/gke-tpu-topology": spec.tpu_topology,
        }
        container["resources"] = {"limits": {"google.com/tpu": spec.accelerators_per_node}}
        annotations["alpha.jobset.sigs.k8s.io/exclusive-topology"] = "cloud.google.com/gke-nodepool"
    elif spec.accelerator == "gpu":
        raise ValueError("launch target gke: name the GKE GPU type as accelerator (e.g. nvidia-h100-80gb)")
    elif spec.accelerator:
        pod["nodeSelector"] = {"cloud.google.com/gke-accelerator": spec.accelerator}
        container["resources"] = {"limits": {"nvidia.com/gpu": spec.accelerators_per_node}}
    job = {
        "parallelism": spec.nodes,
        "completions": spec.nodes,
        "completionMode": "Indexed",
        "backoffLimit": 0,
        "template": {"spec": pod},
    }
    manifest = {
        "apiVersion": "jobset.x-k8s.io/v1alpha2",
        "kind": "JobSet",
        "metadata": {"name": spec.name, **({"annotations": annotations} if annotations else {})},
        "spec": {
            "failurePolicy": {"maxRestarts": spec.max_restarts},
            "network": {"enableDNSHostnames": True, "subdomain": spec.name},
            "replicatedJobs": [{"name": REPLICATED_JOB, "replicas": 1, "template": {"spec": job}}],
        },
    }
    return yaml.safe_dump(manifest, sort_keys=False)


RAY_SCRIPT = string.Template('''\
"""Ray job $name: experiments/train.py on $nodes nodes, one task per node; the first node is jax's coordinator.
Submit it from the repository root with the repository as the job's working directory:
ray job submit --working-dir . -- python <this file, relative to the root>.
"""

import os
import subprocess

import ray
from ray.util.placement_group import placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

NODES = $nodes
GPUS_PER_NODE = $gpus
COMMAND = $argv
ENV = $env
PORT = $port


@ray.remote(num_cpus=0)
def node_address():
    return ray.util.get_node_ip_address()


@ray.remote(num_cpus=1, num_gpus=GPUS_PER_NODE)
def train(process_id, coordinator):
    env = {**os.environ, **ENV, "JAX_COORDINATOR_ADDRESS": coordinator, "JAX_NUM_PROCESSES": str(NODES),
           "JAX_PROCESS_ID": str(process_id)}
    return subprocess.run(COMMAND, env=env).returncode


def main():
    ray.init()
    group = placement_group([{"CPU": 1, "GPU": GPUS_PER_NODE} if GPUS_PER_NODE else {"CPU": 1}] * NODES,
                            strategy="STRICT_SPREAD")
    ray.get(group.ready())

    def on_node(index):
        return PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=index)

    coordinator = f"{ray.get(node_address.options(scheduling_strategy=on_node(0)).remote())}:{PORT}"
    pending = [train.options(scheduling_strategy=on_node(i)).remote(i, coordinator) for i in range(NODES)]
    status = 0
    while pending and not status:  # a failed process ends the others: they would wait in collectives
        done, pending = ray.wait(pending)
        status = next((code for code in ray.get(done) if code != 0), 0)
    for task in pending:
        ray.cancel(task, force=True)
    raise SystemExit(abs(status))  # a process killed by signal N: N


if __name__ == "__main__":
    main()
''')


def render_ray(spec: LaunchSpec) -> str:
    _one_process_per_node(spec, "ray")
    if spec.is_tpu:
        raise ValueError(f"launch target ray: GPU or CPU nodes, not {spec.accelerator!r} (TPU slices: gke)")
    if spec.workdir != ".":
        raise ValueError("launch target ray: the job's working directory is the repository (workdir='.')")
    return RAY_SCRIPT.substitute(
        name=spec.name,
        nodes=spec.nodes,
        gpus=spec.accelerators_per_node,
        argv=repr(spec.train_argv()),
        env=repr(dict(spec.env)),
        port=spec.coordinator_port,
    )


@dataclass(frozen=True)
class Target:
    """A launcher: its renderer, the file it writes, how to submit that file, and what its cluster gives each
    process (`process_env(host, port, num_processes, process_id)`, what run_local reproduces on one machine)."""

    render: Callable[[LaunchSpec], str]
    suffix: str
    submit: str
    process_env: Callable[[str, int, int, int], dict[str, str]]


TARGETS = {
    "slurm": Target(render_slurm, ".sbatch", "sbatch {path}", slurm_env),
    "gke": Target(render_gke, ".yaml", "kubectl apply -f {path}", explicit_env),
    "ray": Target(render_ray, ".py", "ray job submit --working-dir . -- python {path}", explicit_env),
}
