"""Checkpoints damaged after they were written: restore falls back to the newest one that loads, says which and
why, and moves the damaged ones aside; when none loads it raises naming each and moves nothing."""

import glob
import logging
import os
import shutil

import jax
import numpy as np
import pytest
from train_helpers import make_exp, tree_copy

from ipa_jax.pipeline.build import build_mesh, build_state
from ipa_jax.train import CheckpointConfig, Checkpointer
from ipa_jax.train.checkpoint import CheckpointError, checkpoint_mismatch


def _truncate_arrays(step_dir: str) -> None:
    for path in glob.glob(os.path.join(step_dir, "state", "**", "d", "*"), recursive=True):
        open(path, "wb").close()


def _remove_state(step_dir: str) -> None:
    shutil.rmtree(os.path.join(step_dir, "state"))


def _corrupt_host_json(step_dir: str) -> None:
    with open(os.path.join(step_dir, "host", "metadata"), "w", encoding="utf-8") as f:
        f.write('{"source": ')


DAMAGE = {"truncated arrays": _truncate_arrays, "missing state": _remove_state, "corrupt host JSON": _corrupt_host_json}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A template state and a folder with complete checkpoints at steps 1 and 2."""
    exp = make_exp()
    state = build_state(exp, build_mesh(exp.mesh))
    directory = str(tmp_path_factory.mktemp("saved") / "checkpoints")
    checkpointer = Checkpointer(directory, CheckpointConfig(async_save=False))
    for step in (1, 2):
        checkpointer.save(state.replace(step=jax.numpy.full_like(state.step, step)), {"step": step})
    checkpointer.close()
    return state, directory


def _copy(saved, tmp_path) -> str:
    directory = str(tmp_path / "checkpoints")
    shutil.copytree(saved[1], directory)
    return directory


@pytest.mark.parametrize("damage", DAMAGE)
def test_a_damaged_latest_checkpoint_falls_back_to_the_newest_that_loads(saved, tmp_path, damage, caplog):
    template = saved[0]
    directory = _copy(saved, tmp_path)
    DAMAGE[damage](os.path.join(directory, "2"))
    checkpointer = Checkpointer(directory, CheckpointConfig(async_save=False))
    with caplog.at_level(logging.WARNING, logger="ipa_jax.train.checkpoint"):
        state, host = checkpointer.restore(template)
    assert int(state.step) == 1 and host == {"step": 1}
    jax.tree.map(np.testing.assert_array_equal, tree_copy(state.params), tree_copy(template.params))
    assert "checkpoint 2 in" in caplog.text and "cannot be restored" in caplog.text
    assert "restored checkpoint 1, the newest that loads; damaged and moved aside: step 2" in caplog.text
    assert checkpointer.all_steps() == [1] and len(glob.glob(os.path.join(directory, "2.damaged-*"))) == 1
    assert checkpointer.save(state.replace(step=jax.numpy.full_like(state.step, 2)), {"step": 2})  # saved anew
    assert checkpointer.restore(template)[1] == {"step": 2}
    checkpointer.close()


def test_no_checkpoint_that_loads_is_an_error_naming_each_and_moves_nothing(saved, tmp_path):
    directory = _copy(saved, tmp_path)
    _truncate_arrays(os.path.join(directory, "2"))
    _corrupt_host_json(os.path.join(directory, "1"))
    checkpointer = Checkpointer(directory, CheckpointConfig(async_save=False))
    with pytest.raises(CheckpointError, match=r"no checkpoint .* can be restored: step 2: .*; step 1: JSONDecodeError"):
        checkpointer.restore(saved[0])
    assert sorted(os.listdir(directory)) == ["1", "2"]
    checkpointer.close()


def test_a_restore_into_a_fresh_state_gives_back_every_saved_field(tmp_path):
    """A resume restores into a freshly built state (the template). The saved state differs from a fresh one in every
    leaf of the checkpoint (parameters, Adam's moments and count, step, skipped, rng, rl_start, the reference
    policy); after the restore every leaf is the saved one's, none the template's, and the host state comes back."""
    exp = make_exp("objective.kl_weight=0.1")  # a reference policy: ref_params are saved too
    mesh = build_mesh(exp.mesh)
    fresh = build_state(exp, mesh)
    rng = np.random.default_rng(0)

    def moved(x):  # every leaf of the state changed: floats by noise, integers (counts, step, rng key) by 3
        value = np.asarray(x)
        value = value + (rng.normal(0, 1, value.shape) if value.dtype.kind == "f" else 3)
        return jax.device_put(value.astype(x.dtype), x.sharding)

    saved_state = jax.tree.map(moved, fresh)
    saved = jax.tree_util.tree_flatten_with_path(tree_copy(saved_state.checkpoint_tree()))[0]
    names = [jax.tree_util.keystr(path) for path, _ in saved]
    assert any("opt_state" in n for n in names) and any("ref_params" in n for n in names)
    assert {"['step']", "['skipped']", "['rng']", "['rl_start']"} <= set(names)
    host = {"step": 7, "source": {"epoch": 2}, "extra": {"reference_step": 3}}
    checkpointer = Checkpointer(str(tmp_path / "checkpoints"), CheckpointConfig(async_save=False))
    checkpointer.save(saved_state, host)
    restored, restored_host = checkpointer.restore(build_state(exp, mesh))
    checkpointer.close()
    template = jax.tree.leaves(tree_copy(fresh.checkpoint_tree()))
    got = jax.tree_util.tree_flatten_with_path(tree_copy(restored.checkpoint_tree()))[0]
    assert [jax.tree_util.keystr(path) for path, _ in got] == names
    for name, (_, want), (_, value), before in zip(names, saved, got, template, strict=True):
        assert not np.array_equal(want, before), f"{name}: the saved value must differ from a fresh state's"
        np.testing.assert_array_equal(value, want, err_msg=name)
    assert restored_host == host


def test_the_metadata_names_the_first_array_that_does_not_fit(saved, tmp_path, caplog):
    """From the metadata alone: the same config fits, another dtype fits (a restore casts), a wider model names its
    first differing parameter, another layer count an array only one side has; unreadable metadata is left to
    restore()."""
    template, directory = saved
    assert checkpoint_mismatch(directory, 2, template) is None

    def state_of(*overrides: str):
        exp = make_exp(*overrides)
        return build_state(exp, build_mesh(exp.mesh))

    assert checkpoint_mismatch(directory, 2, state_of("model.param_dtype='bfloat16'")) is None
    assert (
        checkpoint_mismatch(directory, 2, state_of("model.arch.intermediate_size=32"))
        == "params.layers.0.mlp.down_proj.value: stored float32[64, 32], requested float32[32, 32]"
    )
    assert (
        checkpoint_mismatch(directory, 2, state_of("model.arch.num_hidden_layers=3"))
        == "params.layers.2.input_layernorm.weight.value: stored nothing, requested float32[32]"
    )
    with caplog.at_level(logging.WARNING):
        assert checkpoint_mismatch(directory, 7, template) is None
    assert "checkpoint 7" in caplog.text and "metadata cannot be read" in caplog.text
