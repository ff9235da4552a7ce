"""Experiment configuration: the base ConfigDict, loading + dotted overrides, validation, typed dataclasses.

Flow: a config file's `get_config()` (a locked ml_collections.ConfigDict, built on `base_config()`) ->
command-line overrides (`--config.objective.gamma=0.9`) -> `validate(config)` (unknown keys with a
did-you-mean, out-of-range values, impossible combinations; every message names the key) ->
`to_typed(config)` -> `ExperimentConfig`, a tree of frozen dataclasses that the code below the
launcher receives (ObjectiveConfig, MeshConfig, OptimizerConfig, TrainConfig, ...).
"""

import contextlib
import dataclasses
import difflib
import importlib.util
import json
import math
import os
import sys
from ast import literal_eval
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ml_collections import ConfigDict, config_dict

from ipa_jax.models import MeshConfig
from ipa_jax.models.config import MOE_IMPLS, REMAT_POLICIES
from ipa_jax.objectives import ObjectiveConfig, flash_reinforce_config, ipa_config
from ipa_jax.rollout.resample import ResampleConfig
from ipa_jax.train.checkpoint import CheckpointConfig
from ipa_jax.train.learner import TrainConfig
from ipa_jax.train.metrics import LoggingConfig
from ipa_jax.train.optimizer import OptimizerConfig

_placeholder = config_dict.placeholder

# Objective fields that a preset fills; None (placeholder) = take the preset's value, anything else
# overrides it (is_clip_max: inf = never truncate, ObjectiveConfig's None).
# Names and meanings: ipa_jax.objectives.ObjectiveConfig.
OBJECTIVE_FIELDS = {
    "baseline": str,  # "none" | "batch_mean" | "group_mean"
    "credit": str,  # "chunk" | "token" | "trajectory"
    "gamma": float,
    "is_level": str,  # "none" | "token" | "chunk" | "sequence"
    "is_apply_to": str,  # "all" | "negatives"
    "is_clip_max": float,  # inf = no truncation
    "mismatch_level": str,  # "none" | "token" | "chunk"
    "mismatch_range": tuple,  # (low, high)
    "trust_region_level": str,  # "none" | "sequence" | "chunk"
    "trust_region_delta": float,
    "negative_token_fraction": float,
    "aggregation": str,  # "sample_mean" | "token_mean" | "chunk_mean" | "sequence_sum"
    "rl_weight": float,
    "il_weight": float,
}


