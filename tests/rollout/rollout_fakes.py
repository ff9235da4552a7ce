"""Scripted engines and expert scripts shared by the rollout tests."""

from __future__ import annotations

import asyncio

import numpy as np

from ipa_jax.chat import ChatFormat
from ipa_jax.engines.base import Engine, GenerationResult, broadcast_params
from ipa_jax.envs import ToolCall, format_tool_call, make_env
from ipa_jax.pipeline.tokenizer import build_corpus_tokenizer

DEFAULT_SYSTEM_PROMPT = "You are a helpful assistant."

# An append-only chat template (Qwen2.5's, with a short default system prompt): the history before an assistant turn,
# rendered with the generation prompt, is a prefix of the full rendering, so a trajectory built by the agent loop
# equals the template's rendering of the finished conversation. The bookkeeping tests use it for that check; Qwen3's
# own template (not append-only for empty reasoning) is tested in test_rollout_qwen3.py.
APPEND_ONLY_TEMPLATE = (
    "{%- if tools %}\n"
    "    {{- '<|im_start|>system\\n' }}\n"
    "    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- messages[0]['content'] }}\n"
    "    {%- else %}\n"
    "        {{- '" + DEFAULT_SYSTEM_PROMPT + "' }}\n"
    "    {%- endif %}\n"
    '    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n'
    'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}\n'
    "    {%- for tool in tools %}\n"
    '        {{- "\\n" }}\n'
    "        {{- tool | tojson }}\n"
    "    {%- endfor %}\n"
    '    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments '
    'within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": '
    '<args-json-object>}\\n</tool_call><|im_end|>\\n" }}\n'
    "{%- else %}\n"
    "    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n"
    "    {%- else %}\n"
    "        {{- '<|im_start|>system\\n" + DEFAULT_SYSTEM_PROMPT + "<|im_end|>\\n' }}\n"
    "    {%- endif %}\n"
    "{%- endif %}\n"
    "{%- for message in messages %}\n"
    '    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or '
    '(message.role == "assistant" and not message.tool_calls) %}\n'
    "        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}\n"
    '    {%- elif message.role == "assistant" %}\n'
    "        {{- '<|im_start|>' + message.role }}\n"
    "        {%- if message.content %}\n"
    "            {{- '\\n' + message.content }}\n"
    "        {%- endif %}\n"
    "        {%- for tool_call in message.tool_calls %}\n"
    "            {%- if tool_call.function is defined %}\n"
    "                {%- set tool_call = tool_call.function %}\n"
    "            {%- endif %}\n"
    '            {{- \'\\n<tool_call>\\n{"name": "\' }}\n'
    "            {{- tool_call.name }}\n"
    '            {{- \'", "arguments": \' }}\n'
    "            {%- if tool_call.arguments is string %}\n"
    "                {{- tool_call.arguments }}\n"
    "            {%- else %}\n"
    "                {{- tool_call.arguments | tojson }}\n"
    "            {%- endif %}\n"
    "            {{- '}\\n</tool_call>' }}\n"
    "        {%- endfor %}\n"
    "        {{- '<|im_end|>\\n' }}\n"
    '    {%- elif message.role == "tool" %}\n'
    '        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}\n'
    "            {{- '<|im_start|>user' }}\n"
    "        {%- endif %}\n"
    "        {{- '\\n<tool_response>\\n' }}\n"
    "        {{- message.content }}\n"
    "        {{- '\\n</tool_response>' }}\n"
    '        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}\n'
    "            {{- '<|im_end|>\\n' }}\n"
    "        {%- endif %}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}\n"
)


def append_only_chat() -> ChatFormat:
    """The corpus tokenizer with APPEND_ONLY_TEMPLATE as its chat template."""
    tokenizer = build_corpus_tokenizer()
    tokenizer.chat_template = APPEND_ONLY_TEMPLATE
    return ChatFormat(tokenizer)


def fake_logprob(token: int) -> float:
    return -0.05 - 0.01 * (token % 13)


