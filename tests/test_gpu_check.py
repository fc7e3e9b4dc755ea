"""The device check's reporting (scripts/gpu_check.sh, scripts/gpu/summarize.py), tested on the
CPU: junit counts and failing ids, the `-v` log fallback of a run killed by its timeout, the
summary's verdict, and the shell script's syntax."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("gpu_summarize", ROOT / "scripts/gpu/summarize.py")
summarize = importlib.util.module_from_spec(spec)
spec.loader.exec_module(summarize)

JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites name="pytest tests"><testsuite name="pytest" errors="1" failures="1" skipped="1"
 tests="5" time="3.5" timestamp="2026-12-01T00:00:00" hostname="h">
<testcase classname="tests.test_noise" name="test_prefill[cuda-layer-kw0]" time="0.5" />
<testcase classname="tests.test_logprobs" name="test_chunked[cuda-False-1.0]" time="0.2">
<failure message="AssertionError: max |Δ| 3e-4 &gt; 1e-5">traceback
E   AssertionError</failure></testcase>
<testcase classname="tests.test_train.TestResume" name="test_resume[cuda-bf16]" time="1.0">
<error message="failed on setup with &quot;RuntimeError: CUDA out of memory&quot;">tb</error>
</testcase>
<testcase classname="tests.test_gpu" name="test_measure_runs_on_cuda" time="0.0">
<skipped type="pytest.skip" message="needs a CUDA device">skip</skipped></testcase>
<testcase classname="tests.test_gpu" name="test_rollout_lives_on_cuda" time="1.8" />
</testsuite></testsuites>
"""


def test_parse_junit_counts_and_failing_ids(tmp_path):
    p = tmp_path / "gpu_tests.xml"
    p.write_text(JUNIT)
    r = summarize.parse_junit(p)
    assert r["present"]
    assert (r["tests"], r["passed"], r["failed"], r["errors"], r["skipped"]) == (5, 2, 1, 1, 1)
    assert r["time_s"] == 3.5
    assert [(f["id"], f["kind"]) for f in r["failing"]] == [
        ("tests/test_logprobs.py::test_chunked[cuda-False-1.0]", "failure"),
        ("tests/test_train.py::TestResume::test_resume[cuda-bf16]", "error"),
    ]
    assert r["failing"][0]["message"] == "AssertionError: max |Δ| 3e-4 > 1e-5"
    assert r["skip_reasons"] == {"needs a CUDA device": 1}


def test_missing_or_broken_junit_is_reported_not_raised(tmp_path):
    assert summarize.parse_junit(tmp_path / "absent.xml") == {"present": False}
    (tmp_path / "cut.xml").write_text("<testsuites><testsuite")
    r = summarize.parse_junit(tmp_path / "cut.xml")
    assert not r["present"] and "unreadable" in r["error"]


def test_summary_verdict_and_the_log_of_a_killed_run(tmp_path):
    out, logs = tmp_path / "out", tmp_path / "logs"
    out.mkdir(), logs.mkdir()
    (out / "gpu_tests.xml").write_text(JUNIT)
    # device_tests was killed by its timeout: no junit, its `pytest -v` log says how far it got
    (logs / "device_tests.out").write_text(
        "tests/test_noise.py::test_a[cuda-layer] PASSED                  [ 33%]\n"
        "tests/test_noise.py::test_b[cuda-fp8] FAILED                    [ 66%]\n"
        "tests/test_train.py::test_resume[cuda-nsr] \n"
    )
    (out / "bench_gpu.json").write_text(
        json.dumps(
            {
                "work": {"prompts": 8},
                "results": [
                    {"model": "task-model", "dtype": "fp32", "device": "cpu", "median_s": 2.0},
                    {
                        "model": "task-model",
                        "dtype": "fp32",
                        "device": "cuda",
                        "median_s": 0.5,
                        "max_memory_gb": 1.234,
                    },
                ],
                "ratio_cpu_over_cuda": {"task-model/fp32": 4.0},
            }
        )
    )
    stages = tmp_path / "stages.tsv"
    stages.write_text("gpu_tests\t1\t12\t\ndevice_tests\t124\t100\ttimed out after 100s\n")
    r = summarize.summarize(out, stages, None, ("gpu_tests", "device_tests"), logs)
    assert r["ok"] is False
    dev = r["tests"]["device_tests"]
    assert not dev["present"] and dev["from_log"]
    assert (dev["passed"], dev["failed"], dev["unfinished"]) == (
        1,
        1,
        "tests/test_train.py::test_resume[cuda-nsr]",
    )
    assert r["tests_total"] == {"passed": 3, "failed": 2, "errors": 1, "skipped": 1}
    assert "tests/test_noise.py::test_b[cuda-fp8]" in r["failing"]
    assert r["stages"]["device_tests"] == {
        "rc": 124,
        "wall_s": 100.0,
        "timed_out": True,
        "note": "timed out after 100s",
    }
    assert r["bench"]["median_step_s"] == {"task-model/fp32/cpu": 2.0, "task-model/fp32/cuda": 0.5}
    assert r["bench"]["ratio_cpu_over_cuda"] == {"task-model/fp32": 4.0}
    assert r["bench"]["max_memory_gb"] == {"task-model/fp32": 1.23}
    assert r["fp8_fidelity"] == {"present": False}
    line = summarize.headline(r)
    assert "ok=False" in line and "task-model/fp32 4.0x" in line and "device_tests=124" in line


