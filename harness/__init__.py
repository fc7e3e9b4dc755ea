"""ratiolab: a controlled-simulation and ablation harness for clipping and importance-ratio
failure modes of RL training of LLMs."""
