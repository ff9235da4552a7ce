"""Sandboxed episodes through the agent loop: sixteen episodes' commands run together off the event loop, a
cancelled episode releases its sandbox (also one cancelled while the sandbox is being built), nothing is left behind."""

import asyncio
import os
import re
import subprocess
import threading
import time

import pytest
from rollout_fakes import ScriptedEngine, append_only_chat

from ipa_jax.envs import ToolCall, format_tool_call, make_env
from ipa_jax.envs.sandbox import SandboxLimits, shared_backend
from ipa_jax.envs.sandbox.bubblewrap import BubblewrapBackend
from ipa_jax.rollout import AgentConfig
from ipa_jax.rollout.agent import run_episode, run_episodes


def _own_workspaces() -> list[str]:
    root = shared_backend("bubblewrap", SandboxLimits()).root
    return [d for d in os.listdir(root) if d.startswith(f"{os.getpid()}-")]


def _stamp_script(chat, seconds):
    """Each episode: one bash call printing its start and end time around a sleep, then the final turn."""
    call = format_tool_call(ToolCall("bash", {"command": f"date +%s.%N; sleep {seconds}; date +%s.%N"}))
    return lambda prompt, index: call if index == 0 else "finished"


def test_sixteen_episodes_run_their_commands_together_without_blocking_the_loop():
    chat = append_only_chat()
    engine = ScriptedEngine(chat, _stamp_script(chat, 6.0))  # long enough for 16 starts on a loaded machine
    tasks = make_env("terminal").tasks("train", 16)
    ticks = []

    async def main():
        async def heartbeat():
            while True:
                ticks.append(time.time())  # the clock the sandboxed `date` reads
                await asyncio.sleep(0.02)

        beat = asyncio.create_task(heartbeat())
        out = await run_episodes(
            engine, chat, tasks, AgentConfig(max_new_tokens=64, record_messages=True), concurrency=16
        )
        beat.cancel()
        return out

    trajs = asyncio.run(main())
    spans = []
    for traj in trajs:
        observation = next(m["content"] for m in traj.info["messages"] if m["role"] == "tool")
        start, end = map(float, re.findall(r"\d+\.\d+", observation))
        spans.append((start, end))
        assert traj.reward == 0.0 and traj.info["finish_reason"] == "answer"  # the tests ran; nothing was solved
    # Commands run one at a time would never overlap; here most of the sixteen run together (the episodes' starts
    # spread with the machine's load: each reset builds a sandbox, so "all sixteen" would test the load instead).
    running_at_start = [sum(s <= start < e for s, e in spans) for start, _ in spans]
    assert max(running_at_start) >= 8, sorted(spans)
    # While the commands ran, the event loop (and so the engine) kept ticking: a command run on the loop's thread
    # would block it for its whole 6 s, so no tick could fall inside any span. On an overloaded machine the loop's
    # thread itself can be descheduled for seconds (seen in a CI run beside two training runs: a span without a
    # tick), so the test asks for ticks inside at least half the spans: blocking commands would leave none.
    ticked = sum(any(s < t < e for t in ticks) for s, e in spans)
    assert ticked >= len(spans) // 2, (ticked, sorted(spans))
    assert _own_workspaces() == []


def test_a_cancelled_episode_releases_its_sandbox():
    # An odd duration: pgrep below searches every process on the machine for this command, and another program
    # (a shell running `sleep 300`) must not look like a leaked one.
    seconds = 271.828
    chat = append_only_chat()
    engine = ScriptedEngine(chat, _stamp_script(chat, seconds))
    task = make_env("terminal").tasks("train", 1)[0]

    async def main():
        episode = asyncio.create_task(run_episode(engine, chat, task, AgentConfig(max_new_tokens=64)))
        await asyncio.sleep(1.0)
        assert len(_own_workspaces()) == 1
        episode.cancel()
        with pytest.raises(asyncio.CancelledError):
            await episode

    asyncio.run(main())
    assert _own_workspaces() == []
    # The command was SIGKILLed; on a loaded machine its processes may take a moment to exit (a leaked one would
    # still be there after its 270 s).
    deadline = time.monotonic() + 10.0
    while (
        left := subprocess.run(["pgrep", "-f", f"sleep {seconds}"], capture_output=True).stdout
    ) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert left == b""


def test_an_episode_cancelled_while_its_sandbox_is_built_leaves_nothing(monkeypatch):
    """The cancel's close runs while reset (in its thread) still builds the sandbox: the sandbox that reset then
    finishes must not outlive the episode."""
    chat = append_only_chat()
    engine = ScriptedEngine(chat, _stamp_script(chat, 300))
    task = make_env("terminal").tasks("train", 1)[0]
    built = threading.Event()
    create = BubblewrapBackend.create

    def slow_create(self, *args, **kwargs):
        sandbox = create(self, *args, **kwargs)  # the workspace exists ...
        built.set()
        time.sleep(1.0)  # ... and reset is still running when the episode is cancelled
        return sandbox

    monkeypatch.setattr(BubblewrapBackend, "create", slow_create)

    async def main():
        episode = asyncio.create_task(run_episode(engine, chat, task, AgentConfig(max_new_tokens=64)))
        await asyncio.get_running_loop().run_in_executor(None, built.wait)
        assert len(_own_workspaces()) == 1
        episode.cancel()
        with pytest.raises(asyncio.CancelledError):
            await episode

    asyncio.run(main())
    deadline = time.monotonic() + 10.0  # reset's thread ends ~1 s later; a leaked workspace stays for good
    while _own_workspaces() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _own_workspaces() == []
