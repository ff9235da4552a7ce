"""The built-in terminal task suite: procedurally generated shell and Python tasks in three tiers.

easy: file and text manipulation with one or two standard commands. medium: small scripts and pipelines (write or
fix a script, aggregate a CSV, extract JSON fields, count log lines). hard: multi-step fixes and discovery, where
later commands depend on what earlier ones printed.

A family is a function `make(rng) -> TerminalSpec` drawing one instance (file names, words, numbers, contents,
which bug) from `rng`: deterministic given the rng, with many distinct instances per family. Each instance carries
its grader (exact expected files and command outputs, see `_common`) and a reference solution, one short bash
command per expert step. Tasks use only bash, coreutils, grep, sed, awk, find and python3's standard library.

To add a family: write `@family def name(rng) -> TerminalSpec` in the tier's module, returning `task(...)`.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

from ipa_jax.envs.terminal.spec import TerminalSpec
from ipa_jax.envs.terminal.suite import easy, hard, medium

TIERS = ("easy", "medium", "hard")


@dataclass(frozen=True)
class Family:
    """A task family: `make(rng)` draws one instance."""

    name: str
    tier: str
    make: Callable[[random.Random], TerminalSpec]


def _collect() -> dict[str, Family]:
    families: dict[str, Family] = {}
    for module in (easy, medium, hard):
        assert module.TIER in TIERS, module.__name__
        for make in module.FAMILIES:
            if make.__name__ in families:
                raise ValueError(f"terminal suite: two families named {make.__name__!r}")
            families[make.__name__] = Family(make.__name__, module.TIER, make)
    return families


FAMILIES: dict[str, Family] = _collect()

__all__ = ["FAMILIES", "TIERS", "Family"]
