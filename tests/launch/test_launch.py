"""Launchers: each target renders a job whose every process runs the training command with the coordinator wired
by its cluster; the local dry run starts the per-process command as 2 CPU processes that train as one job."""

import ast
import dataclasses
import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest
import yaml

from ipa_jax.launch import LaunchSpec, job_name, render_gke, render_ray, render_slurm, run_local
from ipa_jax.launch.local import CLUSTER_VARIABLE_PREFIXES
from ipa_jax.trajectory import Trajectory, build_chunk_ids, write_jsonl

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
OVERRIDES = ("--config.train.run_dir=gs://bucket/runs/tiny", "--config.train.data=('a b.jsonl',)")
COMMAND = ["python", "experiments/train.py", "--config=configs/offline_tiny.py", *OVERRIDES]


def _spec(**kwargs) -> LaunchSpec:
    return LaunchSpec(
        **{
            "config": "configs/offline_tiny.py",
            "name": "tiny",
            "nodes": 4,
            "overrides": OVERRIDES,
            "env": {"XLA_FLAGS": "--xla_gpu_enable_latency_hiding_scheduler=true"},
            **kwargs,
        }
    )


def _bash_syntax_ok(text: str, tmp_path) -> None:
    path = tmp_path / "script.sh"
    path.write_text(text)
    result = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_slurm_runs_one_task_per_gpu_under_srun(tmp_path):
    text = render_slurm(_spec(processes_per_node=8, accelerator="h100", accelerators_per_node=8, partition="gpu"))
    _bash_syntax_ok(text, tmp_path)
    lines = text.splitlines()
    assert lines[0] == "#!/bin/bash"
    for option in ("--nodes=4", "--ntasks-per-node=8", "--gpus-per-node=h100:8", "--partition=gpu", "--job-name=tiny"):
        assert f"#SBATCH {option}" in lines
    assert not any("--account" in line for line in lines)  # unset options are left out
    srun = [line for line in lines if line.startswith("srun ")]
    assert len(srun) == 1
    argv = srun[0].split(" ", 2)[2]  # after "srun --kill-on-bad-exit=1"
    assert (
        subprocess.run(
            ["bash", "-c", f'printf "%s\\n" {argv}'], capture_output=True, text=True, check=True
        ).stdout.splitlines()
        == COMMAND
    )  # the shell hands train.py these arguments
    assert "export XLA_FLAGS=--xla_gpu_enable_latency_hiding_scheduler=true" in lines
    assert not any("JAX_" in line for line in lines)  # jax detects the coordinator from srun's variables


def test_slurm_generic_gpus_and_cpu_nodes():
    assert "#SBATCH --gpus-per-node=8" in render_slurm(_spec(accelerator="gpu", accelerators_per_node=8))
    assert "gpus" not in render_slurm(_spec())


def _container(manifest):
    job = manifest["spec"]["replicatedJobs"][0]
    assert job["replicas"] == 1
    pod = job["template"]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    return job["template"]["spec"], pod, container


def test_gke_jobset_on_a_tpu_slice():
    text = render_gke(
        _spec(
            image="us-docker.pkg.dev/p/r/ipa:1",
            accelerator="tpu-v5p-slice",
            accelerators_per_node=4,
            tpu_topology="2x2x4",
            max_restarts=2,
        )
    )
    manifest = yaml.safe_load(text)
    assert (manifest["apiVersion"], manifest["kind"]) == ("jobset.x-k8s.io/v1alpha2", "JobSet")
    assert manifest["metadata"]["annotations"] == {
        "alpha.jobset.sigs.k8s.io/exclusive-topology": "cloud.google.com/gke-nodepool"
    }
    assert manifest["spec"]["failurePolicy"] == {"maxRestarts": 2}
    assert manifest["spec"]["network"] == {"enableDNSHostnames": True, "subdomain": "tiny"}
    job, pod, container = _container(manifest)
    assert (job["parallelism"], job["completions"], job["completionMode"]) == (4, 4, "Indexed")
    assert pod["nodeSelector"] == {
        "cloud.google.com/gke-tpu-accelerator": "tpu-v5p-slice",
        "cloud.google.com/gke-tpu-topology": "2x2x4",
    }
    assert container["resources"] == {"limits": {"google.com/tpu": 4}}
    assert container["command"] == COMMAND and container["image"] == "us-docker.pkg.dev/p/r/ipa:1"
    assert "workingDir" not in container  # workdir "." = the image's working directory
    env = {e["name"]: e for e in container["env"]}
    # The first pod of the JobSet's first Job, by the headless service's DNS name: <jobset>-<job>-<index>-<pod>.
    assert env["JAX_COORDINATOR_ADDRESS"]["value"] == "tiny-workers-0-0.tiny:8476"
    assert container["ports"] == [{"containerPort": 8476}]
    assert env["JAX_NUM_PROCESSES"]["value"] == "4"
    assert (
        env["JAX_PROCESS_ID"]["valueFrom"]["fieldRef"]["fieldPath"]
        == "metadata.annotations['batch.kubernetes.io/job-completion-index']"
    )
    assert env["XLA_FLAGS"]["value"] == "--xla_gpu_enable_latency_hiding_scheduler=true"


