"""Property-level authorisation: fields a caller is not meant to set (tenant, sha256, number, scopes,
is_active, adapter, created_by, …) sent to every write endpoint change nothing.

Each write runs twice in a rolled-back savepoint — once with only its intended fields, once with a
pile of extra ones — and the database diff of the tables that matter must be the same both times:
the extras add nothing, move nothing, and do not redirect the write to another tenant's rows.
The API runs outside savepoints (its audit transaction is durable) and refuses unknown fields.
"""
from __future__ import annotations

import json
from datetime import datetime

import pytest
from django.apps import apps
from django.db import transaction
from django.test import Client
from django.urls import URLPattern, URLResolver, get_resolver, reverse

pytestmark = [pytest.mark.django_db]



TABLES = ["tenants.Tenant", "tenants.Membership", "tenants.Invitation", "gateway.ApiKey", "auth.User",
          "adapters.BaseModel", "adapters.Adapter", "adapters.AdapterVersion", "adapters.VersionPointerChange",
          "gateway.AuditRecord"]
# Values that differ between two identical requests (random ids, secrets, clocks), not because of input.
VOLATILE = {"key_id", "secret_hash", "last4", "request_id", "password", "total_seconds", "queue_seconds",
            "first_token_seconds", "token_hash", "public_id"}  # public_id: fine-tuning's random file-/ftjob- ids


def _extras(r) -> dict:
    """Everything a hostile client might try to set, pointing at the other tenant where it can."""
    return {
        "tenant": r.globex.pk, "tenant_id": r.globex.pk, "tenant_slug": "globex", "sha256": "0" * 64,
        "number": 99, "scopes": "admin", "is_active": "false", "is_staff": "on", "is_superuser": "on",
        "adapter": r.globex_adapter.pk, "adapter_id": r.globex_adapter.pk, "version": r.globex_v1.pk,
        "active_version": r.globex_v1.pk, "storage_key": "adapters/evil.safetensors", "rank": 1, "alpha": 1,
        "created_by": r.charlie.pk, "actor": r.charlie.pk, "user": r.charlie.pk, "key_id": "AAAAAAAAAAAA",
        "secret_hash": "0" * 64, "revoked_at": "", "deleted_at": "", "role": "owner", "owner": r.charlie.pk,
        "requests_per_minute": 999999, "may_use_base": "on",
    }


def _model(label: str):
    """The installed model named 'app_label.ModelName' (by import-free lookup over the registry)."""
    return next(m for m in apps.get_models() if m._meta.label == label)


def snapshot(tables: list[str] = TABLES) -> dict:
    rows = {}
    for label in tables:
        model = _model(label)
        for obj in model._default_manager.all().values():
            rows[(label, obj["id"])] = obj
    return rows


def diff(before: dict, after: dict) -> dict:
    added = sorted(set(after) - set(before))
    new_ids = {k for k in added}

    def norm(label, name, value):
        if name in VOLATILE:
            return "<volatile>"
        if isinstance(value, datetime):
            return "<datetime>"
        model = _model(label)
        field = next((f for f in model._meta.concrete_fields if f.attname == name), None)
        if field is not None and field.is_relation and value is not None:
            target = field.related_model._meta.label
            if (target, value) in new_ids:
                return f"<new {target}>"
        return value

    def row(key):
        label, _ = key
        return (label, tuple(sorted((n, repr(norm(label, n, v))) for n, v in after[key].items() if n != "id")))

    changed = []
    for key in sorted(set(before) & set(after)):
        for name, value in after[key].items():
            if before[key][name] != value:
                changed.append((key, name, repr(norm(key[0], name, value))))
    return {"added": sorted(row(k) for k in added), "removed": sorted(set(before) - set(after)),
            "changed": sorted(changed)}


def _run_rolled_back(fn) -> tuple[dict, object]:
    with transaction.atomic():
        before = snapshot()
        response = fn()
        result = diff(before, snapshot())
        transaction.set_rollback(True)
    return result, response


def _as(user) -> Client:
    client = Client()
    client.force_login(user)
    return client


def _upload_files(folder):
    from django.core.files.uploadedfile import SimpleUploadedFile

    return {
        "config_file": SimpleUploadedFile("adapter_config.json", (folder / "adapter_config.json").read_bytes()),
        "weights_file": SimpleUploadedFile("adapter_model.safetensors",
                                           (folder / "adapter_model.safetensors").read_bytes()),
    }


@pytest.fixture
def alice_invited_to_globex(realm):
    """An open globex invitation addressed to alice (as a viewer), and its link token: the invitee's writes
    run as alice, like every other row."""
    from tenants.models import Role
    from tenants.services import do_invite

    return do_invite(realm.globex, "alice", Role.VIEWER, actor=realm.charlie)


