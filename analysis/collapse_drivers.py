"""Figure: the collapse experiment with its feedback loop's drivers on (β growth, harder task).

python -m analysis.collapse_drivers [--results DIR]   # reads results/<exp>/summary.csv
"""

from __future__ import annotations

from analysis.collapse_reject_vs_clamp import draw
from analysis.runs import results_root

EXP = "collapse_drivers"


def main(argv: list[str] | None = None) -> None:
    title = (
        "Student-t (ν=3) logit noise in μ, σ 0.5 → 0.7; numbers up to 15 from step 40; "
        "countdown task model"
    )
    draw(results_root(argv), EXP, title)


if __name__ == "__main__":
    main()
