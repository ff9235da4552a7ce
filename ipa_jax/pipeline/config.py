"""The experiment config: one typed `ExperimentConfig`, and the ml_collections ConfigDict built from it.

Every default lives in exactly one place, the section dataclasses (ModelConfig, RolloutConfig, QueueConfig, EnvConfig
here; ObjectiveConfig, OptimizerConfig, TrainConfig, CheckpointConfig, LoggingConfig, MeshConfig, ResampleConfig in
their layers), each checking its own values. `base_config()` builds the locked ConfigDict from them, config files
(`configs/*.py`, `get_config()`) start from it, command-line overrides (`--config.objective.gamma=0.9`) are applied
to it, and `validate(config)` turns it into the `ExperimentConfig` the rest of the code receives, once. Every error
is a `ConfigError` naming the dotted key.

The objective section is a preset plus per-field overrides: a field left at None takes the preset's value. The run
folder's config.json holds the resolved config (`ExperimentConfig.to_dict()`: preset "custom" with every field
explicit), which loads back to the same `ExperimentConfig`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import glob
import importlib.util
import inspect
import json
import math
import os
import re
import sys
from ast import literal_eval
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ml_collections import ConfigDict, config_dict

from ipa_jax.engines.base import PARTIAL_MODES
from ipa_jax.engines.sglang import WEIGHT_SYNCS
from ipa_jax.envs import TASK_BLOCK, Env, TaskSpaceTooSmall, list_envs, make_env
from ipa_jax.models import MeshConfig
from ipa_jax.models.config import ATTENTION_IMPLS, MOE_IMPLS, REMAT_POLICIES
from ipa_jax.models.lora import TARGETS as LORA_TARGETS
from ipa_jax.models.lora import LoraConfig
from ipa_jax.objectives import PRESETS, ObjectiveConfig, ipa_config
from ipa_jax.rollout.resample import ResampleConfig
from ipa_jax.train.checkpoint import CheckpointConfig
from ipa_jax.train.learner import TrainConfig
from ipa_jax.train.metrics import LoggingConfig
from ipa_jax.train.optimizer import OptimizerConfig


class ConfigError(ValueError):
    """A config problem: `key` is the dotted config key, the message says what is wrong and how to fix it."""

    def __init__(self, key: str, message: str):
        self.key = key
        super().__init__(f"config key '{key}': {message}" if key else message)


def _require(ok: bool, key: str, message: str) -> None:
    if not ok:
        raise ConfigError(key, message)


# ---------------------------------------------------------------------------------------------- sections
DTYPES = ("float32", "bfloat16", "float16")
REFERENCE_POLICIES = ("initial", "rl_start")
ENGINES = ("embedded", "sglang")
ONLINE_SOURCES = ("auto", "queue", "resample", "expert")
SCHEDULES = ("async", "lockstep")

# The tiny model a config without model.path initialises (HF config.json field names, Qwen3Config.from_hf_dict).
DEFAULT_ARCH: dict[str, Any] = dict(
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
    num_experts=0,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    norm_topk_prob=True,
    decoder_sparse_step=1,
    mlp_only_layers=(),
)


@dataclass(frozen=True)
class ModelConfig:
    """The policy: a Hugging Face folder (Qwen3 / Qwen3-MoE) or, without one, a random init of `arch`.

    path: HF model folder (config.json + safetensors); "" = random init from arch.
    tokenizer: tokenizer folder; "" = the model folder's, or a small one built for the run.
    arch: HF config.json fields of the random-init model (num_experts > 0 makes it a Qwen3-MoE).
    dtype: compute dtype (weights are cast to it in the forward): float32 or bfloat16.
    param_dtype: dtype of the master weights and the optimizer state.
    remat: rematerialisation per decoder layer: none, full, dots, dots_no_batch or matmuls (keeps the outputs of
      the unbatched matmuls and of the MoE's grouped matmuls, recomputes the rest: attention, norms, activations).
    moe_impl: MoE dispatch: auto (megablox on TPU, tokamax on GPU when installed, else blocked on GPU and CPU, on
      CPU dense for few-token calls),
      blocked (sorted tokens, each expert's run in blocks of rows: every expert's first block in one batched
      matmul, a loop over the further blocks), ragged (grouped lax.ragged_dot), megablox (Pallas TPU grouped
      matmul), tokamax (the tokamax package's ragged_dot: Pallas Mosaic GPU / Triton kernels, grouped forward and
      backward; needs `pip install tokamax`) or dense (the reference).
    moe_block_rows: rows per block of the blocked MoE path; 0 = automatic (a quarter more than the mean rows per
      expert, to a multiple of 8 in [8, 256]: the fastest on CPU). Larger blocks mean fewer loop iterations.
    attention_impl: attention: auto (cudnn on NVIDIA GPUs in bf16/fp16, splash on TPU, blocked elsewhere), blocked
      (causal query blocks), xla (jax.nn.dot_product_attention per block), cudnn, splash (Pallas TPU kernel) or
      reference (the einsum reference).
    scan_layers: decoder layers stacked and run under nnx.scan (compile time independent of depth; layers of one
      kind only).
    routing_replay: use the experts the rollout engine chose in the learner's forward (MoE).
    load_balancing_coef: weight of the Switch load-balancing loss (MoE).
    router_z_coef: weight of the router z-loss (MoE).
    logprob_block_size: sequence block of the token log-probs ([B, T, V] logits are never held at once).
    logprob_keep_logits_mib: the learner's forward keeps its float32 logits for the backward pass instead of
      recomputing them when they take at most this many MiB per microbatch ([b, T, V] x 4 bytes; 0 = always
      recompute, one block at a time). Saves one of the LM head's four matmuls.
    lora_rank: LoRA adapters of this rank on the projections of lora_targets; only they are trained (and in the
      optimizer state and checkpoints), the base weights stay frozen; exports and weight syncs carry the merged
      weights. 0 = full fine-tuning.
    lora_alpha: the adapters' update is scaled by lora_alpha / lora_rank.
    lora_targets: projections with adapters, among q_proj, k_proj, v_proj, o_proj (attention) and gate_proj,
      up_proj, down_proj (the dense MLP's; the experts' too with lora_experts).
    lora_experts: adapters on the MoE experts' gate/up/down projections of lora_targets (one per expert; the
      router is never adapted).
    reference: the frozen reference policy of objective.kl_weight / objective.kl_penalty (unused without them):
      initial (the weights at step 0: model.path's or the random init, before the IL warm start), rl_start (the
      weights when RL begins, after the warm start) or an HF folder of the same architecture; with LoRA
      (lora_rank > 0) that folder must be model.path's, the base model under the adapters. Saved in checkpoints.
    """

    path: str = ""
    tokenizer: str = ""
    arch: Mapping[str, Any] = field(default_factory=lambda: dict(DEFAULT_ARCH))
    dtype: str = "float32"
    param_dtype: str = "float32"
    remat: str = "none"
    moe_impl: str = "auto"
    moe_block_rows: int = 0
    attention_impl: str = "auto"
    scan_layers: bool = False
    routing_replay: bool = False
    load_balancing_coef: float = 0.0
    router_z_coef: float = 0.0
    logprob_block_size: int = 128
    logprob_keep_logits_mib: int = 256
    lora_rank: int = 0
    lora_alpha: float = 16.0
    lora_targets: tuple[str, ...] = LORA_TARGETS
    lora_experts: bool = False
    reference: str = "initial"

    def __post_init__(self) -> None:
        _require(self.dtype in DTYPES, "model.dtype", f"must be one of {DTYPES}, got {self.dtype!r}")
        _require(self.param_dtype in DTYPES, "model.param_dtype", f"must be one of {DTYPES}, got {self.param_dtype!r}")
        _require(self.remat in REMAT_POLICIES, "model.remat", f"must be one of {REMAT_POLICIES}, got {self.remat!r}")
        _require(self.moe_impl in MOE_IMPLS, "model.moe_impl", f"must be one of {MOE_IMPLS}, got {self.moe_impl!r}")
        _require(self.moe_block_rows >= 0, "model.moe_block_rows", "must be >= 0 (0 = automatic)")
        _require(
            self.attention_impl in ATTENTION_IMPLS,
            "model.attention_impl",
            f"must be one of {ATTENTION_IMPLS}, got {self.attention_impl!r}",
        )
        _require(self.load_balancing_coef >= 0, "model.load_balancing_coef", "must be >= 0")
        _require(self.router_z_coef >= 0, "model.router_z_coef", "must be >= 0")
        _require(self.logprob_block_size >= 1, "model.logprob_block_size", "must be >= 1")
        _require(self.logprob_keep_logits_mib >= 0, "model.logprob_keep_logits_mib", "must be >= 0 (0 = recompute)")
        _require(self.lora_rank >= 0, "model.lora_rank", f"must be >= 0 (0 = no adapters), got {self.lora_rank}")
        _require(
            self.lora_rank > 0 or not self.lora_experts,
            "model.lora_experts",
            "adapters on the experts need model.lora_rank > 0",
        )
        try:  # LoraConfig's checks of alpha and targets, also while the adapters are off
            LoraConfig(max(self.lora_rank, 1), self.lora_alpha, tuple(self.lora_targets), self.lora_experts)
        except ValueError as e:
            field_name, message = re.match(r"LoraConfig\.(\w+): (.*)", str(e), re.S).groups()
            raise ConfigError(f"model.lora_{field_name}", message) from None
        _require(
            # a path is checked where it is loaded (the config may be written on another machine)
            self.reference in REFERENCE_POLICIES or "/" in self.reference or os.path.isdir(self.reference),
            "model.reference",
            f"must be one of {REFERENCE_POLICIES} or the path of an HF model folder, got {self.reference!r}",
        )
        unknown = sorted(set(self.arch) - set(DEFAULT_ARCH))
        _require(
            not unknown,
            f"model.arch.{unknown[0] if unknown else ''}",
            f"unknown architecture field; known: {sorted(DEFAULT_ARCH)}",
        )
        arch = {**DEFAULT_ARCH, **self.arch, "mlp_only_layers": list(self.arch.get("mlp_only_layers", ()))}
        object.__setattr__(self, "arch", arch)
        if self.path:  # the folder's config.json describes the model
            return
        for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim"):
            _require(arch[key] >= 1, f"model.arch.{key}", f"must be >= 1, got {arch[key]}")
        _require(
            arch["num_key_value_heads"] >= 1 and arch["num_attention_heads"] % arch["num_key_value_heads"] == 0,
            "model.arch.num_key_value_heads",
            "must divide model.arch.num_attention_heads",
        )
        if arch["num_experts"] > 0:
            _require(
                1 <= arch["num_experts_per_tok"] <= arch["num_experts"],
                "model.arch.num_experts_per_tok",
                f"must be in [1, num_experts={arch['num_experts']}]",
            )
        _require(
            not (self.routing_replay and arch["num_experts"] == 0),
            "model.routing_replay",
            "needs an MoE model (model.arch.num_experts > 0)",
        )
        _require(
            not (self.lora_experts and arch["num_experts"] == 0),
            "model.lora_experts",
            "needs an MoE model (model.arch.num_experts > 0)",
        )

    def lora(self) -> LoraConfig | None:
        """The adapters of the learner's model; None for full fine-tuning."""
        if self.lora_rank == 0:
            return None
        return LoraConfig(self.lora_rank, self.lora_alpha, tuple(self.lora_targets), self.lora_experts)

    @property
    def vocab_size(self) -> int | None:
        """The random-init model's vocabulary size; None for an HF folder (its config.json has it)."""
        return None if self.path else int(self.arch["vocab_size"])


