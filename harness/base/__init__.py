"""The foundation every other package stands on: atomic file writes (`io`), the per-axis
registries (`registry`), the per-token batch and its three log-ratios (`batch`), model loading and
weights checksums (`models`), and the collectives across ranks (`distributed`)."""
