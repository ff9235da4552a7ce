"""A small, locally trained Qwen-style tokenizer for tests and the CPU quickstart (nothing downloaded).

Byte-level BPE exactly as Qwen2/Qwen3 build it (Qwen's pre-tokenizer regex: single digits, letter runs,
punctuation runs; byte-level alphabet of all 256 bytes, so every string round-trips), trained on a small corpus
(for a run: expert conversations of the environments rendered with the chat template), with Qwen's special tokens
as single tokens at ids 0..8 (`<|endoftext|>` = 0 is the pad id) and Qwen3's chat template (the hybrid variant,
`ipa_jax.chat.template`), so a policy trained here has a Qwen3 checkpoint's chat format.

`load_tokenizer` loads any saved tokenizer (this one, a Qwen3 checkpoint's): the one place the package calls
transformers' AutoTokenizer.
"""

from __future__ import annotations

import json
import re

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

from ipa_jax.chat.template import QWEN3_HYBRID_TEMPLATE
from ipa_jax.chat.tokens import ENDOFTEXT, IM_END, QWEN_TOKENS

# Qwen2's pre-tokenizer split (tokenizer.json of Qwen2.5 / Qwen3).
QWEN_SPLIT_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPECIAL_SPLIT_RE = re.compile("|".join(re.escape(t) for t, _ in QWEN_TOKENS))


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
    hf.chat_template = QWEN3_HYBRID_TEMPLATE
    return hf


def load_tokenizer(path: str) -> PreTrainedTokenizerBase:
    """`transformers.AutoTokenizer.from_pretrained(path)`: the tokenizer of an HF folder, whatever its class."""
    # Imported here, not at the top: AutoTokenizer imports torch whenever torch is installed (2-3 s), a start-up
    # cost that processes loading no tokenizer (offline training, --config_help, a config error) need not pay.
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)
