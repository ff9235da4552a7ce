"""Learner throughput: the jitted ipa_jax train step next to a plain PyTorch/transformers training step.

Same random Qwen3-MoE weights (transformers builds them, ipa_jax loads the safetensors), same batch, same objective
(FlashREINFORCE: batch-mean baseline, detached token ratio, sequence Bernoulli-KL trust region, sample-mean;
rl_weight 1, il_weight 0), same optimizer (AdamW + global-norm clip 1.0), float32 master weights and Adam state;
compute in --dtype (bfloat16: ipa_jax casts the weights in the forward, torch runs under autocast). At fixed sizes
it also times ipa_jax with a plain NLL loss (same model, same optimizer) and the objective alone, to give the
objective's share of the step, and (--reference_kl) the step with a reference-KL term (k3, weight 0.04) including the
frozen reference policy's log-prob forward, computed once per batch as the learner does, to give the reference's
cost. With --lora_rank > 0 it also times, at fixed sizes, the same step training LoRA adapters only (same base
weights, ipa_jax/models/lora.py), and compares once the bytes of trained parameters + optimizer state, and of
everything the train state holds (the frozen base too), with full fine-tuning. With --torch_device=none nothing is
built by transformers: ipa_jax's own random init of the same architecture (faster at billions of parameters, and
nothing written to disk). Reports tokens/s, MFU
(6 * N_active * tokens + attention FLOPs over the device's peak), the minimum and median of --iters interleaved
rounds after warm-up (compile; each timed call after a short pause: timing.py), and the ratios torch / ipa_jax
(from the minima, the least disturbed measurements on a shared machine, from the medians, and paired: the median of
the rounds' own ratios with a 95% bootstrap interval, which cancels load that slows a whole round).

Sizes: fixed B x T batches (--sizes, or --batch x --seq_len), each row one trajectory of T tokens; and, with
--lengths, what RL feeds the learner: --length_batches batches of the recorded run's batch size, their episode
lengths drawn from a run's trajectories (episode_lengths.py), as that run's learner packs them (`pack_batch`:
several episodes per row of the bucket whose rows hold the fewest positions, `train.packing`; --buckets: other
buckets) against the same episodes padded to the batch's longest, one per row, for PyTorch (what a transformers
training loop does). When
the run's episodes begin with a common prefix (the recorded system prompt and tool schema), the drawn ones do too,
and ipa_jax is also timed with `train.share_prefix` (each packed row holds the prefix once). One timed call runs
all the batches, one step each; tokens/s counts real tokens.

  python experiments/benchmarks/bench_learner.py          # 4 layers, hidden 256, 16 experts top-4, 4 x 512
  python experiments/benchmarks/bench_learner.py --batch=2 --seq_len=256  # smaller, for a busy 2-core machine
  python experiments/benchmarks/bench_learner.py --sizes=1x128,2x256,4x512,8x512 \
      --lengths=experiments/benchmarks/quickstart_lengths.json --nonll_step  # every size and the quickstart's lengths
  python experiments/benchmarks/bench_learner.py --dtype=bfloat16 --layers=24 --hidden=2048 --experts=64 --top_k=8 \
      --moe_width=768 --vocab=151936 --batch=8 --seq_len=4096 --torch_device=cuda   # one GPU (gpu_learner.sh)
  python experiments/benchmarks/bench_learner.py --moe_impl=tokamax --torch_device=none --nonll_step  # one MoE path
  python experiments/benchmarks/bench_learner.py --lora_rank=8 --torch_device=none --nonll_step  # LoRA vs full
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import sys
import tempfile

from absl import app, flags
from episode_lengths import length_batches, load_lengths  # beside this script, as timing.py
from timing import paired_ratio, time_round_robin  # experiments/benchmarks/timing.py, beside this script

from ipa_jax.host_memory import host_memory_kept, keep_freed_host_memory
from ipa_jax.models.config import MOE_IMPLS, REMAT_POLICIES

flags.DEFINE_integer("layers", 4, "decoder layers")
flags.DEFINE_integer("hidden", 256, "hidden size")
flags.DEFINE_integer("experts", 16, "experts per MoE layer")
flags.DEFINE_integer("top_k", 4, "experts per token")
flags.DEFINE_integer("moe_width", 128, "moe_intermediate_size")
flags.DEFINE_integer("vocab", 8192, "vocabulary size")
flags.DEFINE_integer("batch", 4, "batch size (trajectories)")
flags.DEFINE_integer("seq_len", 512, "tokens per trajectory")
flags.DEFINE_list("sizes", [], "fixed sizes BxT to time one after another (default: --batch x --seq_len)")
flags.DEFINE_string("lengths", "", "also time batches of these episode lengths (an episode_lengths.py JSON file)")
flags.DEFINE_integer("length_batches", 3, "--lengths: batches drawn (each timed call runs one step on each)")
flags.DEFINE_list("buckets", [], "--lengths: the packed rows' buckets (default: the recorded run's)")
flags.DEFINE_integer("seed", 0, "seed of the synthetic batches")
flags.DEFINE_integer("iters", 3, "timed rounds (each implementation once per round)")
flags.DEFINE_enum("moe_impl", "auto", MOE_IMPLS, "ipa_jax MoE path (models/moe.py)")
flags.DEFINE_integer("moe_block_rows", 0, "ipa_jax blocked MoE path: rows per block (0 = automatic)")
flags.DEFINE_string("attention_impl", "auto", "ipa_jax attention: auto | blocked | xla | cudnn | reference")
flags.DEFINE_bool("scan_layers", False, "ipa_jax decoder layers under nnx.scan")
flags.DEFINE_enum("remat", "none", REMAT_POLICIES, "ipa_jax rematerialisation per layer")
flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "compute dtype of both sides (weights stay float32)")
flags.DEFINE_string("torch_device", "cpu", "where the PyTorch step runs: cpu, cuda, or none (time ipa_jax alone)")
flags.DEFINE_integer("heads", 8, "attention heads (KV heads: half of them)")
flags.DEFINE_integer("logprob_block_size", 128, "ipa_jax: positions per block of the LM head and log-probs")
flags.DEFINE_bool(
    "update_bound",
    True,
    "ipa_jax shows each update finite by AdamW's bound before computing it "
    "(False: computes and checks it, as for a custom optax transformation; docs/design.md)",
)
flags.DEFINE_integer("microbatches", 1, "ipa_jax gradient-accumulation microbatches (torch: one pass)")
flags.DEFINE_bool(
    "nll_step",
    True,
    "also time ipa_jax with a plain NLL loss (a second copy of the weights and "
    "optimizer state: turn off for configs that fill the device)",
)
flags.DEFINE_integer("lora_rank", 0, "also time training LoRA adapters of this rank only (0 = not)")
flags.DEFINE_float("lora_alpha", 16.0, "LoRA scale numerator (update scaled by alpha / rank)")
flags.DEFINE_bool("lora_experts", True, "LoRA adapters on the experts too (else attention only: an all-MoE model)")
flags.DEFINE_bool(
    "reference_kl",
    True,
    "also time the step with a reference-KL term and the reference policy's forward (a third copy of the weights, "
    "a fourth of the parameters as the reference: turn off for configs that fill the device)",
)
flags.DEFINE_float("peak_tflops", 0.0, "peak TFLOP/s per device for MFU (0 = detect)")
flags.DEFINE_string("out", "", "also write the results as JSON here")
FLAGS = flags.FLAGS

DELTA = 3e-3  # FlashREINFORCE trust-region threshold (both implementations)


def _synthetic_batch(rng, batch: int, seq_len: int, vocab: int):
    """Prompt = first quarter; then 8 chunks of policy tokens; behaviour log-probs near log(1/V)."""
    import numpy as np

    from ipa_jax.trajectory import Trajectory, build_chunk_ids, pad_batch

    trajs = []
    for i in range(batch):
        tokens = rng.randint(0, vocab, seq_len)
        action = np.zeros(seq_len, bool)
        action[seq_len // 4 :] = True
        ends = np.linspace(seq_len // 4, seq_len - 1, 9).astype(int)[1:]
        behavior = np.where(action, -np.log(vocab) + rng.normal(0, 0.01, seq_len), 0.0)
        trajs.append(
            Trajectory(
                uid=str(i),
                tokens=tokens,
                action_mask=action,
                behavior_logprobs=behavior,
                chunk_ids=build_chunk_ids(action, ends),
                expert_mask=np.zeros(seq_len, bool),
                reward=float(i % 2),
                policy_version=0,
            )
        )
    return pad_batch(trajs, (seq_len,))


def _torch_steps(hf, opt, batches, device: str, dtype: str):
    """One call = a step on each batch in turn: transformers forward -> full logits -> log-softmax gather ->
    FlashREINFORCE loss -> AdamW step (`opt`, over hf's parameters)."""
    import contextlib

    import torch

    put = lambda x, dtype=None: torch.as_tensor(x, dtype=dtype).to(device)  # noqa: E731
    autocast = (
        torch.autocast(device.split(":")[0], dtype=torch.bfloat16) if dtype == "bfloat16" else contextlib.nullcontext()
    )
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    inputs = [
        (
            put(b.tokens, torch.long),
            put(b.action_mask),
            put(b.behavior_logprobs),
            put(b.rewards),
            put(b.attention_mask, torch.long),
        )
        for b in batches
    ]

    def step(tokens, mask, behavior, rewards, attention):
        opt.zero_grad(set_to_none=True)
        with autocast:
            logits = hf(input_ids=tokens, attention_mask=attention).logits
        logp = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, tokens[:, 1:, None])[..., 0]
        logp = torch.nn.functional.pad(logp, (1, 0))
        with torch.no_grad():
            adv = rewards - rewards.mean()
            p = behavior.exp().clamp(1e-6, 1 - 1e-6)
            q = logp.exp().clamp(1e-6, 1 - 1e-6)
            kl = p * (p / q).log() + (1 - p) * ((1 - p) / (1 - q)).log()
            n = mask.sum(1)
            admitted = ((kl * mask).sum(1) / n).clamp(min=0) <= DELTA
            w = torch.where(mask & admitted[:, None], (logp - behavior).exp() * adv[:, None], 0.0)
        loss = -((w * logp).sum(1) / n).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(hf.parameters(), 1.0)
        opt.step()
        sync()
        return float(loss.detach())

    return lambda: [step(*x) for x in inputs]


