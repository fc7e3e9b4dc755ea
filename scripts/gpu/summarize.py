"""The device check's report (scripts/gpu_check.sh): `$OUT/summary.json` from what its stages left.

    python3 scripts/gpu/summarize.py env                                # versions, GPU: JSON
    python3 scripts/gpu/summarize.py summary --out OUT --stages STAGES.tsv --env ENV.json

`summary` reads every junit XML under OUT (pytest's `--junitxml`: passed / failed / errors /
skipped and the failing test ids per file), OUT/bench_gpu.json (median step seconds per
(model, device, dtype) and the CPU/CUDA ratios), OUT/fp8_fidelity/*.json (real-FP8 vs
emulated-FP8 β per confidence bin, as harness.stats.fp8_fidelity writes it) and the stage table
(`name<TAB>rc<TAB>seconds[<TAB>note]` per line, written by the shell script), and writes
(atomically: harness.base.io) and prints OUT/summary.json. Standard library only (torch is imported
by `env` alone), so the report is written whatever failed before it. Tested in
tests/test_gpu_check.py.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root
from harness.base.io import write_text_atomic  # noqa: E402  (standard library only)

# the wheels of .whl/ (scripts/gpu/wheels.sh) and what the image ships
PACKAGES = (
    "hydra-core",
    "omegaconf",
    "antlr4-python3-runtime",
    "submitit",
    "hydra-submitit-launcher",
    "gguf",
    "transformers",
    "accelerate",
    "safetensors",
    "tokenizers",
    "numpy",
    "pytest",
)
MAX_MESSAGE = 300  # characters of a failure message kept per failing test
MAX_FP8_BYTES = 20_000  # an fp8_fidelity JSON larger than this is summarised by its keys


def test_id(classname: str, name: str) -> str:
    """pytest's node id from a junit testcase: `tests.test_x` + `t[a]` → `tests/test_x.py::t[a]`;
    a test class (`tests.test_x.TestC`) → `tests/test_x.py::TestC::t`."""
    if not classname:  # a collection error names the module in `name`
        return name.replace(".", "/") + ".py" if name and "/" not in name else name
    parts = classname.split(".")
    cls = []
    while len(parts) > 1 and parts[-1][:1].isupper():
        cls.insert(0, parts.pop())
    return "::".join(["/".join(parts) + ".py", *cls, name])


def parse_junit(path: Path) -> dict:
    """Counts and failing ids of one pytest junit XML; {"present": False} when it is absent (the
    run was killed by its timeout, or never started) or unreadable."""
    path = Path(path)
    if not path.exists():
        return {"present": False}
    try:
        root = ET.parse(path).getroot()
    except ET.ParseError as e:
        return {"present": False, "error": f"unreadable junit XML: {e}"}
    cases = root.iter("testcase")
    out = {"present": True, "tests": 0, "passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    failing: list[dict] = []
    skip_reasons: dict[str, int] = {}
    for c in cases:
        out["tests"] += 1
        tid = test_id(c.get("classname", ""), c.get("name", ""))
        kinds = {child.tag: child for child in c}
        bad = kinds.get("failure") if "failure" in kinds else kinds.get("error")
        if bad is not None:
            kind = "failed" if bad.tag == "failure" else "errors"
            out[kind] += 1
            msg = bad.get("message") or ""
            if not msg:  # no message attribute: the traceback's last line
                lines = (bad.text or "").strip().splitlines()
                msg = lines[-1] if lines else ""
            failing.append({"id": tid, "kind": bad.tag, "message": msg[:MAX_MESSAGE]})
        elif "skipped" in kinds:
            out["skipped"] += 1
            reason = kinds["skipped"].get("message") or "skipped"
            skip_reasons[reason[:MAX_MESSAGE]] = skip_reasons.get(reason[:MAX_MESSAGE], 0) + 1
        else:
            out["passed"] += 1
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    out["time_s"] = round(sum(float(s.get("time", 0) or 0) for s in suites), 3)
    out["failing"] = failing
    out["skip_reasons"] = skip_reasons
    return out


VERBOSE_LINE = re.compile(r"^(\S+::\S+)\s+(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b")


def parse_verbose_log(path: Path) -> dict:
    """What a `pytest -v` log says when its junit XML is missing (the run was killed by its
    timeout): counts of the tests that finished, the failing ids, and the test it was in."""
    path = Path(path)
    if not path.exists():
        return {"present": False}
    out = {"present": False, "from_log": True, "passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    failing, last = [], None
    kind = {
        "PASSED": "passed",
        "XFAIL": "passed",
        "XPASS": "passed",
        "FAILED": "failed",
        "ERROR": "errors",
        "SKIPPED": "skipped",
    }
    for line in path.read_text(errors="replace").splitlines():
        if m := VERBOSE_LINE.match(line):
            out[kind[m[2]]] += 1
            last = None
            if m[2] in ("FAILED", "ERROR"):
                failing.append({"id": m[1], "kind": m[2].lower(), "message": ""})
        elif line.startswith("tests/") and "::" in line:
            last = line.split()[0]  # started, no result yet
    out["tests"] = sum(out[k] for k in ("passed", "failed", "errors", "skipped"))
    out["failing"] = failing
    if last:
        out["unfinished"] = last
    return out


def read_stages(path: Path) -> dict[str, dict]:
    """The shell script's stage table: name → {rc, wall_s[, note]}; rc 124/137: its timeout."""
    stages: dict[str, dict] = {}
    path = Path(path)
    if not path.exists():
        return stages
    for line in path.read_text().splitlines():
        f = line.split("\t")
        if len(f) < 3:
            continue
        rc = int(f[1]) if f[1].lstrip("-").isdigit() else f[1]
        st = {"rc": rc, "wall_s": float(f[2]), "timed_out": rc in (124, 137)}
        if len(f) > 3 and f[3]:
            st["note"] = f[3]
        stages[f[0]] = st
    return stages


