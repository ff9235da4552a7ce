"""Per-token log-probabilities and entropies without materialising [B, T, V] float32 logits (unless they fit a budget).

`blockwise_logprobs` runs the LM head block by block over the sequence with a hand-written backward pass
(`jax.custom_vjp`): the forward keeps each token's log-sum-exp and entropy, the backward recomputes a block's
logits and forms d logits in one elementwise pass, then its two matmuls (d hidden, d lm_head accumulated over the
blocks). When every block's float32 logits together fit in `keep_logits_bytes`, the forward keeps them instead and
the backward skips the recomputation (one of the LM head's four matmuls). Autodiff through the same computation
under `jax.checkpoint` took ~1.5x the time on CPU (several [block, V] passes for the log-sum-exp, gather and entropy
derivatives, and a transposed copy of d logits for the lm_head gradient; bench_learner.py). `reference_logprobs`
is the plain full-logits reference the tests hold it to.

Given the positions a loss reads (`scored`: an RL row's sampled tokens and its expert tokens), each row's scored
positions are moved to its front (a permutation along the sequence, undone on the outputs) and only the blocks that
hold some row's scored positions are computed, in both passes: the LM head is the largest matmul of a small model,
and an agentic row's prompt and tool observations, most of its tokens and interleaved with its actions, need no
log-prob. A row with n scored positions costs ceil(n / block_size) blocks wherever they lie; `token_logprobs`
gathers the scored positions of all the rows a device holds instead (`groups`), so a batch costs the blocks its
scored tokens fill together rather than its longest row's times the rows.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from ipa_jax.models.sharding import batch_shards


def reference_logprobs(
    hidden: jax.Array, lm_head: jax.Array, targets: jax.Array, return_entropy: bool = False
) -> tuple[jax.Array, jax.Array | None]:
    """The reference: full float32 logits, log softmax, gather. Same signature and result as `blockwise_logprobs`
    (without block_size); holds [B, N, V] float32 at once."""
    logp = jax.nn.log_softmax(jnp.einsum("bth,hv->btv", hidden, lm_head, preferred_element_type=jnp.float32))
    logprobs = jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    return logprobs, (-jnp.sum(jnp.exp(logp) * logp, axis=-1) if return_entropy else None)


def _to_blocks(x: jax.Array, block_size: int) -> jax.Array:
    """[B, N, ...] (N a multiple of block_size) -> [N / block_size, B, block_size, ...]."""
    b, n = x.shape[:2]
    return x.reshape(b, n // block_size, block_size, *x.shape[2:]).swapaxes(0, 1)


def _from_blocks(x: jax.Array) -> jax.Array:
    """[nb, B, block, ...] -> [B, nb * block, ...] (the inverse of `_to_blocks`)."""
    return x.swapaxes(0, 1).reshape(x.shape[1], -1, *x.shape[3:])


def _block_logits(h_block: jax.Array, lm_head: jax.Array) -> jax.Array:
    """logits float32 [B, block, V] of hidden states [B, block, H]."""
    return jnp.einsum("bth,hv->btv", h_block, lm_head, preferred_element_type=jnp.float32)


def _scored_first(scored: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Per row, its scored positions (in order) first, then the others (in order): (order, inverse) int32[B, N] of
    scored bool[B, N], with compact[b, i] = x[b, order[b, i]] and x[b, j] = compact[b, inverse[b, j]]."""
    scored = scored.astype(jnp.int32)
    count = jnp.sum(scored, axis=1, keepdims=True)
    # a scored position goes to its rank among the scored, another to count + its rank among the others
    inverse = jnp.where(scored > 0, jnp.cumsum(scored, axis=1), count + jnp.cumsum(1 - scored, axis=1)) - 1
    return jnp.argsort(inverse, axis=1).astype(jnp.int32), inverse.astype(jnp.int32)