@dataclass(frozen=True)
class RolloutConfig:
    """Online rollouts: engines, sampling and episode budgets.

    engine: embedded (the in-process JAX engine, the default on one machine) or sglang (SGLang servers over HTTP).
    sglang_urls: SGLang server URLs, e.g. ("http://host:30000",); needed when engine is sglang.
    temperature: sampling temperature (importance sampling needs the sampler's full support: keep 1).
    top_p: nucleus sampling threshold (keep 1 for exact importance ratios).
    top_k: top-k sampling; -1 = off (keep -1 for exact importance ratios).
    max_new_tokens: generated tokens per assistant turn.
    max_turns: assistant turns per episode, the final answer included.
    max_context: tokens of a whole episode (prompt, turns and tool observations).
    concurrency: episodes generated at once (schedule async; lockstep plays a whole batch at once, at most this many
      engine rows).
    schedule: async (a rollout worker keeps `concurrency` episodes in flight and the learner takes what the queue
      admits within queue.max_policy_lag: fast, but what it trains on depends on thread timing and the machine's load)
      or lockstep (the batch of learner step t is generated by exactly the weights of step t - queue.max_policy_lag
      (those of RL's first step for the first batches), its episodes advancing turn by turn with sampling seeds of
      (train.seed, seed_offset, step, episode): the same command gives the same run whatever else the machine does;
      also the resampling rounds and the held-out evaluations; docs/off_policy.md).
    eval_concurrency: the engine rows of held-out evaluations (their episodes are all started at once and queue for
      rows): ~32 is fastest on a CPU, where a wider batch costs more per token than it saves.
    group_size: samples per task (> 1 for GRPO-style group baselines).
    weight_sync_every: learner steps between weight syncs to the engines.
    source: auto (resample when resample.mode is not none or resample.il_fallback; expert when objective.rl_weight
      is 0; else queue), queue, resample, or expert (after the warm start too, every batch is fresh scripted-expert
      episodes: imitation only, e.g. the imitation control of an ablation).
    eval_temperature: sampling temperature of held-out evaluations; 0 = greedy.
    enable_thinking: Qwen3 thinking mode, passed to the chat template (the hybrid template's switch; a thinking-only
      template ignores it): the policy reasons in <think>...</think> before each turn's content.
    request_timeout_s: sglang: seconds one /generate call (one turn) may take before it is retried on another server;
      bounds what a hung server costs (raise it for turns that legitimately take longer).
    control_timeout_s: sglang: seconds one control call may take (pause, update_weights_from_disk, continue, probe);
      a server that exceeds it is marked down and skipped.
    max_attempts: sglang: attempts of one /generate call (on different servers) before its episode fails.
    probe_interval_s: sglang: seconds between probes of a server marked down.
    min_sync_servers: sglang: a weight sync succeeds once this many servers serve the new version.
    outage_budget_s: sglang: how long requests and weight syncs wait for enough servers to come back before the run
      stops (with a checkpoint).
    api_key_env: environment variable holding the servers' API key (SGLang's --api-key), sent as a bearer token; unset
      or empty = no key. The key itself stays out of the config and the run folder.
    admin_api_key_env: the same for SGLang's --admin-api-key, sent instead of the API key on the routes of SGLang's
      admin level (pause, continue, abort, weight updates), which take only that key when the servers have one.
    keep_weight_folders: sglang: the newest weights/v* folders kept in the run folder (older ones are deleted).
    weight_dtype: sglang: the dtype of the weights a sync sends the servers (bfloat16: what they serve, half the
      bytes of float32; float32 for servers that run in it).
    weight_sync: sglang: how a sync reaches the servers: disk (an HF folder under the run folder's weights/ that they
      load: a filesystem they share with the learner) or distributed (SGLang's /update_weights_from_distributed: the
      tensors broadcast over a torch.distributed group, nccl on GPUs, gloo otherwise; needs torch:
      `pip install -e '.[weight-sync]'`; docs/sglang.md).
    engine_devices: embedded: how many of process 0's local devices hold the engines' copy of the weights and run
      their batches (the mesh config's axes over them, -1 the rest); 0 = all of them (on one process: the learner's
      own mesh).
    partial: what a weight update does to the generation requests in flight (docs/off_policy.md): finish (they end on
      the weights they started with; the update waits for them) or abort_resume (they are interrupted and continue
      from their tokens so far on the new weights; each chunk records the newest version that sampled it).
    prefix_cache: embedded engine: a turn of a multi-turn episode prefills only the tokens past the longest prefix of
      its context that a batch row's KV cache holds from earlier requests under the same weights (its previous turn;
      SGLang's radix cache does the same on a server). Off: every turn prefills its whole context.
    seed_offset: the rollouts' seed beside train.seed: embedded, the rollout engine samples with seed train.seed +
      seed_offset (0: train.seed); lockstep, every episode's seed derives from it (SGLang servers too, as
      sampling_seed). An A/A control reruns an arm from the same warm start and training seed with other rollouts.
    expert_successes_only: the expert source after the warm start imitates only the demonstrations that succeed
      (filtered imitation: with env.expert_error > 0 the mistaken ones are left out; the warm start is unchanged).
    """

    engine: str = "embedded"
    sglang_urls: tuple[str, ...] = ()
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 256
    max_turns: int = 8
    max_context: int = 2048
    concurrency: int = 8
    schedule: str = "async"
    eval_concurrency: int = 32
    group_size: int = 1
    weight_sync_every: int = 1
    source: str = "auto"
    eval_temperature: float = 0.0
    enable_thinking: bool = True
    request_timeout_s: float = 300.0
    control_timeout_s: float = 120.0
    max_attempts: int = 5
    probe_interval_s: float = 5.0
    min_sync_servers: int = 1
    outage_budget_s: float = 600.0
    api_key_env: str = "SGLANG_API_KEY"
    admin_api_key_env: str = "SGLANG_ADMIN_API_KEY"
    keep_weight_folders: int = 2
    weight_dtype: str = "bfloat16"
    weight_sync: str = "disk"
    engine_devices: int = 0
    partial: str = "finish"
    prefix_cache: bool = True
    seed_offset: int = 0
    expert_successes_only: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "sglang_urls", tuple(self.sglang_urls))
        _require(
            isinstance(self.seed_offset, int) and not isinstance(self.seed_offset, bool) and self.seed_offset >= 0,
            "rollout.seed_offset",
            f"must be an integer >= 0, got {self.seed_offset!r}",
        )
        _require(
            self.seed_offset == 0 or self.engine == "embedded" or self.schedule == "lockstep",
            "rollout.seed_offset",
            "SGLang servers sample with their own seeds unless rollout.schedule = 'lockstep' sends them seeds",
        )
        _require(self.schedule in SCHEDULES, "rollout.schedule", f"must be one of {SCHEDULES}, got {self.schedule!r}")
        _require(self.engine in ENGINES, "rollout.engine", f"must be one of {ENGINES}, got {self.engine!r}")
        _require(
            not (self.engine == "sglang" and not self.sglang_urls),
            "rollout.sglang_urls",
            "rollout.engine='sglang' needs at least one server URL",
        )
        _require(self.temperature > 0, "rollout.temperature", f"must be > 0, got {self.temperature}")
        _require(0 < self.top_p <= 1, "rollout.top_p", f"must be in (0, 1], got {self.top_p}")
        _require(self.top_k == -1 or self.top_k >= 1, "rollout.top_k", f"must be -1 (off) or >= 1, got {self.top_k}")
        for key in (
            "max_new_tokens",
            "max_turns",
            "concurrency",
            "eval_concurrency",
            "group_size",
            "weight_sync_every",
        ):
            _require(getattr(self, key) >= 1, f"rollout.{key}", f"must be >= 1, got {getattr(self, key)}")
        _require(self.max_context > self.max_new_tokens, "rollout.max_context", "must exceed rollout.max_new_tokens")
        _require(
            self.source in ONLINE_SOURCES, "rollout.source", f"must be one of {ONLINE_SOURCES}, got {self.source!r}"
        )
        _require(
            self.eval_temperature >= 0,
            "rollout.eval_temperature",
            f"must be >= 0 (0 = greedy), got {self.eval_temperature}",
        )
        for key in ("request_timeout_s", "control_timeout_s", "probe_interval_s"):
            _require(0 < getattr(self, key) < math.inf, f"rollout.{key}", f"must be > 0, got {getattr(self, key)}")
        _require(
            0 <= self.outage_budget_s < math.inf, "rollout.outage_budget_s", f"must be >= 0, got {self.outage_budget_s}"
        )
        for key in ("max_attempts", "keep_weight_folders"):
            _require(getattr(self, key) >= 1, f"rollout.{key}", f"must be >= 1, got {getattr(self, key)}")
        _require(
            1 <= self.min_sync_servers <= max(len(self.sglang_urls), 1),
            "rollout.min_sync_servers",
            f"must be in [1, len(rollout.sglang_urls)], got {self.min_sync_servers}",
        )
        _require(
            self.weight_dtype in DTYPES, "rollout.weight_dtype", f"must be one of {DTYPES}, got {self.weight_dtype!r}"
        )
        _require(
            self.weight_sync in WEIGHT_SYNCS,
            "rollout.weight_sync",
            f"must be one of {WEIGHT_SYNCS}, got {self.weight_sync!r}",
        )
        _require(
            self.engine_devices >= 0,
            "rollout.engine_devices",
            f"must be >= 0 (0 = all of process 0's devices), got {self.engine_devices}",
        )
        _require(
            self.partial in PARTIAL_MODES, "rollout.partial", f"must be one of {PARTIAL_MODES}, got {self.partial!r}"
        )

    def sglang_client_options(self) -> dict[str, Any]:
        """SGLangEngine's keyword arguments: timeouts, retries, and the API keys read from api_key_env and
        admin_api_key_env."""
        return dict(
            api_key=os.environ.get(self.api_key_env) or None,
            admin_api_key=os.environ.get(self.admin_api_key_env) or None,
            request_timeout_s=self.request_timeout_s,
            control_timeout_s=self.control_timeout_s,
            max_attempts=self.max_attempts,
            probe_interval_s=self.probe_interval_s,
            min_sync_servers=self.min_sync_servers,
            outage_budget_s=self.outage_budget_s,
            weight_sync=self.weight_sync,
        )


