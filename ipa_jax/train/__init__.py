"""The learner: TrainState, the pure jitted train step, optimizer, learner loop, sources, Orbax checkpoints,
metrics, multi-host helpers. Wiring from typed configs: ipa_jax.train.build."""

from ipa_jax.train.checkpoint import CheckpointConfig, Checkpointer, export_hf
from ipa_jax.train.learner import Learner, TrainConfig
from ipa_jax.train.metrics import LoggingConfig, MetricsWriter, read_metrics, train_flops_per_token
from ipa_jax.train.optimizer import OptimizerConfig, make_optimizer, make_schedule
from ipa_jax.train.sources import JsonlSource, TrajectorySource
from ipa_jax.train.state import TrainState
from ipa_jax.train.step import StepOptions, TrainStep, place_state, train_step

__all__ = [
    "CheckpointConfig", "Checkpointer", "JsonlSource", "Learner", "LoggingConfig", "MetricsWriter",
    "OptimizerConfig", "StepOptions", "TrainConfig", "TrainState", "TrainStep", "TrajectorySource", "export_hf",
    "make_optimizer", "make_schedule", "place_state", "read_metrics", "train_flops_per_token", "train_step",
]
