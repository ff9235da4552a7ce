"""A trained policy as a self-contained Hugging Face folder: weights and config.json, the tokenizer with its chat
template, and generation_config.json, so that transformers (AutoTokenizer, AutoModelForCausalLM.generate), SGLang
and vLLM load it with no other file and stop generating at the end of an assistant turn."""

from __future__ import annotations

import json
import os
from typing import Any

import jax
from etils import epath
from transformers import PreTrainedTokenizerBase

from ipa_jax import storage
from ipa_jax.chat import ENDOFTEXT, IM_END, QWEN_TOKENS, load_tokenizer
from ipa_jax.models import Qwen3Config, Qwen3ForCausalLM, save_pretrained
from ipa_jax.pipeline.config import ModelConfig
from ipa_jax.pipeline.run_folder import RunFolder
from ipa_jax.train import TrainState

# transformers 5 saves its generic fast tokenizer as "TokenizersBackend", a class transformers 4 (still in many SGLang
# and vLLM installs) does not have; "PreTrainedTokenizerFast" names the same class in both.
_PORTABLE_TOKENIZER_CLASSES = {"TokenizersBackend": "PreTrainedTokenizerFast"}


def export_policy(
    model_or_state: Qwen3ForCausalLM | TrainState,
    tokenizer: PreTrainedTokenizerBase | None,
    path: str | os.PathLike,
    *,
    dtype=None,
) -> None:
    """Writes the policy to `path` as a self-contained HF folder.

    Files: the safetensors and config.json of `ipa_jax.models.save_pretrained` (dtype: cast on the host, default the
    parameters' own), with config.json's bos/eos/pad token ids set; generation_config.json (`generation_config`);
    the tokenizer (tokenizer.json, tokenizer_config.json with the chat template and the special tokens).
    Token ids come from the tokenizer: eos = [<|im_end|>, <|endoftext|>], pad = <|endoftext|>, bos = the
    tokenizer's bos token or, as in Qwen's config.json, <|endoftext|>.

    tokenizer None (an offline run without one): weights and generation config only, no tokenizer files; the ids
    are then the model config's (a checkpoint's config.json) or, when it has none, those of a tokenizer built by
    `ipa_jax.chat.build_tokenizer` (Qwen's tokens at ids 0..8).
    Multi-host: call on every process (gathering the weights is collective); process 0 writes.
    """
    model = model_or_state.model() if isinstance(model_or_state, TrainState) else model_or_state
    ids = special_token_ids(tokenizer, model.config)  # before writing anything: a wrong tokenizer raises here
    with storage.local_folder(path) as local:  # a gs:// path: written here, then copied
        save_pretrained(model, local, dtype=dtype)
        if jax.process_index() != 0:
            return
        _update_json(os.path.join(local, "config.json"), ids)
        with open(os.path.join(local, "generation_config.json"), "w", encoding="utf-8") as f:
            json.dump(generation_config(ids), f, indent=2)
        if tokenizer is not None:
            save_tokenizer(tokenizer, local)


def special_token_ids(tokenizer: PreTrainedTokenizerBase | None, config: Qwen3Config) -> dict[str, Any]:
    """bos_token_id, eos_token_id (a list) and pad_token_id of the exported folder (see `export_policy`)."""
    if tokenizer is None:
        if config.eos_token_id is not None:
            eos = config.eos_token_id
            return dict(
                bos_token_id=config.bos_token_id,
                pad_token_id=config.pad_token_id,
                eos_token_id=list(eos) if isinstance(eos, tuple) else [eos],
            )
        layout = {token: i for i, (token, _) in enumerate(QWEN_TOKENS)}
        return dict(
            bos_token_id=layout[ENDOFTEXT],
            eos_token_id=[layout[IM_END], layout[ENDOFTEXT]],
            pad_token_id=layout[ENDOFTEXT],
        )
    if len(tokenizer) > config.vocab_size:
        raise ValueError(
            f"tokenizer has {len(tokenizer)} tokens, more than the model's vocab_size "
            f"{config.vocab_size}: not this policy's tokenizer"
        )
    vocab = tokenizer.get_vocab()
    missing = [t for t in (IM_END, ENDOFTEXT) if t not in vocab]
    if missing:
        raise ValueError(f"tokenizer has no {missing}: not a Qwen chat tokenizer")
    bos = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else vocab[ENDOFTEXT]
    return dict(bos_token_id=bos, eos_token_id=[vocab[IM_END], vocab[ENDOFTEXT]], pad_token_id=vocab[ENDOFTEXT])


def generation_config(ids: dict[str, Any]) -> dict[str, Any]:
    """Stops at any of ids["eos_token_id"], pads with ids["pad_token_id"], and samples the policy's own distribution.

    Sampling is set explicitly, not left unset: transformers fills unset fields with top_k=50 when sampling, and
    vLLM / SGLang take generation_config.json's temperature / top_p / top_k as their default sampling parameters;
    any truncation or temperature would make rollouts drawn from the folder differ from the policy whose
    log-probs the learner's importance ratios use. Greedy decoding stays one argument away (do_sample=False).
    The fields of transformers' GenerationConfig, written as JSON by `export_policy` (GenerationConfig itself imports
    torch whenever it is installed).
    """
    return dict(**ids, do_sample=True, temperature=1.0, top_p=1.0, top_k=0)


def save_tokenizer(tokenizer: PreTrainedTokenizerBase, path: str | os.PathLike) -> None:
    """tokenizer.save_pretrained(path) with the chat template inside tokenizer_config.json (transformers 5 would put it
    only in chat_template.jinja, which older transformers and serving stacks ignore) and a tokenizer class every
    transformers version resolves; raises RuntimeError if AutoTokenizer does not load the same tokenizer back."""
    tokenizer.save_pretrained(path, save_jinja_files=False)
    config_file = os.path.join(path, "tokenizer_config.json")
    with open(config_file, encoding="utf-8") as f:
        cls = json.load(f).get("tokenizer_class")
    if cls in _PORTABLE_TOKENIZER_CLASSES:
        _update_json(config_file, {"tokenizer_class": _PORTABLE_TOKENIZER_CLASSES[cls]})
    loaded = load_tokenizer(path)
    if (loaded.get_vocab(), loaded.chat_template, loaded.special_tokens_map) != (
        tokenizer.get_vocab(),
        tokenizer.chat_template,
        tokenizer.special_tokens_map,
    ):
        raise RuntimeError(
            f"the tokenizer saved to {path} loads back with another vocabulary, chat template or special tokens"
        )


def existing_tokenizer(model: ModelConfig, folder: RunFolder) -> PreTrainedTokenizerBase | None:
    """The run's tokenizer when one exists, never building one (offline runs load none): model.tokenizer, else the
    model folder's if it holds tokenizer files, else <run_dir>/tokenizer (built by an online attempt); else None."""
    if model.tokenizer:
        return load_tokenizer(model.tokenizer)
    for path in (model.path, folder.tokenizer_dir):
        if path and epath.Path(path, "tokenizer_config.json").exists():
            with storage.local_copy(path) as local:
                return load_tokenizer(local)
    return None


def _update_json(fname: str, fields: dict[str, Any]) -> None:
    with open(fname, encoding="utf-8") as f:
        d = json.load(f)
    d.update(fields)
    with open(fname, "w", encoding="utf-8") as f:
        json.dump(d, f, indent=2)
