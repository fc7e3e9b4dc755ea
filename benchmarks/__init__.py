"""Side-by-side benchmarks (docs/performance.md). Each runs as a module from the repository root:

    python -m benchmarks.bench_step --model tiny --pairs 9

What they share (recording a run, loading a model by name, interleaved rounds, the sampler
comparison) is in `benchmarks.common`.
"""