def base_config() -> ConfigDict:
    """Every knob of ipa_jax with its default (locked)."""
    c = ConfigDict()

    # ---- policy model: an HF folder (Qwen3 / Qwen3-MoE) or, when `path` is empty, random init of `arch`.
    c.model = ConfigDict()
    c.model.path = ""
    c.model.tokenizer = ""  # tokenizer folder; "" = the model folder (or one built by the experiment)
    c.model.arch = ConfigDict(
        dict(  # HF config.json field names (Qwen3Config.from_hf_dict)
            vocab_size=512,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            rms_norm_eps=1e-6,
            rope_theta=1_000_000.0,
            tie_word_embeddings=False,
            max_position_embeddings=4096,
            num_experts=0,  # 0 = dense Qwen3; > 0 = Qwen3-MoE
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=(),
        )
    )
    c.model.dtype = "float32"  # compute dtype (weights are cast to it in the forward): float32 | bfloat16
    c.model.param_dtype = "float32"  # master weights and optimizer state: float32 | bfloat16
    c.model.remat = "none"  # none | full | dots | dots_no_batch (jax.checkpoint policy per decoder layer)
    c.model.moe_impl = "ragged"  # ragged (grouped lax.ragged_dot) | dense (reference)
    c.model.routing_replay = False  # use the rollout engine's routed experts in the learner's forward
    c.model.load_balancing_coef = 0.0  # weight of the Switch load-balancing loss (MoE)
    c.model.router_z_coef = 0.0  # weight of the router z-loss (MoE)
    c.model.logprob_block_size = 128  # sequence block of token_logprobs ([B, T, V] is never held)

    # ---- device mesh over ("data", "fsdp", "expert", "tensor"); -1 = the remaining devices.
    c.mesh = ConfigDict(dict(data=1, fsdp=-1, expert=1, tensor=1))

    # ---- objective: a preset plus per-field overrides (None = the preset's value).
    c.objective = ConfigDict()
    c.objective.preset = "ipa"  # ipa | flash_reinforce | custom (custom = ObjectiveConfig defaults)
    for name, typ in OBJECTIVE_FIELDS.items():
        c.objective[name] = _placeholder(typ)

    # ---- optimizer: AdamW, warmup + cosine (to min_lr_ratio * lr) or constant, clip by global norm. With an IL
    # warm start the schedule has two phases (warm start at il_lr, then RL at lr), each with its own warmup.
    c.optimizer = ConfigDict(
        dict(
            lr=1e-6,
            il_lr=0.0,  # learning rate of the IL warm start (train.il_warmup_steps); 0 = lr
            schedule="cosine",  # cosine | constant
            warmup_steps=0,  # per phase
            warmup_ratio=0.03,  # fraction of the phase's steps; used when warmup_steps == 0
            min_lr_ratio=0.1,
            b1=0.9,
            b2=0.999,
            eps=1e-8,
            weight_decay=0.1,  # applied to matrices only (not norms, not biases)
            clip_norm=1.0,  # 0 = no clipping
        )
    )

    # ---- rollout (online training): engines and sampling.
    c.rollout = ConfigDict(
        dict(
            engine="embedded",  # embedded | sglang
            sglang_urls=(),
            temperature=1.0,  # importance sampling needs the sampler's full support: keep 1.0 / 1.0 / -1
            top_p=1.0,
            top_k=-1,
            max_new_tokens=256,  # per turn
            max_turns=8,
            max_context=2048,
            concurrency=8,
            group_size=1,  # samples per task (> 1 for GRPO-style group baselines)
            weight_sync_every=1,  # learner steps between weight syncs to the engines
            source="auto",  # auto (resample when resample.mode != "none" or resample.il_fallback) | queue | resample
            eval_temperature=0.0,  # held-out evaluation: 0 = greedy
        )
    )

    # ---- trajectory queue between rollout and learner.
    c.queue = ConfigDict(dict(max_size=8, max_policy_lag=4, forced_lag=0))

    # ---- learner loop.
    c.train = ConfigDict(
        dict(
            steps=100,  # optimizer updates
            batch_size=8,  # trajectories per batch (global, over all processes)
            microbatches=1,  # gradient accumulation; gives the same update as the full batch
            epochs_per_batch=1,  # > 1 only for comparison runs (FlashREINFORCE uses one update per batch)
            minibatches=1,  # optimizer updates per epoch over one batch
            seed=0,
            name="run",
            run_dir="",  # "" = runs/<name>
            eval_every=0,  # RL steps between evaluations, from the warm start's end; 0 = only before and after
            eval_episodes=32,
            il_warmup_steps=0,  # first steps (at most) train the imitation term only
            # > 0: the warm start ends early once greedy decoding would reproduce this fraction of fresh expert
            # episodes (il_greedy_match, mean over il_warmup_window batches); RL keeps steps - il_warmup_steps steps
            il_warmup_target=0.0,
            il_warmup_window=10,
            data=(),  # offline Trajectory JSONL files (globs allowed); empty = online rollouts
            buckets=(64, 128, 256, 512, 1024, 2048, 4096),  # padded lengths (bounded recompilation)
        )
    )

    # ---- checkpoints (Orbax) under <run_dir>/checkpoints.
    c.checkpoint = ConfigDict(
        dict(
            every=100,  # learner steps; 0 = only at exit
            keep=3,
            async_save=True,  # `async` is a Python keyword
            resume=True,  # restore the latest complete checkpoint of the run folder if there is one
            export_hf=False,  # also write HF safetensors of the final policy to <run_dir>/hf
        )
    )

    # ---- metrics: metrics.jsonl + TensorBoard under the run folder.
    c.logging = ConfigDict(dict(every=1, tensorboard=True, entropy=True, peak_tflops=0.0))  # 0 = detect

    # ---- environment (built-in tasks, ipa_jax.envs.make_env(name, **kwargs)).
    c.env = ConfigDict()
    c.env.name = ""
    c.env.kwargs = ConfigDict()  # env-specific, e.g. num_hops, num_distractors

    # ---- chunk-level initialized resampling (ipa_jax.rollout.resample.ResampleConfig fields).
    c.resample = ConfigDict(dataclasses.asdict(ResampleConfig()))

    c.lock()
    return c


