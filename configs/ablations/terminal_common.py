"""The base of the terminal-suite ablations: configs/terminal_tiny.py (the built-in suite's easy tier, commands run in
bubblewrap sandboxes) with the quickstart's warm start rule (imitation until greedy decoding would reproduce 35% of
fresh expert episodes, here at most 600 steps), then 40 IPA steps, 64 held-out tasks per evaluation, one every 20
RL steps. Each terminal_*.py changes ONE thing from here, as its namesake does from common.py.

    python experiments/ablate.py --preset=terminal

Measured (seed 0, 2 CPU cores, 2026-12-04; the same warm start): the tiny policy never reached the target (greedy
match 0-12.5% of a batch) and after the 600 steps (33 minutes) solved 4 of 64 held-out easy tasks (6.2%; 3.1%
after 100 steps), with 2.3 failed commands per episode. The preset's 4 seeds (~2.6 h) started RL at 3.1-7.8% and
ended it at 5.9% (chunk credit), 7.8% (imitation continued) and 6.2% (token credit) on average: at that floor no
arm differs from another (paired intervals span 0; README). The preset is for a policy that learns the tier, e.g.
a Qwen3 checkpoint (--set=model.path=...) with SGLang servers, as in configs/terminal_qwen3.py.
"""

from pathlib import Path

from ipa_jax.pipeline import load_config


def get_config():
    c = load_config(Path(__file__).parent.parent / "terminal_tiny.py")
    c.train.name = "terminal_base"
    c.train.il_warmup_steps = 600
    c.train.il_warmup_target = 0.35
    c.train.steps = 640
    c.train.eval_episodes = 64
    c.train.eval_every = 20
    return c
