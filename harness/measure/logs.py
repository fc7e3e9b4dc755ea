"""The SNR procedure (the SNR post, §3) on a user's own logs: the calibration pass and the live
pass as per-token columns from any stack (verl, TRL, ...; docs/in-your-stack.md), the same
tables, bounds and figures as `python -m harness.measure`, by the same code
(harness.stats.snr: the streams, Table 6's bootstrap intervals, the three-job bounds).

    python -m harness.measure.logs calibration=cal.parquet live=live.parquet [out=DIR]
    python -m harness.measure.logs calibration=cal.jsonl live=live.jsonl \
        logp=old_log_prob logp_mu=rollout_log_probs seq=uid measurement.noise_q=0.99

Each file (parquet or jsonl) has one row per response token; its columns are named by the keys
    logp      log π_trainer(y_t), the trainer's log-prob of the sampled token
    logp_mu   log μ(y_t), the sampler's, as recorded at sampling time
    seq       a sequence id (the bootstrap resamples sequences: tokens within one are correlated)
    p_t       optional: the trainer's probability of the token, the bins (unset: exp(logp))
    gate      optional: 1 − 2p_t + ‖p‖² (Figure 1's gate prediction; unset: not drawn)
The calibration pass holds the trainer and the sampler at the same frozen weights (Δ_cal = β),
the live pass is a training step's (Δ_live = α + β). Advantages are not read: no table depends
on them. The `measurement` node is harness.measure's (bins, cap, band, the bounds' settings).
A missing column, an unknown key or a bad value stops the job before any compute.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass, field, fields
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import torch
from omegaconf import MISSING, OmegaConf
from omegaconf.errors import OmegaConfBaseException
from tqdm import tqdm

from harness.base.io import write_text_atomic
from harness.measure import (
    MeasurementCfg,
    gate_prediction,
    new_split,
    report_tables,
    summary_tables,
    tables_text,
    write_report,
)
from harness.stats.snr import SNRSplit, token_columns

FORMATS = (".parquet", ".jsonl")
# tokens per call into the streams (whole sequences): bounds the bootstrap's B × tokens arrays
CHUNK_TOKENS = 1 << 15
ROOT = Path(__file__).resolve().parents[2]


@dataclass
class LogsConfig:
    """`python -m harness.measure.logs key=value ...`: the two files, where the results go, the
    column each quantity is read from, and harness.measure's `measurement` node."""

    calibration: str = MISSING
    live: str = MISSING
    out: str = "results/logs"
    logp: str = "logp"
    logp_mu: str = "logp_mu"
    seq: str = "seq"
    p_t: str | None = None  # None: exp(logp)
    gate: str | None = None  # None: Figure 1 without the gate prediction
    figures: bool = True  # draw Figures 1 and 2 (analysis.noise_anatomy, analysis.snr_table)
    measurement: MeasurementCfg = field(default_factory=MeasurementCfg)


COLUMNS = ("logp", "logp_mu", "seq", "p_t", "gate")  # the keys that name a column


def parse(argv: list[str]) -> LogsConfig:
    """key=value arguments onto LogsConfig; an unknown key, a bad value or a missing file key
    names the valid ones."""
    valid = [f.name for f in fields(LogsConfig)]
    valid += [f"measurement.{f.name}" for f in fields(MeasurementCfg)]
    for arg in argv:
        key = arg.partition("=")[0]
        if "=" not in arg or key not in valid:
            raise SystemExit(f"[logs] {arg!r}: expected key=value with a key in {', '.join(valid)}")
    try:
        cfg = OmegaConf.merge(OmegaConf.structured(LogsConfig), OmegaConf.from_dotlist(argv))
        return OmegaConf.to_object(cfg)
    except OmegaConfBaseException as e:
        raise SystemExit(f"[logs] {e.__class__.__name__}: {e}".splitlines()[0]) from None


def file_columns(path: Path) -> list[str]:
    """The columns a dump holds, read without loading it (parquet: the schema; jsonl: the first
    row)."""
    if path.suffix not in FORMATS:
        raise ValueError(f"{path}: format {path.suffix!r}; valid: {', '.join(FORMATS)}")
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file")
    if path.suffix == ".parquet":
        return list(pq.read_schema(path).names)
    with path.open() as f:
        first = next((line for line in f if line.strip()), "{}")
    return list(json.loads(first))


def named_columns(cfg: LogsConfig) -> dict[str, str]:
    """key → the column it names (the optional keys left unset are absent)."""
    return {k: getattr(cfg, k) for k in COLUMNS if getattr(cfg, k) is not None}


def check_inputs(cfg: LogsConfig) -> None:
    """Before any compute: both files exist in a valid format and hold every named column."""
    for what in ("calibration", "live"):
        path = Path(getattr(cfg, what))
        have = file_columns(path)
        for key, col in named_columns(cfg).items():
            if col not in have:
                raise KeyError(
                    f"{what}={path}: no column {col!r} (key {key}); its columns: "
                    f"{', '.join(map(repr, have))}; name the right one with {key}=<column>"
                )