@dataclass(frozen=True)
class QueueConfig:
    """The bounded trajectory queue between rollouts and the learner.

    max_size: trajectories the queue holds (at least train.batch_size).
    max_policy_lag: admit a trajectory only if (current version - its sampling version) <= this.
    forced_lag: staleness experiments: the engines serve the weights of step - forced_lag.
    stall_timeout_s: stop the run (with a checkpoint, naming why trajectories were dropped) when the learner has
      waited this long without the queue admitting one; 0 = wait forever.
    dynamic_sampling: DAPO's dynamic sampling: batches are filled with whole groups (rollout.group_size > 1) whose
      rewards differ; a group whose rewards are all equal (every advantage 0 under a group baseline) is dropped and
      more groups are drawn from the queue, within max_policy_lag (docs/off_policy.md). The raw rewards, before
      any shaping (verl's DAPO metric acc; docs/objectives.md, "Differences from verl").
    dynamic_sampling_max_batches: at most this many batches' worth of groups (train.batch_size /
      rollout.group_size each) are drawn for one batch; when they leave it short, the last groups with equal
      rewards fill it (counted as dynamic_groups_filled and dynamic_bound_hit, with a warning).
    """

    max_size: int = 8
    max_policy_lag: int = 4
    forced_lag: int = 0
    stall_timeout_s: float = 900.0
    dynamic_sampling: bool = False
    dynamic_sampling_max_batches: int = 4

    def __post_init__(self) -> None:
        _require(self.max_size >= 1, "queue.max_size", f"must be >= 1, got {self.max_size}")
        _require(self.max_policy_lag >= 0, "queue.max_policy_lag", f"must be >= 0, got {self.max_policy_lag}")
        _require(
            0 <= self.forced_lag <= self.max_policy_lag,
            "queue.forced_lag",
            f"must be in [0, queue.max_policy_lag={self.max_policy_lag}], got {self.forced_lag}",
        )
        _require(
            0 <= self.stall_timeout_s < math.inf,
            "queue.stall_timeout_s",
            f"must be >= 0 (0 = off), got {self.stall_timeout_s}",
        )
        _require(
            isinstance(self.dynamic_sampling, bool),
            "queue.dynamic_sampling",
            f"must be True or False, got {self.dynamic_sampling!r}",
        )
        _require(
            self.dynamic_sampling_max_batches >= 1,
            "queue.dynamic_sampling_max_batches",
            f"must be >= 1, got {self.dynamic_sampling_max_batches}",
        )


