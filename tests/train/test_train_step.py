"""The jitted train step: microbatching == full batch, non-finite losses and updates skipped, sharded == one device,
and the optimizer schedule against its formula."""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from train_helpers import MOE_ARCH, make_batch, make_exp, max_rel_diff, tree_copy

from ipa_jax.models import MeshConfig, make_mesh
from ipa_jax.pipeline.build import build_state, build_steps
from ipa_jax.train.optimizer import (
    OptimizerConfig,
    apply_direction,
    make_optimizer,
    make_schedule,
    moments_within_clip,
    update_magnitude_bound,
)
from ipa_jax.train.step import TrainStep, greedy_reproduced_rows


def _copy_state(state):
    return jax.tree.map(lambda x: x.copy(), state)


# One objective touching every microbatch-sensitive part: batch baseline (full-batch advantages), chunk credit,
# token IS, sequence trust region, entropy filter of failures (needs entropies), token_mean aggregation
# (full-batch token count), the IL term (full-batch expert-token count) and the entropy bonus (gradient through
# the entropies).
OBJECTIVE = (
    "objective.preset=custom",
    "objective.baseline=batch_mean",
    "objective.credit=chunk",
    "objective.is_level=token",
    "objective.trust_region_level=sequence",
    "objective.trust_region_delta=0.05",
    "objective.negative_token_fraction=0.5",
    "objective.aggregation=token_mean",
    "objective.il_weight=0.5",
    "objective.entropy_weight=0.01",
)
# Adam divides by |g| + eps: a gradient element of size ~eps would carry its float32 summation-order noise into
# the update at full relative size, so eps is raised to 1e-4 to compare the gradients' accumulation itself.
EPS = "optimizer.eps=1e-4"


@pytest.fixture(scope="module")
def setup():
    """(initial state, full-batch step, 4-microbatch step) on a 2-device data-parallel mesh; compiled once."""
    mesh = make_mesh(MeshConfig(data=2, fsdp=1, expert=1, tensor=1), devices=jax.devices()[:2])
    full = make_exp("train.batch_size=8", EPS, *OBJECTIVE)
    micro = make_exp("train.batch_size=8", "train.microbatches=4", EPS, *OBJECTIVE)
    state = build_state(full, mesh)
    step_full, _ = build_steps(full, state, mesh)
    step_micro, _ = build_steps(micro, state, mesh)
    return state, step_full, step_micro, micro


def test_microbatched_update_equals_full_batch(setup):
    state, step_full, step_micro, _ = setup
    params0 = tree_copy(state.params)
    batch = make_batch(8, seed=1)

    s_full, m_full = step_full(_copy_state(state), step_full.put_batch(batch))
    s_micro, m_micro = step_micro(_copy_state(state), step_micro.put_batch(batch))

    assert max_rel_diff(tree_copy(s_full.params), params0) > 1e-4  # the update is not a no-op
    assert max_rel_diff(tree_copy(s_micro.params), tree_copy(s_full.params)) < 1e-6
    assert 0 < float(m_full["admitted_fraction"]) <= 1 and float(m_full["il_loss"]) > 0
    for key in (
        "loss",
        "grad_norm",
        "rl_loss",
        "il_loss",
        "entropy_loss",
        "is_ratio_mean",
        "admitted_fraction",
        "mismatch_abs",
        "mismatch_kl",
        "kept_token_fraction",
        "entropy",
        "advantage_std",
    ):
        assert math.isclose(float(m_micro[key]), float(m_full[key]), rel_tol=1e-5, abs_tol=1e-7), key
    assert int(m_micro["skipped"]) == 0


def test_nonfinite_batch_is_skipped_and_counted(setup):
    state, _, step, exp = setup
    state = _copy_state(state)
    params0, opt0 = tree_copy(state.params), tree_copy(state.opt_state)
    good = make_batch(8, seed=2)
    bad = good._replace(rewards=np.full(8, np.nan, np.float32))  # NaN advantages -> NaN loss and gradient

    state, metrics = step(state, step.put_batch(bad))
    assert int(metrics["skipped"]) == 1 and int(metrics["skipped_total"]) == 1
    assert not np.isfinite(float(metrics["loss"]))
    jax.tree.map(np.testing.assert_array_equal, tree_copy(state.params), params0)
    jax.tree.map(np.testing.assert_array_equal, tree_copy(state.opt_state), opt0)
    assert int(state.step) == 1 and int(state.skipped) == 1

    state, metrics = step(state, step.put_batch(good))  # training goes on
    assert int(metrics["skipped"]) == 0 and int(metrics["skipped_total"]) == 1
    assert max_rel_diff(tree_copy(state.params), params0) > 1e-4
    assert math.isclose(float(metrics["lr"]), exp.optimizer.lr, rel_tol=1e-6)


