"""Hugging Face checkpoints in and out: config.json + *.safetensors (single file or sharded with an index).

Safetensors are read through a memory map (header + raw little-endian bytes), so bfloat16 needs no torch and a
tensor is only paged in when its parameter is placed; each parameter goes straight into its NamedSharding with
`jax.make_array_from_callback` (every device copies just its slice). Name mapping (our path -> HF name):
`embed_tokens` -> model.embed_tokens.weight, `lm_head` -> lm_head.weight, `..._proj_bias` -> model.{..}_proj.bias,
any other path p -> model.{p}.weight (norm paths already end in `weight`); the layout metadata of each Param says
whether to transpose ("linear") or to stack per-expert matrices ("experts": mlp.experts.{e}.{gate,up,down}_proj.weight,
or transformers 5's fused mlp.experts.gate_up_proj [E, 2I, H] / mlp.experts.down_proj [E, H, I]).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import Mesh

from ipa_jax.models.config import Qwen3Config
from ipa_jax.models.lora import LoraParam
from ipa_jax.models.qwen3 import Qwen3ForCausalLM, initial_value, merge_lora
from ipa_jax.models.sharding import DEFAULT_RULES, Rules, param_shardings, place

_ST_DTYPES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": ml_dtypes.bfloat16,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U8": np.uint8,
    "BOOL": np.bool_,
}
_ST_NAMES = {np.dtype(v): k for k, v in _ST_DTYPES.items()}
INDEX_FILE = "model.safetensors.index.json"


class SafetensorsReader:
    """All tensors of a checkpoint folder by name: model.safetensors, or the files named by the index."""

    def __init__(self, path: str | os.PathLike):
        index = os.path.join(path, INDEX_FILE)
        if os.path.exists(index):
            with open(index, encoding="utf-8") as f:
                files = sorted(set(json.load(f)["weight_map"].values()))
        else:
            files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
        if not files:
            raise ValueError(f"no *.safetensors files in {path}")
        self._entries: dict[str, tuple[np.memmap, int, dict]] = {}
        for name in files:
            fname = os.path.join(path, name)
            with open(fname, "rb") as f:
                header_len = int.from_bytes(f.read(8), "little")
                header = json.loads(f.read(header_len))
            data = np.memmap(fname, dtype=np.uint8, mode="r")
            for key, meta in header.items():
                if key != "__metadata__":
                    self._entries[key] = (data, 8 + header_len, meta)

    def keys(self) -> list[str]:
        return list(self._entries)

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def get(self, key: str) -> np.ndarray:
        if key not in self._entries:
            raise ValueError(f"checkpoint has no tensor {key!r}")
        data, base, meta = self._entries[key]
        if meta["dtype"] not in _ST_DTYPES:
            raise ValueError(f"tensor {key!r} has unsupported safetensors dtype {meta['dtype']}")
        begin, end = meta["data_offsets"]
        return data[base + begin : base + end].view(_ST_DTYPES[meta["dtype"]]).reshape(meta["shape"])


def write_safetensors(fname: str, tensors: dict[str, np.ndarray]) -> None:
    """Writes one .safetensors file: 8-byte header size, JSON header (8-byte aligned), raw C-order bytes."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for key, arr in tensors.items():
        header[key] = {
            "dtype": _ST_NAMES[arr.dtype],
            "shape": list(arr.shape),
            "data_offsets": [offset, offset + arr.nbytes],
        }
        offset += arr.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(fname, "wb") as f:
        f.write(len(blob).to_bytes(8, "little"))
        f.write(blob)
        for arr in tensors.values():
            f.write(np.ascontiguousarray(arr).tobytes())


def hf_name(path: tuple) -> str:
    """HF tensor name of a parameter path, e.g. ('layers', 0, 'self_attn', 'q_proj') ->
    model.layers.0.self_attn.q_proj.weight."""
    if path == ("lm_head",):
        return "lm_head.weight"
    dotted = ".".join(str(p) for p in path)
    if dotted.endswith("_bias"):  # q_proj_bias -> q_proj.bias
        return f"model.{dotted[: -len('_bias')]}.bias"
    return f"model.{dotted}" + ("" if path[-1] == "weight" else ".weight")


def _is_stacked(var: nnx.Variable) -> bool:
    """Whether the parameter is stacked over the decoder layers (scan_layers: logical axis "layers" first)."""
    return var.get_metadata()["logical_axes"][:1] == ("layers",)


