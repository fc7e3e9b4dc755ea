"""Shared plotting helpers for the analysis/ scripts: one seaborn theme, `savefig` (PNG + PDF),
run discovery and tidy loading. Scripts read only results/."""

from __future__ import annotations

import io
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402
import seaborn as sns  # noqa: E402

from harness.base.io import write_text_atomic  # noqa: E402

RESULTS = Path("results")


def set_theme() -> None:
    sns.set_theme(context="paper", style="whitegrid", palette="colorblind", font_scale=1.1)


def savefig(fig: plt.Figure, path: str | Path, bottom: float = 0.0) -> Path:
    """Write `path`.png (150 dpi) and `path`.pdf (a .png/.pdf suffix is dropped first); return the
    PNG path. `bottom`: the share of the figure's height kept free for a caption."""
    path = Path(path)
    path = path.with_suffix("") if path.suffix in (".png", ".pdf") else path
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout(rect=(0, bottom, 1, 1))
    png, pdf = (path.parent / f"{path.name}{ext}" for ext in (".png", ".pdf"))
    # no timestamps in the files: regenerating unchanged data leaves git clean; each written
    # atomically (an interrupted run leaves the previous figure, not half of a new one)
    for out, kw in (
        (png, {"dpi": 150, "metadata": {"Software": None}}),
        (pdf, {"metadata": {"CreationDate": None, "Producer": None}}),
    ):
        buf = io.BytesIO()
        fig.savefig(buf, format=out.suffix[1:], **kw)
        write_text_atomic(out, buf.getvalue())
    plt.close(fig)
    return png


def find_runs(root: str | Path) -> list[Path]:
    """Run folders at or below `root` (folders holding a summary.json), sorted."""
    root = Path(root)
    return sorted(p.parent for p in root.rglob("summary.json"))


def summary(run: Path) -> dict:
    return json.loads((Path(run) / "summary.json").read_text())


def load_runs(root: str | Path, table: str) -> pd.DataFrame:
    """Concatenate `table` (e.g. "per_bin.csv") over the runs under `root`, tidy, with columns
    `run` (folder, relative to root) and `label` (the run's noise | α label)."""
    root = Path(root)
    frames = [
        pd.read_csv(r / table).assign(run=str(r.relative_to(root)), label=summary(r)["label"])
        for r in find_runs(root)
        if (r / table).exists()
    ]
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


def bin_labels(df: pd.DataFrame) -> list[str]:
    return [f"[{lo:g}, {hi:g})" for lo, hi in zip(df.bin_lo, df.bin_hi)]
