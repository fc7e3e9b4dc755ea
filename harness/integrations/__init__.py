"""ratiolab inside the stacks researchers run: each module plugs one of ratiolab's parts into
another framework through that framework's own plug-in point, and runs in that framework's
environment (docs/in-your-stack.md). The top layer: nothing in harness imports this package
(tests/test_layout.py), and each module needs its framework's optional extra.

  vllm_noise   controlled β in a vLLM V1 sampler: a logits processor (`vllm.logits_processors`)
  verl_losses  every ratiolab objective as a verl policy loss `ratiolab_<name>` (`verl.plugins`)
  trl          any ratiolab objective as the loss of TRL's GRPOTrainer (a subclass)
"""
