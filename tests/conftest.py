from pathlib import Path

import pytest
import tomllib
import torch

from harness.base.models import load_model

# `device`-parametrised tests run on the CPU everywhere and on CUDA where present; the cuda ids
# are `gpu`-marked, so CPU CI (-m "not gpu") runs the CPU half, and `pytest -m gpu` (or
# scripts/gpu_check.sh) the CUDA half
CUDA = pytest.param(
    "cuda",
    id="cuda",
    marks=[
        pytest.mark.gpu,
        pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    ],
)


@pytest.fixture(params=["cpu", CUDA])
def device(request) -> torch.device:
    return torch.device(request.param)


@pytest.fixture
def tiny_llama():
    return load_model("tiny-llama", seed=0)


@pytest.fixture
def tiny_moe():
    return load_model("tiny-moe", seed=0)


@pytest.fixture(autouse=True, scope="session")
def _hydra_registrations():
    """What the entry points register before Hydra composes (the job configs' resolvers, the
    train and measure schemas), for the tests that compose a job's config themselves."""
    from harness import measure

    measure.register()


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _no_hydra_job_left_behind():
    """A test that sets Hydra's job config (HydraConfig.set_config, as a job would) leaves it
    unset again: a later test's plain `compose` is no Hydra job, and the checks that read the
    job's group choices (harness.runs.validate.check_group_names) must not read an earlier
    test's."""
    from hydra.core.hydra_config import HydraConfig

    yield
    HydraConfig.instance().cfg = None


ROOT = Path(__file__).resolve().parents[1]


def installed_entry_points(dest: Path) -> str:
    """A PYTHONPATH on which importlib.metadata in vLLM's venv finds pyproject.toml's entry points
    as an installed ratiolab declares them (`pip install --no-deps -e .` there), without
    installing into the shared venv: a dist-info holding them, then the checkout."""
    eps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]
    info = dest / "ratiolab-0.1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: ratiolab\nVersion: 0.1.0\n")
    (info / "entry_points.txt").write_text(
        "".join(f"[{g}]\n" + "".join(f"{k} = {v}\n" for k, v in eps[g].items()) for g in eps)
    )
    return f"{dest}:{ROOT}"
