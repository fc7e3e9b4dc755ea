"""The RL step and what a run is built from: the GRPO step (`step`), α's controls (`alpha`), the
run's objects (`setup`), checkpoints and resume (`checkpoint`), and the step-0 mechanism check
(`mechanism`)."""