@pytest.mark.parametrize("shown_finite_by", ["bound", "check"])
def test_nonfinite_update_from_a_finite_gradient_is_skipped(setup, shown_finite_by):
    """An overflowing learning rate makes every parameter non-finite from a finite loss and gradient: the update is
    skipped, not applied (before, the run went on with every parameter NaN and exited 0). Both ways of showing an
    update finite: the bound from its inputs (the step knows the optimizer) and checking the computed update."""
    state, step_full, _, _ = setup
    assert step_full.options.optimizer is not None  # build_steps passes the experiment's optimizer
    options = (
        step_full.options if shown_finite_by == "bound" else dataclasses.replace(step_full.options, optimizer=None)
    )
    state = _copy_state(state)
    params0, opt0 = tree_copy(state.params), tree_copy(state.opt_state)
    overflowing = TrainStep(state, step_full.mesh, options, lambda step, rl_start=0: jnp.float32(jnp.inf))
    state, metrics = overflowing(state, overflowing.put_batch(make_batch(8, seed=2)))
    assert np.isfinite(float(metrics["loss"])) and np.isfinite(float(metrics["grad_norm"]))
    assert int(metrics["skipped"]) == 1 and int(state.skipped) == 1
    jax.tree.map(np.testing.assert_array_equal, tree_copy(state.params), params0)
    jax.tree.map(np.testing.assert_array_equal, tree_copy(state.opt_state), opt0)


def test_bounded_update_skips_only_absurd_learning_rates(setup):
    """lr 1e35 is skipped by the bound (lr x Adam's largest direction ~ 1e35 x 1e5 overflows it), lr 1e20 is
    applied: parameters of order 1e20, every number finite."""
    state, step_full, _, _ = setup
    state = _copy_state(state)
    params0 = tree_copy(state.params)
    step = TrainStep(
        state,
        step_full.mesh,
        step_full.options,
        lambda step, rl_start=0: jnp.where(step == 0, jnp.float32(1e35), jnp.float32(1e20)),
    )
    batch = step.put_batch(make_batch(8, seed=2))
    state, first = step(state, batch)
    jax.tree.map(np.testing.assert_array_equal, tree_copy(state.params), params0)
    state, second = step(state, batch)
    assert (int(first["skipped"]), int(second["skipped"])) == (1, 0)
    params = tree_copy(state.params)
    assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves((params, tree_copy(state.opt_state))))
    assert 1e18 < max(float(np.max(np.abs(x))) for x in jax.tree.leaves(params)) < 1e22