def _take_positions(x: jax.Array, index: jax.Array) -> jax.Array:
    """x[b, index[b, i], ...] for x [B, N, ...], index int32[B, N]."""
    return jax.vmap(lambda row, i: row[i])(x, index)


@jax.custom_vjp
def _permute_positions(x: jax.Array, order: jax.Array, inverse: jax.Array) -> jax.Array:
    """x [B, N, ...] permuted along the sequence: x[b, order[b, i]] (`inverse` the inverse permutation). Its
    backward pass permutes the cotangent back with a gather (autodiff of the gather would scatter-add)."""
    return _take_positions(x, order)


def _permute_positions_fwd(x, order, inverse):
    return _take_positions(x, order), inverse


def _permute_positions_bwd(inverse, g):
    return _take_positions(g, inverse), None, None


_permute_positions.defvjp(_permute_positions_fwd, _permute_positions_bwd)


def _forward(hidden, lm_head, targets, needed, block_size, with_entropy, keep_logits=False):
    """(logprobs, log-sum-exp, entropy (zeros unless with_entropy)), each float32 [B, N], N a multiple of
    block_size; zeros in the blocks that are not `needed` (bool[N / block_size]). With keep_logits also the
    logits float32 [N / block_size, B, block_size, V] (zeros in the blocks not needed), else None."""

    def one_block(args):
        h_block, t_block, block_needed = args

        def skipped(*_):
            logits = (jnp.zeros((*t_block.shape, lm_head.shape[1]), jnp.float32),) if keep_logits else ()
            return (jnp.zeros(t_block.shape, jnp.float32),) * 3 + logits

        return jax.lax.cond(block_needed, compute, skipped, h_block, t_block)

    def compute(h_block, t_block):
        logits = _block_logits(h_block, lm_head)
        lse = jax.nn.logsumexp(logits, axis=-1)
        # log p(target) = logit[target] - lse;  H = lse - sum_v p_v logit_v
        logprob = jnp.take_along_axis(logits, t_block[..., None], axis=-1)[..., 0] - lse
        kept = (logits,) if keep_logits else ()
        if not with_entropy:
            return logprob, lse, jnp.zeros_like(lse), *kept
        entropy = lse - jnp.sum(jnp.exp(logits - lse[..., None]) * logits, axis=-1)
        return logprob, lse, entropy, *kept

    blocks = jax.lax.map(one_block, (_to_blocks(hidden, block_size), _to_blocks(targets, block_size), needed))
    return (*(_from_blocks(x) for x in blocks[:3]), blocks[3] if keep_logits else None)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _fused_logprobs(hidden, lm_head, targets, needed, block_size, with_entropy, keep_logits):
    logprobs, _, entropy, _ = _forward(hidden, lm_head, targets, needed, block_size, with_entropy)
    return logprobs, entropy


def _fused_logprobs_fwd(hidden, lm_head, targets, needed, block_size, with_entropy, keep_logits):
    logprobs, lse, entropy, logits = _forward(hidden, lm_head, targets, needed, block_size, with_entropy, keep_logits)
    return (logprobs, entropy), (hidden, lm_head, targets, needed, lse, entropy, logits)


