"""A small, locally trained Qwen-style tokenizer for tests and the CPU quickstart (nothing downloaded).

Byte-level BPE exactly as Qwen2/Qwen3 build it (Qwen's pre-tokenizer regex: single digits, letter runs,
punctuation runs; byte-level alphabet of all 256 bytes, so every string round-trips), trained on a small corpus
(for a run: expert conversations of the environments rendered with the chat template), with Qwen's special tokens
as single tokens at ids 0..8 (`<|endoftext|>` = 0 is the pad id) and a Qwen2.5-style chat template (tools block
in the system turn, `<tool_call>` JSON in assistant turns, consecutive tool messages in one `<|im_start|>user` turn
of `<tool_response>` blocks). The template is append-only at assistant turns: the history before an assistant
turn, rendered with the generation
prompt, is a prefix of the full rendering, so a trajectory is the prompt, the generated ids and the
tool observations tokenized as template differences, appended in order.
"""

from __future__ import annotations

import json
import re
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast
from transformers.utils.chat_template_utils import render_jinja_template

from ipa_jax.chat_tokens import ENDOFTEXT, IM_END, QWEN_TOKENS

# Qwen2's pre-tokenizer split (tokenizer.json of Qwen2.5 / Qwen3).
QWEN_SPLIT_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
DEFAULT_SYSTEM_PROMPT = "You are a helpful assistant."

# Qwen2.5's template with a short default system prompt (tiny models, short contexts).
CHAT_TEMPLATE = (
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
    "            {{- '\\n<tool_call>\\n{\"name\": \"' }}\n"
    "            {{- tool_call.name }}\n"
    "            {{- '\", \"arguments\": ' }}\n"
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

_SPECIAL_SPLIT_RE = re.compile("|".join(re.escape(t) for t, _ in QWEN_TOKENS))


def render_chat(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None, add_generation_prompt: bool = False
) -> str:
    """The chat template applied to one conversation, as text (no tokenizer needed)."""
    rendered, _ = render_jinja_template(
        conversations=[messages], tools=tools, chat_template=CHAT_TEMPLATE, add_generation_prompt=add_generation_prompt
    )
    return rendered[0]


def build_tokenizer(
    corpus: list[str], vocab_size: int = 1024, min_frequency: int = 2, model_max_length: int = 4096
) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE on `corpus` and wrap it as a Qwen-style tokenizer (a run's corpus:
    `ipa_jax.pipeline.tokenizer.expert_corpus`).

    Deterministic: the same corpus and settings give the same vocabulary and merges. vocab_size counts the
    9 Qwen tokens and the 256 byte symbols, so it must be >= 265; it is an upper bound (the merges stop when
    no pair occurs `min_frequency` times).
    """
    n_reserved = len(QWEN_TOKENS) + 256
    if vocab_size < n_reserved:
        raise ValueError(f"vocab_size must be >= {n_reserved} (Qwen tokens + 256 bytes), got {vocab_size}")
    if min_frequency < 1:
        raise ValueError(f"min_frequency must be >= 1, got {min_frequency}")
    if not isinstance(corpus, (list, tuple)) or not all(isinstance(s, str) for s in corpus):
        raise ValueError("corpus must be a list of strings")
    # Special tokens never take part in merges: train on the text between them.
    pieces = [p for text in corpus for p in _SPECIAL_SPLIT_RE.split(text) if p]

    pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_SPLIT_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    trainer_tok = Tokenizer(models.BPE())
    trainer_tok.pre_tokenizer = pre_tokenizer
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(QWEN_TOKENS),
        min_frequency=min_frequency,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    trainer_tok.train_from_iterator(pieces, trainer)
    # Rebuild the model with the Qwen tokens at ids 0..8 (pad = 0) and the learned vocab after them. The
    # trainer's own special_tokens option would mark the tool tags special (dropped by skip_special_tokens).
    trained = json.loads(trainer_tok.to_str())["model"]
    vocab = {t: i for i, (t, _) in enumerate(QWEN_TOKENS)}
    vocab.update({t: i + len(QWEN_TOKENS) for t, i in trained["vocab"].items()})
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in trained["merges"]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizer
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, special in QWEN_TOKENS if special])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t, special in QWEN_TOKENS if not special])

    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        bos_token=None,
        unk_token=None,
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,
        split_special_tokens=False,
    )
    hf.chat_template = CHAT_TEMPLATE
    return hf
