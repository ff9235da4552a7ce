"""The run's tokenizer: the model's or a given one, or a small BPE trained on the environments' expert episodes."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from etils import epath
from transformers import PreTrainedTokenizerBase

from ipa_jax import storage
from ipa_jax.chat import build_tokenizer, load_tokenizer, template
from ipa_jax.envs import BUILTIN_ENVS, Env, make_env
from ipa_jax.pipeline.config import ConfigError, EnvConfig, ModelConfig
from ipa_jax.pipeline.run_folder import RunFolder, is_writer


def expert_corpus(
    env_names: Iterable[str] = BUILTIN_ENVS,
    episodes_per_env: int = 64,
    seed: int = 0,
    extra_envs: Iterable[Callable[[], Env]] = (),
) -> list[str]:
    """Expert conversations of the environments' train and eval task generators, rendered with the chat template:
    covers the template's boilerplate, the tool specs, calls, observations and answers. `extra_envs`: factories
    of further environments (e.g. the run's own, with its settings)."""
    corpus = []
    for make in [*(lambda name=name: make_env(name) for name in env_names), *extra_envs]:
        env = make()
        for split in ("train", "eval"):
            tasks = env.tasks(split, episodes_per_env, seed)
            corpus += [template.render(env.expert(task), tools=task.tools) for task in tasks]
    return corpus


def build_corpus_tokenizer(vocab_size: int = 1024, env: EnvConfig | None = None) -> PreTrainedTokenizerBase:
    """A tokenizer trained on `expert_corpus()` of the built-in environments, plus the run's environment `env` when
    it is not one of them (deterministic)."""
    extra = [env.make] if env is not None and env.name and env.name not in BUILTIN_ENVS else []
    return build_tokenizer(expert_corpus(extra_envs=extra), vocab_size=vocab_size)


def load_or_build_tokenizer(
    model: ModelConfig, folder: RunFolder, env: EnvConfig | None = None
) -> PreTrainedTokenizerBase:
    """model.tokenizer, else the model folder's, else <run_dir>/tokenizer (built by an earlier attempt of this run,
    or now: `build_corpus_tokenizer` sized to model.arch.vocab_size, on the run's environment `env` too)."""
    path = model.tokenizer or model.path
    if path:
        return load_tokenizer(path)
    vocab_size = int(model.arch["vocab_size"])
    if epath.Path(folder.tokenizer_dir, "tokenizer_config.json").exists():
        with storage.local_copy(folder.tokenizer_dir) as local:
            tok = load_tokenizer(local)
    else:
        tok = build_corpus_tokenizer(vocab_size, env)
        if is_writer():
            with storage.local_folder(folder.tokenizer_dir) as local:
                tok.save_pretrained(local)
    if len(tok) > vocab_size:
        raise ConfigError(
            "model.arch.vocab_size",
            f"{vocab_size} is smaller than the tokenizer's {len(tok)} tokens ({folder.tokenizer_dir})",
        )
    return tok
