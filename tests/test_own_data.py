"""A researcher's own model and data, as README → "Your model and data" brings them: a model
exported to a plain HF folder (with a chat template), a parquet dataset, two training steps
through the CLI with the template and math-verify grading."""

import json
import subprocess
import sys
from pathlib import Path

import pandas as pd

from harness.models import export, load_model

ROOT = Path(__file__).resolve().parents[1]
CHAT = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}")  # fmt: skip


def test_a_folder_model_and_a_parquet_dataset_train_through_the_cli(tmp_path):
    folder, sha = export("tiny-llama", tmp_path / "my-model")
    model, tok = load_model(str(folder))
    tok.chat_template = CHAT
    tok.save_pretrained(folder)
    rows = [{"question": f"{a}+{b}=", "answer": f"{a}+{b}={a + b}\n#### {a + b}"}
            for a in range(1, 5) for b in range(1, 5)]  # fmt: skip
    pd.DataFrame(rows).to_parquet(tmp_path / "train.parquet")
    out = tmp_path / "run"
    args = [f"model.spec={folder}", "task=hf", f"task.path={tmp_path / 'train.parquet'}",
            "rollout.prompts_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=6",
            "eval_n=2", "eval_every=1", "steps=2", "progress=false", "engine.device=cpu",
            f"out={out}"]  # fmt: skip
    r = subprocess.run([sys.executable, "-m", "harness.train", *args], cwd=ROOT,
                       capture_output=True, text=True)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2] and all(0 <= m["eval/acc"] <= 1 for m in metrics)
    meta = json.loads((out / "meta.json").read_text())
    assert meta["model"]["weights_sha"] == sha and meta["status"] == "completed"
    cfg = (out / "config.yaml").read_text()
    assert "name: hf" in cfg and "grader" not in cfg  # math-verify: the builder's default
