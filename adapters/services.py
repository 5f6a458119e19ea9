"""Verbs that change base models and adapters (uploads live in adapters/uploads.py)."""
from __future__ import annotations

import hashlib
from pathlib import Path

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from .manifest import shape_manifest_from_checkpoint
from .models import Adapter, AdapterVersion, BaseModel, VersionPointerChange


class AdapterStateError(ValueError):
    """The adapter cannot do that in its current state (deleted, version of another adapter…)."""


def checkpoint_sha256(path: str | Path) -> str:
    """sha256 over config.json and every *.safetensors file, in name order: the base's identity."""
    folder = Path(path)
    digest = hashlib.sha256()
    for file in [folder / "config.json", *sorted(folder.glob("*.safetensors"))]:
        digest.update(file.name.encode() + b"\0")
        with open(file, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                digest.update(chunk)
    return digest.hexdigest()


@transaction.atomic
def register_base_model(
    slug: str, path: str | Path, *, display_name: str = "", max_lora_rank: int | None = None, queue_name: str | None = None
) -> BaseModel:
    """Register (or refresh) a base from a local Hugging Face checkpoint folder."""
    folder = Path(path).resolve()
    manifest = shape_manifest_from_checkpoint(folder)
    defaults = {
        "display_name": display_name or slug,
        "checkpoint_path": str(folder),
        "sha256": checkpoint_sha256(folder),
        "architecture": manifest["architecture"],
        "shape_manifest": manifest,
        "max_lora_rank": max_lora_rank or settings.LORAFLEET_DEFAULT_MAX_RANK,
        "queue_name": queue_name or f"base.{slug}",
    }
    base, _ = BaseModel.objects.update_or_create(slug=slug, defaults=defaults)
    base.full_clean()
    return base


@transaction.atomic
def create_adapter(tenant, name: str, base: BaseModel, *, created_by=None, description: str = "") -> Adapter:
    adapter = Adapter(tenant=tenant, name=name, base=base, created_by=created_by, description=description)
    adapter.full_clean()
    adapter.save()
    return adapter


@transaction.atomic
def activate_version(adapter: Adapter, version: AdapterVersion, *, actor, reason: str) -> VersionPointerChange:
    """Move the adapter's live pointer (rollback or roll forward). Weights are never copied or rewritten."""
    locked = Adapter.objects.select_for_update().get(pk=adapter.pk)
    if locked.is_deleted:
        raise AdapterStateError(f"Adapter {locked.name!r} is deleted.")
    if version.adapter_id != locked.pk:
        raise AdapterVersion.DoesNotExist("No such version of this adapter.")
    reason = (reason or "").strip()
    if not reason:
        raise AdapterStateError("Say why the live version changes (a reason is required).")
    change = VersionPointerChange.objects.create(
        adapter=locked, from_version_id=locked.active_version_id, to_version=version, actor=actor, reason=reason[:500]
    )
    locked.active_version = version
    locked.save(update_fields=["active_version"])
    adapter.active_version = version
    return change


@transaction.atomic
def soft_delete_adapter(adapter: Adapter, *, actor=None) -> Adapter:
    locked = Adapter.objects.select_for_update().get(pk=adapter.pk)
    if locked.deleted_at is None:
        locked.deleted_at = timezone.now()
        locked.save(update_fields=["deleted_at"])
    adapter.deleted_at = locked.deleted_at
    return adapter
