"""The learner: TrainState, the pure jitted train step, optimizer, learner loop, sources, Orbax checkpoints,
metrics settings, multi-host helpers. Wired together from an experiment config by ipa_jax.pipeline."""

from ipa_jax.train.checkpoint import CheckpointConfig, Checkpointer
from ipa_jax.train.learner import Learner, MetricsSink, TrainConfig, TrainingStopped
from ipa_jax.train.metrics import LoggingConfig, train_flops_per_token
from ipa_jax.train.optimizer import OptimizerConfig, make_optimizer, make_schedule
from ipa_jax.train.sources import JsonlSource, TrajectorySource
from ipa_jax.train.state import TrainState
from ipa_jax.train.step import StepOptions, TrainStep, place_state, train_step

__all__ = [
    "CheckpointConfig",
    "Checkpointer",
    "JsonlSource",
    "Learner",
    "LoggingConfig",
    "MetricsSink",
    "OptimizerConfig",
    "StepOptions",
    "TrainConfig",
    "TrainingStopped",
    "TrainState",
    "TrainStep",
    "TrajectorySource",
    "make_optimizer",
    "make_schedule",
    "place_state",
    "train_flops_per_token",
    "train_step",
]
