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

    def model(self) -> nnx.Module:
        return nnx.merge(self.graphdef, self.params, self.rest)

    def checkpoint_tree(self) -> dict[str, Any]:
        """The saved part (rest is rebuilt from the model config: with LoRA, the base weights from model.path or
        the seed)."""
        return {
            "params": self.params,
            "opt_state": self.opt_state,
            "step": self.step,
            "skipped": self.skipped,
            "rng": self.rng,
            "rl_start": self.rl_start,
        }

    def replace_checkpoint_tree(self, tree: dict[str, Any]) -> "TrainState":
        return self.replace(**tree)
