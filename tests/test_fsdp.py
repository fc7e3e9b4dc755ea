"""FSDP2 data parallelism on the CPU (gloo): a 2-rank run equals the 1-rank run on the same global
batch, resumes as it would have run on, survives a killed rank, and refuses what it cannot run.

Each run is a subprocess (`torchrun --nproc_per_node=2`, or one plain process for the reference)
of a launcher that gives rows alternating rewards 0, 1 within every group (the tiny untrained
model never answers: without it every advantage is 0 and nothing would train)."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from harness.runs import validate
from tests.test_train import _cfg

REPO = Path(__file__).resolve().parents[1]
# The equality tests compare 3 steps with checkpoints at each; mechanism_batches=0 because these
# tests are about training, resume and kills (the stock config, check on, is tested below).
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
    "steps=3",
    "mechanism_batches=0",
    "checkpoint_every=1",
]
# A new user's command: the stock config (mechanism check, evaluation, checkpoints on)
STOCK = [
    "model=tiny-llama",
    "eval_n=8",
    "rollout.group_size=2",
    "rollout.prompts_per_step=4",
    "steps=2",
    "progress=false",
]
LAUNCHER = """
import torch
from harness.tasks import Task

def reward(self, problems, ro, tokenizer):
    return (torch.arange(ro.response_ids.shape[0]) % 2).float()