# ----------------------------------------------------------------------------------------------------------
# Objective presets (fields not named keep ObjectiveConfig's defaults). See DESIGN.md "The objective".

OBJECTIVE_PRESETS: dict[str, ObjectiveConfig] = {
    "ipa": ipa_config(),  # chunk credit 0.95, chunk mismatch mask [0, 5], TOPR negatives, no baseline, no IL
    "flash_reinforce": flash_reinforce_config(),  # batch baseline, token IS, sequence trust region 3e-3
    "custom": ObjectiveConfig(),  # ObjectiveConfig's defaults
}


# ----------------------------------------------------------------------------------------------------------
# Typed sections consumed by the model builder, the rollout engineers' code and the environments.

_DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class ModelConfig:
    path: str = ""  # HF folder; "" = random init from `arch`
    tokenizer: str = ""
    arch: Mapping[str, Any] = field(default_factory=dict)  # HF config.json fields
    dtype: str = "float32"
    param_dtype: str = "float32"
    remat: str = "none"
    moe_impl: str = "ragged"
    routing_replay: bool = False
    load_balancing_coef: float = 0.0
    router_z_coef: float = 0.0
    logprob_block_size: int = 128


@dataclass(frozen=True)
class RolloutConfig:
    engine: str = "embedded"
    sglang_urls: tuple[str, ...] = ()
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 256
    max_turns: int = 8
    max_context: int = 2048
    concurrency: int = 8
    group_size: int = 1
    weight_sync_every: int = 1
    source: str = "auto"
    eval_temperature: float = 0.0


ONLINE_SOURCES = ("auto", "queue", "resample")


@dataclass(frozen=True)
class QueueConfig:
    max_size: int = 8
    max_policy_lag: int = 4
    forced_lag: int = 0


