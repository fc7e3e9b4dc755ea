"""Training runs → tidy frames, for the training figures.

Raw run folders `results/<experiment>/<override_dirname>/` (config.yaml +
metrics.jsonl, git-ignored) are reduced by `analysis/summarize.py` to one committed
`results/<experiment>/summary.csv`; the
figure scripts read only that CSV, through `load_summary`. Shared plotting helpers (theme,
`savefig`) come from `analysis/common.py`.
"""

from __future__ import annotations

import argparse
import copy
import functools
import inspect
import json
import math
import os
import sys
import warnings
from pathlib import Path

import pandas as pd
import yaml

from harness.base.io import write_text_atomic
from harness.rl.checkpoint import effective, flatten

PLACE_METRICS = ("place/frac", "clip/frac_low", "clip/frac_high", "mask/frac")
# metrics.jsonl keys kept in summary.csv ('/' → '_')
METRICS = [
    "reward/mean",
    "eval/acc",
    "entropy/mean",
    "response/len",
    "clip/frac_low",
    "clip/frac_high",
    "mask/frac",
    "rescue/frac",
    "dial/out_of_band_frac",
    "dial/mean_abs_delta",
    "is/weight_mean",
    "is/ess",
    "dial/kl_k3",
    "repetition/terminal_loop_rate",
    "repetition/rate",
    "repetition/exit_mass_ratio",
    "collapse/events",
    "calib/low",
    "calib/high",
    "calib/alpha_low",
    "calib/lp_low_share",
    "calib/hp_high_share",
    "calib/lp_high_share",
    "time/step_s",
    # the optimizer and the clip per arm, for audit: the gradient norm before clipping, the share
    # of updates grad clipping rescaled, deletions by the advantage's sign, the IS weight's tail
    # and the tail of the coefficient on ∇log π where the gradient survives
    "grad/norm",
    "grad/clipped",
    "mask/frac_neg",
    "mask/frac_pos",
    "is/weight_p99",
    "is/weight_max",
    "grad/coef_p99",
    "grad/coef_max",
    # where the deletions fall: at EOS (a response that stopped) and at a terminal loop's first
    # copy, as shares of response tokens beside the share of such tokens (harness.stats.repetition)
    *(f"{k}_{place}" for place in ("eos", "loop") for k in PLACE_METRICS),
    # OPSD: R and the student's entropy at copy positions (continuing a repeated segment) and at
    # the other response positions; the copy positions' share of the response tokens
    "repetition/copy_exit_mass_ratio",
    "repetition/noncopy_exit_mass_ratio",
    "repetition/copy_entropy",
    "repetition/noncopy_entropy",
    "repetition/copy_frac",
    # OPSD: the exact forward KL on S_t whatever the objective (under the clipped one it can rise
    # while the clipped loss falls: Prop. 1's reversal), and the teacher mass on clipped entries
    "opsd/fkl",
    "opsd/clipped_mass",
]


def results_root(argv: list[str] | None = None) -> Path:
    """`--results DIR`, else $RATIOLAB_RESULTS, else ./results."""
    return names_and_root(argv, nargs=0)[1]


def names_and_root(argv: list[str] | None, nargs: int | str = "*") -> tuple[list[str], Path]:
    """The command line of an analysis entry point: its positional names (experiments) and
    `--results DIR` (else $RATIOLAB_RESULTS, else ./results)."""
    p = argparse.ArgumentParser()
    if nargs:
        p.add_argument("names", nargs=nargs)
    p.add_argument("--results", default=os.environ.get("RATIOLAB_RESULTS", "results"))
    a = p.parse_intermixed_args(argv)
    return getattr(a, "names", []), Path(a.results)


_UNSET = object()  # a key neither the config nor a builder's signature gives a value


def config_value(cfg: dict, key: str):
    """A dotted key's value as the run used it: the config's, else (an objective or noise
    keyword the config leaves out) the builder's default (defaults live in the builders); else
    _UNSET."""
    node: object = cfg
    parts = key.split(".")
    for part in parts:
        if not isinstance(node, dict) or part not in node:
            break
        node = node[part]
    else:
        return node
    if len(parts) == 2 and parts[0] in ("objective", "noise") and parts[0] in cfg:
        if parts[0] == "objective":
            from harness.objectives import OBJECTIVES as builders
        else:
            from harness.noise import NOISE as builders
        builder = builders.get(cfg[parts[0]].get("name"))  # noise=none: no builder
        param = inspect.signature(builder).parameters.get(parts[1]) if builder else None
        if param is not None and param.default is not inspect.Parameter.empty:
            return param.default
    return _UNSET