def _writes(r, peft_folder, invitation=None):
    """route -> (url, intended form data (callable: fresh files each time), expected status[, who posts]).

    Rows post as alice (owner of acme) unless they name someone else; the invitee's rows need
    `invitation` (an open one addressed to alice, see `alice_invited_to_globex`)."""
    bob_membership = r.acme.memberships.get(user=r.bob).pk
    invitation, token = invitation or (r.acme_invitation, r.acme_invitation_token)
    return {
        "tenants:keys": (reverse("tenants:keys"), lambda: {"name": "ci"}, 200),
        "tenants:revoke_key": (reverse("tenants:revoke_key", args=[r.acme_key.pk]), lambda: {}, 302),
        "tenants:members": (reverse("tenants:members"), lambda: {"username": "eve", "role": "viewer"}, 302),
        "tenants:change_role": (reverse("tenants:change_role", args=[bob_membership]), lambda: {"role": "member"}, 302),
        "tenants:remove_member": (reverse("tenants:remove_member", args=[bob_membership]), lambda: {}, 302),
        # alice is acme's last owner and may not leave: bob (a viewer) does
        "tenants:leave": (reverse("tenants:leave"), lambda: {}, 302, r.bob),
        "tenants:revoke_invitation": (reverse("tenants:revoke_invitation", args=[r.acme_invitation.pk]), lambda: {},
                                      302),
        "tenants:accept_invitation": (reverse("tenants:accept_invitation", args=[invitation.pk]), lambda: {}, 302),
        "tenants:decline_invitation": (reverse("tenants:decline_invitation", args=[invitation.pk]), lambda: {}, 302),
        "tenants:invitation_link": (reverse("tenants:invitation_link", args=[token]), lambda: {"answer": "accept"},
                                    302),
        "tenants:switch": (reverse("tenants:switch"), lambda: {"tenant": "acme"}, 302),
        "tenants:logout": (reverse("tenants:logout"), lambda: {}, 302),
        "adapters:create": (reverse("adapters:create"),
                            lambda: {"name": "fresh", "base": r.base.pk, "description": "d"}, 302),
        "adapters:upload": (reverse("adapters:upload", args=[r.acme_only.pk]), lambda: _upload_files(peft_folder), 302),
        "adapters:activate": (reverse("adapters:activate", args=[r.acme_adapter.pk, 1]), lambda: {"reason": "r"}, 302),
        "adapters:delete": (reverse("adapters:delete", args=[r.acme_adapter.pk]), lambda: {}, 302),
    }


# Routes that only read (GET pages, API reads, login form). Every other route is a write and needs a row above.
READ_ONLY = {"tenants:login", "tenants:home", "tenants:invitations", "adapters:list", "adapters:detail",
             "adapters:usage", "adapters:audit", "adapters:capacity", "operator:workers", "metrics", "schema", "api-docs",
             "gateway:models", "gateway:model-detail", "gateway:unknown"}  # unknown: a JSON 404 for any method
API_WRITES = {"gateway:completions", "gateway:chat-completions"}
# the Files and fine-tuning API: uploads, deletes, jobs and cancels write (tests/finetune covers what they write and
# that another tenant's objects are 404); the rest read
API_WRITES |= {"finetune:files", "finetune:file-detail", "finetune:jobs", "finetune:job-cancel"}
READ_ONLY |= {"finetune:file-content", "finetune:job-detail", "finetune:job-events"}
# The fine-tuning pages: two read, three write (test_fine_tuning_pages_ignore_extra_fields covers the writes)
READ_ONLY |= {"finetuning:jobs", "finetuning:job"}
FINETUNE_WRITES = {"finetuning:upload", "finetuning:create", "finetuning:cancel"}


def _route_names(patterns=None, prefix=""):
    out = []
    for p in patterns if patterns is not None else get_resolver().url_patterns:
        if isinstance(p, URLResolver):
            out += _route_names(p.url_patterns, f"{prefix}{p.namespace}:" if p.namespace else prefix)
        elif isinstance(p, URLPattern):
            out.append(f"{prefix}{p.name}")
    return out


def test_every_write_endpoint_is_covered(realm, peft_folder):
    writes = set(_writes(realm, peft_folder)) | API_WRITES | FINETUNE_WRITES
    unknown = [n for n in _route_names() if not n.startswith("admin:") and n not in writes | READ_ONLY]
    assert not unknown, f"routes neither read-only nor covered as writes: {unknown}"


@pytest.mark.parametrize("route", ["tenants:keys", "tenants:revoke_key", "tenants:members", "tenants:change_role",
                                   "tenants:remove_member", "tenants:leave", "tenants:revoke_invitation",
                                   "tenants:accept_invitation", "tenants:decline_invitation",
                                   "tenants:invitation_link", "tenants:switch", "tenants:logout", "adapters:create",
                                   "adapters:upload", "adapters:activate", "adapters:delete"])
