"""Figure: repetition under self-distillation, clipped vs exact forward KL (OPSD, arXiv 2609.38995).

python -m analysis.opsd_repetition [--results DIR]   # reads results/<exp>/summary.csv
"""

from __future__ import annotations

from pathlib import Path

from analysis.common import set_theme
from analysis.panels import panel_row
from analysis.runs import load_summary, results_root, smooth

EXP = "opsd_repetition"
PANELS = [  # column, title, y label
    ("repetition_terminal_loop_rate", "Terminal-loop rate (5-step mean)", "fraction of responses"),
    ("repetition_rate", "Any-repetition rate (5-step mean)", "fraction of responses"),
    ("response_len", "Response length (5-step mean)", "tokens"),
    (
        "repetition_exit_mass_ratio",
        "Exit-mass ratio R = Σ(1−q)/Σ(1−p) (< 1: student loops more)",
        "R at first-copy positions",
    ),
    ("eval_acc", "Held-out accuracy", "accuracy (fixed held-out set)"),
]


def draw(root: Path, exp: str, title: str, panels: list[tuple] = PANELS) -> None:
    """The loop figure of `exp` (this experiment or smollm2_opsd_*), each panel over the arms
    its own preset declares; every panel but held-out accuracy smoothed."""
    df = load_summary(root, exp)
    df = df[df.complete]
    for col, *_ in panels:  # summaries made before a column was collected
        if col not in df:
            df = df.assign(**{col: float("nan")})
    df = smooth(df, [c for c, *_ in panels if c != "eval_acc"])
    set_theme()
    panel_row(df, panels, "distillation update", title, root, exp)


def main(argv: list[str] | None = None) -> None:
    title = "OPSD, 3-digit arithmetic task model (teacher: initial model + reference solution)"
    draw(results_root(argv), EXP, title)


if __name__ == "__main__":
    main()
