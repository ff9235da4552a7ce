"""Reading runs needs no JAX: RunFolder, the analysis modules and the sweep presets import without it (a notebook
reading runs starts in a second), and ipa_jax.pipeline's exports still resolve, `run` to the function."""

import json
import subprocess
import sys

SCRIPT = """
import json, sys
from ipa_jax.pipeline import RunFolder
import ipa_jax.pipeline.run_folder
import ipa_jax.analysis
import ipa_jax.analysis.presets
folder = RunFolder(sys.argv[1])
print(json.dumps({"heavy": sorted(m for m in ("jax", "flax", "optax", "orbax", "torch") if m in sys.modules),
                  "metrics": folder.read_metrics()}))
"""


def test_run_folder_and_analysis_import_without_jax(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 0.5}\n{"step": 2, "loss": 0.25}\n')
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result == {"heavy": [], "metrics": [{"step": 1, "loss": 0.5}, {"step": 2, "loss": 0.25}]}


def test_pipeline_run_is_the_function_also_after_its_module_is_imported():
    script = (
        "import ipa_jax.pipeline.run\n"  # the submodule first
        "from ipa_jax.pipeline import ConfigError, run\n"
        "from ipa_jax.pipeline.run import changes_since\n"
        "print(callable(run), run.__module__, ConfigError.__module__, changes_since.__module__)"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["True", "ipa_jax.pipeline.run", "ipa_jax.pipeline.config", "ipa_jax.pipeline.run"]