def test_extra_fields_change_nothing(realm, peft_folder, alice_invited_to_globex, route):
    url, intended, status, *who = _writes(realm, peft_folder, alice_invited_to_globex)[route]
    user = who[0] if who else realm.alice
    plain, response = _run_rolled_back(lambda: _as(user).post(url, data=intended()))
    assert response.status_code == status, response.content[:400]
    assert plain["added"] or plain["changed"] or plain["removed"] or route in ("tenants:switch", "tenants:logout"), \
        f"the intended write of {route} changed nothing: the comparison would prove nothing"
    hostile, response = _run_rolled_back(lambda: _as(user).post(url, data={**_extras(realm), **intended()}))
    assert response.status_code == status, response.content[:400]
    assert hostile == plain, f"extra fields changed what {route} wrote"


def test_fine_tuning_pages_ignore_extra_fields(realm, monkeypatch):
    """Upload a dataset, start a job, cancel a job: the same rows with and without the hostile extras (random public
    ids aside: VOLATILE), in the fine-tuning tables as in the others."""
    from django.core.files.base import ContentFile
    from django.core.files.uploadedfile import SimpleUploadedFile

    from finetune.files import create_training_file
    from finetune.jobs import create_job
    from finetune.params import JobParams

    monkeypatch.setattr("finetune.jobs.publish_training_job", lambda job_id, base: None)
    tables = TABLES + ["finetune.TrainingFile", "finetune.FineTuningJob", "finetune.JobEvent"]
    data = b"".join(json.dumps({"messages": [{"role": "user", "content": f"where is the ball {i}"},
                                             {"role": "assistant", "content": "in the garden"}]}).encode() + b"\n"
                    for i in range(3))
    stored = create_training_file(realm.acme, ContentFile(data, name="t.jsonl"), purpose="fine-tune")
    job = create_job(realm.acme, JobParams(model=realm.base.slug, training_file=stored.public_id, suffix="ft", seed=1),
                     created_by=realm.alice)
    rows = {
        "finetuning:upload": (reverse("finetuning:upload"), lambda: {"file": SimpleUploadedFile("t.jsonl", data)}),
        "finetuning:create": (reverse("finetuning:create"), lambda: {
            "training_file": stored.public_id, "model": realm.base.slug, "suffix": "ft2", "rank": 8, "seed": 3}),
        "finetuning:cancel": (reverse("finetuning:cancel", args=[job.public_id]), lambda: {}),
    }
    assert set(rows) == FINETUNE_WRITES

    def run(url, body) -> tuple[dict, object]:
        with transaction.atomic():
            before = snapshot(tables)
            response = _as(realm.alice).post(url, data=body)
            result = diff(before, snapshot(tables))
            transaction.set_rollback(True)
        return result, response

    for route, (url, intended) in rows.items():
        plain, response = run(url, intended())
        assert response.status_code == 302, (route, response.content[:400])
        assert plain["added"] or plain["changed"], f"the intended write of {route} changed nothing"
        hostile, response = run(url, {**_extras(realm), **intended()})
        assert response.status_code == 302, (route, response.content[:400])
        assert hostile == plain, f"extra fields changed what {route} wrote"


def test_a_key_cannot_be_bound_to_another_tenants_adapter(realm):
    from gateway.models import ApiKey

    before = ApiKey.objects.count()
    response = _as(realm.alice).post(reverse("tenants:keys"), data={"name": "x", "bound_adapter": realm.globex_adapter.pk})
    assert response.status_code == 400
    assert ApiKey.objects.count() == before


@pytest.mark.parametrize("path,base", [("/v1/completions", {"model": "acme-only", "prompt": "hi", "max_tokens": 2}),
                                       ("/v1/chat/completions", {"model": "acme-only", "max_tokens": 2,
                                                                 "messages": [{"role": "user", "content": "hi"}]})])
def test_api_refuses_extra_fields_and_enqueues_nothing(realm, path, base):
    """Unknown body fields are a named 400; the only row written is the refusal's audit record (acme's)."""
    from gateway.models import AuditRecord

    headers = {"HTTP_AUTHORIZATION": f"Bearer {realm.acme_secret}"}
    for name, value in [("tenant", "globex"), ("adapter", realm.globex_adapter.pk), ("sha256", "0" * 64),
                        ("version", 1), ("scopes", ["admin"]), ("is_active", False), ("weights_sha256", "0" * 64),
                        ("lora_adapter", "support-bot"), ("worker", "w1"), ("queue", "evil")]:
        before = snapshot()
        response = Client().post(path, data=json.dumps({**base, name: value}), content_type="application/json",
                                 **headers)
        assert response.status_code == 400, (name, response.status_code)
        assert response.json()["error"]["param"] == name
        d = diff(before, snapshot())
        assert d["removed"] == [] and [c for c in d["changed"] if c[0][0] != "gateway.ApiKey"] == []
        assert [a[0] for a in d["added"]] == ["gateway.AuditRecord"], d
        record = AuditRecord.objects.order_by("-id").first()
        assert record.tenant_id == realm.acme.pk and record.http_status == 400
    assert realm.dispatcher.published == []