def _same(value, wanted) -> bool:
    """A config value against an arm's: equal, a bool only to a bool, a tuple as its list."""
    if isinstance(value, tuple):
        value = list(value)
    return isinstance(value, bool) == isinstance(wanted, bool) and value == wanted


def matching_arms(cfg: dict, arms: dict) -> list[str]:
    """The labels of `arms` (label -> {dotted key: value}) whose values all match `cfg`."""
    return [
        label
        for label, values in arms.items()
        if all(_same(config_value(cfg, k), v) for k, v in (values or {}).items())
    ]


@functools.cache
def preset_config(exp: str) -> dict:
    """experiment=<exp> composed as a training run (experiments/); {} when <exp> is no
    training preset."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from harness.runs import config

    root = Path(__file__).resolve().parents[1] / "experiments"
    if not (root / "experiment" / f"{exp}.yaml").exists():
        return {}
    config.register()
    try:
        with initialize_config_dir(config_dir=str(root), version_base="1.3"):
            cfg = compose("train", overrides=[f"experiment={exp}"])
    except (HydraException, OmegaConfBaseException):  # a measure preset
        return {}
    return OmegaConf.to_container(cfg)


def preset_arms(exp: str) -> dict:
    """The arms that experiment=<exp> declares, for runs whose config.yaml predates the `arms`
    key; {} when <exp> is no training preset."""
    return preset_config(exp).get("arms") or {}


def figure_arms(exp: str, df: pd.DataFrame) -> list[str]:
    """The arms a figure of `exp` draws: those experiment=<exp> declares (`arms`), in its order
    (the legend's and the colours'); the runs' own labels, sorted, when it declares none (each run
    is then named by its objective). A run whose arm the preset does not declare (an arm renamed
    or dropped after the runs) raises: a figure never leaves runs out unseen."""
    declared = list(preset_arms(exp))
    if not declared:
        return sorted(set(df.arm))
    unknown = sorted(set(df.arm) - set(declared))
    if unknown:
        raise ValueError(
            f"{exp}: runs of arm(s) {', '.join(map(repr, unknown))}, which "
            f"experiments/experiment/{exp}.yaml does not declare (declared: "
            f"{', '.join(map(repr, declared))}); declare them there: a run keeps the label "
            "its config.yaml's `arms` gave it when it ran"
        )
    return declared


def arm_label(exp: str, cfg: dict) -> str:
    """The legend name of a run's arm: the label of the first arm, of those its preset declares
    (`arms` in the run's config, else today's experiment=<exp>), whose values its config
    matches; the objective's name when none does or the preset declares none."""
    arms = cfg["arms"] if "arms" in cfg else preset_arms(exp)
    labels = matching_arms(cfg, arms or {})
    return labels[0] if labels else cfg["objective"]["name"]


# config keys that do not define what a run trains: where and how it reports, and the
# experiment's own declarations
NOT_RECIPE = ("progress", "out", "name", "arms", "prereg")


def run_recipe(cfg: dict) -> dict:
    """What a run trains, flattened (dotted keys) with the defaults it left out filled in."""
    return {k: v for k, v in effective(flatten(cfg)).items() if k.split(".")[0] not in NOT_RECIPE}


def is_seed(key: str) -> bool:
    """A seed key: runs are paired by it, it never tells an arm or a recipe apart."""
    return key == "seed" or key.endswith(".seed")


def noise_node(cfg: dict) -> dict:
    """A run's noise node with the builder's defaults filled in (group files state only what
    differs from harness.noise's signatures, so σ may be absent from config.yaml)."""
    eff = effective(flatten(cfg))
    return {k[len("noise.") :]: v for k, v in eff.items() if k.startswith("noise.")}


def with_values(cfg: dict, values: dict) -> dict:
    """A copy of the nested config `cfg` with its dotted keys `values` set."""
    out = copy.deepcopy(cfg)
    for key, value in values.items():
        *path, leaf = key.split(".")
        node = out
        for part in path:
            node = node.setdefault(part, {})
        node[leaf] = value
    return out