@dataclass(frozen=True)
class EnvConfig:
    """The environment online rollouts run in.

    name: a registered environment (ipa_jax.envs.list_envs()), e.g. calculator or lookup.
    kwargs: the environment's own settings, passed to its constructor (free-form keys).
    module: a module imported first that registers an environment of your own (ipa_jax.envs.register_env): a
      dotted name (my_pkg.my_env, installed or on PYTHONPATH) or the path of a .py file.
    expert_error: in [0, 1]: on this share of the tasks (a fixed set, chosen by a hash of the task) the scripted
      expert's demonstrations make the environment's systematic mistake and fail (docs/environments.md).
    expert_families: demonstrations only of tasks of these families (the environment's `family`, e.g. the
      calculator's "add_mul"); empty = every family. Held-out success is reported per family either way.
    """

    name: str = ""
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    module: str = ""
    expert_error: float = 0.0
    expert_families: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.module:
            import_env_module(self.module)
        if self.name and self.name not in list_envs():
            close = difflib.get_close_matches(self.name, list_envs(), n=1, cutoff=0.5)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise ConfigError(
                "env.name",
                f"{self.name!r} is not a registered environment; {hint}registered: "
                f"{', '.join(list_envs())} (your own: set env.module to the module that "
                "registers it)",
            )
        if self.name:  # the environment checks its own settings
            try:
                env = self.make()
            except (TypeError, ValueError) as e:
                raise ConfigError("env.kwargs", f"environment {self.name!r} rejects {dict(self.kwargs)}: {e}") from None
            self._check_demonstrations(env)

    def _check_demonstrations(self, env: Env) -> None:
        _require(
            isinstance(self.expert_error, (int, float)) and 0.0 <= self.expert_error <= 1.0,
            "env.expert_error",
            f"must be a share in [0, 1], got {self.expert_error!r}",
        )
        _require(
            self.expert_error == 0 or env.has_expert_mistake(),
            "env.expert_error",
            f"environment {self.name!r} defines no systematic expert mistake (Env.expert_mistake): leave it at 0",
        )
        if self.expert_families:
            try:
                seen = sorted({env.family(task) for task in env.tasks("train", TASK_BLOCK)})
            except TaskSpaceTooSmall:
                return  # the run's task-space check names the problem
            unknown = [f for f in self.expert_families if f not in seen]
            _require(
                not unknown,
                "env.expert_families",
                f"{unknown} are not families of {self.name!r} with {dict(self.kwargs)}; its families: {seen}",
            )

    def make(self) -> Env:
        """A fresh environment instance (one per concurrent episode)."""
        return make_env(self.name, **self.kwargs)


