"""The frozen reference policy of the KL term and penalty: its log-probs (blockwise, microbatched) against a full
transformers forward of the reference HF folder, the reference unchanged by train steps (and the KL term pulling
towards it), the KL reward penalty's advantages against NumPy, and model.reference's errors."""

import math

import jax
import numpy as np
import pytest
import torch
from tiny_models import make_tiny_hf_checkpoint
from train_helpers import make_batch, make_exp, tree_copy

from ipa_jax.models import MeshConfig, make_mesh
from ipa_jax.pipeline import ConfigError
from ipa_jax.pipeline.build import build_state, build_steps
from ipa_jax.train.step import batch_advantages

EPS = "optimizer.eps=1e-4"  # see test_train_step.py


@pytest.fixture(scope="module")
def mesh():
    return make_mesh(MeshConfig(data=2, fsdp=1, expert=1, tensor=1), devices=jax.devices()[:2])


@pytest.fixture(scope="module")
def hf_folders(tmp_path_factory):
    """(policy, reference): two tiny dense HF folders of one architecture, different weights."""
    root = tmp_path_factory.mktemp("hf")
    return tuple(make_tiny_hf_checkpoint(root / name, moe=False, seed=seed) for name, seed in (("p", 0), ("r", 1)))


def _transformers_log_probs(folder, batch) -> np.ndarray:
    """log pi(tokens[t] | tokens[:t]) from one full transformers forward (float32 CPU), 0 where not scored."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
    tokens = torch.as_tensor(np.asarray(batch.tokens), dtype=torch.long)
    mask = torch.as_tensor(np.asarray(batch.attention_mask), dtype=torch.long)
    with torch.no_grad():
        logits = model(input_ids=tokens, attention_mask=mask).logits.double()
    logp = torch.log_softmax(logits[:, :-1], -1).gather(-1, tokens[:, 1:, None])[..., 0].numpy()
    out = np.zeros(batch.tokens.shape)
    out[:, 1:] = logp
    return np.where(np.asarray(batch.action_mask | batch.expert_mask), out, 0)


def test_reference_log_probs_equal_a_full_transformers_forward(mesh, hf_folders):
    policy, reference = hf_folders
    batch = make_batch(8, seed=3)
    exp = make_exp(f"model.path={policy}", f"model.reference={reference}", "objective.kl_weight=0.1",
                   "train.batch_size=8", "train.microbatches=2", "model.logprob_block_size=8")  # fmt: skip
    state = build_state(exp, mesh)
    step, _ = build_steps(exp, state, mesh)
    got = step.reference_log_probs(state, batch)
    np.testing.assert_allclose(got, _transformers_log_probs(reference, batch), rtol=1e-4, atol=2e-5)
    # the policy's own log-probs are another model's: the test would notice the wrong parameters
    assert np.abs(step.old_log_probs(state, batch) - got).max() > 0.1


def test_reference_must_be_a_model_of_the_policy_architecture(mesh, tmp_path):
    other = make_tiny_hf_checkpoint(tmp_path / "wide", moe=False, intermediate_size=96)
    base = make_tiny_hf_checkpoint(tmp_path / "base", moe=False)
    with pytest.raises(ConfigError, match="model.reference.*a parameter of shape"):
        build_state(make_exp(f"model.path={base}", f"model.reference={other}", "objective.kl_weight=0.1"), mesh)
    with pytest.raises(ConfigError, match="model.reference.*no config.json"):
        build_state(make_exp(f"model.reference={tmp_path}/", "objective.kl_penalty=0.1"), mesh)
    with pytest.raises(ConfigError, match="model.reference.: must be one of"):
        make_exp("model.reference=inital")


def test_under_lora_the_reference_folder_is_the_base_model(mesh, hf_folders, tmp_path):
    """With adapters (model.lora_rank > 0), model.reference = model.path's folder (spelt with a trailing slash) is
    the base model under the adapters: its log-probs are a transformers forward of that folder's while the
    adapters have moved the policy away; another folder of the same architecture is a one-line config error."""
    policy, other = hf_folders
    lora = (f"model.path={policy}", "model.lora_rank=2", "model.lora_alpha=4.0", "objective.kl_weight=0.1",
            "train.batch_size=8", "model.logprob_block_size=8")  # fmt: skip
    exp = make_exp(*lora, f"model.reference={policy}/")
    state = build_state(exp, mesh)
    step, _ = build_steps(exp, state, mesh)
    rng = np.random.default_rng(0)
    moved = state.replace(params=jax.tree.map(lambda x: x + rng.normal(0, 0.3, x.shape).astype(x.dtype), state.params))
    batch = make_batch(8, seed=4)
    got = step.reference_log_probs(moved, batch)
    np.testing.assert_allclose(got, _transformers_log_probs(policy, batch), rtol=1e-4, atol=2e-5)
    assert np.abs(step.old_log_probs(moved, batch) - got).max() > 0.01  # the adapters' policy is another model
    with pytest.raises(ConfigError, match=r"^config key 'model.reference': with LoRA .* must be model.path's") as error:
        make_exp(*lora, f"model.reference={other}")
    assert "\n" not in str(error.value)


def test_the_reference_stays_frozen_and_the_kl_term_pulls_towards_it(mesh):
    """Three updates with the KL term (k3) and penalty: state.ref_params stay bit for bit the initial weights while
    the policy moves; the KL metrics are 0 at the first update (policy == reference) and positive after."""
    exp = make_exp("objective.kl_weight=0.5", "objective.kl_penalty=0.01", "train.batch_size=8", EPS)
    state = build_state(exp, mesh)
    initial = tree_copy(state.params)
    assert jax.tree.leaves(state.ref_params)[0] is not jax.tree.leaves(state.params)[0]  # a copy, never donated
    step, _ = build_steps(exp, state, mesh)
    batch = make_batch(8, seed=5)
    history, refs = [], []
    for _ in range(3):
        refs.append(step.reference_log_probs(state, batch))
        state, metrics = step(state, step.put_batch(batch), extras=step.put_batch({"ref_log_probs": refs[-1]}))
        history.append(jax.device_get(metrics))
    jax.tree.map(np.testing.assert_array_equal, tree_copy(state.ref_params), initial)
    moved = max(
        jax.tree.leaves(jax.tree.map(lambda a, b: float(np.abs(np.asarray(a) - b).max()), state.params, initial))
    )
    assert moved > 1e-3
    assert history[0]["kl_loss"] == 0.0 and history[0]["reference_kl"] == 0.0
    assert history[2]["kl_loss"] > 0 and history[2]["reference_kl"] > 0
    assert "kl_penalty_sequence_mean" in history[2] and math.isfinite(history[2]["kl_penalty_sequence_mean"])
    np.testing.assert_array_equal(refs[2], refs[0])  # the reference's log-probs are still the initial weights'


def test_kl_penalty_advantages_match_numpy(mesh):
    """A_i = R'_i - mean R' with R'_i = R_i - beta * sum_{t in actions} (b_t - ref_t) (k1 of behaviour vs
    reference), batch-mean baseline."""
    exp = make_exp("objective.kl_penalty=0.2", "objective.baseline=batch_mean")
    batch = make_batch(4, seed=6)
    ref = np.where(
        batch.action_mask, batch.behavior_logprobs + np.random.default_rng(0).normal(0, 0.5, batch.action_mask.shape), 0
    )
    b, action = np.asarray(batch.behavior_logprobs, np.float64), np.asarray(batch.action_mask)
    penalized = np.asarray(batch.rewards, np.float64) - 0.2 * np.where(action, b - ref, 0).sum(axis=1)
    got = batch_advantages(batch, exp.objective, ref.astype(np.float32))
    np.testing.assert_allclose(np.asarray(got), penalized - penalized.mean(), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="ref_log_probs: required by objective.kl_penalty"):
        batch_advantages(batch, exp.objective)


def test_kl_penalty_of_the_old_log_probs_in_a_step(mesh):
    """kl_penalty_logprobs "recompute" (verl's): the step's first update computes the old log-probs before the
    advantages, so KL_i = sum_t (old_t - ref_t) (k1) with old the learner's log-probs before the update, not the
    sampler's; its mean over trajectories and the advantages' (no baseline) against float64."""
    exp = make_exp("objective.kl_penalty=0.2", "objective.kl_penalty_logprobs=recompute",
                   "objective.old_logprobs=recompute", "train.batch_size=8", "train.il_warmup_steps=1",
                   EPS)  # fmt: skip
    state = build_state(exp, mesh)
    state = state.with_reference(build_state(make_exp("objective.kl_penalty=0.2", "train.seed=1"), mesh).params)
    step, warm_start = build_steps(exp, state, mesh)
    assert warm_start.options.objective.kl_penalty == 0  # the warm start's objective has no penalty to read them
    batch = make_batch(8, seed=8)
    old, ref = step.old_log_probs(state, batch), step.reference_log_probs(state, batch)
    action = np.asarray(batch.action_mask)
    kl = np.where(action, old.astype(np.float64) - ref, 0).sum(axis=1)
    sampler_kl = np.where(action, np.asarray(batch.behavior_logprobs, np.float64) - ref, 0).sum(axis=1)
    assert abs(kl.mean() - sampler_kl.mean()) > 0.1  # the sampler's log-probs would give another penalty
    _, metrics = step(jax.tree.map(lambda x: x.copy(), state), step.put_batch(batch),
                      extras=step.put_batch({"ref_log_probs": ref}))  # fmt: skip
    metrics = jax.device_get(metrics)
    assert math.isclose(metrics["kl_penalty_sequence_mean"], kl.mean(), rel_tol=1e-5, abs_tol=1e-5)
    expected = np.asarray(batch.rewards, np.float64) - 0.2 * kl
    assert math.isclose(metrics["advantage_mean"], expected.mean(), rel_tol=1e-5, abs_tol=1e-6)


def test_kl_step_microbatched_equals_full_batch(mesh):
    """One update with the KL term and penalty against a reference other than the policy: 2 microbatches (each
    with its rows of the reference log-probs) give the full batch's update."""
    exps = [make_exp("objective.kl_weight=0.5", "objective.kl_penalty=0.05", "objective.baseline=batch_mean",
                     "train.batch_size=8", f"train.microbatches={m}", EPS) for m in (1, 2)]  # fmt: skip
    state = build_state(exps[0], mesh)
    other = build_state(make_exp("objective.kl_weight=0.5", "train.seed=1"), mesh)
    state = state.with_reference(other.params)
    batch = make_batch(8, seed=7)
    results = []
    for exp in exps:
        step, _ = build_steps(exp, state, mesh)
        ref = step.reference_log_probs(state, batch)
        copy = jax.tree.map(lambda x: x.copy(), state)
        new, metrics = step(copy, step.put_batch(batch), extras=step.put_batch({"ref_log_probs": ref}))
        results.append((tree_copy(new.params), jax.device_get(metrics), ref))
    (params_1, metrics_1, ref_1), (params_2, metrics_2, ref_2) = results
    np.testing.assert_allclose(ref_2, ref_1, rtol=1e-6, atol=1e-6)
    assert metrics_1["kl_loss"] > 1e-3 and metrics_1["kl_penalty_sequence_mean"] != 0
    for key in ("loss", "kl_loss", "reference_kl", "kl_penalty_sequence_mean", "grad_norm"):
        assert math.isclose(metrics_2[key], metrics_1[key], rel_tol=1e-5, abs_tol=1e-6), key
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), params_2, params_1)
