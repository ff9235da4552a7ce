"""export_policy: the exported folder is a self-contained HF policy. Loaded with transformers alone, its tokenizer
is the run's (ids, special tokens, chat template), `generate` with its generation_config.json stops at the chat stop
tokens and pads with <|endoftext|>, and its logits are the JAX policy's."""

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from tiny_models import tiny_qwen3_config
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, LogitsProcessor, LogitsProcessorList

from ipa_jax.chat import ENDOFTEXT, IM_END, QWEN_TOKENS, template
from ipa_jax.envs import make_env
from ipa_jax.models import Qwen3Config, init_model
from ipa_jax.pipeline import RunFolder, load_config, validate
from ipa_jax.pipeline.build import build_mesh, build_state
from ipa_jax.pipeline.config import ModelConfig
from ipa_jax.pipeline.export import existing_tokenizer, export_policy
from ipa_jax.pipeline.tokenizer import build_corpus_tokenizer

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
QUICKSTART = os.path.join(REPO, "configs", "quickstart.py")
TINY_ARCH = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
)


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    """(tokenizer, TrainState, exported folder) of a tiny random Qwen3-MoE built as a quickstart run builds it."""
    tokenizer = build_corpus_tokenizer(640)
    root = tmp_path_factory.mktemp("export")
    exp = validate(load_config(QUICKSTART, {"model.arch": TINY_ARCH, "train.run_dir": str(root / "run")}))
    state = build_state(exp, build_mesh(exp.mesh))
    path = str(root / "hf")
    export_policy(state, tokenizer, path)
    return tokenizer, state, path


def _conversation():
    env = make_env("calculator", ops=2)
    task = env.tasks("eval", 1, 0)[0]
    return env.expert(task), task.tools


def test_folder_holds_weights_config_tokenizer_and_generation_config(policy):
    _, _, path = policy
    assert sorted(os.listdir(path)) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    tok_config = json.load(open(os.path.join(path, "tokenizer_config.json")))
    assert tok_config["eos_token"] == IM_END and tok_config["pad_token"] == ENDOFTEXT
    assert "<|im_start|>" in tok_config["chat_template"]  # in tokenizer_config.json, where every version reads it
    ids = {token: i for i, (token, _) in enumerate(QWEN_TOKENS)}
    config = json.load(open(os.path.join(path, "config.json")))
    assert (config["eos_token_id"], config["pad_token_id"], config["bos_token_id"]) == (
        [ids[IM_END], ids[ENDOFTEXT]],
        ids[ENDOFTEXT],
        ids[ENDOFTEXT],
    )
    assert Qwen3Config.from_pretrained_dir(path).eos_token_id == (ids[IM_END], ids[ENDOFTEXT])  # ipa_jax reads it


def test_tokenizer_round_trips_ids_special_tokens_and_chat_template(policy):
    tokenizer, _, path = policy
    loaded = AutoTokenizer.from_pretrained(path)
    messages, tools = _conversation()
    text = template.render(messages, tools=tools)
    assert loaded.encode(text) == tokenizer.encode(text) and loaded.decode(tokenizer.encode(text)) == text
    for add_generation_prompt in (False, True):
        kw = dict(tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt)
        assert loaded.apply_chat_template(messages, **kw) == tokenizer.apply_chat_template(messages, **kw)
    assert loaded.convert_tokens_to_ids([t for t, _ in QWEN_TOKENS]) == list(range(len(QWEN_TOKENS)))
    assert (loaded.eos_token_id, loaded.pad_token_id, loaded.bos_token_id) == (
        tokenizer.eos_token_id,
        tokenizer.pad_token_id,
        tokenizer.bos_token_id,
    )
    assert loaded.get_vocab() == tokenizer.get_vocab()


class ForceAt(LogitsProcessor):
    """Row b must emit tokens[b] as its new token number steps[b] (0-based); every other step is left alone."""

    def __init__(self, prompt_len, steps, tokens):
        self.prompt_len, self.steps, self.tokens = prompt_len, steps, tokens

    def __call__(self, input_ids, scores):
        for b, (step, token) in enumerate(zip(self.steps, self.tokens)):
            if input_ids.shape[1] == self.prompt_len + step:
                scores[b] = -torch.inf
                scores[b, token] = 0.0
        return scores