def test_summary_ok_when_everything_passed(tmp_path):
    (tmp_path / "gpu_tests.xml").write_text(
        '<testsuite tests="1" time="1.0">'
        '<testcase classname="tests.test_gpu" name="t" /></testsuite>'
    )
    (tmp_path / "fp8_fidelity").mkdir()
    fid = {
        "bins": [
            {
                "bin": "[0, 0.5)",
                "n_tokens": 3,
                "mean_abs_delta_emulated": 0.02,
                "mean_abs_delta_scaled_mm": 0.03,
                "ratio_scaled_mm_over_emulated": 1.5,
                "mean_abs_scaled_mm_minus_emulated": 0.011,
            },
            {
                "bin": "[0.5, 1]",
                "n_tokens": 0,
                "mean_abs_delta_emulated": None,
                "mean_abs_delta_scaled_mm": None,
                "ratio_scaled_mm_over_emulated": None,
                "mean_abs_scaled_mm_minus_emulated": None,
            },
        ],
        "overall": {"n_tokens": 3, "ratio_scaled_mm_over_emulated": 1.5},
        "device": "NVIDIA H200 (capability 9.0)",
    }
    (tmp_path / "fp8_fidelity" / "fp8_fidelity.json").write_text(json.dumps(fid))
    (tmp_path / "fp8_fidelity" / "other.json").write_text('{"x": 1}')
    stages = tmp_path / "stages.tsv"
    # a stage absent by design (no vLLM venv on the device) does not fail the check; skipped does
    stages.write_text("gpu_tests\t0\t5\t\nvllm\tabsent\t0\tno Python with vLLM\n")
    r = summarize.summarize(tmp_path, stages, None, ("gpu_tests",))
    assert r["ok"] is True and r["tests_total"]["passed"] == 1
    assert r["stages"]["vllm"] == {
        "rc": "absent",
        "wall_s": 0.0,
        "timed_out": False,
        "note": "no Python with vLLM",
    }
    skipped = tmp_path / "skipped.tsv"
    skipped.write_text("gpu_tests\t0\t5\t\nbench\tskipped\t0\tno time left\n")
    assert summarize.summarize(tmp_path, skipped, None, ("gpu_tests",))["ok"] is False
    f = r["fp8_fidelity"]
    assert f["files"] == ["fp8_fidelity.json", "other.json"] and f["other"] == {"x": 1}
    assert f["fp8_fidelity"]["device"] == "NVIDIA H200 (capability 9.0)"
    assert f["fp8_fidelity"]["per_bin"] == {
        "[0, 0.5)": {
            "n": 3,
            "abs_d_emulated": 0.02,
            "abs_d_real": 0.03,
            "real_over_emulated": 1.5,
            "abs_real_minus_emulated": 0.011,
        },
        "[0.5, 1]": {
            "n": 0,
            "abs_d_emulated": None,
            "abs_d_real": None,
            "real_over_emulated": None,
            "abs_real_minus_emulated": None,
        },
    }
    assert f["fp8_fidelity"]["overall"] == {"n": 3, "real_over_emulated": 1.5}
    assert "FP8 real/emulated |Δ| overall 1.5" in summarize.headline(r)
    # every test skipped (no CUDA) is not a pass
    (tmp_path / "gpu_tests.xml").write_text(
        '<testsuite><testcase classname="tests.test_gpu" name="t"><skipped message="needs a '
        'CUDA device"/></testcase></testsuite>'
    )
    assert summarize.summarize(tmp_path, stages, None, ("gpu_tests",))["ok"] is False


def test_summary_cli_writes_summary_json(tmp_path):
    (tmp_path / "gpu_tests.xml").write_text(JUNIT)
    cli = [sys.executable, str(ROOT / "scripts/gpu/summarize.py"), "summary"]
    args = [*cli, "--out", str(tmp_path), "--tests", "gpu_tests,device_tests"]
    p = subprocess.run(args, capture_output=True, text=True, check=True)
    r = json.loads((tmp_path / "summary.json").read_text())
    assert r["tests"]["device_tests"] == {"present": False} and r["ok"] is False
    assert p.stdout.strip().splitlines()[-1].startswith("gpu_check ok=False: tests 2 passed")


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_gpu_check_script_parses():
    for script in ("scripts/gpu_check.sh", "scripts/gpu/wheels.sh"):
        subprocess.run(["bash", "-n", str(ROOT / script)], check=True)