Task.rollout_rewards = reward
from harness.train import main
main()
"""
RUNS = {
    "grpo_logit": ["noise=logit", "++noise.sigma=0.3"],
    # R3 on the tiny MoE, two minibatches (uneven rows per rank in each) and staleness 1
    "moe_r3": [
        "model=tiny-moe",
        "noise=routing",
        "engine.routing_replay=true",
        "alpha.minibatches=2",
        "alpha.staleness=1",
    ],
    # OPSD in micro-batches: each rank runs its own number, padded to the most any rank runs
    "opsd": [
        "objective=opsd_fkl",
        "distill.enabled=true",
        "objective.top_k=null",
        "engine.micro_batch_tokens=40",
    ],
}


def launch(tmp_path: Path, ranks: int, out: Path, *overrides: str, wait: bool = True, base=TINY):
    script = tmp_path / "launch.py"
    script.write_text(LAUNCHER)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, str(script)]
    if ranks > 1:
        port = str(29500 + os.getpid() % 2000)
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nproc_per_node={ranks}",
            f"--master_port={port}",
            str(script),
        ]
    hydra_dir = Path(f"{out}_hydra")  # where Hydra's own record goes before the run adopts it
    args = [*cmd, f"out={out}", f"hydra.run.dir={hydra_dir}", *base, *overrides]
    p = subprocess.Popen(args, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    if not wait:
        return p
    try:  # a hang (a collective one rank never joins) fails the test instead of the suite
        text = p.communicate(timeout=300)[0].decode()
    except subprocess.TimeoutExpired:
        kill_tree(p)
        raise
    assert p.returncode == 0, text[-4000:]
    # one record, in the run folder: no rank leaves a .hydra-only folder behind
    assert (out / ".hydra" / "config.yaml").is_file() and not hydra_dir.exists()
    return text


def kill_tree(p: subprocess.Popen) -> None:
    for c in psutil.Process(p.pid).children(recursive=True):
        c.kill()
    p.kill()


def metrics(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def weights(run: Path, step: int, tmp_path: Path) -> dict[str, torch.Tensor]:
    ck = run / "checkpoints" / f"step_{step}"
    if ck.is_dir():
        dcp_to_torch_save(ck, tmp_path / "full.pt")
        return torch.load(tmp_path / "full.pt", weights_only=True)["model"]
    return torch.load(ck.with_suffix(".pt"), weights_only=True)["model"]


def assert_same_numbers(x: dict, y: dict, where) -> None:
    assert set(x) == set(y), where
    for k in x:
        if not k.startswith("time/"):
            assert x[k] == pytest.approx(y[k], abs=1e-5, rel=1e-5, nan_ok=True), (where, k)


def assert_same_run(a: Path, b: Path, tmp_path: Path, step: int = 3) -> None:
    ma, mb = metrics(a), metrics(b)
    assert [m["step"] for m in ma] == [m["step"] for m in mb] == list(range(1, step + 1))
    for x, y in zip(ma, mb):
        assert_same_numbers(x, y, x["step"])
    wa, wb = weights(a, step, tmp_path), weights(b, step, tmp_path)
    for k, v in wa.items():
        torch.testing.assert_close(wb[k], v, atol=1e-5, rtol=1e-5, msg=k)


@pytest.fixture(scope="module")
def two_rank_grpo(tmp_path_factory) -> Path:
    """The uninterrupted 2-rank GRPO run the resume and kill tests compare with."""
    tmp = tmp_path_factory.mktemp("grpo")
    launch(tmp, 2, tmp / "run", *RUNS["grpo_logit"])
    return tmp / "run"


@pytest.mark.parametrize("name", sorted(RUNS))
def test_two_ranks_equal_one_rank_on_the_same_global_batch(tmp_path, name, two_rank_grpo):
    one, two = tmp_path / "one", tmp_path / "two"
    launch(tmp_path, 1, one, *RUNS[name])
    if name == "grpo_logit":
        two = two_rank_grpo
    else:
        launch(tmp_path, 2, two, *RUNS[name])
    assert_same_run(one, two, tmp_path)
    assert not list(two.glob("checkpoints/.*"))  # no temp folder left behind


def test_the_stock_config_on_two_ranks_finishes_and_equals_one_rank(tmp_path):
    """The defaults a user meets: the step-0 mechanism check, evaluation and checkpointing on.
    The check is collective (the sharded trainer scores each rank's share), so it neither hangs
    nor differs from the one-rank check; the run exits 0."""
    one, two = tmp_path / "one", tmp_path / "two"
    launch(tmp_path, 1, one, base=STOCK)
    launch(tmp_path, 2, two, base=STOCK)
    check = [json.loads((r / "mechanism.json").read_text()) for r in (one, two)]
    assert check[0]["n_tokens"] > 0 and check[0]["batches"] == 2
    assert_same_numbers(*check, "mechanism.json")
    assert_same_run(one, two, tmp_path, step=2)
    assert "eval/acc" in metrics(two)[0]


GPU_PRESETS = sorted(
    p.stem for p in (REPO / "experiments/experiment/gpu").glob("*.yaml") if p.stem[0] != "_"
)
# presets that cannot run sharded refuse before compute, naming the key (one GPU each)
REFUSED = {"fp8_full_pipeline": "engine.trainer_fp8=True with 2 ranks; valid: false"}


@pytest.mark.parametrize("name", GPU_PRESETS)
def test_each_gpu_preset_shrunk_to_the_cpu_runs_at_world_size_two(tmp_path, name):
    """A GPU preset's own config (its objective, noise, dtypes, mechanism check, evaluation,
    checkpoints), only its scale shrunk: the tiny model on a small JSONL, the CPU, 2 steps."""
    data = tmp_path / "train.jsonl"
    rows = [
        {"question": f"What is {a} plus {b}?", "answer": f"#### {a + b}"}
        for a in range(9)
        for b in range(9)
    ]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    shrink = [
        f"experiment=gpu/{name}",
        "model.spec=tiny-llama",
        f"task.path={data}",
        "engine.device=cpu",
        "steps=2",
        "rollout.max_new_tokens=8",
        "eval_n=4",
        "progress=false",
    ]
    out = tmp_path / "run"
    if name in REFUSED:
        p = launch(tmp_path, 2, out, base=shrink, wait=False)
        text = p.communicate(timeout=300)[0].decode()
        assert p.returncode != 0 and REFUSED[name] in text
        assert not (out / "metrics.jsonl").exists()  # before compute
        return
    launch(tmp_path, 2, out, base=shrink)
    assert [m["step"] for m in metrics(out)] == [1, 2]
    assert json.loads((out / "mechanism.json").read_text())["n_tokens"] > 0
    assert (out / "checkpoints" / "step_2").is_dir()


def test_two_rank_resume_equals_the_uninterrupted_run(tmp_path, two_rank_grpo):
    split = tmp_path / "split"
    launch(tmp_path, 2, split, *RUNS["grpo_logit"], "steps=2")
    launch(tmp_path, 2, split, *RUNS["grpo_logit"])
    assert_same_run(two_rank_grpo, split, tmp_path)


def test_a_killed_rank_ends_the_job_and_the_rerun_resumes_from_the_last_checkpoint(
    tmp_path, two_rank_grpo
):
    run = tmp_path / "run"
    over = RUNS["grpo_logit"]
    p = launch(tmp_path, 2, run, *over, wait=False)
    deadline = time.time() + 240
    while not (run / "checkpoints" / "step_2").exists():  # kill rank 1 during step 3
        assert p.poll() is None and time.time() < deadline, p.stdout.read().decode()[-3000:]
        time.sleep(0.05)
    rank1 = [c for c in psutil.Process(p.pid).children() if "RANK" in c.environ()]
    victim = next(c for c in rank1 if c.environ()["RANK"] == "1")
    os.kill(victim.pid, signal.SIGKILL)
    text = p.communicate(timeout=120)[0].decode()
    assert p.returncode != 0
    assert "rank      : 1" in text and "SIGKILL" in text  # torchrun names the lost rank
    done = [int(c.name[5:]) for c in (run / "checkpoints").glob("step_*")]
    assert done and max(done) < 3
    launch(tmp_path, 2, run, *over)
    assert_same_run(two_rank_grpo, run, tmp_path)


@pytest.mark.parametrize(
    ("world", "override", "key"),
    [
        (2, "rollout.prompts_per_step=3", "rollout.prompts_per_step=3"),
        (2, "eval_n=1", "eval_n=1"),
        (2, "engine.fsdp=false", "engine.fsdp=False"),
        (2, "++noise.deterministic=false", "noise.deterministic=False"),
    ],
)
def test_a_bad_value_for_the_world_size_fails_before_compute(tmp_path, world, override, key):
    over = ["noise=logit", override] if "noise" in override else [override]
    cfg = _cfg(tmp_path, *over)
    with pytest.raises(ValueError, match=f"{key}.*valid"):
        validate.validate_ranks(cfg, world)


def test_fsdp_of_a_model_without_a_decoder_layer_list_names_the_spec():
    from harness.base.distributed import shard

    with pytest.raises(ValueError, match="model.spec='my/mlp'.*valid"):
        shard(torch.nn.Sequential(torch.nn.Linear(2, 2)), "my/mlp", torch.float32)
