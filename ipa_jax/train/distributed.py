"""Multi-host: jax.distributed initialisation and feeding each process's slice of a global batch."""

import os

import jax
import numpy as np
from jax.sharding import NamedSharding


def initialize(
    coordinator_address: str | None = None, num_processes: int | None = None, process_id: int | None = None
) -> bool:
    """Calls jax.distributed.initialize when more than one process is configured (arguments, else the
    JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID environment variables).

    Returns whether it initialised. On TPU pods and SLURM/Open MPI clusters jax detects all three by itself:
    set JAX_NUM_PROCESSES (or pass num_processes) to any value > 1 and leave the rest unset.
    On CPU the cross-process collectives go through gloo.
    """
    coordinator_address = coordinator_address or os.environ.get("JAX_COORDINATOR_ADDRESS") or None
    if num_processes is None and os.environ.get("JAX_NUM_PROCESSES"):
        num_processes = int(os.environ["JAX_NUM_PROCESSES"])
    if process_id is None and os.environ.get("JAX_PROCESS_ID"):
        process_id = int(os.environ["JAX_PROCESS_ID"])
    if num_processes is None or num_processes <= 1:
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
