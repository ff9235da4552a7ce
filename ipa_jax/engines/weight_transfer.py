"""Weights over torch.distributed, SGLang's `/update_weights_from_distributed` contract (docs/sglang.md).

Both ends join one named process group the way SGLang's `init_custom_process_group` does: a TCP rendezvous whose
store is prefixed with the group name, and `_new_process_group_helper` on it. The trainer is rank 0 and hosts the
store; server i joins as `rank_offset + tp_rank`. The trainer then broadcasts every tensor of a bucket, in the
order of the bucket's `names`, while the servers' `/update_weights_from_distributed` calls are pending. `nccl` on
GPUs, `gloo` on CPU (the dev server and the CPU tests).

torch is an optional dependency (`pip install 'ipa_jax[weight-sync]'`), imported on first use.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import datetime
import gc
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import ml_dtypes
import numpy as np

BACKENDS = ("gloo", "nccl")
# What a sync may send, by the names SGLang's requests carry.
NUMPY_DTYPES = {
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "float16": np.dtype(np.float16),
    "float32": np.dtype(np.float32),
}
DTYPES = tuple(NUMPY_DTYPES)


def import_torch():
    try:
        import torch
        import torch.distributed  # noqa: F401
    except ImportError as e:
        raise ImportError(
            "weight sync over torch.distributed needs torch: pip install 'ipa_jax[weight-sync]' "
            "(on a CPU machine, torch's CPU build)"
        ) from e
    return torch


def default_backend() -> str:
    """nccl where torch sees a CUDA GPU, else gloo."""
    return "nccl" if import_torch().cuda.is_available() else "gloo"


def host_store(address: str, timeout_s: float):
    """Rank 0's rendezvous store, listening on a free port of `address` (its `.port`) before any rank joins."""
    torch = import_torch()
    return torch.distributed.TCPStore(
        address, 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=timeout_s)
    )


def init_custom_process_group(
    *,
    backend: str,
    world_size: int,
    rank: int,
    group_name: str,
    timeout_s: float,
    master_address: str = "",
    master_port: int = 0,
    store=None,
):
    """A process group of its own (not torch's default group), as SGLang's servers create theirs: a TCP rendezvous
    on master_address:master_port (or rank 0's `store`, see host_store), the store prefixed with group_name. Blocks
    until every rank joined; raises after timeout_s. Every collective on the group is bounded by timeout_s too."""
    import_torch()
    from torch.distributed import distributed_c10d as c10d

    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    timeout = datetime.timedelta(seconds=timeout_s)
    if store is None:
        store, rank, world_size = next(
            c10d.rendezvous(f"tcp://{master_address}:{master_port}", rank, world_size, timeout=timeout)
        )
    store.set_timeout(timeout)
    store = c10d.PrefixStore(group_name, store)
    group, _ = c10d._new_process_group_helper(
        world_size, rank, [], c10d.Backend(backend), store, group_name=group_name, timeout=timeout
    )
    c10d._world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


def destroy_process_group(group) -> None:
    """Leave `group`. Its connections close only once the group object is freed (abort() leaves them open), so
    peers blocked in a collective on it fail at once: the caller must hold no other reference to it."""
    torch = import_torch()
    torch.distributed.destroy_process_group(group)
    del group
    gc.collect()  # the group may sit in reference cycles (tracebacks of failed collectives)


def torch_dtype(name: str):
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {name!r}")
    return getattr(import_torch(), name)


def to_torch(array: Any, dtype: str):
    """A JAX or NumPy array cast to `dtype` -> torch tensor. A single-device JAX array is cast on its device and
    handed over through DLPack (no copy); a NumPy array through torch.from_numpy (no copy once cast)."""
    import jax  # here: rollout hosts import this module without the model's dependencies

    torch = import_torch()
    if isinstance(array, jax.Array):
        array = array.astype(NUMPY_DTYPES[dtype])
        if len(array.devices()) == 1:
            return torch.from_dlpack(array)
        array = np.asarray(jax.device_get(array))  # sharded over several devices: assembled on the host
    array = np.ascontiguousarray(np.asarray(array).astype(NUMPY_DTYPES[dtype], copy=False))
    if array.dtype == ml_dtypes.bfloat16:  # torch reads no NumPy bfloat16: the same bits as int16
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(array)


