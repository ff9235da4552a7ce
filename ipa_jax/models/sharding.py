"""Device mesh and logical-axis sharding rules.

Every parameter carries a tuple of logical axis names (metadata `logical_axes` on its nnx.Param); rules map each
logical name to a mesh axis (or a tuple of axes, or None = replicated). Mesh axes: ("data", "fsdp", "expert",
"tensor"). Experts shard over `expert`, attention heads and MLP width over `tensor`, the model width over `fsdp`;
the batch of activations over every data-like axis.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

MESH_AXES = ("data", "fsdp", "expert", "tensor")

Rules = tuple[tuple[str, Any], ...]

DEFAULT_RULES: Rules = (
    ("batch", ("data", "fsdp", "expert")),
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("q_heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("mlp", "tensor"),
    ("expert", "expert"),
    ("expert_mlp", "tensor"),
    ("router_experts", None),
    ("norm", None),
    ("layers", None),  # the stacked layer axis of scan_layers: every device holds its slice of every layer
)


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Mesh axis sizes; at most one of them may be -1 (= all remaining devices).

    data: data-parallel axis (the batch is split over it; parameters are replicated).
    fsdp: fully sharded data-parallel axis (the batch and the model width are split over it).
    expert: expert-parallel axis (MoE experts are split over it).
    tensor: tensor-parallel axis (attention heads and MLP width are split over it).
    """

    data: int = 1
    fsdp: int = -1
    expert: int = 1
    tensor: int = 1

    def __post_init__(self) -> None:
        sizes = [self.data, self.fsdp, self.expert, self.tensor]
        for name, s in zip(MESH_AXES, sizes):
            if isinstance(s, bool) or not isinstance(s, int) or s == 0 or s < -1:
                raise ValueError(f"MeshConfig.{name}: must be >= 1 or -1 (the remaining devices), got {s!r}")
        if sum(s == -1 for s in sizes) > 1:
            raise ValueError(f"MeshConfig: at most one axis may be -1, got {self}")

    def resolved(self, num_devices: int) -> tuple[int, int, int, int]:
        sizes = [self.data, self.fsdp, self.expert, self.tensor]
        known = math.prod(s for s in sizes if s != -1)
        if -1 in sizes:
            if num_devices % known:
                raise ValueError(f"MeshConfig {self}: {num_devices} devices not divisible by {known}")
            sizes[sizes.index(-1)] = num_devices // known
        if math.prod(sizes) != num_devices:
            raise ValueError(f"MeshConfig {self} needs {math.prod(sizes)} devices, have {num_devices}")
        return tuple(sizes)


def make_mesh(mesh_config: MeshConfig = MeshConfig(), devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A Mesh over axes ("data", "fsdp", "expert", "tensor") with sizes from `mesh_config` (-1 = the rest)."""
    devices = list(jax.devices() if devices is None else devices)
    shape = mesh_config.resolved(len(devices))
    # Auto axes: GSPMD propagates shardings from parameters and the constraints at layer boundaries.
    return jax.make_mesh(shape, MESH_AXES, axis_types=(jax.sharding.AxisType.Auto,) * len(MESH_AXES), devices=devices)


def logical_to_spec(logical_axes: Sequence[str | None], rules: Rules = DEFAULT_RULES) -> P:
    """PartitionSpec for a tuple of logical axis names; unknown names raise (a typo must not silently replicate)."""
    table = dict(rules)
    out = []
    for name in logical_axes:
        if name is None:
            out.append(None)
        elif name not in table:
            raise ValueError(f"logical axis {name!r} has no sharding rule (rules: {sorted(table)})")
        else:
            out.append(table[name])
    return P(*out)


def param_shardings(state: nnx.State, mesh: Mesh, rules: Rules = DEFAULT_RULES) -> nnx.State:
    """NamedSharding for every Variable of `state`, from its `logical_axes` metadata (none = replicated).

    Raises ValueError naming the parameter when a mesh split does not divide its dimension.
    """

    def one(path, v):
        axes = v.get_metadata().get("logical_axes") if isinstance(v, nnx.Variable) else None
        spec = P() if axes is None else logical_to_spec(axes, rules)
        for dim, (size, mesh_axes) in enumerate(zip(v.shape, spec)):
            names = (mesh_axes,) if isinstance(mesh_axes, str) else (mesh_axes or ())
            parts = math.prod(mesh.shape[a] for a in names)
            if size % parts:
                raise ValueError(
                    f"parameter {jax.tree_util.keystr(path)}: dim {dim} of size {size} cannot be split "
                    f"{parts} ways over mesh axes {names}"
                )
        return NamedSharding(mesh, spec)

    return jax.tree_util.tree_map_with_path(one, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def batch_sharding(mesh: Mesh, rules: Rules = DEFAULT_RULES, ndim: int = 2) -> NamedSharding:
    """Sharding of a [B, ...] activation/batch array: B over the rule for "batch", the rest replicated."""
    return NamedSharding(mesh, logical_to_spec(("batch",) + (None,) * (ndim - 1), rules))


def rule_mesh_axes(logical_axis: str, rules: Rules) -> tuple[str, ...]:
    """The mesh axes a logical axis is split over (e.g. "batch": activations' leading axis; "kv_heads")."""
    axes = logical_to_spec((logical_axis,), rules)[0]
    return (axes,) if isinstance(axes, str) else tuple(axes or ())


def batch_shards(mesh: Mesh | None, rules: Rules, batch: int) -> int:
    """How many ways the "batch" rule splits `batch` rows on `mesh`: 1 without a mesh or when the split does not
    divide the rows (`constrain` leaves such a batch unsplit)."""
    if mesh is None:
        return 1
    parts = math.prod(mesh.shape[a] for a in rule_mesh_axes("batch", rules))
    return parts if batch % parts == 0 else 1


def place(host: np.ndarray, sharding: NamedSharding | None) -> jax.Array:
    """Host array -> device array, directly in `sharding` (each device copies only its own slice)."""
    if sharding is None:
        return jnp.asarray(host)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def constrain(x: jax.Array, mesh: Mesh | None, logical_axes: Sequence[str | None], rules: Rules) -> jax.Array:
    """with_sharding_constraint by logical names; the identity when the model has no mesh.

    A dimension the mesh axes do not divide (e.g. a decode batch of 1 on a data-parallel mesh) is left
    unconstrained: the constraint is a layout hint and does not change values.
    """
    if mesh is None:
        return x
    spec = []
    for dim, axes in zip(x.shape, logical_to_spec(logical_axes, rules)):
        names = (axes,) if isinstance(axes, str) else (axes or ())
        spec.append(axes if dim % math.prod(mesh.shape[a] for a in names) == 0 else None)
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P(*spec)))