def config_segments(cfg: dict, overrides: list[dict]) -> list[tuple[int, dict]]:
    """The configs a run trained under, oldest first, each with the first step it governed:
    config.yaml holds the last; each `resume=override` record in meta.json (`config_overrides`:
    from_step and {dotted key: [old, new]}) gives, from its old values, the one before it."""
    segments, current = [], cfg
    for record in reversed(overrides):
        segments.append((record["from_step"], current))
        old = {k: old for k, (old, _) in record["changed"].items()}
        current = with_values(current, old)
    return [(1, current), *reversed(segments)]


# the dotted keys that config_columns' own columns report
COLUMN_KEYS = {
    "seed",
    "objective.name",
    "noise.name",
    "noise.sigma",
    "alpha.staleness",
    "alpha.minibatches",
    "optim.lr",
    "engine.logp_old_source",
    "steps",
}


def config_columns(cfg: dict, swept: list[str]) -> dict:
    """The summary's columns that a run's config gives (one config: a step's): the recipe's
    usual keys, then each swept key of the experiment under its dotted name."""
    noise, values = noise_node(cfg), run_recipe(cfg)
    return {
        "seed": cfg["seed"],
        "objective": cfg["objective"]["name"],
        "noise": noise["name"],
        "sigma": noise.get("sigma"),
        "staleness": cfg["alpha"]["staleness"],
        "minibatches": cfg["alpha"].get("minibatches"),
        "lr": cfg.get("optim", {}).get("lr"),
        "logp_old_source": cfg["engine"]["logp_old_source"],
        "steps": cfg["steps"],
        **{key: values.get(key) for key in swept},
    }


def sweep_axes(recipes: list[dict], swept: list[set[str]]) -> list[str]:
    """The keys a sweep varied among these runs: set on every run's command line (a group
    choice, `objective=band`, sets its node's keys) and not of one value in all; seeds aside."""
    common = set.intersection(*swept) if swept else set()
    return sorted(
        key
        for key in set().union(*recipes)
        if any(key == k or key.startswith(f"{k}.") for k in common)
        and not is_seed(key)
        and len({repr(r.get(key)) for r in recipes}) > 1
    )


def swept_labels(exp: str, cfgs: dict[Path, dict]) -> tuple[dict[Path, str], list[str]]:
    """Each run's arm label and the swept keys that become summary columns. Within an arm
    (`arm_label`), a key the sweep varied joins the label as `arm, key=value`, so no arm holds two
    runs of one seed; a key with its own column (COLUMN_KEYS: σ, staleness, lr, ...) is told
    apart there, as the dose curves and the phase diagram read it, and stays out of the label."""
    recipes = {run: run_recipe(cfg) for run, cfg in cfgs.items()}
    swept = {run: swept_keys(run) for run in cfgs}
    base = {run: arm_label(exp, cfg) for run, cfg in cfgs.items()}
    columns = set(sweep_axes(list(recipes.values()), list(swept.values())))
    labels = {}
    for arm in set(base.values()):
        members = [run for run in cfgs if base[run] == arm]
        axes = sweep_axes([recipes[r] for r in members], [swept[r] for r in members])
        own = [key for key in axes if key not in COLUMN_KEYS]
        columns |= set(own)
        for run in members:
            labels[run] = ", ".join([arm, *(f"{key}={recipes[run].get(key)}" for key in own)])
    return labels, sorted(columns - COLUMN_KEYS)


def load_raw(root: Path, exp: str) -> pd.DataFrame:
    """One row per (run, step) over the raw run folders of `exp`, with config columns, one per
    swept key among them (`swept_labels`), each from the step's own config (`config_segments`:
    a run resumed with `resume=override` changed some)."""
    runs = sorted(p.parent for p in (root / exp).glob("*/metrics.jsonl"))
    cfgs = {run: yaml.safe_load((run / "config.yaml").read_text()) for run in runs}
    labels, swept = swept_labels(exp, cfgs)
    frames = []
    for run, cfg in cfgs.items():
        meta_path = run / "meta.json"
        meta = json.loads(meta_path.read_text()) if meta_path.exists() else {}
        model = meta.get("model", {})
        m = pd.DataFrame(
            [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().split("\n") if ln]
        )
        if m.empty:
            continue
        m = m.reindex(columns=["step", *METRICS]).rename(columns=lambda c: c.replace("/", "_"))
        segments = config_segments(cfg, meta.get("config_overrides", []))
        ends = [start for start, _ in segments[1:]] + [math.inf]
        for (start, step_cfg), end in zip(segments, ends, strict=True):
            frames.append(
                m[(m.step >= start) & (m.step < end)].assign(
                    run=run.name,
                    arm=labels[run],
                    **config_columns(step_cfg, swept),
                    weights_sha=model.get("weights_sha"),
                    recipe_hash=model.get("recipe_hash"),
                    **fingerprints(meta),
                )
            )
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


