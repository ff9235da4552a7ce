"""The base of environments whose episodes hold a sandbox."""

from __future__ import annotations

from ipa_jax.envs.base import Env
from ipa_jax.envs.sandbox.base import Sandbox


class SandboxedEnv(Env):
    """An environment whose episode holds `self.sandbox` (created by the subclass's `reset`), deleted by `close`."""

    def __init__(self) -> None:
        super().__init__()
        self.sandbox: Sandbox | None = None

    def close(self) -> None:
        super().close()
        if self.sandbox is not None:
            self.sandbox.close()
            self.sandbox = None
