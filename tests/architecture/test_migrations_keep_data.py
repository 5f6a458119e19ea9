"""ApiKey moved from tenants to gateway with SeparateDatabaseAndState (its table, `tenants_apikey`, stays).

A database migrated with the migrations as they were before the move (the leaves below, commit 4659184),
filled with tenants, members, an invitation, keys (bound, revoked), adapter versions, pointer history and
audit rows, migrates to today's leaves with every row intact: the same rows, the same values in every
column, a key issued before the move still authenticates, and the key's content type (so its admin
permissions) is the same row, relabelled. Runs on SQLite and on PostgreSQL (DATABASE_URL).
"""
from __future__ import annotations

import hashlib
import uuid

import pytest
from django.db import connection
from django.db.migrations.executor import MigrationExecutor
from django.utils import timezone

# The key's content type is checked on its own: it is the one row meant to change (its app label).
# The leaves of the three project apps with models, as they were before ApiKey moved.
BEFORE_THE_MOVE = [
    ("tenants", "0002_invitations_and_last_used_tenant"),
    ("adapters", "0003_immutable_versions_trigger"),
    ("gateway", "0004_audit_identity_write_once"),
]
TABLES = [
    "auth_user", "auth_permission", "tenants_tenant", "tenants_membership",
    "tenants_invitation", "tenants_apikey", "adapters_basemodel", "adapters_adapter", "adapters_adapterversion",
    "adapters_versionpointerchange", "gateway_auditrecord",
]


def _migrate(targets) -> MigrationExecutor:
    executor = MigrationExecutor(connection)
    executor.loader.build_graph()
    executor.migrate(targets if targets is not None else executor.loader.graph.leaf_nodes())
    return MigrationExecutor(connection)


def _snapshot() -> dict[str, list[dict]]:
    """Every row of every table above, as the database returns it, ordered by primary key."""
    out = {}
    with connection.cursor() as cursor:
        for table in TABLES:
            cursor.execute(f"SELECT * FROM {connection.ops.quote_name(table)} ORDER BY id")  # noqa: S608 (fixed names)
            names = [c[0] for c in cursor.description]
            out[table] = [dict(zip(names, row, strict=True)) for row in cursor.fetchall()]
    return out


