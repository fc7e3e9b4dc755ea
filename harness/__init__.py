"""ratiolab: a controlled-simulation and ablation harness for clipping and importance-ratio
failure modes of RL training of LLMs."""

from pathlib import Path

# The config tree: experiments/ at the checkout's top, shipped inside the package as
# harness/experiments (a link to it in the checkout, its files in a wheel: pyproject.toml)
CONFIGS = Path(__file__).resolve().parent / "experiments"
