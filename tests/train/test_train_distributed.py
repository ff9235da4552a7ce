"""jax.distributed initialisation: explicit arguments, JAX_* variables, or a cluster jax detects by itself."""

import logging

import jax
import pytest
from jax._src import clusters

from ipa_jax.train import distributed

CLUSTER_VARIABLES = (
    "JAX_COORDINATOR_ADDRESS",
    "JAX_NUM_PROCESSES",
    "JAX_PROCESS_ID",
    "OMPI_MCA_orte_hnp_uri",
    "OMPI_COMM_WORLD_SIZE",
    "OMPI_COMM_WORLD_RANK",
    "OMPI_COMM_WORLD_LOCAL_RANK",
    "SLURM_JOB_ID",
    "SLURM_STEP_NODELIST",
    "SLURM_NTASKS",
    "SLURM_PROCID",
    "SLURM_LOCALID",
    "TPU_PROCESS_ADDRESSES",
    "TPU_WORKER_HOSTNAMES",
    "TPU_WORKER_ID",
    "MEGASCALE_NUM_SLICES",
    "KUBERNETES_SERVICE_HOST",
)
SLURM = {
    "SLURM_JOB_ID": "77",
    "SLURM_STEP_NODELIST": "node[001-004]",
    "SLURM_NTASKS": "4",
    "SLURM_PROCID": "1",
    "SLURM_LOCALID": "0",
}
OPEN_MPI = {
    "OMPI_MCA_orte_hnp_uri": "1531576320.0;tcp://10.0.0.1:40000",
    "OMPI_COMM_WORLD_SIZE": "2",
    "OMPI_COMM_WORLD_RANK": "1",
    "OMPI_COMM_WORLD_LOCAL_RANK": "0",
}


@pytest.fixture
def calls(monkeypatch):
    """A plain machine (no cluster variables) whose jax.distributed.initialize records its arguments."""
    for name in CLUSTER_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("JAX_PLATFORMS", "")  # no gloo switch in this process
    recorded = []
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kwargs: recorded.append(kwargs))
    return recorded


def _jax_detection():
    """What jax.distributed.initialize() would pick: the first non-opt-in cluster type present, and its count."""
    env = next((e for e in clusters.ClusterEnv._cluster_types if not e.opt_in_only_method and e.is_env_present()), None)
    return None if env is None else env.get_process_count()


def test_plain_machine_initialises_nothing(calls):
    assert distributed.detect_cluster() is None and _jax_detection() is None
    assert distributed.initialize() is False
    assert calls == []


@pytest.mark.parametrize(
    "env, name, count",
    [
        (SLURM, "Slurm", 4),
        (OPEN_MPI, "Open MPI", 2),
        ({**SLURM, **OPEN_MPI}, "Open MPI", 2),  # jax checks Open MPI first
    ],
)
def test_detection_agrees_with_jax_and_initialises_without_arguments(calls, monkeypatch, caplog, env, name, count):
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert distributed.detect_cluster() == distributed.Cluster(name, count)
    assert _jax_detection() == count
    with caplog.at_level(logging.INFO, logger=distributed.__name__):
        assert distributed.initialize() is True
    assert calls == [dict(coordinator_address=None, num_processes=None, process_id=None)]
    assert f"{name} detected" in caplog.text


@pytest.mark.parametrize(
    "env",
    [
        {**SLURM, "SLURM_NTASKS": "1"},  # a one-task job step
        {key: value for key, value in SLURM.items() if key != "SLURM_STEP_NODELIST"},  # not inside a job step
        {**OPEN_MPI, "OMPI_COMM_WORLD_SIZE": "1"},
        {"TPU_WORKER_HOSTNAMES": "localhost"},  # a single-host TPU VM
    ],
)
def test_single_process_cluster_initialises_nothing(calls, monkeypatch, env):
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert distributed.initialize() is False
    assert calls == []


def test_tpu_slices_on_gke_count_hosts_times_slices(calls, monkeypatch):
    monkeypatch.setenv("TPU_WORKER_HOSTNAMES", "w-0.js,w-1.js,w-2.js,w-3.js")
    monkeypatch.setenv("MEGASCALE_NUM_SLICES", "2")
    assert distributed.detect_cluster() == distributed.Cluster("TPU on GKE", 8)
    assert distributed.initialize() is True
    assert calls == [dict(coordinator_address=None, num_processes=None, process_id=None)]


def test_explicit_arguments_and_variables_win_over_detection(calls, monkeypatch):
    for key, value in SLURM.items():
        monkeypatch.setenv(key, value)
    assert distributed.initialize("host:1234", 2, 1) is True
    monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "other:99")
    monkeypatch.setenv("JAX_NUM_PROCESSES", "3")
    monkeypatch.setenv("JAX_PROCESS_ID", "2")
    assert distributed.initialize() is True
    monkeypatch.setenv("JAX_NUM_PROCESSES", "1")  # one process asked for: nothing, whatever the cluster says
    assert distributed.initialize() is False
    assert calls == [
        dict(coordinator_address="host:1234", num_processes=2, process_id=1),
        dict(coordinator_address="other:99", num_processes=3, process_id=2),
    ]
