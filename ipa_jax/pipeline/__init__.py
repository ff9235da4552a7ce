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

from ipa_jax.pipeline.config import ConfigError, ExperimentConfig, base_config, load_config, validate
from ipa_jax.pipeline.run import run
from ipa_jax.pipeline.run_folder import RunFolder

__all__ = ["ConfigError", "ExperimentConfig", "RunFolder", "base_config", "load_config", "run", "validate"]
