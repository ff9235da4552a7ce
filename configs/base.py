"""Base experiment config: every knob of ipa_jax, grouped by section.

The defaults and their documentation live in `ipa_jax.config.base_config` (so that `validate` can check
any config against them wherever the package is installed). Sections: model, mesh, objective, optimizer,
rollout, queue, train, checkpoint, logging, env. Other config files start from this one:

    from configs.base import get_config as base_config

    def get_config():
        c = base_config()
        c.objective.preset = "flash_reinforce"
        return c

The returned ConfigDict is locked: an unknown or misspelled key (`--config.objective.gamam=0.9`) is an
error, never silently ignored. Env-specific keys go under `env.kwargs` (`with c.unlocked(): ...`).
"""

from ml_collections import ConfigDict

from ipa_jax.config import base_config


def get_config() -> ConfigDict:
    return base_config()