def import_env_module(module: str) -> None:
    """Imports env.module once per process: a dotted module name, or a .py file (loaded under a name derived from
    its path, so a second config naming it does not register its environments twice)."""
    try:
        if not module.endswith(".py"):
            importlib.import_module(module)
            return
        path = os.path.abspath(module)
        name = f"_ipa_env_{abs(hash(path))}"
        if name in sys.modules:
            return
        spec = importlib.util.spec_from_file_location(name, path)
        if spec is None or spec.loader is None or not os.path.isfile(path):
            raise ImportError(f"no such file: {path}")
        loaded = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(loaded)
        sys.modules[name] = loaded
    except (ImportError, SyntaxError) as e:
        raise ConfigError(
            "env.module",
            f"cannot import {module!r} ({e}); install it, put its folder on PYTHONPATH, "
            "or give the path of its .py file",
        ) from None


# Objective presets: the published settings (ipa_jax.objectives.PRESETS; docs/off_policy.md says which source each
# reproduces) and "custom", ObjectiveConfig's defaults.
OBJECTIVE_PRESETS: dict[str, ObjectiveConfig] = {**PRESETS, "custom": ObjectiveConfig()}
OBJECTIVE_FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(ObjectiveConfig))

# Section name -> its dataclass, in the order of the ConfigDict and of config.json.
SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "mesh": MeshConfig,
    "objective": ObjectiveConfig,
    "optimizer": OptimizerConfig,
    "rollout": RolloutConfig,
    "queue": QueueConfig,
    "train": TrainConfig,
    "checkpoint": CheckpointConfig,
    "logging": LoggingConfig,
    "env": EnvConfig,
    "resample": ResampleConfig,
}
FREE_FORM = ("env.kwargs",)  # keys under it are the environment's own, checked by its constructor


