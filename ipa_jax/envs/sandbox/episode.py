"""The base of environments whose episodes hold a sandbox."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from ipa_jax.envs.base import Env
from ipa_jax.envs.sandbox.base import Sandbox, SandboxError


class SandboxedEnv(Env):
    """An environment whose episode holds `self.sandbox` (created by the subclass's `reset` through
    `create_sandbox`), deleted by `close`. `close` may come from another thread while `reset` still builds the
    sandbox (an episode cancelled mid-reset): the close wins and nothing is left behind."""

    def __init__(self) -> None:
        super().__init__()
        self.sandbox: Sandbox | None = None
        self._sandbox_lock = threading.Lock()
        self._closes = 0  # close() calls so far: a sandbox whose creation spans one belongs to a closed episode

    def create_sandbox(self, create: Callable[..., Sandbox], *args: Any, **kwargs: Any) -> Sandbox:
        """`create(*args, **kwargs)` as this episode's sandbox. Raises SandboxError (and deletes the new sandbox) when
        the environment was closed while it was being created."""
        with self._sandbox_lock:
            closes = self._closes
        sandbox = create(*args, **kwargs)
        with self._sandbox_lock:
            if self._closes == closes:
                self.sandbox = sandbox
                return sandbox
        sandbox.close()
        raise SandboxError("the episode was closed while its sandbox was being created")

    def close(self) -> None:
        super().close()
        with self._sandbox_lock:
            self._closes += 1
            sandbox, self.sandbox = self.sandbox, None
        if sandbox is not None:
            sandbox.close()