def test_gke_jobset_on_a_gpu_node_pool():
    manifest = yaml.safe_load(
        render_gke(
            _spec(
                image="img",
                accelerator="nvidia-h100-80gb",
                accelerators_per_node=8,
                workdir="/app",
                coordinator_port=1234,
            )
        )
    )
    assert "annotations" not in manifest["metadata"]
    _, pod, container = _container(manifest)
    assert pod["nodeSelector"] == {"cloud.google.com/gke-accelerator": "nvidia-h100-80gb"}
    assert container["resources"] == {"limits": {"nvidia.com/gpu": 8}}
    assert container["workingDir"] == "/app"
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["JAX_COORDINATOR_ADDRESS"] == "tiny-workers-0-0.tiny:1234"


def test_ray_job_script():
    text = render_ray(_spec(accelerator="gpu", accelerators_per_node=8, coordinator_port=1234))
    module = ast.parse(text)  # valid Python
    constants = {
        node.targets[0].id: ast.literal_eval(node.value)
        for node in module.body
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name)
    }
    assert constants == {
        "NODES": 4,
        "GPUS_PER_NODE": 8,
        "COMMAND": COMMAND,
        "PORT": 1234,
        "ENV": {"XLA_FLAGS": "--xla_gpu_enable_latency_hiding_scheduler=true"},
    }
    assert 'strategy="STRICT_SPREAD"' in text
    for name in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
        assert f'"{name}"' in text


@pytest.mark.parametrize(
    "render, kwargs, message",
    [
        (render_slurm, dict(accelerator="tpu-v5p-slice", accelerators_per_node=4, tpu_topology="2x2x1"), "TPU slices"),
        (render_gke, dict(), "image is required"),
        (render_gke, dict(image="img", processes_per_node=2), "one process per node"),
        (render_gke, dict(image="img", accelerator="gpu", accelerators_per_node=8), "GKE GPU type"),
        (render_ray, dict(workdir="/app"), "working directory"),
    ],
)
def test_render_refuses_what_the_target_cannot_run(render, kwargs, message):
    with pytest.raises(ValueError, match=message):
        render(_spec(**kwargs))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(name="Tiny_Run"), "lower-case"),
        (dict(nodes=0), "nodes"),
        (dict(accelerator="gpu"), "give both"),
        (dict(accelerator="tpu-v5p-slice", accelerators_per_node=4), "tpu_topology"),
        (dict(overrides=("train.steps=2",)), "--config.KEY=VALUE"),
        (dict(env={"A B": "1"}), "environment variable names"),
    ],
)
def test_spec_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        _spec(**kwargs)


def test_job_name():
    assert job_name("offline_tiny") == "offline-tiny"
    assert job_name("7B  Run!") == "ipa-7b-run"
    assert len(job_name("x" * 80)) == 40
    for text in ("offline_tiny", "7B  Run!", "x" * 80):
        LaunchSpec(config="c.py", name=job_name(text))  # accepted


def _trajectories(n: int, first_token: int = 0) -> list[Trajectory]:
    """Trajectories of 128 token ids from `first_token` on (the tiny model's vocabulary at 0): a 3-token prompt, then
    policy chunks of 4 tokens."""
    out = []
    for i in range(n):
        tokens = first_token + (7 * i + 5 * np.arange(15)) % 128
        action = (np.arange(15) >= 3) & ((np.arange(15) - 3) % 6 < 4)
        out.append(
            Trajectory(
                uid=f"t{i}",
                tokens=tokens,
                action_mask=action,
                behavior_logprobs=np.where(action, -4.8, 0.0),
                chunk_ids=build_chunk_ids(action, [6, 12]),
                expert_mask=np.zeros(15, bool),
                reward=float(i % 2),
                policy_version=0,
                info={"task_id": f"task-{i}"},
            )
        )
    return out


def _tiny_job(tmp_path, first_token: int = 0, **kwargs) -> LaunchSpec:
    """2 processes training the tiny offline config for 2 steps into <tmp_path>/run, one CPU device each, on
    `_trajectories(8, first_token)`."""
    data = tmp_path / "data.jsonl"
    write_jsonl(data, _trajectories(8, first_token))
    overrides = (
        f"--config.train.data=('{data}',)",
        f"--config.train.run_dir={tmp_path / 'run'}",
        "--config.train.steps=2",
        "--config.logging.tensorboard=False",
    )
    return LaunchSpec(
        **{
            "config": "configs/offline_tiny.py",
            "name": "tiny",
            "nodes": 2,
            "workdir": REPO,
            "python": sys.executable,
            "overrides": overrides,
            "env": {"XLA_FLAGS": "--xla_force_host_platform_device_count=1"},
            **kwargs,
        }
    )


def _assert_one_job(run_dir, logs: list[str]) -> None:
    """Process 0 alone writes the run folder and prints the summary (two separate 1-process runs would both)."""
    assert "run folder:" in logs[0] and "run folder:" not in logs[1], [log[-3000:] for log in logs]
    rows = [json.loads(line) for line in open(run_dir / "metrics.jsonl", encoding="utf-8")]
    assert [row["step"] for row in rows] == [1, 2]


