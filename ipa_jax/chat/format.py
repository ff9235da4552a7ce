"""The chat format at the token level: `ChatFormat` (prompt, assistant-turn and observation ids, stop ids, read off
the tokenizer's own chat template) and `split_reasoning` (an assistant turn's Qwen3 reasoning and content).

`split_reasoning` is SGLang's Qwen3 parser (`Qwen3Detector`, i.e. `BaseReasoningFormatDetector.detect_and_parse`)
and never raises, whatever the string: reasoning starts at `<think>` or, with `forced`, at the start of the turn
(the prompt opened it); without `</think>` the whole turn is reasoning (truncated) and the content is empty; every
`<think>` is removed and text before `<think>` counts as reasoning; the content is stripped. vLLM
(`Qwen3ReasoningParser.extract_reasoning`) instead treats a turn without `</think>` as all content (calls inside
unfinished reasoning would run), drops text before `<think>`, and always reads a lone `</think>` as the end of
reasoning (SGLang only when forced).
"""

from __future__ import annotations

from typing import Any

from ipa_jax.chat.tokens import ENDOFTEXT, IM_END, IM_START, THINK_CLOSE, THINK_OPEN

_SENTINEL = "@@ipa_jax_assistant_turn@@"  # marks the dummy assistant turn when taking template differences


def split_reasoning(text: str, forced: bool = False) -> tuple[str, str]:
    """(reasoning, content) of an assistant turn, as SGLang's Qwen3 reasoning parser splits it; never raises.

    `forced`: the generation prompt already opened `<think>` (Qwen3 thinking-2507 templates), so the turn is
    reasoning until `</think>` even without an opening tag. Without `forced` and without `<think>` the whole text
    is content, unchanged. Otherwise every `<think>` is dropped and the rest stripped; the reasoning runs to the
    first `</think>` (to the end when there is none: truncated reasoning, empty content) and the content after it
    is stripped.
    """
    if not forced and THINK_OPEN not in text:
        return "", text
    body = text.replace(THINK_OPEN, "").strip()
    reasoning, closed, content = body.partition(THINK_CLOSE)
    if not closed:
        return body, ""
    return reasoning, content.strip()


class ChatFormat:
    """Token-level view of the tokenizer's own chat template (a checkpoint's, or the one ipa_jax builds): prompt ids,
    observation ids, stop ids, and how an assistant turn's text splits into reasoning and content.

    enable_thinking: passed to the template (Qwen3's hybrid switch; None = the template's default).
    `reasoning_forced`: the generation prompt itself opens a `<think>` block (Qwen3 thinking-2507 templates, which
    end it with `<think>\n`), so a turn's text is reasoning until `</think>` even without an opening tag.
    """

    def __init__(self, tokenizer: Any, enable_thinking: bool | None = None) -> None:
        self.tokenizer = tokenizer
        self.enable_thinking = enable_thinking
        vocab = tokenizer.get_vocab()
        for t in (IM_END, ENDOFTEXT):
            if t not in vocab:
                raise ValueError(f"tokenizer has no {t} token (a Qwen-style chat tokenizer is required)")
        self.im_end_id = vocab[IM_END]
        self.endoftext_id = vocab[ENDOFTEXT]
        self.stop_token_ids = (self.im_end_id, self.endoftext_id)
        prompt = self.render([{"role": "user", "content": "."}], None, add_generation_prompt=True)
        opened = prompt[prompt.rfind(IM_START) :]
        self.reasoning_forced = THINK_OPEN in opened and THINK_CLOSE not in opened

    def render(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, add_generation_prompt: bool = False
    ) -> str:
        thinking = {} if self.enable_thinking is None else {"enable_thinking": self.enable_thinking}
        return self.tokenizer.apply_chat_template(
            messages, tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt, **thinking
        )

    def split_turn(self, text: str) -> tuple[str, str]:
        """(reasoning, content) of a generated assistant turn, as the serving stack's Qwen3 reasoning parser splits
        it; tool calls and the final answer are read from the content only."""
        return split_reasoning(text, forced=self.reasoning_forced)

    def assistant_turn_ids(
        self, history: list[dict[str, Any]], message: dict[str, Any], tools: list[dict[str, Any]] | None
    ) -> list[int]:
        """An assistant message's own tokens after the generation prompt of `history`, through its `<|im_end|>`:
        the template's rendering of the conversation ending in `message`, minus the prompt. This is exactly what
        the policy would generate there (a think block included where the template and mode put one)."""
        prompt = self.render(history, tools, add_generation_prompt=True)
        full = self.render(history + [message], tools)
        if not full.startswith(prompt):
            raise ValueError(
                "the chat template's rendering of an assistant turn does not extend its generation "
                "prompt: token bookkeeping needs a template whose history is stable"
            )
        return self.encode(full[len(prompt) : full.index(IM_END, len(prompt)) + len(IM_END)])

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def observation_ids(self, tool_messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[int]:
        """Tool responses as the template difference: what the template puts after an assistant turn's
        `<|im_end|>` when these tool messages follow, through the next generation prompt; for Qwen
        `\\n<|im_start|>user\\n<tool_response>\\n...\\n</tool_response><|im_end|>\\n<|im_start|>assistant\\n`.
        The cut is found inside one rendering (after a sentinel assistant turn), so templates that render
        the last assistant turn differently from earlier ones (Qwen3's think block) work too."""
        rendered = self.render(
            [{"role": "user", "content": "."}, {"role": "assistant", "content": _SENTINEL}] + tool_messages,
            tools,
            add_generation_prompt=True,
        )
        at = rendered.find(_SENTINEL)
        cut = rendered.find(IM_END, at)
        if at < 0 or rendered.find(_SENTINEL, at + 1) >= 0 or cut < 0:
            raise ValueError("cannot locate the end of the assistant turn in the chat template's rendering")
        return self.encode(rendered[cut + len(IM_END) :])
