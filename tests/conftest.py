"""Test-wide setup.

Without a GPU, Triton kernels run on CPU tensors through the interpreter. Both variables must be set
before triton (or vLLM, which imports it) is first imported, hence here, at collection start.
``CUDA_VISIBLE_DEVICES=""`` also stops vLLM from swapping in its placeholder ``triton`` module.
"""

import os

import pytest
import torch

HAS_GPU = torch.cuda.is_available()

if not HAS_GPU:
    os.environ["TRITON_INTERPRET"] = "1"
    os.environ["CUDA_VISIBLE_DEVICES"] = ""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if HAS_GPU:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def device() -> str:
    return "cuda" if HAS_GPU else "cpu"