def _parse_size(size: str) -> tuple[int, int]:
    """ "BxT" -> (B, T)."""
    try:
        b, t = (int(x) for x in size.lower().split("x"))
    except ValueError:
        raise ValueError(f"--sizes: {size!r} is not BxT (e.g. 4x512)") from None
    if b < 1 or t < 2:
        raise ValueError(f"--sizes: {size!r} needs B >= 1 and T >= 2")
    return b, t


def main(_):
    import jax
    import jax.numpy as jnp
    import numpy as np
    import torch
    import transformers
    from flax import nnx

    from ipa_jax.models import (
        LoraConfig,
        MeshConfig,
        Qwen3Config,
        from_pretrained,
        init_model,
        make_mesh,
        token_logprobs,
    )
    from ipa_jax.objectives import combine_terms, compute_advantages, flash_reinforce_config, objective_terms
    from ipa_jax.train import (
        OptimizerConfig,
        StepOptions,
        TrainState,
        TrainStep,
        make_optimizer,
        make_schedule,
        place_state,
    )
    from ipa_jax.train.metrics import peak_flops_per_device, train_flops_per_token
    from ipa_jax.train.optimizer import apply_direction

    sizes = [_parse_size(s) for s in FLAGS.sizes] or [(FLAGS.batch, FLAGS.seq_len)]
    record = load_lengths(FLAGS.lengths) if FLAGS.lengths else None
    longest = max([t for _, t in sizes] + (record["buckets"] if record else []))
    torch.set_num_threads(len(os.sched_getaffinity(0)))
    torch.manual_seed(0)
    hf_config = transformers.Qwen3MoeConfig(
        vocab_size=FLAGS.vocab,
        hidden_size=FLAGS.hidden,
        intermediate_size=4 * FLAGS.hidden,
        moe_intermediate_size=FLAGS.moe_width,
        num_hidden_layers=FLAGS.layers,
        num_attention_heads=FLAGS.heads,
        num_key_value_heads=FLAGS.heads // 2,
        head_dim=FLAGS.hidden // FLAGS.heads,
        num_experts=FLAGS.experts,
        num_experts_per_tok=FLAGS.top_k,
        norm_topk_prob=True,
        max_position_embeddings=4 * longest,
    )
    learner_side = dict(
        moe_impl=FLAGS.moe_impl,
        moe_block_rows=FLAGS.moe_block_rows,
        attention_impl=FLAGS.attention_impl,
        scan_layers=FLAGS.scan_layers,
        remat_policy=FLAGS.remat,
    )
    lora = LoraConfig(FLAGS.lora_rank, FLAGS.lora_alpha, experts=FLAGS.lora_experts) if FLAGS.lora_rank else None
    lora_model = None  # the same base weights with adapters
    if FLAGS.torch_device == "none":
        hf = None
        model = init_model(Qwen3Config.from_hf_dict(hf_config.to_dict(), **learner_side), seed=0)
        if lora:
            lora_model = init_model(model.config.replace(lora=lora), seed=0)
    else:
        hf = transformers.Qwen3MoeForCausalLM(hf_config).float().train()
        with tempfile.TemporaryDirectory() as tmp:
            hf.save_pretrained(tmp)
            model = from_pretrained(tmp, **learner_side)
            if lora:
                lora_model = from_pretrained(tmp, lora=lora, **learner_side)
        hf.to(FLAGS.torch_device)
        torch_opt = torch.optim.AdamW(hf.parameters(), lr=1e-6, weight_decay=0.1, eps=1e-8)
    config = model.config
    mesh = make_mesh(MeshConfig(data=1), devices=jax.devices()[:1])
    optimizer = OptimizerConfig(lr=1e-6, schedule="constant", warmup_ratio=0.0, weight_decay=0.1, clip_norm=1.0)
    tx = make_optimizer(optimizer)
    objective = flash_reinforce_config(DELTA)
    compute_dtype = None if FLAGS.dtype == "float32" else FLAGS.dtype
    options = StepOptions(
        objective=objective,
        logprob_block_size=FLAGS.logprob_block_size,
        entropy=False,
        compute_dtype=compute_dtype,
        microbatches=FLAGS.microbatches,
        optimizer=optimizer if FLAGS.update_bound else None,
    )
    state = place_state(TrainState.create(model, tx, seed=0, mesh=mesh), mesh)
    step = TrainStep(state, mesh, options, make_schedule(optimizer, total_steps=1000))
    holder = {"state": state}

    def jax_steps(train_step, holder, batches, reference=False):
        """One call = a step of `train_step` on each host batch in turn, on holder["state"]; with `reference`, the
        batch's reference log-probs first (once per batch, as the learner computes them)."""
        device_batches = [train_step.put_batch(b) for b in batches]

        def run():
            for b, device_b in zip(batches, device_batches):
                extras = None
                if reference:
                    ref = train_step.reference_log_probs(holder["state"], b)
                    extras = train_step.put_batch({"ref_log_probs": ref})
                holder["state"], metrics = train_step(holder["state"], device_b, extras=extras)
                float(metrics["loss"])  # blocks until the step is done

        return run

    def state_bytes(state) -> dict[str, int]:
        """Bytes of the trained parameters + optimizer state, and of the whole train state (frozen weights too)."""
        size = lambda tree: sum(x.nbytes for x in jax.tree.leaves(tree))  # noqa: E731
        trained = size(state.params) + size(state.opt_state)
        return {"trained_params_and_optimizer": trained, "train_state": trained + size(state.rest)}

    memory = {"full": state_bytes(state)}
    if lora_model is not None:
        lora_state = place_state(TrainState.create(lora_model, tx, seed=0, mesh=mesh), mesh)
        memory["lora"] = state_bytes(lora_state)
        lora_train_step = TrainStep(lora_state, mesh, options, make_schedule(optimizer, total_steps=1000))
        lora_holder = {"state": lora_state}

    # The same step with a plain next-token NLL over the action tokens instead of the objective.
    def nll_update(state, batch):
        def loss_fn(params):
            model = nnx.merge(state.graphdef, params, state.rest)
            logp, _, _ = token_logprobs(model, batch.tokens, batch.attention_mask, batch.positions, block_size=128)
            return -jnp.sum(jnp.where(batch.action_mask, logp, 0)) / jnp.sum(batch.action_mask)

        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        direction, opt_state = state.tx.update(grads, state.opt_state, state.params)
        return state.replace(params=apply_direction(state.params, direction, optimizer.lr), opt_state=opt_state), loss

    nll_jit = jax.jit(nll_update, donate_argnums=0)
    # Its own copy of the weights: the objective step donates (and so frees) the buffers of its state.
    nll_holder = {
        "state": jax.tree.map(lambda x: x.copy(), place_state(TrainState.create(model, tx, seed=0, mesh=mesh), mesh))
        if FLAGS.nll_step
        else None
    }

    def nll_step(device_batch):
        def run():
            nll_holder["state"], loss = nll_jit(nll_holder["state"], device_batch)
            return float(loss)

        return run

    # The step with a reference-KL term: the reference's log-probs (once per batch: here every step) and the step.
    if FLAGS.reference_kl:
        kl_objective = dataclasses.replace(objective, kl_weight=0.04, kl_estimator="k3")
        kl_state = jax.tree.map(lambda x: x.copy(), place_state(TrainState.create(model, tx, seed=0, mesh=mesh), mesh))
        kl_state = kl_state.with_reference(kl_state.params)
        kl_train_step = TrainStep(
            kl_state, mesh, dataclasses.replace(options, objective=kl_objective), make_schedule(optimizer, 1000)
        )
        kl_holder = {"state": kl_state}

    def objective_only(logp, batch):  # the batch is an argument, not a constant XLA could fold
        adv = compute_advantages(batch.rewards, objective.baseline)
        terms, _ = objective_terms(
            logp, batch.behavior_logprobs, adv, batch.action_mask, batch.chunk_ids, batch.expert_mask, objective
        )
        return combine_terms(terms, objective)

    objective_grad = jax.jit(jax.grad(objective_only))
    peak = FLAGS.peak_tflops * 1e12 if FLAGS.peak_tflops else peak_flops_per_device(jax.devices()[0])

    # name -> (steps to time, real tokens of one call, training FLOPs of one call)
    cases = {}
    for b, t in sizes:
        batch = _synthetic_batch(np.random.RandomState(FLAGS.seed), b, t, FLAGS.vocab)
        device_batch = step.put_batch(batch)
        logp0 = jnp.asarray(batch.behavior_logprobs)  # the objective alone: loss and its gradient w.r.t. [B, T]
        fns = {
            "ipa_jax_step": jax_steps(step, holder, [batch]),
            "objective_fwd_bwd": lambda logp0=logp0, b=device_batch: objective_grad(logp0, b).block_until_ready(),
        }
        if FLAGS.nll_step:
            fns["ipa_jax_nll_step"] = nll_step(device_batch)
        if lora_model is not None:
            fns["ipa_jax_lora_step"] = jax_steps(lora_train_step, lora_holder, [batch])
        if FLAGS.reference_kl:
            fns["ipa_jax_reference_kl_step"] = jax_steps(kl_train_step, kl_holder, [batch], reference=True)
        if hf is not None:
            fns["torch_step"] = _torch_steps(hf, torch_opt, [batch], FLAGS.torch_device, FLAGS.dtype)
        cases[f"{b}x{t}"] = (fns, b * t, train_flops_per_token(config, t) * b * t)
    if record is not None:
        buckets = [int(b) for b in FLAGS.buckets] or None
        rng = np.random.default_rng(FLAGS.seed)
        drawn = length_batches(record, FLAGS.length_batches, FLAGS.vocab, rng, buckets)
        fns = {"ipa_jax_step": jax_steps(step, holder, [packed for _, _, packed, _ in drawn])}
        if record["common_prefix"]:
            fns["ipa_jax_shared_prefix_step"] = jax_steps(step, holder, [shared for *_, shared in drawn])
        if hf is not None:
            fns["torch_step"] = _torch_steps(
                hf, torch_opt, [padded for _, padded, _, _ in drawn], FLAGS.torch_device, FLAGS.dtype
            )
        lengths = np.concatenate([n for n, *_ in drawn])
        flops = sum(train_flops_per_token(config, int(n)) * int(n) for n in lengths)
        cases["lengths"] = (fns, int(lengths.sum()), flops)
    del hf  # the torch steps hold their own references (on their device)

    results = {
        "config": dict(
            layers=FLAGS.layers,
            hidden=FLAGS.hidden,
            experts=FLAGS.experts,
            top_k=FLAGS.top_k,
            moe_width=FLAGS.moe_width,
            vocab=FLAGS.vocab,
            sizes=[f"{b}x{t}" for b, t in sizes],
            heads=FLAGS.heads,
            dtype=FLAGS.dtype,
            microbatches=FLAGS.microbatches,
            moe_impl=FLAGS.moe_impl,
            update_bound=FLAGS.update_bound,
            reference_kl=FLAGS.reference_kl,
            keep_host_memory=host_memory_kept(),
            moe_block_rows=FLAGS.moe_block_rows,
            attention_impl=FLAGS.attention_impl,
            scan_layers=FLAGS.scan_layers,
            remat=FLAGS.remat,
            device=jax.devices()[0].device_kind,
            torch_device=FLAGS.torch_device,
            threads=len(os.sched_getaffinity(0)),
            load_average_start=os.getloadavg()[0],
            lora_rank=FLAGS.lora_rank,
            lora_alpha=FLAGS.lora_alpha,
            lora_experts=FLAGS.lora_experts,
        ),
        "peak_flops_per_device": peak,
        "bytes": memory,
    }
    if "lora" in memory:
        memory["ratios"] = {
            f"lora_over_full_{kind}_bytes": memory["lora"][kind] / memory["full"][kind]
            for kind in ("trained_params_and_optimizer", "train_state")
        }
    if record is not None:
        results["length_draws"] = dict(
            file=FLAGS.lengths,
            batches=FLAGS.length_batches,
            batch_size=record["batch_size"],
            buckets=buckets or record["buckets"],
            common_prefix=record["common_prefix"],
            drawn_mean=float(lengths.mean()),
            drawn_max=int(lengths.max()),
            padded_shapes=["x".join(map(str, p.tokens.shape)) for _, p, _, _ in drawn],
            packed_shapes=["x".join(map(str, p.tokens.shape)) for _, _, p, _ in drawn],
            shared_prefix_shapes=["x".join(map(str, p.tokens.shape)) for *_, p in drawn],
            positions={
                name: int(sum(batch.tokens.size for batch in batches))
                for name, batches in zip(("padded", "packed", "shared_prefix"), list(zip(*drawn))[1:])
            },
        )
    summary = []
    for case, (fns, tokens, flops) in cases.items():
        print(f"timing {case}: {FLAGS.iters} rounds of {len(fns)} functions", file=sys.stderr, flush=True)
        rounds = time_round_robin(fns, FLAGS.iters)
        out = {"flops_per_call": flops}
        for name, t in rounds.items():
            out[name] = {"seconds_min": min(t), "seconds_median": statistics.median(t)}
            if name != "objective_fwd_bwd":
                out[name].update(tokens_per_s=tokens / min(t), mfu=flops / min(t) / peak)
        ratios = out["ratios"] = {}
        ipa = out["ipa_jax_step"]
        if "objective_fwd_bwd" in out:
            ratios["objective_alone_share_of_step"] = out["objective_fwd_bwd"]["seconds_min"] / ipa["seconds_min"]
        if "ipa_jax_nll_step" in out:
            ratios["objective_share_of_step"] = 1 - out["ipa_jax_nll_step"]["seconds_min"] / ipa["seconds_min"]
        if "ipa_jax_lora_step" in out:
            ratios["lora_time_over_full_time"] = out["ipa_jax_lora_step"]["seconds_min"] / ipa["seconds_min"]
        if "ipa_jax_reference_kl_step" in out:  # the reference forward and the KL term over the plain step
            ratios["reference_kl_step_over_step"] = out["ipa_jax_reference_kl_step"]["seconds_min"] / ipa["seconds_min"]
        # ipa_jax's step and, on a common prefix, its step with shared prefixes, each against torch's
        for name, label, key in (
            ("ipa_jax_step", f"{case:>8}  ipa_jax", "ipa_jax"),
            ("ipa_jax_shared_prefix_step", f"{'':>8}  shared prefix", "shared_prefix"),
        ):
            if name not in out:
                continue
            ours = out[name]
            line = f"{label} {ours['seconds_min'] * 1e3:8.1f} / {ours['seconds_median'] * 1e3:8.1f} ms"
            if "torch_step" in out:
                torch_t = out["torch_step"]
                ratios[f"torch_time_over_{key}_time"] = torch_t["seconds_min"] / ours["seconds_min"]
                ratios[f"torch_time_over_{key}_time_median"] = torch_t["seconds_median"] / ours["seconds_median"]
                paired = ratios[f"torch_time_over_{key}_time_paired"] = paired_ratio(rounds["torch_step"], rounds[name])
                line += (
                    f"  torch {torch_t['seconds_min'] * 1e3:8.1f} / {torch_t['seconds_median'] * 1e3:8.1f} ms"
                    f"  torch / {key} {ratios[f'torch_time_over_{key}_time']:.2f} / "
                    f"{ratios[f'torch_time_over_{key}_time_median']:.2f}, paired {paired['median']:.2f} "
                    f"[{paired['low']:.2f}, {paired['high']:.2f}]"
                )
            summary.append(line)
            print(line, file=sys.stderr, flush=True)  # as each size finishes; all of them again at the end
        results[case] = out
    results["load_average_end"] = os.getloadavg()[0]
    print(json.dumps(results, indent=2))
    print("(minimum / median of the rounds; paired: median of the rounds' ratios [95% bootstrap interval])")
    print("\n".join(summary))
    if FLAGS.out:
        with open(FLAGS.out, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    keep_freed_host_memory()  # before JAX starts its CPU threads (ipa_jax/host_memory.py)
    app.run(main)
