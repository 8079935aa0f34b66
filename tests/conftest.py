"""Test configuration: Triton runs interpreted without a GPU, and rank pools are shared."""

import os

import torch

# Must be set before any @triton.jit decorator executes (i.e. before distfuse.kernels imports).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from distfuse.testing import shutdown_pools  # noqa: E402


def pytest_collection_modifyitems(config, items):
    has_cuda = torch.cuda.is_available()
    multi = has_cuda and torch.cuda.device_count() > 1
    for item in items:
        if "cuda" in item.keywords and not has_cuda:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
        if "multigpu" in item.keywords and not multi:
            item.add_marker(pytest.mark.skip(reason="needs more than one CUDA GPU"))


@pytest.fixture(scope="session", autouse=True)
def _close_rank_pools():
    yield
    shutdown_pools()
