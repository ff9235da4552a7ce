"""AdamW with warmup + cosine (or constant) learning rate and global-norm clipping.

With an IL warm start the schedule has two phases, each with its own warmup and decay: the warm start (il_lr,
steps [0, rl_start)) and RL (lr, train.steps - train.il_warmup_steps steps from rl_start). rl_start is
train.il_warmup_steps, or earlier when the warm start ends on its target (train.il_warmup_target), so it is
known only at run time: it lives in the TrainState, and the optimizer here is AdamW without its last stage
(the learning rate), which the train step applies as -schedule(step, rl_start). RL's own warmup restarts from
lr 0, so the Adam momentum left by imitation fades at a small step size instead of moving the policy while
the first RL gradients are still tiny.
"""

import math
from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import optax

PhaseSchedule = Callable[..., jax.Array]  # (step, rl_start=il_warmup_steps) -> learning rate


@dataclass(frozen=True)
class OptimizerConfig:
    """AdamW with a warmup + cosine (or constant) schedule per phase and global-norm clipping.

    lr: learning rate of the RL phase (the whole run without an IL warm start).
    il_lr: learning rate of the IL warm start (train.il_warmup_steps); 0 = lr.
    schedule: "cosine" (decay to min_lr_ratio * lr over the phase) or "constant", after the warmup.
    warmup_steps: linear warmup steps at the start of each phase; 0 = warmup_ratio of the phase's steps.
    warmup_ratio: fraction of the phase's steps spent warming up, used when warmup_steps is 0.
    min_lr_ratio: the cosine schedule ends at min_lr_ratio * lr.
    b1: Adam's first-moment decay.
    b2: Adam's second-moment decay.
    eps: Adam's epsilon.
    weight_decay: decoupled weight decay, applied to matrices only (not norms, not biases).
    clip_norm: clip gradients to this global norm; 0 = no clipping.
    """

    lr: float = 1e-6
    il_lr: float = 0.0
    schedule: str = "cosine"
    warmup_steps: int = 0
    warmup_ratio: float = 0.03
    min_lr_ratio: float = 0.1
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.1
    clip_norm: float = 1.0

    def __post_init__(self):
        for name in ("lr", "il_lr", "warmup_ratio", "min_lr_ratio", "b1", "b2", "eps", "weight_decay", "clip_norm"):
            if not math.isfinite(getattr(self, name)):  # inf or nan would make every parameter non-finite
                raise ValueError(f"optimizer.{name}: must be finite, got {getattr(self, name)}")
        if self.schedule not in ("cosine", "constant"):
            raise ValueError(f"optimizer.schedule: must be 'cosine' or 'constant', got {self.schedule!r}")
        if not self.lr > 0:
            raise ValueError(f"optimizer.lr: must be > 0, got {self.lr}")
        if not self.il_lr >= 0:
            raise ValueError(f"optimizer.il_lr: must be >= 0 (0 = optimizer.lr), got {self.il_lr}")
        if self.warmup_steps < 0:
            raise ValueError(f"optimizer.warmup_steps: must be >= 0, got {self.warmup_steps}")
        if not 0.0 <= self.warmup_ratio < 1.0:
            raise ValueError(f"optimizer.warmup_ratio: must be in [0, 1), got {self.warmup_ratio}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"optimizer.min_lr_ratio: must be in [0, 1], got {self.min_lr_ratio}")
        for name in ("b1", "b2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"optimizer.{name}: must be in [0, 1), got {getattr(self, name)}")
        if not self.eps > 0:
            raise ValueError(f"optimizer.eps: must be > 0, got {self.eps}")
        if self.weight_decay < 0:
            raise ValueError(f"optimizer.weight_decay: must be >= 0, got {self.weight_decay}")
        if self.clip_norm < 0:
            raise ValueError(f"optimizer.clip_norm: must be >= 0 (0 = off), got {self.clip_norm}")

    def num_warmup_steps(self, total_steps: int) -> int:
        return self.warmup_steps if self.warmup_steps > 0 else int(self.warmup_ratio * total_steps)


def _phase_schedule(config: OptimizerConfig, lr: float, steps: int) -> optax.Schedule:
    """Linear warmup 0 -> lr, then cosine lr -> min_lr_ratio * lr at `steps` (or constant lr)."""
    warmup = min(config.num_warmup_steps(steps), steps)
    if config.schedule == "constant":
        after = optax.constant_schedule(lr)
    else:
        after = optax.cosine_decay_schedule(lr, max(steps - warmup, 1), alpha=config.min_lr_ratio)
    if warmup == 0:
        return after
    return optax.join_schedules([optax.linear_schedule(0.0, lr, warmup), after], [warmup])


def make_schedule(config: OptimizerConfig, total_steps: int, il_warmup_steps: int = 0) -> PhaseSchedule:
    """lr(step, rl_start): one phase over `total_steps`; with an IL warm start of at most `il_warmup_steps`, the
    warm start's phase (il_lr) before rl_start, then RL's (lr) over total_steps - il_warmup_steps steps from
    rl_start (module doc). rl_start defaults to il_warmup_steps."""
    if not 0 <= il_warmup_steps <= total_steps:
        raise ValueError(f"il_warmup_steps: must be in [0, {total_steps}], got {il_warmup_steps}")
    rl = _phase_schedule(config, config.lr, total_steps - il_warmup_steps)
    if il_warmup_steps == 0:
        return lambda step, rl_start=0: rl(step)
    il = _phase_schedule(config, config.il_lr or config.lr, il_warmup_steps)

    def schedule(step, rl_start=il_warmup_steps):
        return jnp.where(step < rl_start, il(step), rl(step - rl_start))

    return schedule


def _decay_mask(params):
    # Decay matrices only: norms' scales and biases are 1-D.
    return jax.tree.map(lambda p: p.ndim >= 2, params)


def make_optimizer(config: OptimizerConfig) -> optax.GradientTransformation:
    """The update direction: clip_by_global_norm (when clip_norm > 0), Adam, decoupled weight decay, i.e.
    optax.adamw without its learning-rate stage; apply it with `apply_direction` (module doc)."""
    stages = [optax.clip_by_global_norm(config.clip_norm)] if config.clip_norm > 0 else []
    stages += [
        optax.scale_by_adam(b1=config.b1, b2=config.b2, eps=config.eps),
        optax.add_decayed_weights(config.weight_decay, mask=_decay_mask),
    ]
    return optax.chain(*stages)


def apply_direction(params, direction, lr: jax.Array):
    """params - lr * direction (optax.adamw's scale_by_learning_rate, with the run-time learning rate)."""
    return optax.apply_updates(params, jax.tree.map(lambda d: (-lr * d).astype(d.dtype), direction))


def _max_abs(tree) -> jax.Array:
    return jnp.max(jnp.stack([jnp.max(jnp.abs(x)).astype(jnp.float32) for x in jax.tree.leaves(tree)]))


def moments_within_clip(config: OptimizerConfig, opt_state) -> jax.Array:
    """bool scalar: every |mu| <= clip_norm and nu <= clip_norm^2, which every update of make_optimizer(config)
    keeps (mu' = b1 mu + (1 - b1) g and nu' = b2 nu + (1 - b2) g^2 with the clipped |g_i| <= clip_norm) from
    init's zeros. False without clipping."""
    if config.clip_norm <= 0:
        return jnp.asarray(False)
    c = jnp.float32(config.clip_norm)
    mu, nu = (optax.tree_utils.tree_get(opt_state, name) for name in ("mu", "nu"))
    return (_max_abs(mu) <= c) & (_max_abs(nu) <= c * c)


def update_magnitude_bound(
    config: OptimizerConfig, params, opt_state, grad_norm: jax.Array, lr: jax.Array, moments_within: bool = False
) -> jax.Array:
    """A float32 scalar >= |x| for every number the update of make_optimizer(config) then apply_direction(lr)
    computes from a gradient of global norm grad_norm (moments, bias-corrected moments, direction, new
    parameters), from the inputs alone; inf or nan when an input is not finite. The train step reads it to
    apply an update without first computing it and checking the result (module doc of train/step.py).

    With g the clipped gradient (|g_i| <= G = min(grad_norm, clip_norm)), M = max|mu|, N = max nu, P = max|p|:
      |mu'| <= max(M, G),  nu' <= max(N, G^2) =: V,  nu' / (1 - b2^t) <= V / (1 - b2),
      |mu' / (1 - b1^t)| <= max(M, G) / (1 - b1) =: H,
      |direction| <= H / eps + weight_decay * P =: D,  |p - lr * direction| <= P + |lr| * D.
    moments_within: the caller knows `moments_within_clip` holds, so M = clip_norm and N = clip_norm^2 without
    reading the moments (two of the three passes over the state)."""
    g = grad_norm.astype(jnp.float32)
    if config.clip_norm > 0:
        g = jnp.minimum(g, config.clip_norm)
    if moments_within:
        if config.clip_norm <= 0:
            raise ValueError("moments_within: the moments are bounded by clip_norm only when clip_norm > 0")
        m = v = jnp.float32(config.clip_norm)
        v = v * v
    else:
        m, v = (_max_abs(optax.tree_utils.tree_get(opt_state, name)) for name in ("mu", "nu"))
    m, v = jnp.maximum(m, g), jnp.maximum(v, g * g)  # (nan when grad_norm is)
    p = _max_abs(params)
    h = m / (1.0 - config.b1)
    d = h / config.eps + config.weight_decay * p
    return jnp.max(jnp.stack([v / (1.0 - config.b2), h, d, p + jnp.abs(lr) * d]))
