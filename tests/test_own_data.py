"""A researcher's own model and data, as README → "Your model and data" brings them: a model
exported to a plain HF folder (with a chat template), a parquet dataset, two training steps
through the CLI with the template and math-verify grading."""

import json
import subprocess
import sys
from pathlib import Path

import pandas as pd

from harness.base.models import export, load_model

ROOT = Path(__file__).resolve().parents[1]
CHAT = (
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


def test_a_folder_model_and_a_parquet_dataset_train_through_the_cli(tmp_path):
    folder, sha = export("tiny-llama", tmp_path / "my-model")
    model, tok = load_model(str(folder))
    tok.chat_template = CHAT
    tok.save_pretrained(folder)
    rows = [
        {"question": f"{a}+{b}=", "answer": f"{a}+{b}={a + b}\n#### {a + b}"}
        for a in range(1, 5)
        for b in range(1, 5)
    ]
    pd.DataFrame(rows).to_parquet(tmp_path / "train.parquet")
    out = tmp_path / "run"
    args = [
        f"model.spec={folder}",
        "task=hf",
        f"task.path={tmp_path / 'train.parquet'}",
        "rollout.prompts_per_step=2",
        "rollout.group_size=2",
        "rollout.max_new_tokens=6",
        "eval_n=2",
        "eval_every=1",
        "steps=2",
        "progress=false",
        "engine.device=cpu",
        f"out={out}",
    ]
    r = subprocess.run(
        [sys.executable, "-m", "harness.train", *args], cwd=ROOT, capture_output=True, text=True
    )
    assert r.returncode == 0, r.stderr[-3000:]
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2] and all(0 <= m["eval/acc"] <= 1 for m in metrics)
    meta = json.loads((out / "meta.json").read_text())
    assert meta["model"]["weights_sha"] == sha and meta["status"] == "completed"
    cfg = (out / "config.yaml").read_text()
    assert "name: hf" in cfg and "grader" not in cfg  # math-verify: the builder's default


def _compose(*overrides):
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(ROOT / "experiments"), version_base="1.3"):
        return compose("train", overrides=list(overrides))


def test_a_dataset_with_the_default_task_model_names_what_to_pass(tmp_path):
    """task=hf with model=task-model (the default): a task model knows only arithmetic and
    countdown, so the error (before any compute) says to pass model.spec=, and names the
    dataset file when it is missing too."""
    import pytest

    from harness.runs.validate import validate

    missing = tmp_path / "missing.jsonl"
    with pytest.raises(ValueError) as e:
        validate(_compose("task=hf", f"task.path={missing}"))
    msg = str(e.value)
    assert "model=task-model" in msg and "arithmetic, countdown" in msg, msg
    assert "model.spec=" in msg and "model=smollm2-135m" in msg, msg
    assert f"task.path={str(missing)!r}" in msg and "not a file or folder here" in msg, msg
    missing.write_text('{"question": "1+1?", "answer": "#### 2"}\n')
    with pytest.raises(ValueError) as e:
        validate(_compose("task=hf", f"task.path={missing}"))
    assert "model.spec=" in str(e.value) and "task.path" not in str(e.value)
