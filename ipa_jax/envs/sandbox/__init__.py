"""Isolated workspaces for agent tools: the backend interface, the bubblewrap backend, the shell/Python/file tools."""

from ipa_jax.envs.sandbox.base import (
    CommandResult,
    Mount,
    Sandbox,
    SandboxBackend,
    SandboxError,
    SandboxLimits,
    make_backend,
    register_backend,
    shared_backend,
)
from ipa_jax.envs.sandbox.bubblewrap import BubblewrapBackend, BubblewrapSandbox

register_backend("bubblewrap", BubblewrapBackend)

__all__ = [
    "BubblewrapBackend",
    "BubblewrapSandbox",
    "CommandResult",
    "Mount",
    "Sandbox",
    "SandboxBackend",
    "SandboxError",
    "SandboxLimits",
    "make_backend",
    "register_backend",
    "shared_backend",
]
