"""Fixtures for learner tests (helpers live in train_helpers.py)."""

import pytest


@pytest.fixture
def run_dir(tmp_path):
    return str(tmp_path / "run")
