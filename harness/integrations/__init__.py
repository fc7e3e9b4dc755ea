"""ratiolab inside the stacks researchers train with: each module plugs ratiolab's objectives
into one framework's extension point (docs/in-your-stack.md). The top layer: nothing in harness
imports it (tests/test_layout.py), and each module needs its framework's optional extra."""