def bench_summary(path: Path) -> dict:
    """benchmarks/bench_gpu.py's JSON, reduced: median step s per model/dtype/device, ratios."""
    path = Path(path)
    if not path.exists():
        return {"present": False}
    try:
        r = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        return {"present": False, "error": f"unreadable: {e}"}
    return {
        "present": True,
        "work": r.get("work"),
        "median_step_s": {
            f"{x['model']}/{x['dtype']}/{x['device']}": round(x["median_s"], 4)
            for x in r.get("results", [])
        },
        "max_memory_gb": {
            f"{x['model']}/{x['dtype']}": round(x["max_memory_gb"], 2)
            for x in r.get("results", [])
            if x.get("max_memory_gb") is not None
        },
        "ratio_cpu_over_cuda": {
            k: round(v, 2) for k, v in r.get("ratio_cpu_over_cuda", {}).items()
        },
    }


def fp8_summary(folder: Path) -> dict:
    """Every JSON harness.stats.fp8_fidelity wrote into `folder` (whole when small, else its
    keys)."""
    folder = Path(folder)
    if not folder.is_dir():
        return {"present": False}
    out: dict = {"present": True, "files": sorted(p.name for p in folder.iterdir())}
    for p in sorted(folder.glob("*.json")):
        if p.stat().st_size > MAX_FP8_BYTES:
            try:
                d = json.loads(p.read_text())
                out[p.stem] = {"keys": sorted(d) if isinstance(d, dict) else type(d).__name__}
            except json.JSONDecodeError as e:
                out[p.stem] = {"error": f"unreadable: {e}"}
            continue
        try:
            d = json.loads(p.read_text())
        except json.JSONDecodeError as e:
            out[p.stem] = {"error": f"unreadable: {e}"}
            continue
        out[p.stem] = compact_fp8(d) if isinstance(d, dict) and "bins" in d else d
    return out


FP8_KEYS = {  # harness.stats.fp8_fidelity's per-bin keys → the summary's short names
    "n_tokens": "n",
    "mean_abs_delta_emulated": "abs_d_emulated",
    "mean_abs_delta_scaled_mm": "abs_d_real",
    "ratio_scaled_mm_over_emulated": "real_over_emulated",
    "mean_abs_scaled_mm_minus_emulated": "abs_real_minus_emulated",
}


def _short(d: dict) -> dict:
    return {
        s: (round(d[k], 6) if isinstance(d.get(k), float) else d.get(k))
        for k, s in FP8_KEYS.items()
        if k in d
    }


def compact_fp8(d: dict) -> dict:
    """harness.stats.fp8_fidelity's result, per confidence bin: token count, mean |Δ log π| of the
    emulated and the real FP8 path against the clean model, real / emulated, |real − emulated|
    (the whole file comes back beside the summary)."""
    meta = ("model", "n_layers", "dtype", "device", "recipe", "torch", "wall_s")
    return {
        **{k: d[k] for k in meta if k in d},
        "per_bin": {b.get("bin", str(i)): _short(b) for i, b in enumerate(d["bins"])},
        "overall": _short(d.get("overall", {})),
    }


