"""From an ExperimentConfig to a ready learner: mesh, model, TrainState, train steps, checkpointer, Learner; and the
engines (`build_engine`, `build_online_engines`: the one place that knows engine kinds).

The run (`ipa_jax.pipeline.run`), the tests and the benchmarks build learners here and only choose the data
source and the hooks (weight sync, evaluation).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from ipa_jax import storage
from ipa_jax.engines import Engine, SGLangEngine
from ipa_jax.models import MeshConfig, Qwen3Config, Qwen3ForCausalLM, from_pretrained, init_model, make_mesh
from ipa_jax.models.sharding import DEFAULT_RULES, param_shardings
from ipa_jax.objectives import ObjectiveConfig
from ipa_jax.pipeline.config import ENGINES, REFERENCE_POLICIES, ConfigError, ExperimentConfig, ModelConfig
from ipa_jax.pipeline.run_folder import RunFolder
from ipa_jax.train import (
    Checkpointer,
    Learner,
    StepOptions,
    TrainConfig,
    TrainState,
    TrainStep,
    TrajectorySource,
    make_optimizer,
    make_schedule,
    place_state,
    train_flops_per_token,
)
from ipa_jax.train.metrics import peak_flops_per_device
from ipa_jax.train.step import data_parallel_size

log = logging.getLogger(__name__)


def build_mesh(mesh_config: MeshConfig) -> Mesh:
    return make_mesh(mesh_config)


def learner_side(model_cfg: ModelConfig) -> dict[str, Any]:
    """The Qwen3Config fields that are the learner's choice, not the checkpoint's (its adapters included)."""
    return dict(
        moe_impl=model_cfg.moe_impl,
        moe_block_rows=model_cfg.moe_block_rows,
        attention_impl=model_cfg.attention_impl,
        remat_policy=model_cfg.remat,
        scan_layers=model_cfg.scan_layers,
        lora=model_cfg.lora(),
    )


def model_config(model_cfg: ModelConfig) -> Qwen3Config:
    """Qwen3Config of an HF folder (model.path) or of the inline `model.arch` fields."""
    if model_cfg.path:
        return Qwen3Config.from_pretrained_dir(model_cfg.path, **learner_side(model_cfg))
    arch = dict(model_cfg.arch)
    arch["model_type"] = "qwen3_moe" if arch.get("num_experts", 0) > 0 else "qwen3"
    if arch["model_type"] == "qwen3":  # a dense config.json carries no MoE fields
        for key in (
            "num_experts",
            "num_experts_per_tok",
            "moe_intermediate_size",
            "norm_topk_prob",
            "decoder_sparse_step",
            "mlp_only_layers",
        ):
            arch.pop(key)
    return Qwen3Config.from_hf_dict(arch, **learner_side(model_cfg))


def build_model(model_cfg: ModelConfig, mesh: Mesh, seed: int):
    """The policy (master weights in model.param_dtype), each parameter placed in its sharding."""
    dtype = jnp.dtype(model_cfg.param_dtype)
    if model_cfg.path:
        return from_pretrained(model_cfg.path, dtype=dtype, mesh=mesh, seed=seed, **learner_side(model_cfg))
    return init_model(model_config(model_cfg), seed=seed, dtype=dtype, mesh=mesh)


def step_options(exp: ExperimentConfig, objective: ObjectiveConfig | None = None) -> StepOptions:
    m = exp.model
    return StepOptions(
        objective=objective or exp.objective,
        microbatches=exp.train.microbatches,
        logprob_block_size=m.logprob_block_size,
        logprob_keep_logits_mib=m.logprob_keep_logits_mib,
        entropy=exp.logging.entropy,
        routing_replay=m.routing_replay,
        load_balancing_coef=m.load_balancing_coef,
        router_z_coef=m.router_z_coef,
        compute_dtype=None if m.dtype == m.param_dtype else m.dtype,
        success_reward=exp.resample.success_reward,  # the one definition of a successful episode
        optimizer=exp.optimizer,
    )


def check_batch_divisibility(train_cfg: TrainConfig, mesh: Mesh) -> None:
    """Every microbatch is split evenly over the data-parallel devices."""
    dp = data_parallel_size(mesh)
    rows = train_cfg.batch_size // (train_cfg.minibatches * train_cfg.microbatches)
    if rows % dp:
        raise ConfigError(
            "train.batch_size",
            f"{train_cfg.batch_size} trajectories / (train.minibatches="
            f"{train_cfg.minibatches} * train.microbatches={train_cfg.microbatches}) = {rows} rows per "
            f"microbatch, not divisible by the data-parallel size {dp} of mesh {dict(mesh.shape)}",
        )


def build_state(exp: ExperimentConfig, mesh: Mesh) -> TrainState:
    """The initial TrainState; with a KL term or penalty, its reference policy (`reference_params`)."""
    model = build_model(exp.model, mesh, exp.train.seed)
    state = TrainState.create(
        model, make_optimizer(exp.optimizer), exp.train.seed, mesh, rl_start=exp.train.il_warmup_steps
    )
    state = place_state(state, mesh)
    if exp.objective.needs_reference:
        try:
            state = state.with_reference(reference_params(exp, state, mesh))
        except ValueError as e:  # an HF folder of another architecture
            raise ConfigError("model.reference", f"{exp.model.reference!r}: {e}") from e
    return state


def reference_params(exp: ExperimentConfig, state: TrainState, mesh: Mesh) -> nnx.State:
    """The reference policy's parameters (model.reference): the initial ones (also those of "rl_start" until the
    learner replaces them when RL begins) or an HF folder's, loaded like model.path in model.param_dtype; under LoRA
    (whose reference folder is model.path's) zero adapters, so that the reference is the base model."""
    if exp.model.reference in REFERENCE_POLICIES:
        return state.params
    if exp.model.lora_rank > 0:  # model.path's folder (ExperimentConfig checks it): the base, adapters at 0
        return jax.tree.map(jnp.zeros_like, state.params)
    path = exp.model.reference
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ConfigError("model.reference", f"{path!r} is not an HF model folder (no config.json)")
    model = from_pretrained(path, dtype=jnp.dtype(exp.model.param_dtype), mesh=mesh, **learner_side(exp.model))
    return nnx.split(model, nnx.Param, ...)[1]


def build_steps(exp: ExperimentConfig, state: TrainState, mesh: Mesh) -> tuple[TrainStep, TrainStep | None]:
    """(the main step, the IL-only warm-start step or None)."""
    check_batch_divisibility(exp.train, mesh)
    schedule = make_schedule(exp.optimizer, exp.train.steps, exp.train.il_warmup_steps)
    step = TrainStep(state, mesh, step_options(exp), schedule, DEFAULT_RULES)
    warmup = None
    if exp.train.il_warmup_steps > 0:
        warmup = TrainStep(state, mesh, step_options(exp, warm_start_objective(exp.objective)), schedule, DEFAULT_RULES)
    return step, warmup


def warm_start_objective(objective: ObjectiveConfig) -> ObjectiveConfig:
    """The IL warm start's objective: the imitation term alone, averaged over expert tokens, whatever the RL phase's
    objective says (no RL term, no KL term or penalty, whose reference may be the warm start's end: rl_start; no
    entropy bonus; il_aggregation is the RL phase's), so configs that differ in objective.* share a warm start."""
    return dataclasses.replace(
        objective,
        rl_weight=0.0,
        il_weight=1.0,
        il_aggregation="token_mean",
        entropy_weight=0.0,
        kl_weight=0.0,
        kl_penalty=0.0,
        kl_penalty_logprobs="behavior",
    )


def build_learner(
    exp: ExperimentConfig,
    source: TrajectorySource,
    *,
    run_dir: str | None = None,
    mesh: Mesh | None = None,
    state: TrainState | None = None,
    **hooks: Any,
) -> Learner:
    """A Learner over `source` writing into the run folder (default exp.run_dir): metrics and checkpoints.
    hooks: eval_fn, after_update, extra (see Learner). The learner restores the latest checkpoint when it runs
    (checkpoint.resume)."""
    folder = RunFolder(run_dir or exp.run_dir)
    mesh = mesh or build_mesh(exp.mesh)
    state = state or build_state(exp, mesh)
    step, warmup = build_steps(exp, state, mesh)
    arch = model_config(exp.model)
    peak = exp.logging.peak_tflops * 1e12 if exp.logging.peak_tflops > 0 else _detect_peak()
    return Learner(
        state=state,
        step_fn=step,
        warmup_step_fn=warmup,
        source=source,
        config=exp.train,
        metrics_log=folder.metrics_log(exp.logging, exp.to_dict()),
        logging_config=exp.logging,
        checkpointer=Checkpointer(folder.checkpoints_dir, exp.checkpoint),
        vocab_size=arch.vocab_size,
        flops_per_token=lambda seq_len: train_flops_per_token(arch, seq_len),
        peak_flops=peak,
        requires_routed_experts=exp.model.routing_replay,
        reference_at_rl_start=exp.model.reference == "rl_start",
        **hooks,
    )


def _detect_peak() -> float:
    try:
        return peak_flops_per_device(jax.devices()[0])
    except ValueError as e:
        log.warning("MFU is not logged: %s", e)
        return 0.0


# ---------------------------------------------------------------------------------------------- engines
def engine_mesh(exp: ExperimentConfig) -> Mesh:
    """The embedded engines' mesh: exp.mesh's axes over the first rollout.engine_devices of this process's local
    devices (all of them by default: on one process, the learner's mesh)."""
    devices = jax.local_devices()
    count = exp.rollout.engine_devices or len(devices)
    if count > len(devices):
        raise ConfigError("rollout.engine_devices", f"{count} > the {len(devices)} local devices of process 0")
    try:
        return make_mesh(exp.mesh, devices[:count])
    except ValueError as e:
        raise ConfigError(
            "rollout.engine_devices",
            f"the mesh config does not fit {count} devices ({e}); set rollout.engine_devices, or make one mesh axis -1",
        ) from None


def engine_model(exp: ExperimentConfig, mesh: Mesh) -> Qwen3ForCausalLM:
    """The policy's architecture in model.param_dtype on `mesh`, its weights zeros: the engines serve the learner's
    weights from the first push on (`Learner` syncs before its first step). No adapters: pushes carry merged weights."""
    dtype = jnp.dtype(exp.model.param_dtype)
    config = model_config(exp.model).replace(lora=None)
    abstract = nnx.eval_shape(lambda: Qwen3ForCausalLM(config, dtype=dtype, rngs=nnx.Rngs(0), mesh=mesh))
    graphdef, state = nnx.split(abstract)
    state = jax.tree.map(
        lambda var, sharding: var.replace(value=jnp.zeros(var.shape, var.dtype, device=sharding)),
        state,
        param_shardings(state, mesh),
        is_leaf=lambda x: isinstance(x, nnx.Variable),
    )
    return nnx.merge(graphdef, state)


def build_engine(
    exp: ExperimentConfig,
    kind: str,
    *,
    tokenizer: Any = None,
    model: Qwen3ForCausalLM | None = None,
    max_batch: int = 1,
    seed: int = 0,
    sglang_urls: tuple[str, ...] = (),
    weights_dir: str | None = None,
    **sglang_options: Any,
) -> Engine:
    """An engine with exp.rollout's settings. kind "embedded": on `model` (a batch of `max_batch` rows, sampling
    seed `seed`); "sglang": a client of `sglang_urls` (default rollout.sglang_urls) whose weight pushes go to
    `weights_dir`, with rollout's client options updated by `sglang_options`."""
    r = exp.rollout
    if kind == "embedded":
        from ipa_jax.engines import EmbeddedEngine

        if model is None:
            raise ValueError("build_engine: the embedded engine needs a model")
        return EmbeddedEngine(
            model,
            seed=seed,
            max_len=r.max_context,
            max_batch=max_batch,
            tokenizer=tokenizer,
            partial=r.partial,
            prefix_cache=r.prefix_cache,
        )
    if kind == "sglang":
        return SGLangEngine(
            list(sglang_urls or r.sglang_urls),
            partial=r.partial,
            weights_dir=weights_dir,
            keep_weight_folders=r.keep_weight_folders,
            weight_dtype=r.weight_dtype,
            **{**r.sglang_client_options(), **sglang_options},
        )
    raise ConfigError("rollout.engine", f"must be one of {ENGINES}, got {kind!r}")


def build_online_engines(exp: ExperimentConfig, tokenizer: Any, weights_dir: str) -> tuple[Engine, Engine | None]:
    """The online loop's engines (process 0's): (the control engine: evaluations and weight pushes, the rollout
    engine when it is a separate one, else None). Embedded: two engines on one zero-weight copy of the model
    (`engine_mesh`), sharing compiled functions: evaluations then run on the current weights while the rollouts' may
    lag (queue.forced_lag). SGLang: one client of the pool, used by the rollouts too: one state of the pool's health
    and weights."""
    r, t = exp.rollout, exp.train
    if r.engine != "embedded":
        if r.weight_sync == "disk" and not storage.is_local(weights_dir):
            raise ConfigError(
                "rollout.weight_sync",
                f"'disk' has the servers load weight folders from {weights_dir}, "
                "an object store they cannot read: use rollout.weight_sync='distributed', or a run "
                "folder on a filesystem the servers share",
            )
        return build_engine(exp, r.engine, weights_dir=weights_dir), None
    model = engine_model(exp, engine_mesh(exp))
    eval_rows = max(min(r.eval_concurrency, t.eval_episodes * t.eval_samples), 1)
    control = build_engine(exp, "embedded", tokenizer=tokenizer, max_batch=eval_rows, seed=t.seed + 1, model=model)
    rollout = build_engine(
        exp, "embedded", tokenizer=tokenizer, max_batch=max(r.concurrency, 1), seed=t.seed + r.seed_offset, model=model
    )
    return control, rollout