def _layer_path(stacked_path: tuple, layer: int) -> tuple:
    """('layers', 'self_attn', 'q_proj'), 3 -> ('layers', 3, 'self_attn', 'q_proj'): the unstacked parameter path."""
    return stacked_path[:1] + (layer,) + stacked_path[1:]


def _read_param(reader: SafetensorsReader, path: tuple, layout: str, used: set[str]) -> np.ndarray:
    """Host array of one parameter in our layout, assembled from its HF tensor(s)."""
    if layout != "experts":
        name = hf_name(path)
        used.add(name)
        arr = reader.get(name)
        return arr.T if layout == "linear" else arr
    base = "model." + ".".join(str(p) for p in path[:-1])  # model.layers.{i}.mlp.experts
    proj = path[-1]
    fused_key = f"{base}.gate_up_proj" if proj in ("gate_proj", "up_proj") else f"{base}.down_proj"
    if fused_key in reader:  # transformers 5 fused layout: [E, out, in]
        used.add(fused_key)
        arr = reader.get(fused_key)
        if proj != "down_proj":
            half = arr.shape[1] // 2
            arr = arr[:, :half] if proj == "gate_proj" else arr[:, half:]
        return np.swapaxes(arr, 1, 2)
    mats = []
    e = 0
    while f"{base}.{e}.{proj}.weight" in reader:
        used.add(f"{base}.{e}.{proj}.weight")
        mats.append(reader.get(f"{base}.{e}.{proj}.weight").T)
        e += 1
    if not mats:
        raise ValueError(f"checkpoint has neither {fused_key!r} nor {base}.0.{proj}.weight")
    return np.stack(mats)


def from_pretrained(
    path: str | os.PathLike,
    *,
    dtype=jnp.float32,
    mesh: Mesh | None = None,
    sharding_rules: Rules | None = None,
    seed: int = 0,
    **config_overrides,
) -> Qwen3ForCausalLM:
    """Loads a HF Qwen3 / Qwen3-MoE folder tensor by tensor, each placed directly in its sharding on `mesh`.

    config_overrides: learner-side Qwen3Config fields (moe_impl, attention_impl, remat_policy, scan_layers; with
    scan_layers each stacked parameter is read layer by layer) and lora (adapters drawn from `seed`, B zeros).
    Extra checkpoint tensors (other than a tied lm_head) and shape mismatches raise ValueError.
    """
    config = Qwen3Config.from_pretrained_dir(path, **config_overrides)
    adapter_rng = np.random.default_rng(seed)
    rules = DEFAULT_RULES if sharding_rules is None else tuple(sharding_rules)
    abstract = nnx.eval_shape(lambda: Qwen3ForCausalLM(config, dtype=dtype, rngs=nnx.Rngs(0), mesh=mesh, rules=rules))
    graphdef, state = nnx.split(abstract)
    shardings = None if mesh is None else param_shardings(state, mesh, rules)
    reader = SafetensorsReader(path)
    used: set[str] = set()

    def load(path_, var: nnx.Variable, sharding) -> nnx.Variable:
        if isinstance(var, LoraParam):  # adapters are no checkpoint tensors: initialised (B zeros)
            return var.replace(value=place(initial_value(var, adapter_rng, dtype), sharding))
        keys = tuple(getattr(p, "key", getattr(p, "idx", None)) for p in path_)
        layout = var.get_metadata()["hf_layout"]
        if _is_stacked(var):  # scan_layers: one HF tensor per layer
            host = np.stack([_read_param(reader, _layer_path(keys, i), layout, used) for i in range(var.shape[0])])
        else:
            host = _read_param(reader, keys, layout, used)
        if tuple(host.shape) != tuple(var.shape):
            raise ValueError(f"{hf_name(keys)}: checkpoint shape {host.shape} != model shape {var.shape}")
        return var.replace(value=place(np.asarray(host, dtype=jnp.dtype(dtype)), sharding))

    is_var = lambda x: isinstance(x, nnx.Variable)  # noqa: E731
    if shardings is None:
        state = jax.tree_util.tree_map_with_path(lambda p, v: load(p, v, None), state, is_leaf=is_var)
    else:
        state = jax.tree_util.tree_map_with_path(load, state, shardings, is_leaf=is_var)
    unused = set(reader.keys()) - used - ({"lm_head.weight"} if config.tie_word_embeddings else set())
    unused = {k for k in unused if not k.endswith("rotary_emb.inv_freq")}
    if unused:
        raise ValueError(f"checkpoint tensors not used by the model: {sorted(unused)[:10]} ({len(unused)} total)")
    return nnx.merge(graphdef, state)