def test_moments_within_clip_hold_over_clipped_updates_and_bound_the_update():
    """|mu| <= clip_norm and nu <= clip_norm^2 after many clipped AdamW updates of large gradients; the bound
    that takes them so, without reading them, still covers every number of the next update (float64 NumPy from
    the formula) and is at least the bound that reads them; a state outside the clip is recognised."""
    rng = np.random.default_rng(1)
    config, lr = OptimizerConfig(clip_norm=0.5), 1e-2
    tx = make_optimizer(config)
    params = {"w": jnp.asarray(rng.normal(size=(6, 5)), jnp.float32), "b": jnp.zeros(3, jnp.float32)}
    opt_state = tx.init(params)
    for scale in (1e3, 1e-3, 1e6, 1.0, 30.0):  # gradients far above and below the clip
        grads = {k: jnp.asarray(scale * rng.normal(size=v.shape), jnp.float32) for k, v in params.items()}
        direction, opt_state = tx.update(grads, opt_state, params)
        params = apply_direction(params, direction, lr)
        assert bool(moments_within_clip(config, opt_state))
    g = rng.normal(size=(6, 5))
    get = functools.partial(optax.tree_utils.tree_get, opt_state)
    mu, nu = (np.asarray(get(name)["w"], np.float64) for name in ("mu", "nu"))
    count = int(get("count"))

    grads = {"w": jnp.asarray(g, jnp.float32), "b": jnp.zeros(3, jnp.float32)}
    g = g * min(1.0, config.clip_norm / float(optax.global_norm(grads)))
    numbers = _adamw_numbers(config, np.asarray(params["w"], np.float64), g, mu, nu, count, lr)
    largest = max(float(np.max(np.abs(x))) for x in numbers.values())
    norm, lr32 = optax.global_norm(grads), jnp.float32(lr)
    assumed = float(update_magnitude_bound(config, params, opt_state, norm, lr32, moments_within=True))
    assert assumed >= float(update_magnitude_bound(config, params, opt_state, norm, lr32)) >= largest
    assert not np.isfinite(float(update_magnitude_bound(config, params, opt_state, jnp.float32(np.nan), lr32, True)))
    outside = optax.tree_utils.tree_set(opt_state, mu=jax.tree.map(lambda m: m.at[0].set(0.6), get("mu")))
    assert not bool(moments_within_clip(config, outside))
    with pytest.raises(ValueError, match="only when clip_norm > 0"):
        update_magnitude_bound(OptimizerConfig(clip_norm=0.0), params, opt_state, norm, lr32, moments_within=True)
    assert not bool(moments_within_clip(OptimizerConfig(clip_norm=0.0), opt_state))


def test_step_reads_the_moments_only_of_a_state_it_did_not_return(setup):
    """The step's own states are taken as within the clip (no read); a state from elsewhere is read once, and one
    whose moments are far outside it (mu 1e36: the assumed bound would let the update overflow every parameter)
    gets the bound that reads them, which skips the update."""
    state, step_full, _, _ = setup
    state = _copy_state(state)
    step = TrainStep(state, step_full.mesh, step_full.options, step_full.schedule)
    batch = step.put_batch(make_batch(8, seed=2))
    for _ in range(3):
        state, metrics = step(state, batch)
        assert int(metrics["skipped"]) == 0
    assert step.moment_checks == 1  # the first state only
    restored = _copy_state(state)  # what a checkpoint restore hands the step: other arrays, the same numbers
    restored, _ = step(restored, batch)
    assert step.moment_checks == 2
    huge = restored.replace(
        opt_state=optax.tree_utils.tree_set(
            restored.opt_state,
            mu=jax.tree.map(lambda m: jnp.full_like(m, 1e36), optax.tree_utils.tree_get(restored.opt_state, "mu")),
        )
    )
    params0 = tree_copy(huge.params)
    huge, metrics = step(huge, batch)
    assert step.moment_checks == 3 and int(metrics["skipped"]) == 1
    jax.tree.map(np.testing.assert_array_equal, tree_copy(huge.params), params0)
    huge, _ = step(huge, batch)  # still outside (skipped updates keep the moments): read again
    assert step.moment_checks == 4


@pytest.fixture(scope="module")
def decaying():
    """(state, step showing updates finite by the bound, step checking them) for AdamW with weight decay at a
    learning rate of 100 (finite updates of every parameter by itself); 1 device, compiled once each."""
    mesh = make_mesh(MeshConfig(data=1, fsdp=1, expert=1, tensor=1), devices=jax.devices()[:1])
    exp = make_exp("train.batch_size=8", "optimizer.weight_decay=0.1")
    state = build_state(exp, mesh)
    bound, _ = build_steps(exp, state, mesh)
    lr = lambda step, rl_start=0: jnp.float32(100.0)  # noqa: E731
    return (
        state,
        TrainStep(state, mesh, bound.options, lr),
        TrainStep(state, mesh, dataclasses.replace(bound.options, optimizer=None), lr),
    )


def _set_element(tree, path_has: str, index: tuple, value: float):
    """`tree` with tree[leaf][index] = value in the one leaf whose path names `path_has`."""

    def put(path, x):
        if path_has not in jax.tree_util.keystr(path):
            return x
        return jax.device_put(x.at[index].set(value), x.sharding)

    hits = [p for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0] if path_has in jax.tree_util.keystr(p)]
    assert len(hits) == 1, hits
    return jax.tree_util.tree_map_with_path(put, tree)


