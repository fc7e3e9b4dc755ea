"""Figure: full-pipeline FP8, calibrated vs standard clip (Calibrated Clipping, arXiv 2609.22870).

python -m analysis.fp8_full_pipeline [--results DIR]   # reads results/<exp>/summary.csv
"""

from __future__ import annotations

from analysis.common import set_theme
from analysis.panels import panel_row
from analysis.runs import load_summary, results_root, smooth

EXP = "fp8_full_pipeline"
PANELS = [  # column, title, y label (the bounds: the calibrated arm logs them)
    ("entropy_mean", "Policy entropy (5-step mean)", "entropy (nats/token)"),
    ("eval_acc", "Held-out accuracy", "accuracy (fixed 512-problem set)"),
    ("clip_frac_low", "Mechanism: A<0 clipped at the lower bound", "fraction of tokens"),
    ("calib_low", "Calibrated lower bound L", "L"),
    ("calib_high", "Calibrated upper bound H", "H"),
]


def main(argv: list[str] | None = None) -> None:
    root = results_root(argv)
    df = load_summary(root, EXP)
    df = smooth(df[df.complete], ["entropy_mean", "clip_frac_low"])
    set_theme()
    title = "Full-pipeline FP8 (E5M2 W8A8, trainer straight-through), π_old := μ, k = 2"
    panel_row(df, PANELS, "optimizer step", title, root, EXP)


if __name__ == "__main__":
    main()
