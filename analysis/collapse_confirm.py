"""Figure: collapse in kind, reject vs clamp (SNR post §2), the confirmatory sweep of
experiment=collapse_confirm: every run's trajectory with its events marked.

python -m analysis.collapse_confirm [--results DIR]   # reads results/collapse_confirm/summary.csv
"""

from __future__ import annotations

from analysis.collapse_reject_vs_clamp import draw
from analysis.runs import results_root

EXP = "collapse_confirm"


def main(argv: list[str] | None = None) -> None:
    title = "Student-t (ν=3, σ=0.75) logit noise in μ, lr 4e-4, countdown task model"
    draw(results_root(argv), EXP, title)


if __name__ == "__main__":
    main()
