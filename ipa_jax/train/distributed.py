"""Multi-host: jax.distributed initialisation, feeding each process's slice of a global batch, and what one process
decides reaching all of them (`from_process_0`, `agreed_stop`).

Every helper here is collective with several processes: all of them must call it, in the same order. A process that
dies leaves the others in the collective until it fails (gloo: the peer's connection closes) or until the
distributed service's heartbeat timeout (jax.distributed.initialize's heartbeat_timeout_seconds, 100 s by default)
ends them.
"""

import logging
import os
import pickle
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TypeVar

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Cluster:
    """A cluster whose launcher gave this process its place: `jax.distributed.initialize()` finds the coordinator,
    the process count and this process's id in the same environment."""

    name: str
    num_processes: int


def detect_cluster(environ: Mapping[str, str] = os.environ) -> Cluster | None:
    """The cluster that jax.distributed.initialize() would detect by itself, from the environment variables it reads
    (jax/_src/clusters, checked in the same order), or None on a plain machine.

    Open MPI: OMPI_MCA_orte_hnp_uri (mpirun); Slurm: SLURM_JOB_ID, SLURM_STEP_NODELIST, SLURM_NTASKS, SLURM_PROCID,
    SLURM_LOCALID (srun); a TPU slice on GKE: TPU_PROCESS_ADDRESSES or TPU_WORKER_HOSTNAMES (times
    MEGASCALE_NUM_SLICES). Not detected: TPU VMs outside GKE and other Kubernetes jobs, whose process count jax reads
    from the metadata server or the Kubernetes API; give those JAX_NUM_PROCESSES (the JobSet launcher sets all
    three JAX_* variables).
    """
    if "OMPI_MCA_orte_hnp_uri" in environ:
        return Cluster("Open MPI", int(environ["OMPI_COMM_WORLD_SIZE"]))
    slurm = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID")
    if all(name in environ for name in slurm):
        return Cluster("Slurm", int(environ["SLURM_NTASKS"]))
    hosts = environ.get("TPU_PROCESS_ADDRESSES", environ.get("TPU_WORKER_HOSTNAMES"))
    if hosts is not None:
        return Cluster("TPU on GKE", len(hosts.split(",")) * int(environ.get("MEGASCALE_NUM_SLICES") or 1))
    return None


T = TypeVar("T")


def initialize(
    coordinator_address: str | None = None, num_processes: int | None = None, process_id: int | None = None
) -> bool:
    """Calls jax.distributed.initialize when more than one process is configured: by the arguments, else the
    JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID environment variables, else a cluster that jax
    detects by itself (`detect_cluster`: srun, mpirun, a TPU slice on GKE; logged). Returns whether it initialised.

    Setting only JAX_NUM_PROCESSES (or num_processes) > 1 leaves the rest to jax's detection (TPU VMs outside GKE).
    A plain machine, or a cluster job of one process, initialises nothing. On CPU the cross-process collectives go
    through gloo.
    """
    coordinator_address = coordinator_address or os.environ.get("JAX_COORDINATOR_ADDRESS") or None
    if num_processes is None and os.environ.get("JAX_NUM_PROCESSES"):
        num_processes = int(os.environ["JAX_NUM_PROCESSES"])
    if process_id is None and os.environ.get("JAX_PROCESS_ID"):
        process_id = int(os.environ["JAX_PROCESS_ID"])
    if num_processes is None:
        cluster = detect_cluster()
        if cluster is None or cluster.num_processes <= 1:
            return False
        log.info("%s detected: jax.distributed.initialize() over %d processes", cluster.name, cluster.num_processes)
    elif num_processes <= 1:
        return False
    if os.environ.get("JAX_PLATFORMS", "").startswith("cpu"):
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=coordinator_address, num_processes=num_processes, process_id=process_id
    )
    return True


def local_rows(sharding: NamedSharding, global_shape: tuple[int, ...]) -> slice:
    """The contiguous range of leading-axis rows held by this process's devices under `sharding`."""
    starts, stops = [], []
    for index in sharding.addressable_devices_indices_map(global_shape).values():
        rows = index[0]
        starts.append(rows.start or 0)
        stops.append(global_shape[0] if rows.stop is None else rows.stop)
    start, stop = min(starts), max(stops)
    return slice(start, stop)


def device_put_global(tree, shardings):
    """Host NumPy arrays of the GLOBAL batch (identical on every process) -> global jax.Arrays.

    Each process hands over only its own rows via jax.make_array_from_process_local_data, so the same
    code runs on one process and on many.
    """

    def put(x, sharding):
        x = np.asarray(x)
        return jax.make_array_from_process_local_data(sharding, x[local_rows(sharding, x.shape)], x.shape)

    return jax.tree.map(put, tree, shardings)


def broadcast_bytes(payload: bytes) -> bytes:
    """Process 0's `payload` on every process (the others' is ignored). The buffer is padded to a power of two, so
    payloads of many sizes share a few compiled broadcasts."""
    if jax.process_count() == 1:
        return payload
    size = int(multihost_utils.broadcast_one_to_all(np.int64(len(payload))))
    buffer = np.zeros(1 << max(size - 1, 0).bit_length(), np.uint8)
    if jax.process_index() == 0:
        buffer[:size] = np.frombuffer(payload, np.uint8)
    return multihost_utils.broadcast_one_to_all(buffer)[:size].tobytes()


def from_process_0(fn: Callable[[], T]) -> T:
    """`fn()` run on process 0 only, its result (picklable) returned on every process; what it raised (a
    KeyboardInterrupt too) is raised on every process, so that all of them leave the same way and meet in the same
    next collective (e.g. the checkpoint a stop saves). One process: `fn()`."""
    if jax.process_count() == 1:
        return fn()
    error: BaseException | None = None
    if jax.process_index() == 0:
        try:
            outcome = (True, fn())
        except BaseException as e:  # noqa: BLE001 - every process raises it after the broadcast
            error, outcome = e, (False, e)
        try:
            payload = pickle.dumps(outcome)
        except Exception:  # noqa: BLE001 - an exception that does not pickle: its type and message
            payload = pickle.dumps((False, RuntimeError(f"{type(error).__name__}: {error}")))
    else:
        payload = b""
    ok, value = pickle.loads(broadcast_bytes(payload))
    if error is not None:
        raise error
    if not ok:
        raise value
    return value


def agreed_stop(reason: str | None) -> str | None:
    """Whether any process asks to stop (e.g. one got SIGTERM): its reason (the lowest such process's) on every
    process, else None. One process: `reason`."""
    if jax.process_count() == 1:
        return reason
    encoded = np.zeros(256, np.uint8)
    if reason:
        raw = reason.encode()[:255]
        encoded[0], encoded[1 : 1 + len(raw)] = 1, np.frombuffer(raw, np.uint8)
    reasons = np.asarray(multihost_utils.process_allgather(encoded))
    asking = [r for r in reasons if r[0]]
    return bytes(asking[0][1:]).rstrip(b"\0").decode(errors="replace") if asking else None
