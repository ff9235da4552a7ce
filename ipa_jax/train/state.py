"""TrainState: everything a train step reads and writes, as one pytree."""

from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx, struct
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ipa_jax.models.lora import LoraParam


@struct.dataclass
class TrainState:
    """params and opt_state are trained; `rest` holds the model's other variables (passed through). A model with
    LoRA adapters (config.lora) trains only them: params are the adapters, and the frozen base weights are in rest.

    step counts learner steps (one per train_step call); skipped counts steps whose update was not
    applied because the loss or gradient was not finite. The number of applied updates is step - skipped.
    rl_start is the step where the IL warm start ends and RL begins (train.il_warmup_steps, or earlier when
    the warm start reaches train.il_warmup_target); the learning rate schedule's phase boundary.

    ref_params: the frozen reference policy of the KL term and penalty (objective.kl_weight, objective.kl_penalty),
    parameters of the same model in the same shardings as `params` (`with_reference`), or None without one. It is
    not trained and not in the optimizer state: every step passes it through unchanged, and checkpoints save it.
    """

    graphdef: nnx.GraphDef = struct.field(pytree_node=False)
    tx: optax.GradientTransformation = struct.field(pytree_node=False)
    params: nnx.State
    rest: nnx.State
    opt_state: optax.OptState
    step: jax.Array  # int32 []
    skipped: jax.Array  # int32 []
    rng: jax.Array  # uint32 [2], a raw PRNG key (plain array: checkpoints as is)
    rl_start: jax.Array  # int32 []
    ref_params: nnx.State | None = None

    @classmethod
    def create(
        cls, model: nnx.Module, tx: optax.GradientTransformation, seed: int, mesh: Mesh | None = None, rl_start: int = 0
    ) -> "TrainState":
        """Splits the model into (graphdef, params, rest): params the adapters with LoRA, else every nnx.Param. With a
        mesh, the optimizer's per-parameter state (Adam moments) is created in its parameter's sharding and
        everything else is replicated on the mesh."""
        trained = LoraParam if model.config.lora is not None else nnx.Param
        graphdef, params, rest = nnx.split(model, trained, ...)
        out_shardings = None
        if mesh is not None:
            replicated = NamedSharding(mesh, P())
            param_shardings = jax.tree.map(
                lambda x: x.sharding if isinstance(x.sharding, NamedSharding) else replicated, params
            )
            out_shardings = optax.tree_map_params(
                tx,
                lambda _, sharding: sharding,
                jax.eval_shape(tx.init, params),
                param_shardings,
                transform_non_params=lambda _: replicated,
            )
        opt_state = jax.jit(tx.init, out_shardings=out_shardings)(params)
        return cls(
            graphdef=graphdef,
            tx=tx,
            params=params,
            rest=rest,
            opt_state=opt_state,
            step=jnp.zeros((), jnp.int32),
            skipped=jnp.zeros((), jnp.int32),
            rng=jax.random.PRNGKey(seed),
            rl_start=jnp.asarray(rl_start, jnp.int32),
        )

    def with_reference(self, ref_params: nnx.State) -> "TrainState":
        """This state with `ref_params` as its reference policy: copies (a step donates `params`' buffers, which the
        reference must not share) placed in the shardings of `params`. ValueError unless the trees and shapes match."""
        if jax.tree.structure(ref_params) != jax.tree.structure(self.params):
            raise ValueError("reference policy: its parameters are not those of the policy's model")
        for ref, param in zip(jax.tree.leaves(ref_params), jax.tree.leaves(self.params), strict=True):
            if ref.shape != param.shape:
                raise ValueError(
                    f"reference policy: a parameter of shape {ref.shape} where the policy has {param.shape}"
                )
        copy = jax.tree.map(
            lambda r, p: jax.device_put(jnp.array(r, dtype=p.dtype, copy=True), p.sharding), ref_params, self.params
        )
        return self.replace(ref_params=copy)

    def model(self) -> nnx.Module:
        return nnx.merge(self.graphdef, self.params, self.rest)

    def checkpoint_tree(self) -> dict[str, Any]:
        """The saved part (rest is rebuilt from the model config: with LoRA, the base weights from model.path or
        the seed); the reference policy when there is one."""
        tree = {
            "params": self.params,
            "opt_state": self.opt_state,
            "step": self.step,
            "skipped": self.skipped,
            "rng": self.rng,
            "rl_start": self.rl_start,
        }
        if self.ref_params is not None:
            tree["ref_params"] = self.ref_params
        return tree

    def replace_checkpoint_tree(self, tree: dict[str, Any]) -> "TrainState":
        return self.replace(**tree)
