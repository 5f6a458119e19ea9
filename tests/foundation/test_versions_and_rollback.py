"""Immutable versions and rollback as a pointer move (Python layer: runs on SQLite and PostgreSQL)."""
import pytest
from django.db import IntegrityError, transaction

from adapters.models import AdapterVersion, ImmutableFieldError, VersionPointerChange
from adapters.services import AdapterStateError, activate_version, soft_delete_adapter


def test_rollback_moves_only_the_pointer_and_records_who_and_why(world):
    before = list(AdapterVersion.objects.filter(adapter=world.acme_adapter).values())
    change = activate_version(world.acme_adapter, world.acme_v1, actor=world.alice, reason="v2 regressed")
    world.acme_adapter.refresh_from_db()
    assert world.acme_adapter.active_version == world.acme_v1
    assert (change.from_version, change.to_version, change.actor, change.reason) == (
        world.acme_v2, world.acme_v1, world.alice, "v2 regressed")
    assert list(AdapterVersion.objects.filter(adapter=world.acme_adapter).values()) == before
    history = [(c.from_version_id, c.to_version_id) for c in VersionPointerChange.objects.filter(adapter=world.acme_adapter)]
    assert history == [(world.acme_v2.pk, world.acme_v1.pk), (world.acme_v1.pk, world.acme_v2.pk), (None, world.acme_v1.pk)]


def test_activation_needs_a_reason(world):
    with pytest.raises(AdapterStateError, match="reason"):
        activate_version(world.acme_adapter, world.acme_v1, actor=world.alice, reason="  ")


def test_deleted_adapter_cannot_be_activated(world):
    soft_delete_adapter(world.acme_adapter, actor=world.alice)
    with pytest.raises(AdapterStateError, match="deleted"):
        activate_version(world.acme_adapter, world.acme_v1, actor=world.alice, reason="undo")


def test_python_layer_refuses_changing_a_version(world):
    v = AdapterVersion.objects.get(pk=world.acme_v1.pk)
    v.sha256 = "f" * 64
    with pytest.raises(ImmutableFieldError):
        v.save()
    with pytest.raises(ImmutableFieldError):
        AdapterVersion.objects.filter(pk=v.pk).update(rank=64)
    assert AdapterVersion.objects.get(pk=v.pk).sha256 == "a" * 64


def test_version_numbers_are_unique_per_adapter(world):
    with pytest.raises(IntegrityError), transaction.atomic():
        AdapterVersion.objects.create(
            adapter=world.acme_adapter, number=1, sha256="d" * 64, storage_key="k", size_bytes=1, rank=1, alpha=1,
            target_modules=["q_proj"], dtype="float32", parameter_count=1)


def test_adapter_names_are_unique_per_tenant(world):
    from django.core.exceptions import ValidationError

    from adapters.services import create_adapter

    with pytest.raises(ValidationError):
        create_adapter(world.acme, "support-bot", world.base)
    create_adapter(world.acme, "other-bot", world.base)  # a new name is fine
