"""Dashboard fixtures: the lead's alice/bob/charlie `world`, plus a real tiny base with PEFT adapters
built once per session, and adapter storage under tmp_path so tests never write to var/."""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

from demo.tiny_base import build_tiny_base
from tests.support.peft_factory import make_random_peft_adapter


@pytest.fixture(scope="session")
def dash_files(tmp_path_factory) -> SimpleNamespace:
    """A tiny base checkpoint and PEFT folders: two good adapters (v1, v2) and a bad one."""
    root = tmp_path_factory.mktemp("dashboard")
    base_dir = build_tiny_base(root / "base", arch="llama", seed=0)
    good1 = make_random_peft_adapter(base_dir, root / "good1", r=8, alpha=16, seed=1)
    good2 = make_random_peft_adapter(base_dir, root / "good2", r=4, alpha=8, seed=2)
    # The config says rank 4 but the tensors are rank 8: every lora_A has the wrong shape.
    bad = root / "bad"
    shutil.copytree(good1, bad)
    config = json.loads((bad / "adapter_config.json").read_text())
    config["r"] = 4
    (bad / "adapter_config.json").write_text(json.dumps(config))
    return SimpleNamespace(base_dir=base_dir, good1=good1, good2=good2, bad=bad)


@pytest.fixture
def real_base(world, dash_files, adapter_storage_dir):
    """A registered base built from the tiny checkpoint, and acme's adapter "writer" on it (no versions)."""
    from adapters.services import create_adapter, register_base_model

    base = register_base_model("tiny-real", dash_files.base_dir, display_name="Tiny Llama")
    writer = create_adapter(world.acme, "writer", base, created_by=world.alice)
    return SimpleNamespace(base=base, writer=writer)


@pytest.fixture
def upload_files():
    """upload_files(folder) -> the two files of a PEFT folder as Django test-client uploads."""
    return _upload_files


def _upload_files(folder: Path) -> dict:
    from django.core.files.uploadedfile import SimpleUploadedFile

    return {
        "config_file": SimpleUploadedFile("adapter_config.json", (folder / "adapter_config.json").read_bytes()),
        "weights_file": SimpleUploadedFile("adapter_model.safetensors", (folder / "adapter_model.safetensors").read_bytes()),
    }