def fingerprints(meta: dict) -> dict[str, str | None]:
    """fp_batch: the step-1 batch's hash; fp_machine: the machines' hashes in the order the
    run's starts used them, '+'-joined (harness.runs.fingerprint); None where not recorded."""
    machines = "+".join(dict.fromkeys(m["hash"] for m in meta.get("machines", [])))
    return {"fp_batch": meta.get("batch_fingerprint"), "fp_machine": machines or None}


def swept_keys(run: Path) -> set[str]:
    """The keys the run's command line set (Hydra's .hydra/overrides.yaml; none without it)."""
    path = run / ".hydra" / "overrides.yaml"
    items = yaml.safe_load(path.read_text()) if path.exists() else None
    return {o.split("=", 1)[0].lstrip("+~") for o in items or []}


def config_problems(root: Path, exp: str) -> list[str]:
    """Why the raw runs of `exp` are not one experiment: a config key on which they differ
    although not every run's command line set it (a sweep axis is set by every run: `seed=0,1`,
    `noise.sigma=1,2`; a toy sweep's `steps=4` or a changed default is not), and duplicate
    runs (one effective config in two folders: a paired test would count that seed twice)."""
    runs = sorted(p.parent for p in (root / exp).glob("*/metrics.jsonl"))
    cfgs = {r.name: yaml.safe_load((r / "config.yaml").read_text()) for r in runs}
    recipes = {name: run_recipe(cfg) for name, cfg in cfgs.items()}
    arms = [preset_arms(exp), *(cfg.get("arms") or {} for cfg in cfgs.values())]
    arm_keys = {k for a in arms for values in a.values() for k in values or {}}
    # an arm that picks a config group (`objective.name: calibrated_clip`) brings that group's
    # own keys (`objective.ema`): they differ between arms by design
    arm_groups = tuple(k.removesuffix("name") for k in arm_keys if k.endswith(".name"))
    swept = set.intersection(*map(swept_keys, runs)) if runs else set()
    problems = []
    seeds = {k for r in recipes.values() for k in r if is_seed(k)}
    for key in sorted(set().union(*recipes.values()) - swept - arm_keys - seeds):
        if key.startswith(arm_groups):
            continue
        by_value: dict[str, list[str]] = {}
        for name, r in recipes.items():
            by_value.setdefault(repr(r.get(key, "<unset>")), []).append(name)
        if len(by_value) > 1:
            parts = "; ".join(f"{v} in {len(n)} runs like {n[0]}" for v, n in by_value.items())
            problems.append(f"mixed configs: {key} = {parts}")
    same: dict[str, list[str]] = {}
    for name, r in recipes.items():
        same.setdefault(repr(sorted((k, repr(v)) for k, v in r.items())), []).append(name)
    dups = [n for n in same.values() if len(n) > 1]
    problems += [f"duplicate runs (one config, {len(n)} folders): {', '.join(n)}" for n in dups]
    return problems


MECHANISM = [
    "mean_abs_delta",
    "oob_frac",
    "fork_oob_share",
    "fork_frac",
    "forks_deleted",
    "neg_low_clip",
    "pos_high_clip",
    "sampler_reward",
    "n_tokens",
    "teacher_acc",
    "student_acc",
    "teacher_ref_logp",
    "student_ref_logp",
]


