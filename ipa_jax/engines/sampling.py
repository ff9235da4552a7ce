"""Token sampling with per-row temperature / top-p / top-k that returns the log-prob of the distribution it
actually sampled from (what importance ratios need as the behaviour log-prob)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def truncation_mask(scaled: jax.Array, top_p: jax.Array, top_k: jax.Array) -> jax.Array:
    """Tokens kept by top-k then top-p (SGLang's order), bool[B, V].

    scaled [B, V] temperature-scaled logits; top_p float[B] in (0, 1]; top_k int[B] (<= 0: whole vocab).
    In descending-probability order, token r is kept iff r < top_k and the probability mass before it is
    < top_p (so the most likely token is always kept). Ties are broken by sort order, so exactly the sorted
    prefix is kept.
    """
    b, v = scaled.shape
    order = jnp.argsort(-scaled, axis=-1)
    sorted_logits = jnp.take_along_axis(scaled, order, axis=-1)
    rank = jnp.arange(v)[None, :]
    in_top_k = (top_k[:, None] <= 0) | (rank < top_k[:, None])
    # top-p on the top-k-renormalised distribution: mass_before[r] = sum_{j<r} p_j
    probs = jax.nn.softmax(jnp.where(in_top_k, sorted_logits, -jnp.inf), axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    keep_sorted = in_top_k & (mass_before < top_p[:, None])
    rows = jnp.arange(b)[:, None]
    return jnp.zeros((b, v), bool).at[rows, order].set(keep_sorted)


def sampling_logprobs(logits: jax.Array, temperature: jax.Array, top_p: jax.Array, top_k: jax.Array) -> jax.Array:
    """log mu(. | context) of the distribution sampled from, float32[B, V] (-inf outside the support).

    logits [B, V]; temperature float[B] (0 = greedy: the model's own log_softmax(logits), as SGLang reports);
    top_p float[B]; top_k int[B]. mu = softmax(mask(logits / T)) with mask from truncation_mask.
    """
    logits = logits.astype(jnp.float32)
    greedy = temperature <= 0.0
    scaled = logits / jnp.where(greedy, 1.0, temperature)[:, None]
    needs_mask = jnp.any((top_p < 1.0) | (top_k > 0))
    masked = jax.lax.cond(
        needs_mask,
        lambda x: jnp.where(truncation_mask(x, top_p, top_k), x, -jnp.inf),
        lambda x: x,
        scaled,
    )
    return jax.nn.log_softmax(jnp.where(greedy[:, None], logits, masked), axis=-1)


def sample_categorical(keys: jax.Array, logp: jax.Array) -> jax.Array:
    """One token per row from softmax(logp) (logp float32[B, V], -inf outside the support), row b drawn with its own
    key keys[b] (a key array [B]: a row's draw does not depend on the other rows) -> int32[B].

    Exact and in two levels, so that a row needs ~2 sqrt(V) random numbers instead of V (on CPU the random bits of
    a Gumbel-max draw over the whole vocabulary cost more than the rest of a small model's decode step): the
    vocabulary in blocks of b = the power of two >= sqrt(V); a block j ~ softmax(logsumexp of each block), then
    a token within it ~ softmax(logp[block j]). P(token) = (M_j / sum M) (p_token / M_j) = p_token.
    """
    rows, vocab = logp.shape
    size = 1 << max(0, (int(vocab**0.5 + 0.5) - 1).bit_length())
    blocks = jnp.pad(logp, ((0, 0), (0, -vocab % size)), constant_values=-jnp.inf).reshape(rows, -1, size)
    block_keys, token_keys = jnp.moveaxis(jax.vmap(jax.random.split)(keys), 1, 0)
    categorical = jax.vmap(jax.random.categorical)
    block = categorical(block_keys, jax.nn.logsumexp(blocks, axis=-1))
    within = jnp.take_along_axis(blocks, block[:, None, None], axis=1)[:, 0]
    return (block * size + categorical(token_keys, within)).astype(jnp.int32)


def sample_tokens(
    keys: jax.Array, logits: jax.Array, temperature: jax.Array, top_p: jax.Array, top_k: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Sample one token per row, row b with key keys[b] (a key array [B]) -> (tokens int32[B], logprobs float32[B]).

    logits [B, V]; temperature/top_p/top_k [B] as in sampling_logprobs. token ~ mu (argmax of the logits where
    temperature == 0); logprob = log mu(token).
    """
    logp = sampling_logprobs(logits, temperature, top_p, top_k)
    drawn = sample_categorical(keys, logp)
    greedy = temperature <= 0.0
    # The argmax over the vocabulary only when a row is greedy: on CPU it costs as much as the draw.
    tokens = jax.lax.cond(
        jnp.any(greedy), lambda: jnp.where(greedy, jnp.argmax(logits, axis=-1), drawn), lambda: drawn
    ).astype(jnp.int32)
    return tokens, jnp.take_along_axis(logp, tokens[:, None], axis=-1)[:, 0]
