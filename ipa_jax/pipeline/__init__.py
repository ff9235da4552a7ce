"""The top layer: wires models, objectives, the learner, engines, rollouts and environments into runs.

    config.py       ExperimentConfig (typed sections) and the ConfigDict built from it; load, override, validate
    run_folder.py   the run folder's layout and every reader and writer of its files
    build.py        mesh, model, TrainState, train steps and Learner from an ExperimentConfig
    tokenizer.py    the run's tokenizer (given, the model's, or trained on the environments' expert episodes)
    online.py       the online loop: engines, expert stream, rollouts -> queue / resampling, weight sync, eval
    evaluation.py   held-out evaluation (pass@k) of the learner's policy, a run folder's checkpoint or an HF folder
    export.py       the policy as a self-contained Hugging Face folder (weights, tokenizer, generation config)
    forks.py        success per expert anchor of a policy (where its success is decided)
    run.py          run(config): one training run, its summary; honest resume
    cli.py          the entry points' config flags (--config, --config.KEY=VALUE, --config_help) and errors

Dependency rule: experiments -> analysis -> pipeline -> {train, rollout, engines, envs, models, objectives,
trajectory}; nothing below imports the pipeline.
"""

import sys
import types

from ipa_jax.lazy_exports import lazy_getattr

# Imported on first use: RunFolder is light (a notebook reading runs needs no JAX), the rest brings JAX.
_EXPORTS = {
    "ConfigError": "config",
    "ExperimentConfig": "config",
    "base_config": "config",
    "load_config": "config",
    "validate": "config",
    "run": "run",
    "RunFolder": "run_folder",
}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_getattr(__name__, _EXPORTS)


class _Package(types.ModuleType):
    """`run` is the function run(config) even after its submodule ipa_jax.pipeline.run is imported (the import
    system then sets the package's attribute of that name to the submodule)."""

    def __setattr__(self, name, value):
        if not (name == "run" and isinstance(value, types.ModuleType)):
            super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
