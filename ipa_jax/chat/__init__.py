"""The Qwen chat format, a base layer that imports no other ipa_jax package (any layer may import it).

tokens.py       the chat-format token strings (`<|im_start|>`, `<|im_end|>`, `<tool_call>`, ...): pure constants
template.py     Qwen3's Jinja chat templates (hybrid, thinking-2507) and `render`
tokenizer.py    a small Qwen-style BPE tokenizer built locally (`build_tokenizer`); `load_tokenizer`
format.py       `ChatFormat` (prompt, assistant-turn and observation ids of a tokenizer's template) and
                `split_reasoning` (an assistant turn's reasoning and content)
"""

from ipa_jax.lazy_exports import lazy_getattr

# Imported on first use: tokens and format are light (the environments import them), template and tokenizer bring
# transformers.
_EXPORTS = {
    **dict.fromkeys(
        (
            "ENDOFTEXT",
            "IM_END",
            "IM_START",
            "QWEN_TOKENS",
            "THINK_CLOSE",
            "THINK_OPEN",
            "TOOL_CALL_CLOSE",
            "TOOL_CALL_OPEN",
            "TOOL_RESPONSE_CLOSE",
            "TOOL_RESPONSE_OPEN",
        ),
        "tokens",
    ),
    **dict.fromkeys(("CHAT_TEMPLATES", "QWEN3_HYBRID_TEMPLATE", "QWEN3_THINKING_2507_TEMPLATE", "render"), "template"),
    **dict.fromkeys(("build_tokenizer", "load_tokenizer"), "tokenizer"),
    **dict.fromkeys(("ChatFormat", "split_reasoning"), "format"),
}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_getattr(__name__, _EXPORTS)