@dataclass(frozen=True)
class ExperimentConfig:
    """Everything one run needs, typed and checked (cross-section rules here, the rest in each section)."""

    model: ModelConfig = field(default_factory=ModelConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    objective: ObjectiveConfig = field(default_factory=ipa_config)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    queue: QueueConfig = field(default_factory=QueueConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    resample: ResampleConfig = field(default_factory=ResampleConfig)

    def __post_init__(self) -> None:
        _require(
            not (self.objective.rl_weight == 0 and self.objective.il_weight == 0),
            "objective.rl_weight",
            "rl_weight and il_weight are both 0: nothing to train",
        )
        if self.objective.needs_reference and self.model.lora_rank > 0:
            self._check_lora_reference()
        if self.online:
            _require(
                not self.objective.needs_group_ids or self.rollout.group_size > 1,
                "objective.baseline",
                f"{self.objective.baseline!r} needs several samples per task: set rollout.group_size > 1",
            )
            _require(
                self.online_source != "expert" or self.objective.il_weight > 0,
                "objective.il_weight",
                "the expert source (rollout.source) trains on expert episodes only: needs il_weight > 0",
            )
            _require(
                not (self.rollout.expert_successes_only and self.env.expert_error == 1),
                "rollout.expert_successes_only",
                "with env.expert_error = 1 every demonstration fails: nothing would be left to imitate",
            )
            _require(
                self.objective.credit != "branch" or self.online_source == "queue",
                "objective.credit",
                f"'branch' samples its continuations in the rollout worker of rollout.source 'queue', not "
                f"{self.online_source!r}",
            )
            if self.env.name:
                self._check_task_space()
            if self.queue.dynamic_sampling:
                self._check_dynamic_sampling()
            if self.rollout.schedule == "lockstep":
                self._check_lockstep()
        else:
            _require(
                not self.queue.dynamic_sampling,
                "queue.dynamic_sampling",
                "filters the groups of online rollouts: offline trajectories (train.data) have none",
            )
            missing = [p for p in self.train.data if not glob.glob(os.path.expanduser(p))]
            _require(not missing, "train.data", f"no file matches {missing[0]!r}" if missing else "")

    def _check_lora_reference(self) -> None:
        """Under LoRA only the adapters train, so the reference is the base model under them (adapters at 0): an HF
        folder is that base only when it is model.path's; another model is not adapters away from the policy."""
        m = self.model
        _require(
            m.reference in REFERENCE_POLICIES or (bool(m.path) and _same_path(m.reference, m.path)),
            "model.reference",
            f"with LoRA (model.lora_rank > 0) the reference is the base model under the adapters: an HF folder "
            f"must be model.path's ({m.path!r}), got {m.reference!r}",
        )

    def _check_lockstep(self) -> None:
        """Lockstep fixes which weights generate each batch: one sync per update, no other lag, no sampling that
        depends on what else is in flight."""
        for key, ok, why in (
            ("rollout.weight_sync_every", self.rollout.weight_sync_every == 1, "a sync after every update"),
            ("queue.forced_lag", self.queue.forced_lag == 0, "its lag is queue.max_policy_lag alone"),
            ("queue.dynamic_sampling", not self.queue.dynamic_sampling, "batches of a fixed set of episodes"),
            ("objective.credit", self.objective.credit != "branch", "no branching continuations"),
        ):
            _require(ok, key, f"rollout.schedule 'lockstep' needs {why}")

    def _check_dynamic_sampling(self) -> None:
        """Dynamic sampling judges whole groups that the rollout worker feeds through the queue."""
        _require(
            self.online_source == "queue",
            "queue.dynamic_sampling",
            f"filters the trajectory queue's groups: needs rollout.source 'queue' (resolved: {self.online_source!r})",
        )
        g = self.rollout.group_size
        _require(
            g > 1,
            "queue.dynamic_sampling",
            "drops groups whose rewards are all equal: a group of one sample always is; set rollout.group_size > 1",
        )
        _require(
            self.train.batch_size % g == 0,
            "queue.dynamic_sampling",
            f"fills batches with whole groups: rollout.group_size={g} must divide train.batch_size="
            f"{self.train.batch_size}",
        )

    def _check_task_space(self) -> None:
        """Draws the distinct tasks a run needs first (train.eval_episodes held-out ones, a block of the training
        stream), so that a task space too small fails here instead of minutes into the run."""
        env = self.env.make()
        for split, needed, key in (
            ("eval", self.train.eval_episodes, "train.eval_episodes"),
            ("train", TASK_BLOCK, "env.kwargs"),
        ):
            try:
                env.tasks(split, needed)
            except TaskSpaceTooSmall as e:
                raise ConfigError(
                    key,
                    f"environment {self.env.name!r} with {dict(self.env.kwargs)}: its {split} split "
                    f"holds only {e.found} distinct tasks ({e.draws} draws); a run needs "
                    f"{self.train.eval_episodes} eval tasks (train.eval_episodes) and {TASK_BLOCK} "
                    f"train tasks (the training stream draws {TASK_BLOCK} at a time): widen the "
                    "task space (env.kwargs) or lower train.eval_episodes",
                ) from None

    @property
    def online(self) -> bool:
        """Trajectories come from rollouts (no offline train.data)."""
        return not self.train.data

    @property
    def online_source(self) -> str:
        """rollout.source resolved: auto is resample when resampling or its IL fallback is on, expert when
        objective.rl_weight is 0 (the policy's own rollouts would carry no gradient), else queue."""
        if self.rollout.source != "auto":
            return self.rollout.source
        if self.resample.mode != "none" or self.resample.il_fallback:
            return "resample"
        return "expert" if self.objective.rl_weight == 0 else "queue"

    @property
    def run_dir(self) -> str:
        return self.train.resolved_run_dir

    def to_dict(self) -> dict[str, Any]:
        """The resolved config as plain JSON values (config.json): the objective as preset "custom" with every
        field explicit (is_clip_max None, "never truncate", as inf); loads back with `config_from_dict`."""
        values = json.loads(json.dumps(dataclasses.asdict(self)))
        objective = values["objective"]
        if objective["is_clip_max"] is None:
            objective["is_clip_max"] = math.inf
        values["objective"] = {"preset": "custom", **objective}
        return values


def _same_path(a: str, b: str) -> bool:
    """Whether two spellings of a path name one folder (trailing slash, relative, symlinks, ~)."""
    return os.path.realpath(os.path.expanduser(a)) == os.path.realpath(os.path.expanduser(b))


def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """A config dict as {dotted key: value} (model.arch and env.kwargs stay whole dicts)."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, Mapping) and f"{prefix}{key}" not in ("model.arch", "env.kwargs"):
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[prefix + key] = value
    return out


def config_changes(old: Mapping[str, Any], new: Mapping[str, Any]) -> dict[str, tuple[Any, Any]]:
    """{dotted key: (old value, new value)} where two resolved configs (to_dict()) differ; a key missing on one side
    has None there. train.allow_config_change is not a change of the experiment."""
    old_flat, new_flat = flatten(old), flatten(new)
    keys = sorted((old_flat.keys() | new_flat.keys()) - {"train.allow_config_change"})
    return {k: (old_flat.get(k), new_flat.get(k)) for k in keys if old_flat.get(k) != new_flat.get(k)}


# ---------------------------------------------------------------------------------------------- help text
def field_help(cls: type) -> dict[str, str]:
    """{field name: help} from the dataclass's docstring, whose entries read `name: text` (continuation lines
    indented deeper). Every config section documents every field this way (tests check it)."""
    names = {f.name for f in dataclasses.fields(cls)}
    entries: dict[str, str] = {}
    current = None
    for line in (inspect.getdoc(cls) or "").splitlines():
        match = re.match(r"(\w+): (.*)", line)
        if match and match.group(1) in names:
            current = match.group(1)
            entries[current] = match.group(2).strip()
        elif current and line.startswith(" ") and line.strip():
            entries[current] += " " + line.strip()
        else:
            current = None
    return entries


_EXTRA_HELP = {
    "objective.preset": "ipa (the ROME paper's text), ipa_seed (its pseudo-code: IS clip 10, sign by reward, token "
    "mismatch mask 5, sum / B), ipa_roll (ROLL: recomputed old log-probs, sign by reward, "
    "kept-token row mean), flash_reinforce, the baselines grpo, dr_grpo, rloo, reinforce_pp, ppo_dual_clip "
    "(docs/objectives.md), or custom (ObjectiveConfig's defaults); the objective "
    "fields left at None take the preset's value (docs/off_policy.md).",
}


def describe_config(config: ConfigDict | None = None) -> list[tuple[str, str, str, str]]:
    """(dotted key, type, value, help) of every config key, in section order: the values of `config` (default: the
    base config's); an objective field left unset shows the value its preset gives it, marked "(preset)".
    model.arch fields are HF config.json fields; env.kwargs keys are free-form."""
    config = config if config is not None else base_config()
    preset = OBJECTIVE_PRESETS.get(config.objective.preset)  # None: an unknown preset, which validation names
    rows = []
    for section, cls in SECTIONS.items():
        helps = field_help(cls)
        node = config[section]
        for key in node.keys():
            dotted = f"{section}.{key}"
            value = node[key]
            if isinstance(value, ConfigDict):
                label = "HF config.json field" if dotted == "model.arch" else "environment setting"
                rows += [(f"{dotted}.{k}", type(v).__name__, repr(v), label) for k, v in value.items()]
                if not len(value):
                    rows.append((dotted, "dict", "{}", helps.get(key, "")))
                continue
            typ = node.get_type(key) if key in node else type(value)
            text = _EXTRA_HELP.get(dotted) or helps.get(key, "")
            shown = repr(value)
            if section == "objective" and key != "preset":
                text += " (unset: the preset's value)"
                if value is None and preset is not None:
                    shown = f"{getattr(preset, key)!r} (preset)"
            rows.append((dotted, getattr(typ, "__name__", str(typ)), shown, text))
    return rows


def format_config_help(config: ConfigDict | None = None) -> str:
    """describe_config as aligned text, one key per line."""
    rows = describe_config(config)
    width = max(len(r[0]) for r in rows)
    return "\n".join(f"{key:<{width}}  {typ:<6} {value:<14} {text}" for key, typ, value, text in rows)


# ---------------------------------------------------------------------------------------------- ConfigDict
def _section_dict(cls: type) -> ConfigDict:
    values = dataclasses.asdict(cls())
    if cls is ModelConfig:
        values["arch"] = ConfigDict(dict(DEFAULT_ARCH))
    if cls is EnvConfig:
        values["kwargs"] = ConfigDict()
    return ConfigDict(values)


def _objective_section() -> ConfigDict:
    section = ConfigDict()
    section.preset = "ipa"
    defaults = ObjectiveConfig()
    for name in OBJECTIVE_FIELDS:
        section[name] = config_dict.placeholder(type(getattr(defaults, name)))
    return section


def base_config() -> ConfigDict:
    """Every knob of ipa_jax with its default (locked): built from the section dataclasses."""
    config = ConfigDict()
    for name, cls in SECTIONS.items():
        config[name] = _objective_section() if cls is ObjectiveConfig else _section_dict(cls)
    config.lock()
    return config


def load_config(path: str | os.PathLike, overrides: Iterable[str] | Mapping[str, Any] = ()) -> ConfigDict:
    """A config file (`get_config()` of a .py file, or a run's config.json) with dotted overrides applied
    ("objective.gamma=0.9" strings, or a {dotted key: value} mapping). Config files load their bases the same
    way: `load_config(Path(__file__).parent / "quickstart.py")`."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise ConfigError("", f"no config file {os.path.abspath(path)}")
    if path.endswith(".json"):
        with open(path, encoding="utf-8") as f:
            config = config_from_dict(json.load(f))
    else:
        config = _load_py_config(path)
    apply_overrides(config, overrides)
    return config


def _load_py_config(path: str) -> ConfigDict:
    path = os.path.abspath(path)
    spec = importlib.util.spec_from_file_location(f"_ipa_config_{abs(hash(path))}", path)
    if spec is None or spec.loader is None:
        raise ConfigError("", f"cannot load config file {path}")
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
        if not hasattr(module, "get_config"):
            raise ConfigError("", f"config file {path} defines no get_config()")
        return module.get_config()
    except (AttributeError, KeyError, TypeError) as e:  # a locked ConfigDict's unknown key or wrong type
        raise ConfigError("", f"config file {path}: {e}") from None


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
    items = overrides.items() if isinstance(overrides, Mapping) else (split_override(o) for o in overrides)
    for dotted, value in items:
        *parents, leaf = dotted.split(".")
        node = config
        for i, part in enumerate(parents):
            _check_key(node, part, ".".join(parents[: i + 1]))
            node = node[part]
        if dotted in ("env.kwargs", "model.arch"):
            if isinstance(value, str):  # from the command line: --config.env.kwargs="{'hops': 3}"
                value = _parse_value(value, dict, dotted)
            with config.unlocked():
                if dotted == "env.kwargs":
                    node[leaf] = ConfigDict(dict(value))
                else:  # arch keys are checked by ModelConfig
                    node[leaf].update(dict(value))
            continue
        free_form = ".".join(parents[:2]) in FREE_FORM  # env-specific keys may be new
        if not free_form:
            _check_key(node, leaf, dotted)
        if isinstance(value, str) and leaf in node:
            value = _parse_value(value, node.get_type(leaf), dotted)
        elif isinstance(value, str):  # a new env kwarg: a Python literal, else a string
            with contextlib.suppress(ValueError, SyntaxError):
                value = literal_eval(value)
        try:
            with config.unlocked() if free_form else contextlib.nullcontext():
                node[leaf] = value
        except (TypeError, ValueError) as e:
            raise ConfigError(dotted, f"cannot take {value!r}: {e}") from None


def split_override(text: str) -> tuple[str, str]:
    """'--config.train.steps=5' or 'train.steps=5' -> ('train.steps', '5')."""
    key, sep, value = text.lstrip("-").removeprefix("config.").partition("=")
    if not sep:
        raise ConfigError(key, f"override {text!r} is not of the form key.sub=value")
    return key.strip(), value.strip()


def _check_key(node: ConfigDict, key: str, dotted: str) -> None:
    if key not in node:
        raise ConfigError(dotted, _unknown_key_message(dotted, list(node.keys())))


def _unknown_key_message(dotted: str, known: list[str]) -> str:
    prefix, _, key = dotted.rpartition(".")
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.5)
    hint = f"did you mean '{prefix + '.' if prefix else ''}{close[0]}'? " if close else ""
    return f"unknown key; {hint}valid keys here: {', '.join(sorted(known))}"


def _parse_value(text: str, typ: type, dotted: str) -> Any:
    if typ is str:
        quoted = len(text) >= 2 and text[0] == text[-1] and text[0] in "'\""
        return text[1:-1] if quoted else text
    if text.lower() in ("none", "null"):
        return None
    if typ is bool:
        if text.lower() in ("true", "1", "yes"):
            return True
        if text.lower() in ("false", "0", "no"):
            return False
        raise ConfigError(dotted, f"expected a boolean (True or False), got {text!r}")
    try:
        value = float(text) if text.lower() in ("inf", "+inf", "-inf") else literal_eval(text)
    except (ValueError, SyntaxError):
        raise ConfigError(dotted, f"cannot parse {text!r} as {typ.__name__}") from None
    if typ is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if typ is tuple and isinstance(value, list):
        value = tuple(value)
    if not isinstance(value, typ):
        raise ConfigError(dotted, f"expected {typ.__name__}, got {text!r}")
    return value


# ---------------------------------------------------------------------------------------------- validation
def validate(config: ConfigDict) -> ExperimentConfig:
    """The typed config of `config`, or a ConfigError naming the key: unknown or misspelled keys (with a
    did-you-mean), values out of range, impossible combinations."""
    _check_schema(config, base_config(), "")
    sections = {name: _build_section(name, cls, config[name]) for name, cls in SECTIONS.items()}
    return _build("", ExperimentConfig, sections)


def _check_schema(config: ConfigDict, schema: ConfigDict, prefix: str) -> None:
    for key in config.keys():
        dotted = f"{prefix}{key}"
        if key not in schema:
            raise ConfigError(dotted, _unknown_key_message(dotted, list(schema.keys())))
        if dotted in FREE_FORM or dotted == "model.arch":  # arch keys are checked by ModelConfig
            continue
        if isinstance(schema[key], ConfigDict):
            _require(isinstance(config[key], ConfigDict), dotted, f"must be a section, got {config[key]!r}")
            _check_schema(config[key], schema[key], dotted + ".")


def _build_section(name: str, cls: type, section: ConfigDict) -> Any:
    values = section.to_dict()
    if cls is ObjectiveConfig:
        return resolve_objective(values)
    values = {k: tuple(v) if isinstance(v, list) else v for k, v in values.items()}
    return _build(name, cls, values)


def resolve_objective(section: Mapping[str, Any]) -> ObjectiveConfig:
    """The preset's fields, then every field set explicitly (not None) in the objective section."""
    preset = section["preset"]
    _require(
        preset in OBJECTIVE_PRESETS,
        "objective.preset",
        f"must be one of {', '.join(OBJECTIVE_PRESETS)}, got {preset!r}",
    )
    values = dataclasses.asdict(OBJECTIVE_PRESETS[preset])
    values.update({name: section[name] for name in OBJECTIVE_FIELDS if section.get(name) is not None})
    if values["is_clip_max"] == math.inf:  # the config's spelling of "never truncate" (None = the preset's)
        values["is_clip_max"] = None
    return _build("objective", ObjectiveConfig, values)


def _build(section: str, cls: type, values: Mapping[str, Any]) -> Any:
    """cls(**values); a ValueError of a lower layer's dataclass ("ObjectiveConfig.gamma: ..." or
    "train.steps: ...") becomes a ConfigError naming the dotted key."""
    try:
        return cls(**values)
    except ConfigError:
        raise
    except (ValueError, TypeError) as e:
        message = str(e)
        match = re.match(rf"(?:{cls.__name__}|{section})\.(\w+):?\s*(.*)", message, re.S)
        if section and match:
            raise ConfigError(f"{section}.{match.group(1)}", match.group(2)) from None
        raise ConfigError(section, message) from None