def load_mechanism(root: Path, exp: str) -> pd.DataFrame:
    """One row per run folder of `exp` holding a mechanism.json (training runs write one before
    step 1; `python -m harness.rl.mechanism -m` sweeps write only that): arm, seed, noise and the
    step-0 numbers."""
    rows = []
    for path in sorted((root / exp).glob("*/mechanism.json")):
        cfg = yaml.safe_load((path.parent / "config.yaml").read_text())
        m = json.loads(path.read_text())
        noise = noise_node(cfg)
        rows.append(
            {
                "run": path.parent.name,
                "arm": arm_label(exp, cfg),
                "seed": cfg["seed"],
                "noise": noise["name"],
                "sigma": noise.get("sigma"),
                "nu": noise.get("nu"),
                "fmt": noise.get("fmt"),
                "activations": noise.get("activations"),
                "trained": (path.parent / "metrics.jsonl").exists(),
                **{k: m.get(k) for k in MECHANISM},
            }
        )
    return pd.DataFrame(rows)


# per-step metrics shown beside the step-0 check: the mechanism acting during the run
RUN_MECHANISM = {
    "dial_out_of_band_frac": "out of band",
    "mask_frac": "deleted",
    "clip_frac_low": "clipped low",
    "clip_frac_high": "clipped high",
    "rescue_frac": "rescued",
}


def share(x: float, spec: str = ".0%") -> str:
    """A share as a percentage; "—" when undefined (nothing out of band: no fork share; no
    token with A < 0 when no response earned a reward)."""
    return "—" if pd.isna(x) else format(x, spec)


def mechanism_summary(mech: pd.DataFrame | None, df: pd.DataFrame, arm: str) -> str:
    """The step-0 mechanism check of `arm`'s runs (mean over seeds) and the run-mean share of
    tokens each in-run mechanism acted on."""
    parts = []
    if mech is not None and not mech.empty:
        m = mech[(mech.arm == arm) & mech.trained]
        if not m.empty:
            mean = m.mean(numeric_only=True)
            parts.append(
                f"step 0: {mean.oob_frac:.1%} out of band, {share(mean.fork_oob_share)} of it on "
                f"forks, {mean.forks_deleted:.0%} of forks outside; A<0 below 1−ε "
                f"{share(mean.neg_low_clip, '.1%')} vs A>0 above 1+ε "
                f"{share(mean.pos_high_clip, '.1%')}; "
                f"μ reward {mean.sampler_reward:.3f}"
            )
            if "teacher_acc" in mean and pd.notna(mean.teacher_acc):  # OPSD runs
                parts.append(
                    f"teacher acc {mean.teacher_acc:.3f} vs student {mean.student_acc:.3f}, "
                    f"reference log-prob/token {mean.teacher_ref_logp:.3f} vs "
                    f"{mean.student_ref_logp:.3f}"
                )
    runs = df[(df.arm == arm) & df.complete]
    acting = {
        name: runs[col].mean()
        for col, name in RUN_MECHANISM.items()
        if col in runs and runs[col].notna().any() and runs[col].mean() > 0
    }
    if acting:
        parts.append("in run: " + ", ".join(f"{v:.1%} {k}" for k, v in acting.items()))
    return "; ".join(parts) or "no mechanism check recorded"


def mechanism_caption(root: Path, exp: str, df: pd.DataFrame, arms: list[str]) -> str:
    """The figure caption's mechanism check: one line per arm shown (mechanism.csv + the
    summary's per-step mechanism metrics), over the runs `df` shows (an A/A cell the figure
    leaves out is left out here too)."""
    path = Path(root) / exp / "mechanism.csv"
    mech = pd.read_csv(path) if path.exists() else None
    if mech is not None:
        mech = mech[mech.run.isin(set(df.run))]
    shown = [a for a in arms if a in set(df.arm)]
    return "\n".join(f"{a}: {mechanism_summary(mech, df, a)}" for a in shown)


def load_prereg(root: Path, exp: str) -> dict:
    """The pre-registration (`prereg` node) the training runs of `exp` were made under; {} when
    they carry none. A registration may be amended by adding keys before the runs they govern
    (e.g. an A/A cell's `aa_offset`), never by changing or removing one: runs made under the
    registration and runs made under its amendment summarise together under the amendment; any
    other difference between two runs' registrations raises."""
    seen: dict[str, list[str]] = {}
    for run in sorted(p.parent for p in (root / exp).glob("*/metrics.jsonl")):
        prereg = yaml.safe_load((run / "config.yaml").read_text()).get("prereg") or {}
        seen.setdefault(yaml.safe_dump(prereg, sort_keys=True), []).append(run.name)
    if not seen:
        return {}
    versions = [yaml.safe_load(k) for k in seen]
    latest = max(versions, key=len)
    if any(any(k not in latest or latest[k] != v for k, v in p.items()) for p in versions):
        groups = "; ".join(f"{len(v)} runs like {v[0]}" for v in seen.values())
        raise ValueError(
            f"{root / exp}: runs made under different pre-registrations ({groups}); "
            "move the stale runs out before summarising"
        )
    return latest


