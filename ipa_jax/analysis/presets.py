"""Sweep presets: named sets of ablation configs, seeds and the paired comparison their table reports.

A preset is a file, `get_preset()` of a .py file (configs/sweeps/<name>.py), loaded by path the way config files
are; its docstring is the preset's description unless the preset sets one. A preset file may load another and
change it (`load_preset(Path(__file__).with_name("longhorizon.py"))`).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
from dataclasses import dataclass
from typing import Any

from ipa_jax.analysis.stats import CLAIMS, DEFAULT_EFFECT


@dataclass(frozen=True)
class Preset:
    """A named sweep: config names (files of the ablation config folder), seeds, overrides for every arm, and the
    paired comparison its table reports (`reference`: default the first config; `claim`: see CLAIMS; `controls`:
    positive controls among the configs, built to be worse than the reference, whose detection the table checks;
    `effect`: the effect of interest, in success rate, whose seed count the table states; `pairs`: (config, its own
    reference) for configs compared with another config than `reference`, the one they differ from by one change;
    `conditions`: (name, overrides) settings the whole sweep runs under one after the other, each its own table in
    <out>/<name> and results in <results>/<name>; `claims`: the configs whose comparison with their reference is a
    pre-registered claim, the family Holm's correction and the verdicts' detectable effect run over (empty: every
    config compared but the controls); `aa_controls`: A/A controls, the reference again under another name or
    rollout seed, whose interval must cover 0; `keep_results`: False for a preset whose runs are not worth keeping,
    e.g. a smoke test: no results files unless --results names a folder). Claims, controls and A/A controls are
    configs other than their reference, each of one kind."""

    configs: tuple[str, ...]
    seeds: tuple[int, ...]
    description: str = ""
    overrides: tuple[tuple[str, Any], ...] = ()
    reference: str | None = None
    claim: str = "higher"
    controls: tuple[str, ...] = ()
    effect: float = DEFAULT_EFFECT
    pairs: tuple[tuple[str, str], ...] = ()
    conditions: tuple[tuple[str, tuple[tuple[str, Any], ...]], ...] = ()
    claims: tuple[str, ...] = ()
    aa_controls: tuple[str, ...] = ()
    keep_results: bool = True

    def __post_init__(self) -> None:
        bad = [p for p in self.pairs if p[0] not in self.configs or p[1] not in self.configs or p[0] == p[1]]
        if bad or len({config for config, _ in self.pairs}) != len(self.pairs):
            raise ValueError(f"pairs {self.pairs} must pair each config of {self.configs} once with another config")
        names = [name for name, _ in self.conditions]
        if len(set(names)) != len(names) or not all(re.fullmatch(r"[A-Za-z0-9_.-]+", name) for name in names):
            raise ValueError(f"condition names must be distinct folder names, got {names}")
        if self.reference is not None and self.reference not in self.configs:
            raise ValueError(f"reference {self.reference!r} is not one of the configs {self.configs}")
        reference = self.reference or self.configs[0]
        for kind in ("controls", "claims", "aa_controls"):
            names = getattr(self, kind)
            if any(c not in self.configs or c == dict(self.pairs).get(c, reference) for c in names):
                raise ValueError(
                    f"{kind} {names} must be configs {self.configs} other than the reference {reference!r} (or "
                    "their own, in pairs)"
                )
        kinds = [*self.controls, *self.claims, *self.aa_controls]
        if len(set(kinds)) != len(kinds):
            raise ValueError(f"controls, claims and aa_controls must not share a config, got {kinds}")
        if not 0.0 < self.effect <= 1.0:
            raise ValueError(f"effect must be a success-rate difference in (0, 1], got {self.effect}")
        if self.claim not in CLAIMS:
            raise ValueError(f"claim must be one of {', '.join(CLAIMS)}, got {self.claim!r}")


def load_preset(path: str | os.PathLike) -> Preset:
    """`get_preset()` of the preset file at `path`, described by the file's docstring unless it sets a
    description."""
    path = os.path.abspath(path)
    spec = importlib.util.spec_from_file_location(f"_ipa_preset_{abs(hash(path))}", path)
    if not os.path.isfile(path) or spec is None or spec.loader is None:
        raise ValueError(f"no preset file {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    preset = getattr(module, "get_preset", lambda: None)()
    if not isinstance(preset, Preset):
        raise ValueError(f"preset file {path}: get_preset() must return a Preset, got {preset!r}")
    return (
        preset
        if preset.description
        else dataclasses.replace(preset, description=" ".join((module.__doc__ or "").split()))
    )


def preset_files(sweep_dir: str) -> dict[str, str]:
    """{name: path} of the preset files in `sweep_dir`, by name."""
    names = sorted(f[:-3] for f in os.listdir(sweep_dir) if f.endswith(".py"))
    return {name: os.path.join(sweep_dir, f"{name}.py") for name in names}


def resolve_preset(spec: str, sweep_dir: str) -> tuple[str, Preset]:
    """(name, preset) of a bare name (a file of `sweep_dir`) or the path of a preset file."""
    if spec.endswith(".py") or os.sep in spec:
        return os.path.splitext(os.path.basename(spec))[0], load_preset(spec)
    files = preset_files(sweep_dir)
    if spec not in files:
        raise ValueError(f"must be one of {', '.join(files)} or the path of a preset file, got {spec!r}")
    return spec, load_preset(files[spec])


def listing(sweep_dir: str, config_dir: str) -> str:
    """The presets (what they compare, seeds, reference and claim) and the configs (their docstrings' first line)."""
    presets = {name: load_preset(path) for name, path in preset_files(sweep_dir).items()}
    width = max(map(len, presets), default=0)
    lines = [f"presets (--preset=NAME; files in {os.path.relpath(sweep_dir)}):"]
    for name, preset in presets.items():
        lines += [
            f"  {name:<{width}} {', '.join(preset.configs)}; seeds {','.join(map(str, preset.seeds))}; "
            f"paired with {preset.reference or preset.configs[0]}, claim {preset.claim}"
            + (f", claims {', '.join(preset.claims)}" if preset.claims else "")
            + (f", positive controls {', '.join(preset.controls)}" if preset.controls else "")
            + (f", A/A controls {', '.join(preset.aa_controls)}" if preset.aa_controls else ""),
            f"  {'':<{width}} {preset.description}",
        ]
    lines.append(f"configs (--configs=NAME,...; files in {os.path.relpath(config_dir)}):")
    names = sorted(filename[:-3] for filename in os.listdir(config_dir) if filename.endswith(".py"))
    width = max(map(len, names), default=0)
    for name in names:
        with open(os.path.join(config_dir, name + ".py"), encoding="utf-8") as f:
            first = f.read().split('"""')[1].strip().splitlines()[0]
        lines.append(f"  {name:<{width}} {first}")
    return "\n".join(lines)
