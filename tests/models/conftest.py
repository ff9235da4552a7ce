"""Shared tiny checkpoints for the model tests (built once per session by transformers, float32)."""

import pytest
from tiny_models import make_tiny_hf_checkpoint


@pytest.fixture(scope="session")
def hf_checkpoint(tmp_path_factory):
    """hf_checkpoint(name, moe=..., family=..., **overrides) -> path; cached by name for the whole session."""
    cache = {}

    def make(name: str, *, moe: bool, **overrides) -> str:
        if name not in cache:
            cache[name] = make_tiny_hf_checkpoint(tmp_path_factory.mktemp(name), moe=moe, **overrides)
        return cache[name]

    return make