@pytest.mark.slow
def test_local_dry_run_under_srun_variables_trains_as_one_two_process_job(tmp_path):
    """jax's own Slurm detection; the explicit JAX_* variables of GKE and Ray: the Ray script's test below."""
    results = run_local(_tiny_job(tmp_path), "slurm", str(tmp_path / "logs"), timeout_s=300)
    logs = [open(r.log_path, encoding="utf-8").read() for r in results]
    assert [r.returncode for r in results] == [0, 0], [log[-3000:] for log in logs]
    _assert_one_job(tmp_path / "run", logs)


@pytest.mark.slow
def test_the_ray_script_runs_one_training_process_per_bundle(tmp_path):
    """The rendered script itself, under a stand-in for Ray (tests/launch/fake_ray: tasks in threads here)."""
    spec = _tiny_job(
        tmp_path,
        coordinator_port=_free_port(),
        env={"XLA_FLAGS": "--xla_force_host_platform_device_count=1", "JAX_PLATFORMS": "cpu"},
    )
    job, recorded = _run_ray_script(spec, tmp_path)
    assert job.returncode == 0, (job.stdout + job.stderr)[-3000:]
    assert recorded[1] == {"event": "placement_group", "bundles": [{"CPU": 1}] * 2, "strategy": "STRICT_SPREAD"}
    tasks = [(e["name"], e["bundle"]) for e in recorded if e["event"] == "task"]
    assert tasks == [("node_address", 0), ("train", 0), ("train", 1)]
    assert job.stdout.count("run folder:") == 1  # both processes print to the job's output; only process 0 reports
    _assert_one_job(tmp_path / "run", [job.stdout, ""])


def _stopped_job(tmp_path, spec: LaunchSpec) -> list[tuple[int, list[str]]]:
    """The job run locally: (exit status, log lines) of each process."""
    results = run_local(spec, "slurm", str(tmp_path / "logs"), timeout_s=300)
    return [(r.returncode, open(r.log_path, encoding="utf-8").read().splitlines()) for r in results]


def test_a_two_process_run_stops_on_a_config_error_in_each_process_with_one_line(tmp_path):
    """Every process meets the error and exits with the config's status and its one-line message (the dry run
    gives them time to: none is killed for its peer's failure)."""
    stopped = _stopped_job(tmp_path, _tiny_job(tmp_path, overrides=("--config.train.steps=-1",)))
    assert stopped == [(2, ["error: config key 'train.steps': must be >= 1, got -1"])] * 2


@pytest.mark.slow
def test_a_two_process_run_stops_on_bad_data_in_each_process_with_one_line(tmp_path):
    """Trajectories outside the model's vocabulary stop the run before its first step: each process saves its part
    of the step-0 checkpoint (replicated scalars made on one process's device included) and exits with status 1
    and one `stopped:` line, no traceback."""
    stopped = _stopped_job(tmp_path, _tiny_job(tmp_path, first_token=128))
    for status, lines in stopped:
        assert status == 1 and not any("Traceback" in line for line in lines), lines[-30:]
        assert lines[-1].startswith("stopped: ") and "outside the vocabulary of size 128" in lines[-1], lines[-30:]
    assert (tmp_path / "run" / "checkpoints" / "0").is_dir()


def test_the_ray_script_fails_with_its_first_failed_process(tmp_path):
    job, _ = _run_ray_script(_tiny_job(tmp_path, overrides=("--config.train.steps=-1",)), tmp_path)
    assert job.returncode == 2, (job.stdout + job.stderr)[-3000:]  # experiments/train.py's status on a config error
    assert "train.steps" in job.stderr


def _run_ray_script(spec: LaunchSpec, tmp_path) -> tuple[subprocess.CompletedProcess, list[dict]]:
    """Runs the rendered Ray script from the repository root (the job's working directory) under the stand-in for
    Ray; returns the finished job and what the stand-in recorded."""
    script, events = tmp_path / "ray_job.py", tmp_path / "ray_events.jsonl"
    script.write_text(render_ray(dataclasses.replace(spec, workdir=".")))
    env = {k: v for k, v in os.environ.items() if not k.startswith(CLUSTER_VARIABLE_PREFIXES)}
    env.update(FAKE_RAY_LOG=str(events), PYTHONPATH=os.pathsep.join([os.path.join(HERE, "fake_ray"), REPO]))
    job = subprocess.run([sys.executable, str(script)], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    return job, [json.loads(line) for line in open(events, encoding="utf-8")]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def test_the_cli_writes_its_launcher_under_runs(tmp_path):
    """experiments/launch.py run from a checkout leaves nothing outside the ignored runs/ folder."""
    config = os.path.join(REPO, "configs", "quickstart.py")
    proc = subprocess.run(
        [sys.executable, os.path.join(REPO, "experiments", "launch.py"), f"--config={config}", "--target=slurm"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "submit with: sbatch runs/launch/quickstart.sbatch" in proc.stdout
    assert os.listdir(tmp_path) == ["runs"] and os.listdir(tmp_path / "runs" / "launch") == ["quickstart.sbatch"]