@pytest.mark.parametrize("shown_finite_by", ["bound", "check"])
@pytest.mark.parametrize("way", ["squared_gradient", "first_moment", "weight_decay"])
def test_nonfinite_update_with_a_finite_loss_is_skipped(decaying, way, shown_finite_by):
    """A finite loss, and still a non-finite update: gradients of ~1e30 (rewards +-1e30) whose squares overflow
    (the global norm and Adam's second moment), or, with the gradient also finite, a first moment near float32's
    largest value divided by its bias correction 1 - b1 (-> inf direction), or weight decay of a huge parameter,
    lr * weight_decay * 1e38 = 1e39 (an embedding row of a token the batch lacks: no gradient, the forward
    untouched). Skipped, params and optimizer state unchanged; the same step on the unchanged state is applied
    (the control). (Non-finite losses: test_nonfinite_batch_is_skipped_and_counted; learning rates:
    test_nonfinite_update_from_a_finite_gradient_is_skipped.)"""
    state, bound, check = decaying
    step = bound if shown_finite_by == "bound" else check
    batch = make_batch(8, seed=2)
    unused = sorted(set(range(128)) - set(np.unique(batch.tokens).tolist()))[0]
    applied, control = step(_copy_state(state), step.put_batch(batch))
    assert int(control["skipped"]) == 0
    assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves(tree_copy(applied.params)))
    state = _copy_state(state)
    if way == "squared_gradient":
        batch = batch._replace(rewards=np.where(np.arange(8) % 2, 1e30, -1e30).astype(np.float32))
    elif way == "first_moment":
        mu = optax.tree_utils.tree_get(state.opt_state, "mu")
        first = jax.tree_util.keystr(jax.tree_util.tree_flatten_with_path(mu)[0][0][0])
        mu = _set_element(mu, first, (0,) * jax.tree.leaves(mu)[0].ndim, 3e38)
        state = state.replace(opt_state=optax.tree_utils.tree_set(state.opt_state, mu=mu))
    else:
        state = state.replace(params=_set_element(state.params, "embed", (unused, 0), 1e38))
        assert 100.0 * 0.1 * 1e38 > float(np.finfo(np.float32).max)  # the decay step alone overflows
    params0, opt0 = tree_copy(state.params), tree_copy(state.opt_state)
    state, metrics = step(state, step.put_batch(batch))
    assert np.isfinite(float(metrics["loss"]))
    assert np.isfinite(float(metrics["grad_norm"])) == (way != "squared_gradient")
    assert int(metrics["skipped"]) == 1 and int(state.skipped) == 1
    jax.tree.map(np.testing.assert_array_equal, tree_copy(state.params), params0)
    jax.tree.map(np.testing.assert_array_equal, tree_copy(state.opt_state), opt0)


def _adamw_numbers(config: OptimizerConfig, p, g, mu, nu, count, lr) -> dict[str, np.ndarray]:
    """Every number AdamW's update computes, in float64 from its formula (one leaf, a matrix: weight decay on)."""
    norm = np.sqrt(np.sum(g * g))
    if config.clip_norm > 0 and norm > config.clip_norm:
        g = g * config.clip_norm / norm
    t = count + 1
    mu1, nu1 = config.b1 * mu + (1 - config.b1) * g, config.b2 * nu + (1 - config.b2) * g * g
    mu_hat, nu_hat = mu1 / (1 - config.b1**t), nu1 / (1 - config.b2**t)
    direction = mu_hat / (np.sqrt(nu_hat) + config.eps) + config.weight_decay * p
    return {
        "mu": mu1,
        "nu": nu1,
        "mu_hat": mu_hat,
        "nu_hat": nu_hat,
        "direction": direction,
        "params": p - lr * direction,
    }


