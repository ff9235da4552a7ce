"""sample_tokens draws from softmax(mask(logits / T)) and returns that distribution's log-prob (NumPy float64
reference written from the definition; chi-square goodness of fit on a 6-token vocabulary)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from ipa_jax.engines.sampling import sample_categorical, sample_tokens

LOGITS = np.array([2.0, 1.5, 0.3, 0.0, -0.7, -2.0])
sample = jax.jit(sample_tokens)  # one compile for every case below


def reference_probs(logits: np.ndarray, temperature: float, top_p: float, top_k: int) -> np.ndarray:
    """float64: p = softmax(logits / T); keep the top_k most likely, renormalise; keep the most likely tokens
    while the mass before them is < top_p, renormalise."""
    z = logits.astype(np.float64) / temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    order = np.argsort(-p, kind="stable")
    keep = np.zeros_like(p, bool)
    k = len(p) if top_k <= 0 else top_k
    keep[order[:k]] = True
    q = np.where(keep, p, 0.0)
    q /= q.sum()
    mass = 0.0
    keep2 = np.zeros_like(keep)
    for i in order:
        if keep[i] and mass < top_p:
            keep2[i] = True
            mass += q[i]
    r = np.where(keep2, q, 0.0)
    return r / r.sum()


@pytest.mark.parametrize(
    "temperature, top_p, top_k",
    [(1.0, 1.0, -1), (0.7, 1.0, -1), (1.6, 1.0, 3), (1.0, 0.8, -1), (1.3, 0.9, 4)],
)
def test_sampling_distribution_chi_square(temperature, top_p, top_k):
    n = 20000
    logits = jnp.asarray(np.tile(LOGITS, (n, 1)), jnp.float32)
    tokens, logprobs = sample(
        jax.random.split(jax.random.key(0), n),
        logits,
        jnp.full((n,), temperature),
        jnp.full((n,), top_p),
        jnp.full((n,), top_k, jnp.int32),
    )
    tokens, logprobs = np.asarray(tokens), np.asarray(logprobs)
    want = reference_probs(LOGITS, temperature, top_p, top_k)
    support = want > 0
    counts = np.bincount(tokens, minlength=len(LOGITS))
    assert counts[~support].sum() == 0, "sampled outside the truncated support"
    chi2 = stats.chisquare(counts[support], n * want[support])
    assert chi2.pvalue > 1e-3, (counts, n * want)
    # the returned log-prob is that of the distribution sampled from
    np.testing.assert_allclose(logprobs, np.log(want[tokens]), atol=1e-5)


def test_rows_have_independent_params_and_greedy():
    logits = jnp.asarray(np.stack([LOGITS, LOGITS[::-1], LOGITS]), jnp.float32)
    temperature = jnp.array([0.0, 0.0, 1.0])
    tokens, logprobs = sample_tokens(
        jax.random.split(jax.random.key(1), 3),
        logits,
        temperature,
        jnp.array([1.0, 0.5, 1.0]),
        jnp.array([-1, 2, 1], jnp.int32),
    )
    assert tokens.tolist()[:2] == [0, 5]
    # greedy reports the model's own log-prob (as SGLang); top_k=1 is a point mass
    log_softmax = LOGITS - np.log(np.exp(LOGITS).sum())
    np.testing.assert_allclose(np.asarray(logprobs), [log_softmax[0], log_softmax[0], 0.0], atol=1e-6)
    assert int(tokens[2]) == 0


def test_two_level_draw_matches_a_large_vocabulary():
    """sample_categorical over V = 1000 (blocks of 32, the last one padded): chi-square on 20 equal-mass bins of a
    skewed distribution whose mass spans many blocks, and no draw outside the support."""
    rng = np.random.RandomState(0)
    vocab, n = 1000, 40000
    logits = rng.standard_normal(vocab) * 2.0
    logits[rng.rand(vocab) < 0.3] = -np.inf  # outside the support (as top-k / top-p leave it)
    p = np.exp(logits - logits[np.isfinite(logits)].max())
    p /= p.sum()
    logp = jnp.asarray(np.tile(np.log(p), (n, 1)), jnp.float32)
    tokens = np.asarray(jax.jit(sample_categorical)(jax.random.split(jax.random.key(3), n), logp))
    assert np.all(p[tokens] > 0), "sampled outside the support"
    order = np.argsort(p)
    bins = np.zeros(vocab, int)
    bins[order] = np.minimum((np.cumsum(p[order]) * 20).astype(int), 19)  # 20 bins of ~equal mass
    want = np.bincount(bins, weights=p, minlength=20) * n
    chi2 = stats.chisquare(np.bincount(bins[tokens], minlength=20), want)
    assert chi2.pvalue > 1e-3, chi2


def test_a_row_draws_from_its_own_key_alone():
    """Row b's token depends on keys[b] and its own logits only: the same key and logits give the same token whatever
    the other rows hold (what lets a seeded request sample alike in any batch); other keys give other draws."""
    rng = np.random.RandomState(1)
    n, vocab = 64, 300
    logits = jnp.asarray(rng.standard_normal((n, vocab)), jnp.float32)
    keys = jax.random.split(jax.random.key(5), n)
    ones, no_k = jnp.ones((n,)), jnp.full((n,), -1, jnp.int32)
    tokens = np.asarray(sample(keys, logits, ones, ones, no_k)[0])
    shuffled = rng.permutation(n)
    others = jnp.asarray(rng.standard_normal((n, vocab)), jnp.float32).at[shuffled[0]].set(logits[0])
    keys_elsewhere = jax.random.split(jax.random.key(6), n).at[shuffled[0]].set(keys[0])
    alone = np.asarray(sample(keys_elsewhere, others, ones, ones, no_k)[0])
    assert alone[shuffled[0]] == tokens[0]
    # the control: a row's draws follow its key (the other keys' draws of the same logits differ somewhere)
    redrawn = np.asarray(sample(jax.random.split(jax.random.key(7), n), logits, ones, ones, no_k)[0])
    assert (redrawn != tokens).any()