def _fill(apps) -> dict:
    """Rows written through the *historical* models of the state before the move."""
    models = apps.all_models
    User = models["auth"]["user"]
    Tenant, Membership = models["tenants"]["tenant"], models["tenants"]["membership"]
    Invitation, ApiKey = models["tenants"]["invitation"], models["tenants"]["apikey"]
    BaseModel, Adapter = models["adapters"]["basemodel"], models["adapters"]["adapter"]
    AdapterVersion = models["adapters"]["adapterversion"]
    VersionPointerChange = models["adapters"]["versionpointerchange"]
    AuditRecord = models["gateway"]["auditrecord"]

    now = timezone.now()
    alice = User.objects.create(username="alice", email="alice@example.com", password="!")
    bob = User.objects.create(username="bob", password="!")
    acme = Tenant.objects.create(slug="acme", name="Acme")
    globex = Tenant.objects.create(slug="globex", name="Globex", may_use_base=False)
    Membership.objects.create(tenant=acme, user=alice, role="owner", last_used_at=now)
    Membership.objects.create(tenant=globex, user=bob, role="viewer")
    Invitation.objects.create(tenant=acme, invited_as="carol@example.com", role="member", invited_by=alice,
                              token_hash="f" * 64, created_at=now, expires_at=now + timezone.timedelta(days=7))
    base = BaseModel.objects.create(slug="tiny", display_name="Tiny", sha256="0" * 64, architecture="llama",
                                    shape_manifest={"modules": {"q_proj": [64, 64]}}, queue_name="base.tiny")
    adapter = Adapter.objects.create(tenant=acme, name="support-bot", base=base, created_by=alice)
    versions = [
        AdapterVersion.objects.create(
            adapter=adapter, number=n, sha256=c * 64, storage_key=f"adapters/{c * 64}.safetensors", size_bytes=1000 * n,
            rank=8, alpha=16, target_modules=["q_proj", "v_proj"], dtype="float32", parameter_count=250, created_by=alice,
        )
        for n, c in ((1, "a"), (2, "b"))
    ]
    for before, after in ((None, versions[0]), (versions[0], versions[1])):
        VersionPointerChange.objects.create(adapter=adapter, from_version=before, to_version=after, actor=alice,
                                            reason="test")
    Adapter.objects.filter(pk=adapter.pk).update(active_version=versions[1])
    secret = "S" * 30
    bound = ApiKey.objects.create(tenant=acme, name="bound", key_id="A" * 12,
                                  secret_hash=hashlib.sha256(secret.encode()).hexdigest(), last4="abcd",
                                  bound_adapter=adapter, created_by=alice, last_used_at=now)
    ApiKey.objects.create(tenant=globex, name="old", key_id="B" * 12, secret_hash="0" * 64, last4="wxyz",
                          revoked_at=now, expires_at=now + timezone.timedelta(days=1))
    for status, code, version in (("ok", "", versions[1]), ("error", "adapter_load_failed", versions[0])):
        AuditRecord.objects.create(
            request_id=uuid.uuid4(), route="/v1/completions", tenant=acme, key_prefix=f"lf_live_{bound.key_id}",
            adapter=adapter, adapter_name=adapter.name, version=version, version_number=version.number,
            expected_sha256=version.sha256, weights_sha256=version.sha256 if status == "ok" else "",
            adapter_identity="e" * 64 if status == "ok" else None, base_model=base, base_slug="tiny",
            base_sha256="0" * 64, worker_id="w1", status=status, http_status=200 if status == "ok" else 502,
            error_code=code, prompt_tokens=3, completion_tokens=5 if status == "ok" else None, finished_at=now,
        )
    return {"bound_key_id": bound.key_id, "secret": secret, "adapter": adapter.pk}


@pytest.mark.django_db(transaction=True)
def test_a_database_from_before_the_move_keeps_every_row():
    from django.contrib.contenttypes.models import ContentType

    from gateway.keys import PREFIX, authenticate_api_key, checksum
    from gateway.models import ApiKey

    executor = _migrate(BEFORE_THE_MOVE)
    assert not any(app == "gateway" and name >= "0005" for app, name in executor.loader.applied_migrations)
    key_type = ContentType.objects.get(app_label="tenants", model="apikey").pk  # relabelled back by 0005's reverse
    made = _fill(executor.loader.project_state(BEFORE_THE_MOVE).apps)
    before = _snapshot()
    assert len(before["tenants_apikey"]) == 2 and len(before["gateway_auditrecord"]) == 2

    _migrate(None)
    ContentType.objects.clear_cache()
    after = _snapshot()
    for table, rows in before.items():
        assert len(after[table]) == len(rows), table
        for old, new in zip(rows, after[table], strict=True):
            assert {k: new[k] for k in old} == old, (table, old["id"])  # new columns may be added, none changes
    assert [row["revoked_by_id"] for row in after["tenants_apikey"]] == [None, None]  # unknown before the move

    # Today's models read the same rows: the gateway owns the key, still bound, still usable.
    assert ContentType.objects.get(app_label="gateway", model="apikey").pk == key_type
    assert not ContentType.objects.filter(app_label="tenants", model="apikey").exists()
    key = ApiKey.objects.get(key_id=made["bound_key_id"])
    assert key.bound_adapter_id == made["adapter"] and key.tenant.slug == "acme"
    body = f"{PREFIX}{made['bound_key_id']}_{made['secret']}"
    assert authenticate_api_key(body + checksum(body), touch=False).pk == key.pk
    assert ApiKey.objects.get(key_id="B" * 12).revoked_at is not None