@pytest.mark.parametrize("case", ["random", "momentum_without_variance", "huge_variance", "huge_params_unclipped"])
def test_update_magnitude_bound_covers_every_number_of_the_update(case):
    """update_magnitude_bound >= |x| for every number of the AdamW update (float64 NumPy from the formula, itself
    checked against the optax update), and within 20x of the largest in the cases built to approach it."""
    rng = np.random.default_rng(0)
    config, lr, count = OptimizerConfig(), 1e-3, 5
    p, g = rng.normal(size=(6, 5)), rng.normal(size=(6, 5))
    mu, nu = 0.1 * rng.normal(size=(6, 5)), 0.01 * rng.random((6, 5))
    if case == "momentum_without_variance":  # d = mu_hat / eps at the first step: the direction's bound
        config, lr, count, g, nu = OptimizerConfig(eps=1e-3), 1e30, 0, 0 * g, 0 * nu
        mu[2, 3] = 1e3
    elif case == "huge_variance":  # nu_hat = nu' / (1 - b2) at the first step
        count, nu = 0, nu + 1e30
    elif case == "huge_params_unclipped":
        config, lr, g = OptimizerConfig(clip_norm=0.0, weight_decay=0.5), 0.5, 1e6 * g
        p[0, 0] = 1e36
    numbers = _adamw_numbers(config, p, g, mu, nu, count, lr)
    largest = max(float(np.max(np.abs(x))) for x in numbers.values())

    tx = make_optimizer(config)
    params = {"w": jnp.asarray(p, jnp.float32)}
    opt_state = optax.tree_utils.tree_set(
        tx.init(params),
        mu={"w": jnp.asarray(mu, jnp.float32)},
        nu={"w": jnp.asarray(nu, jnp.float32)},
        count=jnp.asarray(count, jnp.int32),
    )
    grads = {"w": jnp.asarray(g, jnp.float32)}
    direction, _ = tx.update(grads, opt_state, params)
    np.testing.assert_allclose(apply_direction(params, direction, lr)["w"], numbers["params"], rtol=1e-5, atol=1e-5)
    bound = float(update_magnitude_bound(config, params, opt_state, optax.global_norm(grads), jnp.float32(lr)))
    assert bound >= largest, (bound, largest)
    if case != "random":
        assert bound <= 20 * largest, (bound, largest)
    assert not np.isfinite(
        float(update_magnitude_bound(config, params, opt_state, jnp.float32(np.nan), jnp.float32(lr)))
    )


def test_sharded_mesh_update_equals_one_device():
    assert jax.device_count() == 8, "tests/conftest.py sets 8 fake CPU devices"
    # MoE with expert parallelism, routing replay (4-D routed_experts batch array) and the load-balancing loss.
    exp = make_exp(
        "train.batch_size=8",
        EPS,
        *MOE_ARCH,
        "model.arch.num_hidden_layers=1",
        "objective.il_weight=0.3",
        "model.load_balancing_coef=0.01",
        "model.routing_replay=True",
    )
    batch = make_batch(8, seed=3, num_layers_k=(1, 2))
    results = []
    for sizes, devices in (((2, 2, 2, 1), jax.devices()), ((1, 1, 1, 1), jax.devices()[:1])):
        mesh = make_mesh(MeshConfig(*sizes), devices=devices)
        state = build_state(exp, mesh)
        params0 = tree_copy(state.params)
        step, _ = build_steps(exp, state, mesh)
        state, metrics = step(state, step.put_batch(batch))
        if len(devices) == 8:  # parameters and Adam moments stay sharded (fsdp x expert), not replicated
            for tree in (state.params, state.opt_state):
                per_device = sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(tree))
                assert per_device < 0.5 * sum(x.nbytes for x in jax.tree.leaves(tree))
        results.append((params0, tree_copy(state.params), jax.device_get(metrics)))
    (init8, after8, m8), (init1, after1, m1) = results
    assert max_rel_diff(init8, init1) == 0.0
    assert max_rel_diff(after8, init8) > 1e-4
    assert max_rel_diff(after8, after1) < 1e-5
    for key in ("loss", "grad_norm", "load_balancing_loss"):
        assert math.isclose(float(m8[key]), float(m1[key]), rel_tol=1e-5, abs_tol=1e-7), key


@pytest.mark.parametrize("schedule", ["cosine", "constant"])
def test_schedule_matches_formula(schedule):
    cfg = OptimizerConfig(lr=1e-3, schedule=schedule, warmup_ratio=0.1, min_lr_ratio=0.2)
    total, warmup = 100, 10
    fn = make_schedule(cfg, total)
    for step in (0, 5, 10, 40, 99, 100):
        if step < warmup:
            expected = 1e-3 * step / warmup
        elif schedule == "constant":
            expected = 1e-3
        else:
            progress = (step - warmup) / (total - warmup)
            expected = 1e-3 * (0.2 + 0.8 * 0.5 * (1 + math.cos(math.pi * progress)))
        assert math.isclose(float(fn(step)), expected, rel_tol=1e-5, abs_tol=1e-12), step