def _fused_logprobs_bwd(block_size, with_entropy, keep_logits, residuals, cotangents):
    """d logits = g_lp (onehot(target) - p) + g_H p (lse - logits - H), per block (the logits recomputed, or
    those the forward kept); d hidden = d logits W^T, d W = sum over blocks of hidden^T d logits (float32
    accumulator). Blocks not needed: no gradient (their outputs are the constant 0)."""
    hidden, lm_head, targets, needed, lse, entropy, kept_logits = residuals
    g_logprob, g_entropy = cotangents
    vocab = jnp.arange(lm_head.shape[1], dtype=targets.dtype)

    def one_block(g_head, args):
        *block, block_needed = args
        return jax.lax.cond(
            block_needed, compute, lambda g_head, h_block, *_: (g_head, jnp.zeros_like(h_block)), g_head, *block
        )

    def compute(g_head, h_block, t_block, lse_block, ent_block, g_lp, g_ent, *logits_block):
        logits = logits_block[0] if keep_logits else _block_logits(h_block, lm_head)
        p = jnp.exp(logits - lse_block[..., None])
        d_logits = jnp.where(vocab == t_block[..., None], g_lp[..., None], 0.0) - p * g_lp[..., None]
        if with_entropy:
            d_logits += p * g_ent[..., None] * ((lse_block - ent_block)[..., None] - logits)
        d_hidden = jnp.einsum("btv,hv->bth", d_logits.astype(lm_head.dtype), lm_head).astype(hidden.dtype)
        g_head = g_head + jnp.einsum(
            "bth,btv->hv", h_block, d_logits.astype(h_block.dtype), preferred_element_type=jnp.float32
        )
        return g_head, d_hidden

    blocks = tuple(_to_blocks(x, block_size) for x in (hidden, targets, lse, entropy, g_logprob, g_entropy))
    blocks += (kept_logits,) if keep_logits else ()
    g_head, d_hidden = jax.lax.scan(one_block, jnp.zeros(lm_head.shape, jnp.float32), (*blocks, needed))
    return _from_blocks(d_hidden), g_head.astype(lm_head.dtype), None, None


_fused_logprobs.defvjp(_fused_logprobs_fwd, _fused_logprobs_bwd)


def blockwise_logprobs(
    hidden: jax.Array,
    lm_head: jax.Array,
    targets: jax.Array,
    *,
    block_size: int = 128,
    return_entropy: bool = False,
    scored: jax.Array | None = None,
    keep_logits_bytes: int = 0,
    groups: int | None = None,
) -> tuple[jax.Array, jax.Array | None]:
    """log softmax(h W)[target] and entropy -sum p log p, computed block by block over the sequence.

    hidden [B, N, H], lm_head [H, V], targets int32[B, N], scored bool[B, N] | None (the positions read; None = all)
    -> (logprobs float32[B, N], entropy float32[B, N] | None). Neither pass holds more than one block's
    [B, block, V] float32 logits; both outputs are differentiable. With `scored`, each row's scored positions are
    computed first (`_scored_first`) and only ceil(max scored per row / block_size) blocks are computed; positions
    outside `scored` hold 0. keep_logits_bytes: when the float32 logits of every block ([B, N, V], N rounded up to
    whole blocks) take at most this many bytes, a differentiated call keeps them for the backward pass instead of
    recomputing them (0 = always recompute: one block's logits at a time).

    groups: with `scored`, take the rows in this many groups of consecutive rows (a divisor of B; None = B: each row
    on its own) and gather each group's scored positions to its front: a block is then block_size positions of each
    of a group's rows, and the batch costs ceil(max over groups of its scored positions / (block_size x rows per
    group)) blocks, never more than ceil(max scored per row / block_size), far fewer when the rows' scored counts
    differ (an agentic batch: a few long action sequences among short ones). Pass the batch's shards (one group per
    device keeps the gather on the device).
    """
    b, n, h = hidden.shape
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    if scored is not None and groups is not None and groups != b:
        if groups <= 0 or b % groups:
            raise ValueError(f"groups must divide the batch's {b} rows, got {groups}")
        rows = b // groups
        # Each group as one row of its rows' positions: its blocks hold `rows` blocks' worth of positions.
        logprobs, entropy = blockwise_logprobs(
            hidden.reshape(groups, rows * n, h),
            lm_head,
            targets.reshape(groups, rows * n),
            block_size=block_size * rows,
            return_entropy=return_entropy,
            scored=scored.reshape(groups, rows * n),
            keep_logits_bytes=keep_logits_bytes,
        )
        return logprobs.reshape(b, n), (entropy.reshape(b, n) if return_entropy else None)
    pad = -n % block_size
    hidden = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0)))
    targets = jnp.pad(targets, ((0, 0), (0, pad)))
    num_blocks = (n + pad) // block_size
    keep_logits = b * (n + pad) * lm_head.shape[1] * 4 <= keep_logits_bytes
    if scored is None:
        logprobs, entropy = _fused_logprobs(
            hidden, lm_head, targets, jnp.ones((num_blocks,), bool), block_size, return_entropy, keep_logits
        )
        return logprobs[:, :n], (entropy[:, :n] if return_entropy else None)
    scored = jnp.pad(scored.astype(bool), ((0, 0), (0, pad)))
    order, inverse = _scored_first(scored)
    needed = jnp.arange(num_blocks) * block_size < jnp.max(jnp.sum(scored, axis=1))
    compact = _fused_logprobs(
        _permute_positions(hidden, order, inverse),
        lm_head,
        _take_positions(targets, order),
        needed,
        block_size,
        return_entropy,
        keep_logits,
    )
    logprobs, entropy = (jnp.where(scored, _permute_positions(x, inverse, order), 0.0)[:, :n] for x in compact)
    return logprobs, (entropy if return_entropy else None)


