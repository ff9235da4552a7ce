"""AdamW with warmup + cosine (or constant) learning rate and global-norm clipping.

With an IL warm start (train.il_warmup_steps = W > 0) the schedule has two phases, each with its own warmup and
decay: the warm start (il_lr, steps [0, W)) and RL (lr, steps [W, train.steps)). RL's own warmup restarts
from lr 0, so the Adam momentum left by imitation fades at a small step size instead of moving the policy
while the first RL gradients are still tiny.
"""

from dataclasses import dataclass

import jax
import optax


@dataclass(frozen=True)
class OptimizerConfig:
    lr: float = 1e-6
    il_lr: float = 0.0  # learning rate of the IL warm start; 0 = lr
    schedule: str = "cosine"  # cosine | constant
    warmup_steps: int = 0
    warmup_ratio: float = 0.03  # used when warmup_steps == 0
    min_lr_ratio: float = 0.1
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.1
    clip_norm: float = 1.0  # 0 = no clipping

    def __post_init__(self):
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


def make_schedule(config: OptimizerConfig, total_steps: int, il_warmup_steps: int = 0) -> optax.Schedule:
    """One phase over `total_steps`; with an IL warm start, the warm start's phase (il_lr) over the first
    `il_warmup_steps`, then RL's (lr) over the rest (module doc)."""
    if not 0 <= il_warmup_steps <= total_steps:
        raise ValueError(f"il_warmup_steps: must be in [0, {total_steps}], got {il_warmup_steps}")
    rl = _phase_schedule(config, config.lr, total_steps - il_warmup_steps)
    if il_warmup_steps == 0:
        return rl
    il = _phase_schedule(config, config.il_lr or config.lr, il_warmup_steps)
    return optax.join_schedules([il, rl], [il_warmup_steps])


def _decay_mask(params):
    # Decay matrices only: norms' scales and biases are 1-D.
    return jax.tree.map(lambda p: p.ndim >= 2, params)


def make_optimizer(config: OptimizerConfig, total_steps: int,
                   il_warmup_steps: int = 0) -> optax.GradientTransformation:
    """clip_by_global_norm (when clip_norm > 0) then AdamW on the schedule."""
    adamw = optax.adamw(
        make_schedule(config, total_steps, il_warmup_steps),
        b1=config.b1,
        b2=config.b2,
        eps=config.eps,
        weight_decay=config.weight_decay,
        mask=_decay_mask,
    )
    if config.clip_norm > 0:
        return optax.chain(optax.clip_by_global_norm(config.clip_norm), adamw)
    return adamw
