"""The imitation term's two aggregations against float64 NumPy from their formulas, one row per sequence and packed."""

import jax.numpy as jnp
import numpy as np
import pytest

from ipa_jax.objectives import ObjectiveConfig
from ipa_jax.objectives.composed import term_denominators
from ipa_jax.objectives.imitation import imitation_denominator, imitation_sample_mean, imitation_term
from ipa_jax.objectives.sequences import sequences_of


def reference(log_probs, expert, segments):
    """(token mean, sample mean) NLL: -sum l / #expert tokens; -(1/N) sum_i mean_{t in expert_i} l_t."""
    lp, mask = np.asarray(log_probs, np.float64), np.asarray(expert, bool)
    token_mean = -lp[mask].sum() / mask.sum()
    means = []
    for row in range(lp.shape[0]):
        for seg in np.unique(segments[row][segments[row] > 0]):
            tokens = mask[row] & (segments[row] == seg)
            if tokens.any():
                means.append(-lp[row][tokens].mean())
    return token_mean, float(np.mean(means)), len(means)


@pytest.mark.parametrize("packed", [False, True])
def test_sample_mean_weighs_every_imitated_sequence_alike(packed):
    rng = np.random.default_rng(0)
    log_probs = -rng.random((3, 12)).astype(np.float32) * 3
    expert = rng.random((3, 12)) < 0.4
    expert[2] = False  # a row without expert tokens is left out of the mean
    expert[0, :3] = True  # sequences of different lengths: the two means differ
    segments = np.ones((3, 12), np.int32)
    if packed:
        segments[:, 6:] = 2
        segments[1, 10:] = 0  # padding
        expert[1, 10:] = False
    token_mean, sample_mean, n = reference(log_probs, expert, segments)
    seqs = sequences_of(expert.shape, jnp.asarray(segments) if packed else None)
    num, den = imitation_sample_mean(jnp.asarray(log_probs), jnp.asarray(expert), seqs)
    assert float(den) == n and float(num) / float(den) == pytest.approx(sample_mean, rel=1e-5)
    num, den = imitation_term(jnp.asarray(log_probs), jnp.asarray(expert))
    assert float(num) / float(den) == pytest.approx(token_mean, rel=1e-5)
    assert abs(sample_mean - token_mean) > 1e-3
    # The full-batch denominators term_denominators hands to every microbatch are the same counts.
    action = jnp.zeros(expert.shape, bool)
    no_chunks = jnp.full(expert.shape, -1, jnp.int32)  # chunk ids of a batch without action tokens
    for aggregation, expected in (("token_mean", expert.sum()), ("sample_mean", n)):
        config = ObjectiveConfig(il_aggregation=aggregation)
        dens = term_denominators(
            action, no_chunks, jnp.asarray(expert), config, jnp.asarray(segments) if packed else None
        )
        assert float(dens["il"]) == expected


def test_il_aggregation_is_validated():
    with pytest.raises(ValueError, match="il_aggregation"):
        ObjectiveConfig(il_aggregation="chunk_mean")
    with pytest.raises(ValueError, match="il_aggregation"):
        imitation_denominator(jnp.zeros((1, 2), bool), "mean")