def token_logprobs(
    model,
    tokens: jax.Array,
    attention_mask: jax.Array | None = None,
    positions: jax.Array | None = None,
    *,
    segment_ids: jax.Array | None = None,
    prefix_segment_ids: jax.Array | None = None,
    return_entropy: bool = False,
    block_size: int = 128,
    routed_experts: jax.Array | None = None,
    moe_impl: str | None = None,
    scored: jax.Array | None = None,
    keep_logits_bytes: int = 0,
):
    """Log-prob of every token given its prefix, aligned with `tokens`: out[:, t] = log pi(tokens[t] | tokens[:t]).

    tokens int32[B, T], attention_mask bool[B, T], segment_ids int32[B, T] (packed rows: every segment is its
    own sequence, positions restart in it unless given; prefix_segment_ids: shared prefixes, see
    `Qwen3ForCausalLM.hidden_states`) -> (logprobs float32[B, T], entropy float32[B, T] | None,
    aux). Position 0, padding, a token right after padding and the first token of a segment hold 0 (entropy
    too); entropy[:, t] is that of the distribution tokens[t] was drawn from. aux: the model's aux dict
    (load-balancing / z losses, routed experts). scored bool[B, T] | None: the tokens the caller reads (None =
    all); only they are computed, in as few blocks as they fill (those of each batch shard's rows gathered
    together: `blockwise_logprobs`'s groups), and the others hold 0.
    keep_logits_bytes: the memory a differentiated call may spend keeping the logits (`blockwise_logprobs`).
    """
    hidden, aux = model.hidden_states(
        tokens,
        positions,
        attention_mask,
        segment_ids=segment_ids,
        prefix_segment_ids=prefix_segment_ids,
        routed_experts=routed_experts,
        moe_impl=moe_impl,
    )
    logprobs, entropy = blockwise_logprobs(
        hidden[:, :-1],
        model.lm_head_weight(),
        tokens[:, 1:],
        block_size=block_size,
        return_entropy=return_entropy,
        scored=None if scored is None else scored[:, 1:],
        keep_logits_bytes=keep_logits_bytes,
        groups=batch_shards(model.mesh, model.rules, tokens.shape[0]),
    )
    real = jnp.ones(tokens.shape, bool) if attention_mask is None else attention_mask.astype(bool)
    # a token is scored only if it and its predecessor are real (the first token of a row never is) ...
    valid = real & jnp.pad(real[:, :-1], ((0, 0), (1, 0)))
    if segment_ids is not None:  # ... and of one segment
        valid &= jnp.pad(segment_ids[:, 1:] == segment_ids[:, :-1], ((0, 0), (1, 0)))
    logprobs = jnp.where(valid, jnp.pad(logprobs, ((0, 0), (1, 0))), 0.0)
    if entropy is not None:
        entropy = jnp.where(valid, jnp.pad(entropy, ((0, 0), (1, 0))), 0.0)
    return logprobs, entropy, aux
