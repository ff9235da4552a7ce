"""Base experiment config: every knob of ipa_jax with its default, grouped by section.

The defaults and their documentation live in the typed config sections (`ipa_jax.pipeline.config`); list them
with `python experiments/train.py --config=configs/base.py --config_help`. Sections: model, mesh, objective,
optimizer, rollout, queue, train, checkpoint, logging, env, resample. Other config files start from this one,
or from another config file:

    from pathlib import Path

    from ipa_jax.pipeline import base_config, load_config

    def get_config():
        c = base_config()  # or another file's: load_config(Path(__file__).with_name("quickstart.py"))
        c.objective.preset = "flash_reinforce"
        return c

The returned ConfigDict is locked: an unknown or misspelled key (`--config.objective.gamam=0.9`) is an error,
never silently ignored. Env-specific keys go under `env.kwargs` (`with c.unlocked(): ...`).
"""

from ml_collections import ConfigDict

from ipa_jax.pipeline import base_config


def get_config() -> ConfigDict:
    return base_config()