@dataclass(frozen=True)
class EnvConfig:
    name: str = ""
    kwargs: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ExperimentConfig:
    model: ModelConfig
    mesh: MeshConfig
    objective: ObjectiveConfig
    optimizer: OptimizerConfig
    rollout: RolloutConfig
    queue: QueueConfig
    train: TrainConfig
    checkpoint: CheckpointConfig
    logging: LoggingConfig
    env: EnvConfig
    resample: ResampleConfig = field(default_factory=ResampleConfig)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-compatible dict (tuples become lists; inf stays a float)."""
        return json.loads(json.dumps(dataclasses.asdict(self)))


# ----------------------------------------------------------------------------------------------------------
# Loading and overrides.


def load_config(path: str, overrides: Iterable[str] | Mapping[str, Any] = ()) -> ConfigDict:
    """Loads a config file (`get_config()` of a .py file, or a resolved config.json written by a run) and
    applies dotted overrides ("objective.gamma=0.9" strings or a {dotted key: value} mapping)."""
    if path.endswith(".json"):
        with open(path, encoding="utf-8") as f:
            config = config_from_dict(json.load(f))
    else:
        config = _load_py_config(path)
    apply_overrides(config, overrides)
    return config


def _load_py_config(path: str) -> ConfigDict:
    path = os.path.abspath(path)
    # Config files import `configs.base`: make the folder that holds the `configs` package importable.
    root = os.path.dirname(os.path.dirname(path))
    if root not in sys.path:
        sys.path.insert(0, root)
    spec = importlib.util.spec_from_file_location(f"_ipa_config_{abs(hash(path))}", path)
    if spec is None or spec.loader is None:
        raise ValueError(f"cannot load config file {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not hasattr(module, "get_config"):
        raise ValueError(f"config file {path} defines no get_config()")
    return module.get_config()


def config_from_dict(values: Mapping[str, Any]) -> ConfigDict:
    """The base config with every value of a (possibly partial) nested dict applied; unknown keys fail."""
    config = base_config()
    overrides: dict[str, Any] = {}

    def flatten(prefix: str, tree: Mapping[str, Any]) -> None:
        for key, value in tree.items():
            name = f"{prefix}{key}"
            if name in ("env.kwargs", "model.arch") and isinstance(value, Mapping):
                overrides[name] = dict(value)
            elif isinstance(value, Mapping):
                flatten(name + ".", value)
            else:
                overrides[name] = tuple(value) if isinstance(value, list) else value

    flatten("", values)
    apply_overrides(config, overrides)
    return config


def apply_overrides(config: ConfigDict, overrides: Iterable[str] | Mapping[str, Any]) -> None:
    """Sets dotted keys in place. Strings are parsed by the field's type; unknown keys raise naming them."""
    items = overrides.items() if isinstance(overrides, Mapping) else (_split_override(o) for o in overrides)
    for dotted, value in items:
        *parents, leaf = dotted.split(".")
        node = config
        for i, part in enumerate(parents):
            _check_key(node, part, ".".join(parents[: i + 1]))
            node = node[part]
        if dotted in ("env.kwargs", "model.arch"):
            with config.unlocked():
                if dotted == "env.kwargs":
                    node[leaf] = ConfigDict(dict(value))
                else:  # arch keys are checked against the base by validate()
                    node[leaf].update(dict(value))
            continue
        free_form = parents[:2] == ["env", "kwargs"]  # env-specific keys may be new
        if not free_form:
            _check_key(node, leaf, dotted)
        if isinstance(value, str) and leaf in node and _field_type(node, leaf) is str:
            value = _unquote(value)
        elif isinstance(value, str) and leaf in node:
            value = _parse_value(value, _field_type(node, leaf), dotted)
        elif isinstance(value, str) and leaf not in node:  # a new env kwarg: a Python literal, else a string
            try:
                value = literal_eval(value)
            except (ValueError, SyntaxError):
                pass
        with config.unlocked() if free_form else contextlib.nullcontext():
            node[leaf] = value


def _split_override(text: str) -> tuple[str, str]:
    key, sep, value = text.lstrip("-").removeprefix("config.").partition("=")
    if not sep:
        raise ValueError(f"override {text!r} is not of the form key.sub=value")
    return key.strip(), value.strip()


def _unquote(text: str) -> str:
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        return text[1:-1]
    return text


def _check_key(node: ConfigDict, key: str, dotted: str) -> None:
    if key not in node:
        raise ValueError(_unknown_key_message(dotted, list(node.keys())))


def _unknown_key_message(dotted: str, known: list[str]) -> str:
    prefix, _, key = dotted.rpartition(".")
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.5)
    hint = f" (did you mean '{prefix + '.' if prefix else ''}{close[0]}'?)" if close else ""
    return f"unknown config key '{dotted}'{hint}; valid keys here: {sorted(known)}"


def _field_type(node: ConfigDict, key: str) -> type:
    return node.get_type(key)


def _parse_value(text: str, typ: type, dotted: str) -> Any:
    if text.lower() in ("none", "null"):
        return None
    if typ is bool:
        if text.lower() in ("true", "1", "yes"):
            return True
        if text.lower() in ("false", "0", "no"):
            return False
        raise ValueError(f"{dotted}: expected a boolean, got {text!r}")
    try:
        value = literal_eval(text) if text.lower() not in ("inf", "+inf", "-inf") else float(text)
    except (ValueError, SyntaxError) as e:
        raise ValueError(f"{dotted}: cannot parse {text!r} as {typ.__name__}") from e
    if typ is float and isinstance(value, int):
        value = float(value)
    if typ is tuple and isinstance(value, list):
        value = tuple(value)
    if not isinstance(value, typ):
        raise ValueError(f"{dotted}: expected {typ.__name__}, got {text!r}")
    return value


# ----------------------------------------------------------------------------------------------------------
# Validation.