def gather_to_process_0(value: jax.Array | np.ndarray, dtype=None) -> np.ndarray | None:
    """The whole of `value`, cast to `dtype` first (on its devices), as a host array on process 0; None on the other
    processes. Collective when `value` spans several processes: every process calls it, the others take part in the
    gather (each holds the tensor for the duration of the call) and keep nothing."""
    if dtype is not None:
        value = value.astype(jnp.dtype(dtype))
    if isinstance(value, np.ndarray) or value.is_fully_addressable:
        return np.asarray(jax.device_get(value))
    full = multihost_utils.process_allgather(value, tiled=True)
    return np.asarray(full) if jax.process_index() == 0 else None


def gather_model(model: Qwen3ForCausalLM, dtype=None, *, to_host: bool = False) -> Qwen3ForCausalLM | None:
    """`model` with every parameter addressable by process 0 (what `Engine.push_weights` takes), adapters merged into
    a plain model (`merge_lora`). One process: the model itself (engines cast what they take), or with `to_host` a
    copy in host arrays cast to `dtype` (None: as they are). Several: such a host copy on process 0 and None on the
    others; collective (every process calls it, `gather_to_process_0` tensor by tensor, a stacked one layer by layer,
    each cast on its devices before it travels)."""
    model = merge_lora(model)
    if jax.process_count() == 1 and not to_host:
        return model
    graphdef, state = nnx.split(model)
    state = jax.tree.map(
        lambda var: var.replace(value=_gather_param(var, dtype)), state, is_leaf=lambda x: isinstance(x, nnx.Variable)
    )
    return nnx.merge(graphdef, state) if jax.process_index() == 0 else None


def _gather_param(var: nnx.Variable, dtype) -> np.ndarray | None:
    """`gather_to_process_0` of a parameter; a stacked one (scan_layers) layer by layer, so that a process holds one
    layer of it at a time, not the whole stack (process 0 stacks them)."""
    value = var[...]
    if not _is_stacked(var) or isinstance(value, np.ndarray) or value.is_fully_addressable:
        return gather_to_process_0(value, dtype)
    layers = [gather_to_process_0(value[i], dtype) for i in range(value.shape[0])]
    return None if layers[0] is None else np.stack(layers)


def iter_hf_tensors(model: Qwen3ForCausalLM, dtype=None, *, on_host: bool = True) -> Iterator[tuple[str, Any]]:
    """(HF name, array in HF layout, optionally cast) for every parameter, one parameter at a time (adapters merged
    in: `merge_lora`); per-expert names for experts. on_host=False keeps a parameter that one process holds whole on
    its devices (cast and transposed there). Multi-host: collective (every process iterates it to the end,
    `gather_to_process_0` parameter by parameter); process 0 gets the tensors, the others none."""
    for path, var in nnx.to_flat_state(nnx.state(merge_lora(model), nnx.Param)):
        value = var[...]
        if not on_host and isinstance(value, jax.Array) and value.is_fully_addressable:
            arr = value if dtype is None else value.astype(jnp.dtype(dtype))
        else:
            arr = _gather_param(var, dtype)
            if arr is None:
                continue
        layout = var.get_metadata()["hf_layout"]
        if _is_stacked(var):
            for i in range(arr.shape[0]):
                yield from _hf_entries(_layer_path(tuple(path), i), arr[i], layout)
        else:
            yield from _hf_entries(tuple(path), arr, layout)


def hf_tensors(model: Qwen3ForCausalLM, dtype=None) -> dict[str, np.ndarray]:
    """HF name -> host array (HF layout, optionally cast) for every parameter; per-expert names for experts.
    Multi-host: collective (every process calls it); process 0 gets the tensors, the others an empty dict."""
    return dict(iter_hf_tensors(model, dtype))


def _hf_entries(path: tuple, arr: Any, layout: str) -> Iterator[tuple[str, Any]]:
    """(HF name, array in HF layout) of one unstacked parameter (NumPy or JAX); one entry per expert for experts."""
    contiguous = np.ascontiguousarray if isinstance(arr, np.ndarray) else (lambda a: a)
    if layout == "experts":
        base = "model." + ".".join(str(p) for p in path[:-1])
        for e in range(arr.shape[0]):
            yield f"{base}.{e}.{path[-1]}.weight", contiguous(arr[e].T)
    else:
        yield hf_name(path), contiguous(arr.T if layout == "linear" else arr)


