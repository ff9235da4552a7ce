"""Terminal tasks: shell work in a sandbox graded by tests (built-in suite, or Terminal-Bench / Harbor folders)."""

from ipa_jax.envs.terminal.env import DONE_MESSAGE, TerminalEnv
from ipa_jax.envs.terminal.grader import grade
from ipa_jax.envs.terminal.spec import TerminalSpec, load_task_folder, split_solution

__all__ = ["DONE_MESSAGE", "TerminalEnv", "TerminalSpec", "grade", "load_task_folder", "split_solution"]
