"""Command-line support shared by the entry points in experiments/: the config flags and clear config errors.

    --config=PATH                 a config file (configs/*.py, or a run's config.json)
    --config.SECTION.KEY=VALUE    override one key (repeatable); VALUE is parsed by the key's type
    --config_help                 print every config key with its type, value and help, then exit

absl does not know the dotted override flags, so `ConfigFlags.parse` takes them out of argv before absl parses
the rest (pass it as `app.run(main, flags_parser=...)`). A config problem (unknown key, bad type, bad value) prints
one line naming the key and exits with status 2 (`exit_on_config_error`), without a traceback; so does a run that
stopped itself with a checkpoint, with status 1 (`exit_on_stop`). Library INFO logs are off unless --verbosity=0
(or -v 0) asks for them.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Sequence
from typing import Any

from absl import flags, logging
from ml_collections import ConfigDict

from ipa_jax.pipeline.config import (
    ConfigError,
    ExperimentConfig,
    apply_overrides,
    base_config,
    format_config_help,
    load_config,
    validate,
)
from ipa_jax.train import TrainingStopped

EXIT_CONFIG_ERROR = 2
EXIT_STOPPED = 1


class ConfigFlags:
    """Defines --config and --config_help; after `parse`, `config()` loads the file with the overrides applied."""

    def __init__(
        self, help_text: str = "Experiment config file (configs/*.py or a run's config.json).", required: bool = True
    ):
        self.required = required
        self.overrides: list[str] = []
        self._path = flags.DEFINE_string(
            "config", None, help_text + " Override keys with --config.SECTION.KEY=VALUE (see --config_help)."
        )
        self._help = flags.DEFINE_bool(
            "config_help",
            False,
            "Print every config key (type, value, help) of --config (default: the base config) and exit.",
        )

    def parse(self, argv: Sequence[str]) -> list[str]:
        """absl flags_parser: takes the --config.KEY=VALUE overrides out of argv, then lets absl parse the rest."""
        self.overrides = [a for a in argv[1:] if a.startswith("--config.")]
        rest = flags.FLAGS([a for a in argv if not a.startswith("--config.")])
        quiet_library_logs()
        return rest

    @property
    def path(self) -> str | None:
        return self._path.value

    def config(self) -> ConfigDict:
        """The config file with the overrides applied (ConfigError naming the key on a bad one). Prints the keys and
        exits when --config_help is set."""
        if self._help.value:
            print(format_config_help(load_config(self.path, self.overrides) if self.path else None))
            sys.exit(0)
        if self.path is not None:
            return load_config(self.path, self.overrides)
        if self.required:
            raise ConfigError("", "--config=PATH is required (a file in configs/, e.g. configs/quickstart.py)")
        config = base_config()
        apply_overrides(config, self.overrides)
        return config

    def experiment(self) -> ExperimentConfig:
        """The validated, typed config."""
        return validate(self.config())


def quiet_library_logs() -> None:
    """Library INFO logs (Orbax's per-checkpoint lines, absl's) off unless --verbosity / -v was given: the console
    shows the learner's progress, warnings and errors."""
    if not flags.FLAGS["verbosity"].present:
        logging.set_verbosity(logging.WARNING)


def exit_on_config_error(main: Callable[..., Any]) -> Callable[..., Any]:
    """Wraps an absl main: a ConfigError prints `error: <message>` on one line and exits with status 2."""

    @functools.wraps(main)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        try:
            return main(*args, **kwargs)
        except ConfigError as e:
            print(f"error: {e}", file=sys.stderr)
            sys.exit(EXIT_CONFIG_ERROR)

    return wrapped


def exit_on_stop(main: Callable[..., Any]) -> Callable[..., Any]:
    """Wraps an absl main: a run that stopped itself with a checkpoint (`TrainingStopped`: its rollout servers gone
    past the outage budget, nothing admissible for too long) prints `stopped: <why>` on one line and exits with status
    1; rerunning the command resumes from that checkpoint."""

    @functools.wraps(main)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        try:
            return main(*args, **kwargs)
        except TrainingStopped as e:
            print(f"stopped: {e}", file=sys.stderr)
            sys.exit(EXIT_STOPPED)

    return wrapped
