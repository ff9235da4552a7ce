"""The agent loop over real HTTP: SGLangEngine client -> dev server (SGLang's contract) -> scripted expert."""

import asyncio

import numpy as np
import pytest
from rollout_fakes import ScriptedEngine, append_only_chat, expert_script, fake_logprob

from ipa_jax.engines import SGLangEngine
from ipa_jax.engines.devserver import DevServer
from ipa_jax.envs import make_env
from ipa_jax.rollout.agent import AgentConfig, run_episodes


@pytest.fixture(scope="module")
def chat():
    return append_only_chat()


def test_episodes_through_sglang_client_and_dev_server(chat):
    env = make_env("lookup")
    tasks = env.tasks("eval", 6, 0)
    backend = ScriptedEngine(chat, expert_script(chat, tasks), delay=0.002)
    server = DevServer(backend).serve_in_thread()
    try:

        async def main():
            client = SGLangEngine([server.url])
            try:
                return await run_episodes(client, chat, tasks, AgentConfig(), concurrency=3)
            finally:
                await client.close()

        trajs = asyncio.run(main())
    finally:
        server.shutdown()
    for task, traj in zip(tasks, trajs):
        assert traj.reward == 1.0 and traj.info["finish_reason"] == "answer"
        assert traj.tokens.tolist() == chat.encode(chat.render(env.expert(task), task.tools))[:-1]
        # Behaviour log-probs survive the JSON round trip exactly (float32).
        expected = np.asarray([fake_logprob(t) for t in traj.tokens[traj.action_mask]], np.float32)
        np.testing.assert_array_equal(traj.behavior_logprobs[traj.action_mask], expected)
        traj.validate(vocab_size=len(chat.tokenizer))
    assert backend.max_in_flight >= 2  # concurrent requests reached the server