def test_generate_with_the_exported_generation_config_stops_at_the_chat_stop_tokens(policy):
    tokenizer, _, path = policy
    im_end, endoftext = tokenizer.convert_tokens_to_ids([IM_END, ENDOFTEXT])
    gen = GenerationConfig.from_pretrained(path)  # raises if generation_config.json is missing
    # Sampling from the policy's own distribution: no temperature, top-p or top-k truncation.
    assert (gen.do_sample, gen.temperature, gen.top_p, gen.top_k) == (True, 1.0, 1.0, 0)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    messages, tools = _conversation()
    prompt = tokenizer.apply_chat_template(messages[:2], tools=tools, tokenize=False, add_generation_prompt=True)
    ids = torch.tensor([tokenizer.encode(prompt)] * 2)
    # A random policy rarely ends a turn: force <|im_end|> as row 0's 3rd new token, <|endoftext|> as row 1's 5th.
    # Only the eos ids of generation_config.json stop them there; the finished row 0 is then padded with its pad id.
    force = LogitsProcessorList([ForceAt(ids.shape[1], steps=(2, 4), tokens=(im_end, endoftext))])
    gen.update(do_sample=False, max_new_tokens=16)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gen, logits_processor=force)
    new = out[:, ids.shape[1] :].tolist()
    assert len(new[1]) == 5 and new[1][4] == endoftext and not {im_end, endoftext} & set(new[1][:4])
    assert new[0][:3] == new[1][:2] + [im_end] and new[0][3:] == [endoftext, endoftext]


def test_exported_logits_equal_the_jax_policy(policy):
    tokenizer, state, path = policy
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    messages, tools = _conversation()
    ids = tokenizer.encode(template.render(messages, tools=tools))
    with torch.no_grad():
        hf_logits = model(torch.tensor([ids])).logits.numpy()
    jax_logits = np.asarray(nnx.jit(lambda m, x: m(x).logits)(state.model(), jnp.asarray([ids], jnp.int32)))
    np.testing.assert_allclose(hf_logits, jax_logits, atol=1e-4, rtol=1e-4)


def test_without_a_tokenizer_only_weights_and_generation_config_are_written(policy, tmp_path):
    _, state, _ = policy
    export_policy(state.model(), None, tmp_path)
    assert sorted(os.listdir(tmp_path)) == ["config.json", "generation_config.json", "model.safetensors"]
    ids = {token: i for i, (token, _) in enumerate(QWEN_TOKENS)}  # a random init uses ipa_jax's tokenizer layout
    gen = GenerationConfig.from_pretrained(tmp_path)
    assert (gen.eos_token_id, gen.pad_token_id) == ([ids[IM_END], ids[ENDOFTEXT]], ids[ENDOFTEXT])
    # A model loaded from a checkpoint keeps the ids of its config.json.
    model = init_model(tiny_qwen3_config(eos_token_id=7, pad_token_id=5, bos_token_id=5))
    export_policy(model, None, tmp_path / "checkpoint")
    gen = GenerationConfig.from_pretrained(tmp_path / "checkpoint")
    assert (gen.eos_token_id, gen.pad_token_id, gen.bos_token_id) == ([7], 5, 5)


def test_a_tokenizer_larger_than_the_vocabulary_is_refused_before_writing(policy, tmp_path):
    tokenizer = policy[0]
    with pytest.raises(ValueError, match="vocab_size"):
        export_policy(init_model(tiny_qwen3_config()), tokenizer, tmp_path / "hf")  # vocab 128 < 606 tokens
    assert not os.path.exists(tmp_path / "hf")


def test_existing_tokenizer_loads_the_runs_tokenizer_and_never_builds_one(policy, tmp_path):
    tokenizer = policy[0]
    folder = RunFolder(tmp_path / "run")
    assert existing_tokenizer(ModelConfig(), folder) is None
    tokenizer.save_pretrained(folder.tokenizer_dir)
    assert existing_tokenizer(ModelConfig(), folder).get_vocab() == tokenizer.get_vocab()