def summarize(
    out_dir: Path,
    stages: Path | None = None,
    env: Path | None = None,
    test_stages: tuple[str, ...] = (),
    logs: Path | None = None,
) -> dict:
    """The report. `test_stages`: the pytest stages whose junit `<name>.xml` is expected in
    `out_dir` (a missing one counts as not ok, its `-v` log `logs/<name>.out` read instead)."""
    out_dir = Path(out_dir)
    names = sorted({p.stem for p in out_dir.glob("*.xml")} | set(test_stages))
    tests = {n: parse_junit(out_dir / f"{n}.xml") for n in names}
    for n, t in tests.items():
        if not t["present"] and logs is not None and (Path(logs) / f"{n}.out").exists():
            tests[n] = {**parse_verbose_log(Path(logs) / f"{n}.out"), **t}
    kinds = ("passed", "failed", "errors", "skipped")
    total = {k: sum(t.get(k, 0) for t in tests.values()) for k in kinds}
    report = {
        "ok": None,
        "tests_total": total,
        "failing": [f["id"] for t in tests.values() for f in t.get("failing", [])],
        "tests": tests,
        "bench": bench_summary(out_dir / "bench_gpu.json"),
        "fp8_fidelity": fp8_summary(out_dir / "fp8_fidelity"),
        "stages": read_stages(stages) if stages else {},
        "env": json.loads(Path(env).read_text()) if env and Path(env).exists() else {},
    }
    report["ok"] = (  # every junit there, something ran (all skipped: no CUDA), none failed
        bool(tests)
        and all(t.get("present") for t in tests.values())
        and total["passed"] > 0
        and total["failed"] == total["errors"] == 0
        and all(s["rc"] in (0, "absent") for s in report["stages"].values())  # absent: by design
    )
    return report


def headline(report: dict) -> str:
    """One line: ok, test counts, failing ids, the step-time ratios, stages that did not pass."""
    t = report["tests_total"]
    bad = [f"{k}={v['rc']}" for k, v in report["stages"].items() if v["rc"] != 0]
    ratios = report["bench"].get("ratio_cpu_over_cuda") or {}
    fails = report["failing"]
    fp8 = report["fp8_fidelity"].get("fp8_fidelity", {}).get("overall", {})
    fp8 = fp8.get("real_over_emulated") if isinstance(fp8, dict) else None
    return (
        f"gpu_check ok={report['ok']}: tests {t['passed']} passed, {t['failed']} failed, "
        f"{t['errors']} errors, {t['skipped']} skipped"
        + (f" ({', '.join(fails[:5])}{' …' if len(fails) > 5 else ''})" if fails else "")
        + (f"; CPU/CUDA step {', '.join(f'{k} {v}x' for k, v in ratios.items())}" if ratios else "")
        + (f"; FP8 real/emulated |Δ| overall {fp8}" if fp8 is not None else "")
        + (f"; stages not ok: {', '.join(bad)}" if bad else "")
    )


def env_info() -> dict:
    """nvidia-smi, python, torch, CUDA, the GPU's name and compute capability, package versions."""
    import importlib.metadata
    import platform

    info: dict = {"python": platform.python_version(), "machine": platform.machine()}
    try:
        q = "name,driver_version,memory.total,compute_cap"
        info["nvidia_smi"] = subprocess.run(
            ["nvidia-smi", f"--query-gpu={q}", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError) as e:
        info["nvidia_smi"] = f"unavailable: {e}"
    try:
        import torch

        cuda = torch.cuda.is_available()
        info["torch"] = torch.__version__
        info["cuda"] = torch.version.cuda
        info["cudnn"] = torch.backends.cudnn.version() if cuda else None
        info["cuda_available"] = cuda
        info["device_count"] = torch.cuda.device_count() if cuda else 0
        if cuda:
            p = torch.cuda.get_device_properties(0)
            info["gpu"] = p.name
            info["capability"] = f"{p.major}.{p.minor}"
            info["gpu_memory_gb"] = round(p.total_memory / 2**30, 1)
            info["bf16_supported"] = torch.cuda.is_bf16_supported()
            info["fp8_e4m3_matmul"] = (p.major, p.minor) >= (8, 9)  # torch._scaled_mm: Ada+
    except Exception as e:  # noqa: BLE001 - the report is written whatever broke
        info["torch"] = f"import failed: {e!r}"
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    info["packages"] = versions
    return info


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("env", help="print the environment as JSON")
    e.add_argument("--json", default=None, help="also write it here")
    s = sub.add_parser("summary", help="write and print OUT/summary.json")
    s.add_argument("--out", required=True, help="the check's output folder")
    s.add_argument("--stages", default=None, help="the stage table (name, rc, seconds)")
    s.add_argument("--env", default=None, help="the `env` JSON written before the stages")
    s.add_argument("--tests", default="", help="comma list of the pytest stages (junit names)")
    s.add_argument("--logs", default=None, help="folder of the stages' logs (<name>.out)")
    a = ap.parse_args(argv)
    if a.cmd == "env":
        text = json.dumps(env_info(), indent=2)
        if a.json:
            write_text_atomic(Path(a.json), text + "\n")
        print(text)
        return
    tests = tuple(t for t in a.tests.split(",") if t)
    report = summarize(Path(a.out), a.stages, a.env, tests, a.logs)
    text = json.dumps(report, indent=2)
    write_text_atomic(Path(a.out) / "summary.json", text + "\n")
    print(text)
    print(headline(report))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
