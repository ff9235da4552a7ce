"""Where a policy's success is decided: its success rate from every expert anchor of a set of tasks.

Anchor j is the state after the scripted expert's first j tool-call chunks (anchor 0 the start state, anchor K only
the answer left); `probe_policy` samples episodes of an HF policy from each anchor (`probe_forks`). A curriculum from
K back to 0 (sequential rollback) has something to learn where the rates fall off towards 0.
"""

from __future__ import annotations

import asyncio

from ipa_jax.chat import ChatFormat, load_tokenizer
from ipa_jax.engines import EmbeddedEngine
from ipa_jax.models import from_pretrained
from ipa_jax.pipeline.config import ExperimentConfig
from ipa_jax.pipeline.online import sampling_agent_config
from ipa_jax.rollout.resample import ForkEstimate, build_experts, probe_forks


def probe_policy(
    exp: ExperimentConfig,
    policy: str,
    *,
    tokenizer: str = "",
    num_tasks: int = 16,
    samples: int = 8,
    split: str = "eval",
    seed: int = 0,
) -> list[ForkEstimate]:
    """Per-task success by anchor of the HF policy folder `policy` on `num_tasks` tasks of exp.env (scripted
    experts; sampling as exp.rollout; the tokenizer from `tokenizer`, else exp.model.tokenizer, else `policy`)."""
    tok = load_tokenizer(tokenizer or exp.model.tokenizer or policy)
    chat = ChatFormat(tok, enable_thinking=exp.rollout.enable_thinking)
    tasks = exp.env.make().tasks(split, num_tasks, seed=seed)
    experts = build_experts(exp.resample, tasks, chat, exp.env.expert_error)
    r = exp.rollout
    engine = EmbeddedEngine(
        from_pretrained(policy),
        seed=seed,
        max_len=r.max_context,
        max_batch=max(r.concurrency, 1),
        tokenizer=tok,
        prefix_cache=r.prefix_cache,
    )
    agent = sampling_agent_config(exp)

    async def probe() -> list[ForkEstimate]:
        try:
            return await probe_forks(
                engine,
                chat,
                experts,
                samples,
                exp.resample.fork_jump,
                agent,
                success_reward=exp.resample.success_reward,
                concurrency=max(r.concurrency, 1),
            )
        finally:
            await engine.close()

    return asyncio.run(probe())