def test_schedule_with_il_warm_start_has_two_phases():
    """Warm start: warmup to il_lr then cosine over W steps; RL: its own warmup from 0 to lr, cosine to the end."""
    cfg = OptimizerConfig(lr=1e-4, il_lr=3e-3, schedule="cosine", warmup_steps=4, min_lr_ratio=0.1)
    fn = make_schedule(cfg, 100, il_warmup_steps=40)

    def phase(lr, start, steps, step):
        k = step - start
        if k < 4:
            return lr * k / 4
        return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (k - 4) / (steps - 4))))

    for step in (0, 2, 4, 20, 39, 40, 42, 44, 70, 99):
        expected = phase(3e-3, 0, 40, step) if step < 40 else phase(1e-4, 40, 60, step)
        assert math.isclose(float(fn(step)), expected, rel_tol=1e-5, abs_tol=1e-12), step
    # The warm start ended early (train.il_warmup_target) at step 25: RL's phase starts there, 60 steps long.
    for step in (0, 24, 25, 27, 29, 50, 84):
        expected = phase(3e-3, 0, 40, step) if step < 25 else phase(1e-4, 25, 60, step)
        assert math.isclose(float(fn(step, 25)), expected, rel_tol=1e-5, abs_tol=1e-12), step
    assert float(make_schedule(OptimizerConfig(lr=1e-4), 10, 10)(5)) > 0  # warm start only: il_lr 0 means lr
    with pytest.raises(ValueError, match="il_warmup_steps"):
        make_schedule(cfg, 10, 11)


def test_optimizer_direction_times_lr_is_adamw():
    """make_optimizer + apply_direction (the run-time learning rate) == optax.adamw with clipping and the mask."""
    cfg = OptimizerConfig(lr=1e-2, weight_decay=0.1, clip_norm=0.5, b1=0.8, b2=0.95, eps=1e-6)
    rng = np.random.default_rng(0)
    params = {"w": jnp.asarray(rng.normal(size=(4, 3)), jnp.float32), "b": jnp.asarray(rng.normal(size=3), jnp.float32)}
    reference = optax.chain(
        optax.clip_by_global_norm(0.5),
        optax.adamw(
            1e-2, b1=0.8, b2=0.95, eps=1e-6, weight_decay=0.1, mask=lambda p: jax.tree.map(lambda x: x.ndim >= 2, p)
        ),
    )
    ours = make_optimizer(cfg)
    p_ref, s_ref, p_ours, s_ours = params, reference.init(params), params, ours.init(params)
    for _ in range(3):
        grads = jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape), jnp.float32), params)
        updates, s_ref = reference.update(grads, s_ref, p_ref)
        p_ref = optax.apply_updates(p_ref, updates)
        direction, s_ours = ours.update(grads, s_ours, p_ours)
        p_ours = apply_direction(p_ours, direction, jnp.float32(1e-2))
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7), p_ours, p_ref)
    assert max_rel_diff(p_ours, params) > 1e-3


def test_greedy_reproduced_rows_matches_reference():
    """A row counts when it has expert tokens and each has probability > 1/2 (reference: plain float64 NumPy)."""
    rng = np.random.default_rng(0)
    b, t = 64, 12
    probs = rng.choice([0.2, 0.49, 0.51, 0.9, 1.0], size=(b, t), p=[0.1, 0.05, 0.05, 0.3, 0.5])
    expert = rng.random((b, t)) < 0.3
    expert[:4] = False  # rows without imitation tokens never count
    expected = np.array(
        [
            row_e.any() and all(p > 0.5 for p, e in zip(row_p, row_e) if e)
            for row_p, row_e in zip(probs.astype(np.float64), expert)
        ]
    )
    got = np.asarray(greedy_reproduced_rows(jnp.log(jnp.asarray(probs, jnp.float32)), jnp.asarray(expert)))
    assert 0 < expected.sum() < b - 4
    np.testing.assert_array_equal(got, expected)


