"""Tracking: the framework alias table against the names the loop logs, TensorBoard and wandb
(offline) receiving each step under both names, the plain log line by hand."""

import json

import pytest
from hydra import compose, initialize_config_dir

from harness import train
from harness.runs.tracking import ALIASES, aliased, plain_line, scalars

CONFIG_DIR = str(train.__file__.rsplit("/harness/", 1)[0] + "/experiments")
TINY = [
    "model=tiny-llama",
    "++task.digits=1",
    "rollout.prompts_per_step=2",
    "rollout.group_size=4",
    "rollout.max_new_tokens=6",
    "eval_n=4",
    "eval_every=2",
    "progress=false",
    "engine.device=cpu",
    "noise=logit",
    "noise.sigma=0.3",
]


def _run(tmp_path, *overrides):
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = compose("train", overrides=[f"out={tmp_path}", *TINY, *overrides])
    train.run(cfg)
    return [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def tensorboard_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("tb")
    return out, _run(out, "steps=2", "logger=tensorboard")


def test_every_alias_names_a_metric_the_loop_logs(tensorboard_run):
    _, rows = tensorboard_run
    assert set(ALIASES.values()) <= set(rows[-1])
    assert aliased(rows[-1])["mismatch_kl"] == rows[-1]["dial/kl_k3"]


def test_tensorboard_receives_each_step_under_both_names(tensorboard_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out, rows = tensorboard_run
    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"dial/kl_k3", "mismatch_kl", "rollout_corr/kl", "reward/mean"} <= tags
    for name, metric in [("mismatch_kl", "dial/kl_k3"), ("reward", "reward/mean")]:
        got = [(e.step, e.value) for e in events.Scalars(name)]
        assert got == [(r["step"], pytest.approx(r[metric], rel=1e-6)) for r in rows]


def test_wandb_offline_writes_its_run_in_the_run_folder(tmp_path, monkeypatch):
    """The offline run file (protobuf records: a history item is the key, then its value as
    JSON) holds every step's k3 under ratiolab's name and prime-rl's."""
    import re

    monkeypatch.setenv("WANDB_SILENT", "true")
    rows = _run(tmp_path, "steps=2", "logger=wandb")
    (run_file,) = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    data = run_file.read_bytes()
    want = {r["dial/kl_k3"] for r in rows}
    for name in (b"mismatch_kl", b"dial/kl_k3"):
        logged = re.findall(re.escape(name) + rb"\x82\x01.([-0-9.e]+)", data, re.S)
        assert {float(v) for v in logged} == want


def test_plain_line_and_scalars_by_hand():
    m = {
        "step": 10,
        "reward/mean": 0.125,
        "entropy/mean": 0.3414,
        "time/step_s": 2.9,
        "identity/ok": True,
        "note": "x",
    }
    assert plain_line(m, 300) == "step 10/300  reward 0.125  entropy 0.341  2.9 s/step"
    assert scalars(m) == {
        "reward/mean": 0.125,
        "entropy/mean": 0.3414,
        "time/step_s": 2.9,
        "identity/ok": 1.0,
        "reward": 0.125,
        "entropy": 0.3414,
    }