def without_aa(df: pd.DataFrame, root: Path, exp: str) -> pd.DataFrame:
    """The runs of the registered arms: drops every run on a seed ≥ the registration's
    `aa_offset` (only the A/A cell, the control arm again, runs there), which analysis.claims
    reads apart and the figures leave out."""
    path = Path(root) / exp / "prereg.yaml"
    offset = (yaml.safe_load(path.read_text()) or {}).get("aa_offset") if path.exists() else None
    return df[df.seed < offset] if offset else df


def load_summary(root: Path, exp: str) -> pd.DataFrame:
    """The committed summary; warns loudly when it does not name its model's weights checksum or
    names one that is not the shipped model of its recipe."""
    path = Path(root) / exp / "summary.csv"
    df = pd.read_csv(path, dtype={"weights_sha": str, "recipe_hash": str})
    for problem in weights_problems(df):
        warnings.warn(f"{path}: {problem}", stacklevel=2)
        print(f"WARNING {path}: {problem}", file=sys.stderr, flush=True)
    return df


def summaries(root: Path, experiments: dict):
    """(experiment, its label, its summary) for each of `experiments` (experiment → label: any
    value the figure script reads) whose summary.csv exists under root: a figure script's pilot
    and confirmatory sweep, each once it has run."""
    for exp, label in experiments.items():
        if (Path(root) / exp / "summary.csv").exists():
            yield exp, label, load_summary(root, exp)


def doubled(df: pd.DataFrame) -> dict[tuple[str, int], list[str]]:
    """(arm, seed) → its runs, for every arm and seed with more than one run (a paired test
    would count that seed twice)."""
    runs = df.groupby(["arm", "seed"]).run.unique()
    return {key: list(r) for key, r in runs.items() if len(r) > 1}


def run_head(run: pd.DataFrame) -> dict:
    """The first columns of a per-run table: one run's arm, seed, last step and completeness."""
    return {
        "arm": run.arm.iloc[0],
        "seed": run.seed.iloc[0],
        "last_step": int(run.step.max()),
        "complete": bool(run.complete.iloc[0]),
    }


def write_run_table(root: Path, exp: str, name: str, table: pd.DataFrame) -> None:
    """A per-run table (events, shape) written beside the experiment's summary, and printed."""
    text = table.to_csv(index=False, float_format="%.4g")
    write_text_atomic(Path(root) / exp / name, text)
    print(table.to_string(index=False, float_format=lambda x: f"{x:.3g}"))


def weights_problems(df: pd.DataFrame) -> list[str]:
    """Why the model behind these runs is not pinned by content (empty: every run names the
    shipped weights of its recipe)."""
    from harness.tasks.warmstart import shipped_manifest

    if "weights_sha" not in df or df.weights_sha.isna().any():
        return [
            "some runs do not record the weights checksum of their model (made before "
            "checksums were recorded): the recipe hash alone does not pin the model"
        ]
    manifest, out = shipped_manifest(), []
    for (recipe, sha), _ in df.groupby(["recipe_hash", "weights_sha"], dropna=False):
        # a recipe that does not ship (e.g. the OPSD model) is named by its checksum alone
        if (
            isinstance(recipe, str)
            and recipe in manifest
            and manifest[recipe]["weights_sha"] != sha
        ):
            out.append(
                f"runs of recipe {recipe} used weights {sha}, not the shipped "
                f"{manifest.get(recipe, {}).get('weights_sha')}"
            )
    return out


def smooth(df: pd.DataFrame, cols: list[str], window: int = 5) -> pd.DataFrame:
    """Trailing rolling mean of `cols` within each run (per-step metrics: 64 samples)."""
    df = df.sort_values(["run", "step"]).copy()
    df[cols] = df.groupby("run")[cols].transform(lambda s: s.rolling(window, min_periods=1).mean())
    return df
