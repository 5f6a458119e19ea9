"""Fine-tuning fixtures: a tiny base built locally, two tenants (acme and globex) with keys, storage under tmp_path,
and the training queue recorded instead of published (the real queue and trainer are in test_real_stack.py)."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from demo.tiny_base import build_tiny_base


@pytest.fixture(scope="session")
def ft_base_dir(tmp_path_factory) -> Path:
    # 2 layers, hidden 64, context 512: trains in a second or two on the CPU
    return build_tiny_base(tmp_path_factory.mktemp("ft_base"), arch="llama", seed=11)


@pytest.fixture
def ft(db, settings, tmp_path, ft_base_dir, monkeypatch):
    from adapters.services import register_base_model
    from gateway.services import issue_api_key
    from tenants.services import create_tenant

    settings.STORAGES = {
        **settings.STORAGES,
        "adapters": {"BACKEND": "adapters.storage.AtomicFileSystemStorage",
                     "OPTIONS": {"location": str(tmp_path / "storage")}},
    }
    published: list[tuple[str, str]] = []
    monkeypatch.setattr("finetune.jobs.publish_training_job", lambda job_id, base: published.append((job_id, base.slug)))
    base = register_base_model("tiny-ft", ft_base_dir, max_lora_rank=16)
    acme = create_tenant("acme", "Acme")
    globex = create_tenant("globex", "Globex")
    _, acme_key = issue_api_key(acme, "prod")
    _, globex_key = issue_api_key(globex, "prod")
    return SimpleNamespace(base=base, acme=acme, globex=globex, acme_key=acme_key, globex_key=globex_key,
                           published=published, storage=tmp_path / "storage", base_dir=ft_base_dir)