def to_numpy(tensor) -> np.ndarray:
    """torch tensor (any device) -> host NumPy array of the same dtype (bfloat16 as ml_dtypes.bfloat16)."""
    torch = import_torch()
    tensor = tensor.detach().cpu()
    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return tensor.numpy()


@dataclasses.dataclass(frozen=True)
class Bucket:
    """Tensors sent in one `/update_weights_from_distributed` call (HF names, in broadcast order)."""

    names: list[str]
    arrays: list[Any]  # JAX or NumPy, not yet cast
    dtype: str
    nbytes: int

    def request(self, group_name: str) -> dict[str, Any]:
        """The call's body, without flush_cache / weight_version."""
        return {
            "names": self.names,
            "dtypes": [self.dtype] * len(self.names),
            "shapes": [list(a.shape) for a in self.arrays],
            "group_name": group_name,
        }


def buckets(named_arrays: Iterable[tuple[str, Any]], bucket_bytes: int, dtype: str) -> Iterator[Bucket]:
    """(HF name, array) pairs -> buckets of at most bucket_bytes once cast to dtype (a larger tensor goes alone)."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    itemsize = NUMPY_DTYPES[dtype].itemsize
    names: list[str] = []
    arrays: list[Any] = []
    size = 0
    for name, array in named_arrays:
        nbytes = int(np.prod(array.shape)) * itemsize
        if names and size + nbytes > bucket_bytes:
            yield Bucket(names, arrays, dtype, size)
            names, arrays, size = [], [], 0
        names.append(name)
        arrays.append(array)
        size += nbytes
    if names:
        yield Bucket(names, arrays, dtype, size)


class WeightSender:
    """Rank 0 of a weight-update group: `store` (host_store) is where the other ranks join; `broadcast(bucket)` sends
    a bucket's tensors to every other rank. backend "nccl" sends from the current CUDA device, "gloo" from host
    memory."""

    def __init__(self, *, backend: str, store, world_size: int, group_name: str, timeout_s: float):
        self.backend, self.group_name = backend, group_name
        self.group = init_custom_process_group(
            backend=backend, store=store, world_size=world_size, rank=0, group_name=group_name, timeout_s=timeout_s
        )

    def broadcast(self, bucket: Bucket) -> None:
        """Raises RuntimeError when a rank fails. The error carries no traceback: the frames of the failed
        collective hold the group, and peers blocked in it fail only once it is freed (close)."""
        torch = import_torch()
        device = torch.device("cuda") if self.backend == "nccl" else torch.device("cpu")
        error = None
        try:
            for array in bucket.arrays:
                torch.distributed.broadcast(to_torch(array, bucket.dtype).to(device), src=0, group=self.group)
            if self.backend == "nccl":
                torch.cuda.synchronize()
        except RuntimeError as e:
            error = f"broadcast in group {self.group_name} failed: {e}"
        if error is not None:
            raise RuntimeError(error)

    def close(self) -> None:
        """Leaves the group (again: a no-op)."""
        group, self.group = self.group, None
        if group is not None:
            destroy_process_group(group)


def receive(group, names_dtypes_shapes: Iterable[tuple[str, str, list[int]]]) -> dict[str, Any]:
    """The receiving side of one bucket (a server rank): name -> host tensor, broadcast from rank 0 in order."""
    torch = import_torch()
    out = {}
    handles = []
    for name, dtype, shape in names_dtypes_shapes:
        out[name] = torch.empty(shape, dtype=torch_dtype(dtype))
        handles.append(torch.distributed.broadcast(out[name], src=0, group=group, async_op=True))
    for handle in handles:
        handle.wait()
    return out


def in_daemon_thread(fn: Callable[..., Any], *args: Any) -> asyncio.Future:
    """Run fn(*args) in a daemon thread, awaitable. Unlike asyncio.to_thread, a collective still blocked (until its
    group's timeout) never holds up the interpreter's exit."""
    future: concurrent.futures.Future = concurrent.futures.Future()

    def run() -> None:
        try:
            future.set_result(fn(*args))
        except BaseException as e:  # noqa: BLE001 - handed to the awaiting coroutine
            future.set_exception(e)

    threading.Thread(target=run, name=f"weight-transfer-{getattr(fn, '__name__', 'call')}", daemon=True).start()
    return asyncio.wrap_future(future)
