"""The figure of any pre-registered experiment, wherever its preset lives: every run's
trajectory per arm (held-out accuracy, training reward, policy entropy, then each other metric
an endpoint registers; mean and 95% t-interval over seeds, each run thin) with its in-kind
events marked (analysis.events), each registered endpoint's test over its panel, and each
arm's step-0 mechanism check as the footer (mechanism.csv).

    python -m analysis.figure [EXPERIMENT ...] [--results DIR]

reads DIR/<exp>/{summary.csv, prereg.yaml, mechanism.csv} (analysis.summarize) and writes
DIR/<exp>/fig_<exp>.png and .pdf; without names, every experiment under DIR whose runs carry a
`prereg` (analysis.claims.registered). A named experiment without a prereg is a pilot: the same
figure, titled PILOT, with the loop rate and both clip shares (the events a pilot looks for)
in place of registered endpoints and no test over any panel.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from analysis.claims import registered
from analysis.panels import trajectories
from analysis.runs import names_and_root

PANELS = [  # column, title, y label
    ("eval_acc", "Held-out accuracy", "accuracy (fixed held-out set)"),
    ("reward_mean", "Training reward (5-step mean)", "mean reward"),
    ("entropy_mean", "Policy entropy (5-step mean)", "entropy (nats/token)"),
]


PILOT_PANELS = [
    ("repetition_terminal_loop_rate", "Terminal loops (5-step mean)", "share of responses"),
    ("clip_frac_low", "Clipped below, A < 0 (5-step mean)", "share of response tokens"),
    ("clip_frac_high", "Clipped above, A > 0 (5-step mean)", "share of response tokens"),
]


def panels(prereg: dict) -> list[tuple]:
    """PANELS, then one panel per other summary column an endpoint registers."""
    shown = {col for col, *_ in PANELS}
    metrics = dict.fromkeys(ep["metric"] for ep in prereg["endpoints"])
    return PANELS + [(m, f"{m} (5-step mean)", m) for m in metrics if m not in shown]


def draw(root: Path, exp: str) -> None:
    """The figure of `exp`, titled with its registered claim and source (a pilot: PILOT)."""
    path = Path(root) / exp / "prereg.yaml"
    if not path.exists():
        trajectories(root, exp, PANELS + PILOT_PANELS, f"{exp}: PILOT, no test")
        return
    prereg = yaml.safe_load(path.read_text())
    title = f"{exp}: {prereg['claim']} ({prereg['source']})"
    trajectories(root, exp, panels(prereg), title)


def main(argv: list[str] | None = None) -> None:
    experiments, root = names_and_root(argv)
    for exp in experiments or registered(root):
        draw(root, exp)
        print(f"[figure] {root / exp / f'fig_{exp}.png'}")


if __name__ == "__main__":
    main()