class ScriptedEngine(Engine):
    """Engine whose output is `script(prompt_ids, call_index) -> str | list[int]` (a str is encoded and closed
    with <|im_end|>). Applies the stop-token and max_new_tokens semantics of SamplingParams, records every call,
    and tracks the number of requests in flight. `updates_mid_call`: call indices (per session) during which a weight
    update interrupts the turn and it continues on the next version (rollout.partial = "abort_resume"): its first
    half is sampled by the current version, the rest by the next one."""

    def __init__(self, chat, script, delay: float = 0.0, routed_layout: tuple[int, int] | None = None):
        self.chat, self.script, self.delay, self.routed_layout = chat, script, delay, routed_layout
        self.version = 0
        self.calls: dict[str, list[tuple[list[int], list[int], list[float]]]] = {}
        self.in_flight = self.max_in_flight = 0
        self.abort_sessions: set[str] = set()
        self.bump_version_each_call = False
        self.updates_mid_call: set[int] = set()

    @property
    def weight_version(self) -> int:
        return self.version

    async def generate(self, prompts, params, session_ids=None, request_ids=None):
        params = broadcast_params(params, len(prompts))
        keys = session_ids or request_ids or [f"anonymous-{len(self.calls)}-{i}" for i in range(len(prompts))]
        out = []
        for prompt, p, sid in zip(prompts, params, keys):
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
            await asyncio.sleep(self.delay)
            self.in_flight -= 1
            calls = self.calls.setdefault(sid, [])
            if any(sid.startswith(a) for a in self.abort_sessions):
                out.append(GenerationResult([], [], "abort", None, self.version))
                continue
            produced = self.script(list(prompt), len(calls))
            ids = self.chat.encode(produced) + [self.chat.im_end_id] if isinstance(produced, str) else list(produced)
            finish, matched = "length", None
            for i, t in enumerate(ids):
                if t in p.stop_token_ids:
                    ids, finish, matched = ids[: i + 1], "stop", t
                    break
            if len(ids) > p.max_new_tokens:
                ids, finish, matched = ids[: p.max_new_tokens], "length", None
            lps = [fake_logprob(t) for t in ids]
            versions = [self.version] * len(ids)
            if len(calls) in self.updates_mid_call:
                self.version += 1
                versions[len(ids) // 2 :] = [self.version] * (len(ids) - len(ids) // 2)
            calls.append((list(prompt), ids, lps))
            routed = None
            if p.return_routed_experts and self.routed_layout:
                n = len(prompt) + len(ids) - 1
                routed = (np.arange(n * np.prod(self.routed_layout)) % 7).reshape(n, *self.routed_layout)
                routed = routed.astype(np.int32)
            out.append(GenerationResult(ids, lps, finish, matched, self.version, routed, versions))
            if self.bump_version_each_call:
                self.version += 1
        return out

    async def update_weights(self, path, version):
        self.version = version

    async def pause(self):
        pass

    async def resume(self):
        pass

    async def abort(self, request_ids=None):
        self.abort_sessions.update(request_ids if request_ids is not None else [""])

    async def health(self):
        return True

    async def close(self):
        pass


def expert_turn_texts(env, task) -> list[str]:
    """The assistant turns of the expert's conversation, as the model would generate them."""
    texts = []
    for m in env.expert(task):
        if m["role"] == "assistant":
            calls = [ToolCall(c["function"]["name"], c["function"]["arguments"]) for c in m.get("tool_calls", [])]
            texts.append("\n".join(format_tool_call(c) for c in calls) if calls else m["content"])
    return texts


def expert_script(chat, tasks):
    """Plays the expert: the turn index is read from the prompt (the number of assistant turns so far)."""
    by_prompt = {task.prompt: (make_env(task.env), task) for task in tasks}

    def script(prompt, call_index):
        text = chat.decode(prompt)
        env, task = next(v for k, v in by_prompt.items() if f"user\n{k}<|im_end|>" in text)
        turn = text.count("<|im_start|>assistant\n") - 1
        return expert_turn_texts(env, task)[turn]

    return script


class RecordingEngine(Engine):
    """Wraps an engine and records (prompt, token_ids, logprobs) of every call per session id."""

    def __init__(self, inner: Engine):
        self.inner = inner
        self.calls: dict[str, list[tuple[list[int], list[int], list[float]]]] = {}

    @property
    def weight_version(self) -> int:
        return self.inner.weight_version

    async def generate(self, prompts, params, session_ids=None, request_ids=None):
        out = await self.inner.generate(prompts, params, session_ids=session_ids, request_ids=request_ids)
        for prompt, sid, res in zip(prompts, session_ids, out):
            self.calls.setdefault(sid, []).append((list(prompt), list(res.token_ids), list(res.logprobs)))
        return out

    async def update_weights(self, path, version):
        await self.inner.update_weights(path, version)

    async def pause(self):
        await self.inner.pause()

    async def resume(self):
        await self.inner.resume()

    async def abort(self, request_ids=None):
        await self.inner.abort(request_ids)

    async def health(self):
        return await self.inner.health()

    async def close(self):
        await self.inner.close()


def check_token_invariants(chat, engine, traj, task):
    """The trajectory equals the chat template of its final conversation, with the engine's own ids for the
    generated turns; masks, chunk ids and behaviour log-probs match what the engine returned."""
    traj.validate(vocab_size=len(chat.tokenizer))
    calls = engine.calls[traj.uid]
    messages = traj.info["messages"]
    assistant_idx = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    assert len(calls) == len(assistant_idx) == traj.num_chunks == traj.info["num_turns"]
    expected: list[int] = []
    for k, (i, (prompt, ids, lps)) in enumerate(zip(assistant_idx, calls)):
        head = chat.render(messages[:i], task.tools, add_generation_prompt=True)
        if k == 0:
            between = head
        else:
            prev = chat.render(messages[: assistant_idx[k - 1] + 1], task.tools)
            cut = prev.rindex("<|im_end|>") + len("<|im_end|>")
            assert head.startswith(prev[:cut])
            between = head[cut:]
        expected += chat.encode(between)
        assert prompt == expected  # what the engine saw is the trajectory so far
        start = len(expected)
        expected += ids
        span = slice(start, start + len(ids))
        assert traj.action_mask[span].all() and (traj.chunk_ids[span] == k).all()
        np.testing.assert_array_equal(traj.behavior_logprobs[span], np.asarray(lps, np.float32))
    assert traj.tokens.tolist() == expected
    assert traj.action_mask.sum() == sum(len(ids) for _, ids, _ in calls) == traj.info["generated_tokens"]
    assert (traj.behavior_logprobs[~traj.action_mask] == 0).all() and not traj.expert_mask.any()
