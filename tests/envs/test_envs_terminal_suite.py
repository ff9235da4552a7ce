"""The built-in terminal suite: every family's reference solution passes its tests in a real bubblewrap sandbox, an
untouched workspace fails them, instances are deterministic and varied, and each task keeps to the suite's limits
(instruction length, file size, expert steps per tier)."""

import json
import random

import pytest

from ipa_jax.envs.sandbox import make_backend
from ipa_jax.envs.sandbox.bubblewrap import namespaces_unavailable
from ipa_jax.envs.terminal.grader import grade
from ipa_jax.envs.terminal.suite import FAMILIES, TIERS

NAMES = sorted(FAMILIES)
SANDBOX_SEEDS = (0, 1)
STEPS_PER_TIER = {"easy": (1, 2), "medium": (2, 3), "hard": (3, 6)}
MAX_INSTRUCTION_CHARS = 300
MAX_FILE_BYTES = 1536


def draw(name, seed):
    return FAMILIES[name].make(random.Random(seed))


def fingerprint(spec):
    return json.dumps(spec.to_dict(), sort_keys=True)


@pytest.fixture(scope="module")
def backend():
    """One bubblewrap backend for the module; the sandbox tests skip only where the platform cannot create the
    namespaces (any other start error fails them)."""
    reason = namespaces_unavailable()
    if reason:
        pytest.skip(reason)
    return make_backend("bubblewrap")


def test_suite_size_and_tiers():
    assert len(FAMILIES) >= 40
    for tier in TIERS:
        assert sum(f.tier == tier for f in FAMILIES.values()) >= 12, tier
    assert all(f.tier in TIERS and f.name == name for name, f in FAMILIES.items())


@pytest.mark.parametrize("name", NAMES)
def test_instances_are_deterministic_and_labelled(name):
    spec = draw(name, 7)
    assert fingerprint(spec) == fingerprint(draw(name, 7))
    assert (spec.name, spec.family, spec.tier) == (name, name, FAMILIES[name].tier)


@pytest.mark.parametrize("name", NAMES)
def test_instances_vary(name):
    assert len({fingerprint(draw(name, seed)) for seed in range(30)}) >= 20


@pytest.mark.parametrize("name", NAMES)
def test_tasks_keep_to_the_suite_limits(name):
    low, high = STEPS_PER_TIER[FAMILIES[name].tier]
    for seed in range(20):
        spec = draw(name, seed)
        assert len(spec.instruction) <= MAX_INSTRUCTION_CHARS, spec.instruction
        assert low <= len(spec.solution) <= high, spec.solution
        for path, text in spec.files.items():
            assert len(text.encode()) < MAX_FILE_BYTES, path


@pytest.mark.parametrize("seed", SANDBOX_SEEDS)
@pytest.mark.parametrize("name", NAMES)
def test_reference_solution_passes_and_untouched_workspace_fails(backend, name, seed):
    spec = draw(name, seed)
    with backend.create(spec.files, executable=spec.executable) as sandbox:
        for step in spec.solution:
            result = sandbox.run(step, timeout_s=spec.agent_timeout_s)
            assert result.ok, f"step {step!r} failed: exit {result.exit_code}\n{result.stdout}\n{result.stderr}"
        reward, result = grade(sandbox, spec)
        assert reward == 1.0, f"{result.stdout}\n{result.stderr}"
    with backend.create(spec.files, executable=spec.executable) as sandbox:
        reward, result = grade(sandbox, spec)
        assert reward == 0.0, f"an untouched workspace passes: {result.stdout}"