_FREE_FORM = ("env.kwargs",)  # env-specific, checked by the environment's constructor


def validate(config: ConfigDict) -> None:
    """Raises ValueError naming the key for: unknown/misspelled keys (with a did-you-mean), values out of
    range, and impossible combinations. Returns None when the config is usable."""
    _check_schema(config, base_config(), "")
    to_typed(config)


def _check_schema(config: ConfigDict, schema: ConfigDict, prefix: str) -> None:
    for key in config.keys():
        dotted = f"{prefix}{key}"
        if key not in schema:
            raise ValueError(_unknown_key_message(dotted, list(schema.keys())))
        if dotted in _FREE_FORM:
            continue
        if isinstance(schema[key], ConfigDict):
            if not isinstance(config[key], ConfigDict):
                raise ValueError(f"config key '{dotted}' must be a section, got {config[key]!r}")
            _check_schema(config[key], schema[key], dotted + ".")


def _require(ok: bool, key: str, message: str) -> None:
    if not ok:
        raise ValueError(f"config key '{key}': {message}")


def _build(section: str, cls: type, **values: Any) -> Any:
    """cls(**values), its ValueError re-raised naming the config key (`ObjectiveConfig.gamma` -> `objective.gamma`)."""
    try:
        return cls(**values)
    except (ValueError, TypeError) as e:
        message = str(e).replace(f"{cls.__name__}.", f"{section}.")
        raise ValueError(f"config key {message}" if message.startswith(f"{section}.") else
                         f"config section '{section}': {message}") from e


def resolve_objective(section: ConfigDict) -> ObjectiveConfig:
    """The preset's fields, then every field set explicitly (not None) in the config section."""
    preset = section.preset
    _require(preset in OBJECTIVE_PRESETS, "objective.preset", f"must be one of {sorted(OBJECTIVE_PRESETS)}, "
             f"got {preset!r}")
    values = dataclasses.asdict(OBJECTIVE_PRESETS[preset])
    values.update({name: section[name] for name in OBJECTIVE_FIELDS if section[name] is not None})
    if values["is_clip_max"] == math.inf:  # the config's spelling of "never truncate" (None = the preset's)
        values["is_clip_max"] = None
    return _build("objective", ObjectiveConfig, **values)


