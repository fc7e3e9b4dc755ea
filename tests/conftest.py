import pytest
import torch

from harness.models import load_model


@pytest.fixture
def tiny_llama():
    return load_model("tiny-llama", seed=0)


@pytest.fixture
def tiny_moe():
    return load_model("tiny-moe", seed=0)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
