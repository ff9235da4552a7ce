"""Per-token log-probabilities and entropies without materialising [B, T, V] float32 logits."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def blockwise_logprobs(hidden: jax.Array, lm_head: jax.Array, targets: jax.Array, *, block_size: int = 128,
                       return_entropy: bool = False) -> tuple[jax.Array, jax.Array | None]:
    """log softmax(h W)[target] and entropy -sum p log p, computed block by block over the sequence.

    hidden [B, N, H], lm_head [H, V], targets int32[B, N] -> (logprobs float32[B, N], entropy float32[B, N] | None).
    Each block's [B, block, V] float32 logits are recomputed in the backward pass (jax.checkpoint), so neither
    pass holds more than one block of logits.
    """
    b, n, h = hidden.shape
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    num_blocks = -(-n // block_size)
    pad = num_blocks * block_size - n
    hidden = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0)))
    targets = jnp.pad(targets, ((0, 0), (0, pad)))
    h_blocks = hidden.reshape(b, num_blocks, block_size, h).swapaxes(0, 1)
    t_blocks = targets.reshape(b, num_blocks, block_size).swapaxes(0, 1)

    @jax.checkpoint
    def one_block(args):
        h_blk, t_blk = args
        logits = jnp.einsum("bth,hv->btv", h_blk, lm_head, preferred_element_type=jnp.float32)
        lse = jax.nn.logsumexp(logits, axis=-1)
        # log p(target) = logit[target] - logsumexp(logits)
        logprob = jnp.take_along_axis(logits, t_blk[..., None], axis=-1)[..., 0] - lse
        if not return_entropy:
            return logprob, jnp.zeros_like(logprob)
        # H = logsumexp(logits) - sum_v p_v logit_v
        entropy = lse - jnp.sum(jax.nn.softmax(logits, axis=-1) * logits, axis=-1)
        return logprob, entropy

    logprobs, entropy = jax.lax.map(one_block, (h_blocks, t_blocks))
    logprobs = logprobs.swapaxes(0, 1).reshape(b, -1)[:, :n]
    entropy = entropy.swapaxes(0, 1).reshape(b, -1)[:, :n] if return_entropy else None
    return logprobs, entropy


def token_logprobs(model, tokens: jax.Array, attention_mask: jax.Array | None = None,
                   positions: jax.Array | None = None, *, segment_ids: jax.Array | None = None,
                   return_entropy: bool = False, block_size: int = 128, routed_experts: jax.Array | None = None,
                   moe_impl: str | None = None):
    """Log-prob of every token given its prefix, aligned with `tokens`: out[:, t] = log pi(tokens[t] | tokens[:t]).

    tokens int32[B, T], attention_mask bool[B, T], segment_ids int32[B, T] (packed rows: every segment is its
    own sequence, positions restart in it unless given) -> (logprobs float32[B, T], entropy float32[B, T] | None,
    aux). Position 0, padding, a token right after padding and the first token of a segment hold 0 (entropy
    too); entropy[:, t] is that of the distribution tokens[t] was drawn from. aux: the model's aux dict
    (load-balancing / z losses, routed experts).
    """
    hidden, aux = model.hidden_states(tokens, positions, attention_mask, segment_ids=segment_ids,
                                      routed_experts=routed_experts, moe_impl=moe_impl)
    logprobs, entropy = blockwise_logprobs(hidden[:, :-1], model.lm_head_weight(), tokens[:, 1:],
                                           block_size=block_size, return_entropy=return_entropy)
    real = jnp.ones(tokens.shape, bool) if attention_mask is None else attention_mask.astype(bool)
    # a token is scored only if it and its predecessor are real (the first token of a row never is) ...
    valid = real & jnp.pad(real[:, :-1], ((0, 0), (1, 0)))
    if segment_ids is not None:  # ... and of one segment
        valid &= jnp.pad(segment_ids[:, 1:] == segment_ids[:, :-1], ((0, 0), (1, 0)))
    logprobs = jnp.where(valid, jnp.pad(logprobs, ((0, 0), (1, 0))), 0.0)
    if entropy is not None:
        entropy = jnp.where(valid, jnp.pad(entropy, ((0, 0), (1, 0))), 0.0)
    return logprobs, entropy, aux