def to_typed(config: ConfigDict) -> ExperimentConfig:
    """Builds the typed dataclasses (validating each section); run `validate` for the full check."""
    m, r, q, t = config.model, config.rollout, config.queue, config.train

    _require(m.dtype in _DTYPES, "model.dtype", f"must be one of {_DTYPES}, got {m.dtype!r}")
    _require(m.param_dtype in _DTYPES, "model.param_dtype", f"must be one of {_DTYPES}, got {m.param_dtype!r}")
    _require(m.remat in REMAT_POLICIES, "model.remat", f"must be one of {REMAT_POLICIES}, got {m.remat!r}")
    _require(m.moe_impl in MOE_IMPLS, "model.moe_impl", f"must be one of {MOE_IMPLS}, got {m.moe_impl!r}")
    _require(m.load_balancing_coef >= 0, "model.load_balancing_coef", "must be >= 0")
    _require(m.router_z_coef >= 0, "model.router_z_coef", "must be >= 0")
    _require(m.logprob_block_size >= 1, "model.logprob_block_size", "must be >= 1")
    arch = m.arch.to_dict()
    if not m.path:
        for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim"):
            _require(arch[key] >= 1, f"model.arch.{key}", f"must be >= 1, got {arch[key]}")
        _require(arch["num_key_value_heads"] >= 1 and arch["num_attention_heads"] % arch["num_key_value_heads"] == 0,
                 "model.arch.num_key_value_heads", "must divide model.arch.num_attention_heads")
        if arch["num_experts"] > 0:
            _require(1 <= arch["num_experts_per_tok"] <= arch["num_experts"], "model.arch.num_experts_per_tok",
                     f"must be in [1, num_experts={arch['num_experts']}]")
        _require(not (m.routing_replay and arch["num_experts"] == 0), "model.routing_replay",
                 "needs an MoE model (model.arch.num_experts > 0)")
    arch["mlp_only_layers"] = list(arch["mlp_only_layers"])
    model = ModelConfig(**{**m.to_dict(), "arch": arch})

    sizes = config.mesh.to_dict()
    for axis, size in sizes.items():
        _require(size == -1 or size >= 1, f"mesh.{axis}", f"must be >= 1 or -1 (the rest), got {size}")
    _require(sum(s == -1 for s in sizes.values()) <= 1, "mesh", "at most one axis may be -1")
    mesh = MeshConfig(**sizes)

    objective = resolve_objective(config.objective)
    optimizer = _build("optimizer", OptimizerConfig, **config.optimizer.to_dict())

    _require(r.engine in ("embedded", "sglang"), "rollout.engine", f"must be embedded|sglang, got {r.engine!r}")
    _require(not (r.engine == "sglang" and not r.sglang_urls), "rollout.sglang_urls",
             "rollout.engine='sglang' needs at least one server URL")
    _require(r.temperature > 0, "rollout.temperature", f"must be > 0, got {r.temperature}")
    _require(0 < r.top_p <= 1, "rollout.top_p", f"must be in (0, 1], got {r.top_p}")
    _require(r.top_k == -1 or r.top_k >= 1, "rollout.top_k", f"must be -1 (off) or >= 1, got {r.top_k}")
    for key in ("max_new_tokens", "max_turns", "concurrency", "group_size", "weight_sync_every"):
        _require(r[key] >= 1, f"rollout.{key}", f"must be >= 1, got {r[key]}")
    _require(r.max_context > r.max_new_tokens, "rollout.max_context", "must exceed rollout.max_new_tokens")
    _require(r.source in ONLINE_SOURCES, "rollout.source", f"must be one of {ONLINE_SOURCES}, got {r.source!r}")
    _require(r.eval_temperature >= 0, "rollout.eval_temperature",
             f"must be >= 0 (0 = greedy), got {r.eval_temperature}")
    rollout = RolloutConfig(**{**r.to_dict(), "sglang_urls": tuple(r.sglang_urls)})

    _require(q.max_size >= 1, "queue.max_size", f"must be >= 1, got {q.max_size}")
    _require(q.max_policy_lag >= 0, "queue.max_policy_lag", f"must be >= 0, got {q.max_policy_lag}")
    _require(0 <= q.forced_lag <= q.max_policy_lag, "queue.forced_lag",
             f"must be in [0, queue.max_policy_lag={q.max_policy_lag}], got {q.forced_lag}")
    queue = QueueConfig(**q.to_dict())

    if objective.baseline == "group_mean" and not t.data:
        _require(r.group_size > 1, "objective.baseline",
                 "'group_mean' needs several samples per task: set rollout.group_size > 1")
    train = _build("train", TrainConfig, **{**t.to_dict(), "data": tuple(t.data), "buckets": tuple(t.buckets)})
    _require(not (objective.rl_weight == 0 and objective.il_weight == 0), "objective.rl_weight",
             "rl_weight and il_weight are both 0: nothing to train")
    checkpoint = _build("checkpoint", CheckpointConfig, **config.checkpoint.to_dict())
    logging_ = _build("logging", LoggingConfig, **config.logging.to_dict())
    env = EnvConfig(name=config.env.name, kwargs=config.env.kwargs.to_dict())
    resample = _build("resample", ResampleConfig, **{**config.resample.to_dict(),
                                                     "anchors": tuple(config.resample.anchors)})
    return ExperimentConfig(model, mesh, objective, optimizer, rollout, queue, train, checkpoint, logging_, env,
                            resample)


def resolved_dict(config: ConfigDict) -> dict[str, Any]:
    """The config as written to the run folder: the objective's preset resolved into explicit fields."""
    values = json.loads(config.to_json())
    objective = dataclasses.asdict(resolve_objective(config.objective))
    if objective["is_clip_max"] is None:
        objective["is_clip_max"] = math.inf
    values["objective"] = json.loads(json.dumps({"preset": "custom", **{k: objective[k] for k in OBJECTIVE_FIELDS}}))
    return values
