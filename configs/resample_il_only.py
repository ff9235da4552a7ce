"""Reference for the resampling comparison (configs/resample_plain.py): imitation only, every update a batch of
16 scripted-expert episodes of the hard task (what the IL fallback could give at most per update), no RL, at the
same learning rate (optimizer.il_lr = 3e-3 = the hard task's lr). Held-out success after the same number of
updates."""

from pathlib import Path

from ipa_jax.pipeline import load_config


def get_config():
    c = load_config(Path(__file__).with_name("resample_plain.py"))
    c.train.name = "resample_il_only"
    c.train.il_warmup_steps = c.train.steps
    c.train.il_warmup_target = 0.0  # every update imitates (no early switch to RL)
    return c
