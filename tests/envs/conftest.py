"""Fixtures the sandbox and grading tests share."""

import importlib.metadata
import importlib.util
import os
import shutil
import subprocess
import tempfile

import pytest

PYTEST_MODULES = ("pytest", "_pytest", "pluggy", "iniconfig", "packaging", "pygments", "py")
PYTEST_DISTRIBUTIONS = ("pytest", "pluggy", "iniconfig", "packaging", "pygments")  # their versions come from these


@pytest.fixture(scope="session")
def sandbox_pytest():
    """pytest's pure-Python packages and their metadata in a folder every user can read (the sandbox's python3 has
    no pytest): tests bind it read-only and put it on their PYTHONPATH."""
    folder = tempfile.mkdtemp(prefix="ipa_jax_test_pytest_")
    for name in PYTEST_MODULES:
        origin = importlib.util.find_spec(name).origin
        source = os.path.dirname(origin) if origin.endswith("__init__.py") else origin
        copy = shutil.copytree if os.path.isdir(source) else shutil.copy
        copy(source, os.path.join(folder, os.path.basename(source)))
    for name in PYTEST_DISTRIBUTIONS:
        metadata = str(importlib.metadata.distribution(name)._path)
        shutil.copytree(metadata, os.path.join(folder, os.path.basename(metadata)))
    subprocess.run(["chmod", "-R", "a+rX", folder], check=True)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)
