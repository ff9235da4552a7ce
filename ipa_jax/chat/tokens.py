"""Qwen's chat-format token strings (Qwen2.5 / Qwen3), defined once: the chat template's turn markers, the
hermes-style tool-call tags and the thinking tags. Pure constants, so any module can import them."""

ENDOFTEXT = "<|endoftext|>"  # end of document; also the pad token
IM_START = "<|im_start|>"  # opens a chat turn: `<|im_start|>role\n`
IM_END = "<|im_end|>"  # closes a chat turn; generation stops on it
TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
TOOL_RESPONSE_OPEN = "<tool_response>"
TOOL_RESPONSE_CLOSE = "</tool_response>"
THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"

# (token, special) in id order: a tokenizer built here gives them ids 0..8. Special tokens are dropped by
# decode(skip_special_tokens=True); the tool and think tags are not (like Qwen, where they are added tokens
# with special=False).
QWEN_TOKENS: tuple[tuple[str, bool], ...] = (
    (ENDOFTEXT, True),
    (IM_START, True),
    (IM_END, True),
    (TOOL_CALL_OPEN, False),
    (TOOL_CALL_CLOSE, False),
    (TOOL_RESPONSE_OPEN, False),
    (TOOL_RESPONSE_CLOSE, False),
    (THINK_OPEN, False),
    (THINK_CLOSE, False),
)
