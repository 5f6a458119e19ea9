"""Tests marked `cuda` need a CUDA device and skip cleanly without one (this project's CPU-only CI)."""
import pytest


def pytest_collection_modifyitems(config, items):
    cuda = [item for item in items if item.get_closest_marker("cuda")]
    if not cuda:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (bench/gpu_check.sh covers it on the GPU machine)")
    for item in cuda:
        item.add_marker(skip)