def test_optimizer_config_names_bad_field():
    with pytest.raises(ValueError, match="optimizer.min_lr_ratio"):
        OptimizerConfig(min_lr_ratio=1.5)


# PPO's clipped surrogate of the ratio current / old, trajectory credit, batch-mean baseline, token mean, RL only.
PPO = (
    "objective.preset=custom",
    "objective.surrogate=ppo",
    "objective.is_level=none",
    "objective.mismatch_level=none",
    "objective.old_logprobs=recompute",
    "objective.baseline=batch_mean",
    "objective.credit=trajectory",
    "objective.gamma=1.0",
    "objective.aggregation=token_mean",
    "objective.il_weight=0.0",
)


def test_ppo_update_at_float32_overflowing_log_ratios_stays_finite(setup):
    """Old log-probs 90 below (r = e^90) and 90 above (r = e^-90) the current ones on four rows, advantages of both
    signs: exp overflows float32 there (past 88.7), but with the log-ratio clamped at 20 (the default) the loss is
    the float64 formula's, the update is applied, and it is the update of the same batch with those rows'
    advantages 0: beyond the clamp a token carries no gradient."""
    state, step_full, _, _ = setup
    exp = make_exp("train.batch_size=8", EPS, *PPO)
    assert exp.objective.ppo_log_ratio_clamp == 20.0
    step, _ = build_steps(exp, state, step_full.mesh)
    batch = make_batch(8, seed=5)
    current = step.old_log_probs(state, batch).astype(np.float64)  # the learner's log-probs before the update
    adv = np.array([1.0, -1.0, 1.0, -1.0, 1.0, -1.0, 0.5, -0.5], np.float32)

    def update(shift, advantages):
        old = np.where(batch.action_mask, current - np.asarray(shift, np.float64)[:, None], 0).astype(np.float32)
        args = (batch, advantages, old)
        return step(_copy_state(state), *(step.put_batch(x) for x in args)), old

    (new, metrics), old = update([90, 90, -90, -90, 0, 0, 0, 0], adv)
    assert int(metrics["skipped"]) == 0 and np.isfinite(float(metrics["grad_norm"]))
    # loss = sum over action tokens of max(-A r, -A clip(r, 0.8, 1.2)) / their count, r = exp(clip(log r, +-20))
    A = np.broadcast_to(adv[:, None].astype(np.float64), current.shape)
    ratio = np.exp(np.clip(current - old.astype(np.float64), -20.0, 20.0))
    token_loss = np.maximum(-A * ratio, -A * np.clip(ratio, 0.8, 1.2))
    expected = np.sum(np.where(batch.action_mask, token_loss, 0)) / batch.action_mask.sum()
    assert math.isclose(float(metrics["loss"]), expected, rel_tol=1e-5)
    (same, same_metrics), _ = update(np.zeros(8), np.where(np.arange(8) < 4, 0, adv).astype(np.float32))
    assert math.isclose(float(metrics["grad_norm"]), float(same_metrics["grad_norm"]), rel_tol=1e-5)
    assert max_rel_diff(tree_copy(new.params), tree_copy(same.params)) < 1e-6
    assert max_rel_diff(tree_copy(new.params), tree_copy(state.params)) > 1e-4  # the update is not a no-op


def test_bf16_compute_keeps_float32_master_weights(setup):
    state, step_full, _, _ = setup
    exp = make_exp("train.batch_size=8", EPS, *OBJECTIVE, "model.dtype=bfloat16", "model.param_dtype=float32")
    step_bf16, _ = build_steps(exp, state, step_full.mesh)
    batch = make_batch(8, seed=4)
    s16, m16 = step_bf16(_copy_state(state), step_bf16.put_batch(batch))
    _, m32 = step_full(_copy_state(state), step_full.put_batch(batch))
    assert all(x.dtype == np.float32 for x in jax.tree.leaves(s16.params))
    assert all(x.dtype == np.float32 for x in jax.tree.leaves(s16.opt_state) if x.ndim)
    assert int(m16["skipped"]) == 0
    assert float(m16["loss"]) != float(m32["loss"])  # the forward really ran in bfloat16
    assert math.isclose(float(m16["loss"]), float(m32["loss"]), rel_tol=3e-2)
    assert math.isclose(float(m16["grad_norm"]), float(m32["grad_norm"]), rel_tol=5e-2)