def read_tokens(path: Path, cols: dict[str, str]) -> dict[str, torch.Tensor]:
    """The named columns of a dump as tensors in the dtype they were recorded in, ordered by
    sequence (stable), `seq` renumbered 0, 1, ... (any id type); non-finite log-probs and p_t
    outside [0, 1] stop the job naming the column."""
    names = list(dict.fromkeys(cols.values()))
    if path.suffix == ".parquet":
        df = pd.read_parquet(path, columns=names)
    else:
        df = pd.read_json(path, lines=True, dtype=False)[names]
    if df.empty:
        raise ValueError(f"{path}: no tokens")
    seq = np.unique(df[cols["seq"]].to_numpy(), return_inverse=True)[1].ravel()
    order = np.argsort(seq, kind="stable")
    out = {"seq": torch.from_numpy(seq[order])}
    for key, col in cols.items():
        if key == "seq":
            continue
        x = df[col].to_numpy()[order]
        if x.dtype.kind != "f":
            raise TypeError(f"{path}: column {col!r} (key {key}) holds {x.dtype}; valid: floats")
        bad = ~np.isfinite(x) if key != "p_t" else ~((x >= 0) & (x <= 1))
        if bad.any():
            valid = "in [0, 1]" if key == "p_t" else "finite"
            raise ValueError(
                f"{path}: column {col!r} (key {key}) has {int(bad.sum())} of {len(x)} values "
                f"not {valid} (e.g. {x[bad][0]!r}); drop those tokens from both columns first"
            )
        out[key] = torch.from_numpy(np.ascontiguousarray(x))
    return out


def seq_chunks(seq: np.ndarray, size: int) -> list[slice]:
    """Consecutive slices of about `size` tokens of a seq-sorted array, never splitting a
    sequence (the streams' sequence statistics need whole ones)."""
    starts = np.flatnonzero(np.r_[True, seq[1:] != seq[:-1]])
    cuts = starts[np.r_[True, np.diff(starts // size) > 0]].tolist() + [len(seq)]
    return [slice(a, b) for a, b in zip(cuts[:-1], cuts[1:])]


def add_pass(split: SNRSplit, which: str, tok: dict[str, torch.Tensor]) -> None:
    """Stream one pass's tokens into `split` (add_cal / add_live), whole sequences at a time."""
    if "p_t" not in tok:
        tok = {**tok, "p_t": tok["logp"].double().exp()}
    add = split.add_cal if which == "cal" else split.add_live
    chunks = seq_chunks(tok["seq"].numpy(), CHUNK_TOKENS)
    for sl in tqdm(chunks, desc=f"[logs] {which}", disable=len(chunks) < 4):
        add(**token_columns(**{k: v[sl] for k, v in tok.items()}))


def run(cfg: LogsConfig) -> dict:
    check_inputs(cfg)
    out = Path(cfg.out)
    cols = named_columns(cfg)
    split = new_split(cfg.measurement)
    n = {}
    for which, path in (("cal", Path(cfg.calibration)), ("live", Path(cfg.live))):
        print(f"[logs] reading {which}: {path} ...", flush=True)
        tok = read_tokens(path, cols)
        n[which] = len(tok["seq"])
        add_pass(split, which, tok)
    report = report_tables(split, cfg.measurement)
    per_bin = report["per_bin"]
    # the gate's σ fitted to the calibration pass's mean |Δ| (no noise model is known here)
    pred, src = gate_prediction(per_bin[per_bin["pass"] == "cal"], [], 1.0)
    per_bin["gate_pred"] = np.concatenate([pred.to_numpy(), np.full(len(pred), np.nan)])
    report["summary"] = {
        "source": "logs",
        "calibration": cfg.calibration,
        "live": cfg.live,
        "columns": cols,
        "n_tokens": n,
        "label": f"logs: {Path(cfg.live).name}",
        "gate_sigma_source": src,
        **summary_tables(report),
    }
    header = f"logs: calibration {cfg.calibration} ({n['cal']} tokens), live {cfg.live} "
    text = tables_text(report, header + f"({n['live']} tokens)")
    print("\n" + text, flush=True)
    out.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out / "tables.txt", text)
    write_text_atomic(out / "config.yaml", OmegaConf.to_yaml(OmegaConf.structured(cfg)))
    write_report(out, report)
    print(f"[logs] wrote {out}/", flush=True)
    if cfg.figures:  # harness never imports analysis/: its scripts run as their own processes
        for mod in ("noise_anatomy", "snr_table"):
            cmd = [sys.executable, "-m", f"analysis.{mod}", str(out.absolute())]
            subprocess.run(cmd, cwd=ROOT, check=True)
    return report["summary"]


if __name__ == "__main__":
    run(parse(sys.argv[1:]))
