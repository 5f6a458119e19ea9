"""Tiny checkpoints built once per test session (a few hundred milliseconds each, no downloads).

Shapes differ on purpose so the suite covers the model code's branches: llama is untied with GQA
group 2, mistral uses GQA group 4 (one KV head), qwen2 has no GQA, q/k/v biases and tied embeddings.
"""
from pathlib import Path

import pytest

from demo.tiny_base import build_tiny_base


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    return build_tiny_base(tmp_path_factory.mktemp("tiny_llama"), arch="llama", seed=1)


@pytest.fixture(scope="session")
def tiny_mistral(tmp_path_factory) -> Path:
    return build_tiny_base(tmp_path_factory.mktemp("tiny_mistral"), arch="mistral", seed=2, kv_heads=1)


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory) -> Path:
    return build_tiny_base(tmp_path_factory.mktemp("tiny_qwen2"), arch="qwen2", seed=3, kv_heads=4,
                           tie_embeddings=True)


@pytest.fixture(scope="session")
def tiny_tied_wide(tmp_path_factory) -> Path:
    """Tied embeddings at the width (protocol.memory.PACK_MIN_HIDDEN) from which a CPU worker packs its weights for
    oneDNN, and so packs a copy of the tied LM head; one layer and a small vocabulary keep it tiny."""
    return build_tiny_base(tmp_path_factory.mktemp("tiny_tied_wide"), arch="llama", seed=4, hidden=512, layers=1,
                           heads=8, kv_heads=2, intermediate=256, vocab=512, tie_embeddings=True)


@pytest.fixture(params=["llama", "mistral", "qwen2"])
def tiny_base(request) -> Path:
    """Each tiny architecture in turn."""
    return request.getfixturevalue(f"tiny_{request.param}")
