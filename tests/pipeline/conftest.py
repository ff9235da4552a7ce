"""Fixtures of the pipeline tests (the shared tiny setting lives in tiny_pipeline.py)."""

import pytest

from ipa_jax.pipeline.tokenizer import build_corpus_tokenizer


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory):
    """A saved 640-token tokenizer of the built-in environments' expert episodes (the quickstart's vocabulary)."""
    path = str(tmp_path_factory.mktemp("tok"))
    build_corpus_tokenizer(640).save_pretrained(path)
    return path
