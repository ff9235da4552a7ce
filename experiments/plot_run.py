"""A run's learning curve as a PNG: held-out success at every evaluation beside each phase's training signal.

    python experiments/plot_run.py --run=runs/quickstart --out=docs/img/quickstart.png

The README's figure is this command on the quickstart run its numbers quote (rerun it when they change). Logic:
`ipa_jax.analysis.figures.run_figure`.
"""

import os

from absl import app, flags

from ipa_jax.analysis.figures import run_figure

flags.DEFINE_string("run", None, "Run folder.", required=True)
flags.DEFINE_string("out", None, "PNG to write (default <run>/learning_curve.png).")
flags.DEFINE_string("title", None, "Figure title (default: the run folder's name and where RL starts).")
FLAGS = flags.FLAGS


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    out = FLAGS.out or os.path.join(FLAGS.run, "learning_curve.png")
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    run_figure(FLAGS.run, FLAGS.title).savefig(out)
    print(f"wrote {out}")


if __name__ == "__main__":
    app.run(main)