class _TensorMap:
    """The reader interface of `_read_param` over named host arrays."""

    def __init__(self, tensors: Mapping[str, np.ndarray]):
        self._tensors = tensors

    def __contains__(self, key: str) -> bool:
        return key in self._tensors

    def get(self, key: str) -> np.ndarray:
        return self._tensors[key]


def _hf_names(path: tuple, var: nnx.Variable) -> list[str]:
    """The HF tensor names one parameter is assembled from (per layer when stacked, per expert for experts)."""
    layout = var.get_metadata()["hf_layout"]
    paths = [_layer_path(path, i) for i in range(var.shape[0])] if _is_stacked(var) else [path]
    if layout != "experts":
        return [hf_name(p) for p in paths]
    experts = var.shape[1] if _is_stacked(var) else var.shape[0]
    return [f"model.{'.'.join(str(x) for x in p[:-1])}.{e}.{p[-1]}.weight" for p in paths for e in range(experts)]


def merge_hf_tensors(state: nnx.State, tensors: Mapping[str, np.ndarray]) -> tuple[nnx.State, set[str]]:
    """A model state with every parameter whose HF tensors (per-expert names for experts) are all in `tensors`
    replaced by them, cast to the parameter's dtype and placed in its sharding; -> (new state, the names used).
    Parameters only partly given keep their values (their names are not used). Raises ValueError naming a tensor of
    the wrong shape, or one that is no parameter of the model."""
    reader = _TensorMap(tensors)
    used: set[str] = set()
    known: set[str] = set()

    def merge(path_, var):
        if not isinstance(var, nnx.Param):
            return var
        keys = tuple(getattr(p, "key", getattr(p, "idx", None)) for p in path_)
        names = _hf_names(keys, var)
        known.update(names)
        if not all(n in tensors for n in names):
            return var
        layout = var.get_metadata()["hf_layout"]
        if _is_stacked(var):
            host = np.stack([_read_param(reader, _layer_path(keys, i), layout, used) for i in range(var.shape[0])])
        else:
            host = _read_param(reader, keys, layout, used)
        if tuple(host.shape) != tuple(var.shape):
            raise ValueError(f"{hf_name(keys)}: tensor shape {host.shape} (in our layout) != model shape {var.shape}")
        old = var[...]
        return var.replace(value=place(np.asarray(host, dtype=old.dtype), getattr(old, "sharding", None)))

    is_var = lambda x: isinstance(x, nnx.Variable)  # noqa: E731
    state = jax.tree_util.tree_map_with_path(merge, state, is_leaf=is_var)
    unknown = set(tensors) - known
    if unknown:
        raise ValueError(f"not tensors of the model: {sorted(unknown)[:5]} ({len(unknown)} total)")
    return state, used


def save_pretrained(
    model: Qwen3ForCausalLM, path: str | os.PathLike, *, dtype=None, max_shard_bytes: int = 5 * 1024**3
) -> None:
    """Writes config.json and safetensors (sharded + model.safetensors.index.json above max_shard_bytes) that
    transformers' AutoModelForCausalLM.from_pretrained (and SGLang) load. dtype: cast on the host (default: the
    parameters' own dtype). Multi-host: call on every process; process 0 writes."""
    tensors = hf_tensors(model, dtype)  # collective on multi-host: every process calls save_pretrained
    if jax.process_index() != 0:
        return
    os.makedirs(path, exist_ok=True)
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for key in sorted(tensors):
        if shards[-1] and size + tensors[key].nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][key] = tensors[key]
        size += tensors[key].nbytes
    for stale in os.listdir(path):  # an older checkpoint's shards would be picked up by readers
        if stale.endswith(".safetensors") or stale == INDEX_FILE:
            os.remove(os.path.join(path, stale))
    if len(shards) == 1:
        write_safetensors(os.path.join(path, "model.safetensors"), shards[0])
    else:
        weight_map = {}
        for i, shard in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            write_safetensors(os.path.join(path, fname), shard)
            weight_map.update({k: fname for k in shard})
        with open(os.path.join(path, INDEX_FILE), "w", encoding="utf-8") as f:
            json.dump(
                {"metadata": {"total_size": sum(a.nbytes for a in tensors.values())}, "weight_map": weight_map},
                f,
                indent=2,
            )
    config = model.config.to_hf_dict()
    saved_dtype = jnp.dtype(dtype or model.dtype)
    config["torch_dtype"] = config["dtype"] = saved_dtype.name  # old and new transformers key
    with open(os.path.join(path, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
