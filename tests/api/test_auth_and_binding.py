"""Who may call which weights: keys, server-side binding, and the same 404 for everything not yours."""
from __future__ import annotations

import json

import pytest
from django.utils import timezone

from adapters.services import create_adapter, soft_delete_adapter
from gateway.models import AuditRecord
from gateway.services import issue_api_key, revoke_api_key

pytestmark = pytest.mark.django_db

COMPLETIONS = "/v1/completions"


def body(model: str, **extra) -> dict:
    return {"model": model, "prompt": "Once upon a time", "max_tokens": 4, **extra}


def test_it_refuses_a_missing_key_in_openai_shape(api, post):
    r = post(COMPLETIONS, body("support-bot"))
    assert r.status_code == 401
    assert r.json() == {"error": {"message": r.json()["error"]["message"], "type": "authentication_error",
                                  "param": None, "code": "invalid_api_key"}}
    assert r["WWW-Authenticate"].startswith("Bearer")
    assert not api.dispatcher.published


@pytest.mark.parametrize("raw", ["lf_live_nonsense", "sk-123", "lf_live_AAAAAAAAAAAA_" + "B" * 30 + "CCCCCC"])
def test_it_refuses_malformed_or_forged_keys_without_an_audit_row(api, post, raw):
    r = post(COMPLETIONS, body("support-bot"), key=raw)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert AuditRecord.objects.count() == 0  # no key row found: nothing to attribute the request to


def test_a_revoked_key_is_refused_and_audited(api, post):
    revoke_api_key(api.acme_key)
    r = post(COMPLETIONS, body("support-bot"), key=api.acme_secret)
    assert r.status_code == 401 and "revoked" in r.json()["error"]["message"]
    row = AuditRecord.objects.get()
    assert (row.tenant_id, row.key_prefix, row.http_status, row.status) == (api.acme.pk, api.acme_key.prefix, 401, "error")
    assert not api.dispatcher.published


def test_an_expired_key_is_refused_and_audited(api, post):
    key, secret = issue_api_key(api.acme, "short", expires_at=timezone.now() + timezone.timedelta(seconds=1))
    type(key).objects.filter(pk=key.pk).update(expires_at=timezone.now() - timezone.timedelta(seconds=1))
    r = post(COMPLETIONS, body("support-bot"), key=secret)
    assert r.status_code == 401 and "expired" in r.json()["error"]["message"]
    assert AuditRecord.objects.get().error_code == "invalid_api_key"


def test_name_uses_the_active_version_and_name_at_n_pins_one(api, post):
    r = post(COMPLETIONS, body("support-bot"), key=api.acme_secret)
    assert r.status_code == 200, r.content
    assert r.json()["model"] == "support-bot@2"
    r = post(COMPLETIONS, body("support-bot@1"), key=api.acme_secret)
    assert r.status_code == 200 and r.json()["model"] == "support-bot@1"
    jobs = [p.job for p in api.dispatcher.published]
    assert [j.adapter.sha256 for j in jobs] == [api.acme_v2.sha256, api.acme_v1.sha256]
    assert jobs[0].adapter.storage_key == api.acme_v2.storage_key and jobs[0].adapter.rank == 8
    assert {p.queue for p in api.dispatcher.published} == {"base.tiny"}


@pytest.mark.parametrize("model", ["support-bot@9", "no-such-adapter", "bad name!", "@1", "support-bot@0", "x" * 80])
def test_missing_and_malformed_names_are_the_same_404(api, post, model):
    r = post(COMPLETIONS, body(model), key=api.acme_secret)
    assert r.status_code == 404
    assert r.json()["error"]["code"] == "adapter_not_found" and r.json()["error"]["param"] == "model"
    assert not api.dispatcher.published
    assert AuditRecord.objects.get().http_status == 404


def test_another_tenants_adapter_is_indistinguishable_from_a_missing_one(api, post):
    """Globex and acme both have 'support-bot'; charlie's key only ever reaches globex's, and acme's
    version numbers do not exist for globex."""
    theirs = post(COMPLETIONS, body("support-bot@2"), key=api.globex_secret)
    missing = post(COMPLETIONS, body("nothing-here@2"), key=api.globex_secret)
    assert theirs.status_code == missing.status_code == 404
    assert theirs.json()["error"]["message"].replace("support-bot", "X") == \
        missing.json()["error"]["message"].replace("nothing-here", "X")
    assert not api.dispatcher.published
    r = post(COMPLETIONS, body("support-bot"), key=api.globex_secret)
    assert r.status_code == 200 and api.dispatcher.published[0].job.adapter.sha256 == api.globex_v1.sha256


def test_a_deleted_adapter_is_410_and_one_without_a_version_is_409(api, post):
    fresh = create_adapter(api.acme, "empty", api.base)
    r = post(COMPLETIONS, body("empty"), key=api.acme_secret)
    assert r.status_code == 409 and r.json()["error"]["code"] == "adapter_not_ready"
    soft_delete_adapter(api.acme_adapter)
    for model in ("support-bot", "support-bot@1"):
        r = post(COMPLETIONS, body(model), key=api.acme_secret)
        assert r.status_code == 410 and r.json()["error"]["code"] == "adapter_deleted"
    assert not api.dispatcher.published
    assert sorted(AuditRecord.objects.values_list("http_status", "adapter_name")) == [
        (409, "empty"), (410, "support-bot"), (410, "support-bot")]
    assert fresh.pk


def test_a_bound_key_uses_its_adapter_and_refuses_any_other(api, post):
    other = create_adapter(api.acme, "other", api.base)
    _, secret = issue_api_key(api.acme, "bound", bound_adapter=api.acme_adapter)
    assert post(COMPLETIONS, body("support-bot@1"), key=secret).status_code == 200
    for model in ("other", "base/tiny", "support-bot-2"):
        r = post(COMPLETIONS, body(model), key=secret)
        assert r.status_code == 403 and r.json()["error"]["code"] == "adapter_mismatch", model
    assert [p.job.adapter.sha256 for p in api.dispatcher.published] == [api.acme_v1.sha256]
    assert other.pk


def test_the_base_model_only_when_named_explicitly_and_allowed(api, post):
    r = post(COMPLETIONS, body("base/tiny"), key=api.acme_secret)
    assert r.status_code == 200 and r.json()["model"] == "base/tiny"
    assert api.dispatcher.published[0].job.adapter is None
    assert post(COMPLETIONS, body("tiny"), key=api.acme_secret).status_code == 404  # no implicit base
    api.acme.may_use_base = False
    api.acme.save()
    r = post(COMPLETIONS, body("base/tiny"), key=api.acme_secret)
    assert r.status_code == 404 and r.json()["error"]["code"] == "adapter_not_found"
    assert len(api.dispatcher.published) == 1


def test_a_base_the_tenant_may_not_use_looks_exactly_like_a_missing_one(api, post, client):
    """Whether a base model exists is not the business of a tenant that may not call it."""
    api.acme.may_use_base = False
    api.acme.save()

    def same_answer(existing, missing):
        assert existing.status_code == missing.status_code == 404
        assert existing.json() == json.loads(missing.content.decode().replace("base/nope", "base/tiny"))

    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    same_answer(post(COMPLETIONS, body("base/tiny"), key=api.acme_secret),
                post(COMPLETIONS, body("base/nope"), key=api.acme_secret))
    same_answer(post("/v1/chat/completions", {"model": "base/tiny", **chat}, key=api.acme_secret),
                post("/v1/chat/completions", {"model": "base/nope", **chat}, key=api.acme_secret))
    auth = {"HTTP_AUTHORIZATION": f"Bearer {api.acme_secret}"}
    same_answer(client.get("/v1/models/base/tiny", **auth), client.get("/v1/models/base/nope", **auth))
    assert not api.dispatcher.published


def test_models_lists_only_the_callers_adapters(api, client):
    r = client.get("/v1/models", HTTP_AUTHORIZATION=f"Bearer {api.globex_secret}")
    assert r.status_code == 200
    entries = {m["id"]: m for m in r.json()["data"]}
    assert set(entries) == {"support-bot", "base/tiny"}
    assert entries["support-bot"]["owned_by"] == "globex"
    assert entries["support-bot"]["lorafleet"]["weights_sha256"] == api.globex_v1.sha256
    r = client.get("/v1/models/support-bot@2", HTTP_AUTHORIZATION=f"Bearer {api.globex_secret}")
    assert r.status_code == 404 and r.json()["error"]["code"] == "adapter_not_found"
    r = client.get("/v1/models/support-bot@2", HTTP_AUTHORIZATION=f"Bearer {api.acme_secret}")
    assert r.status_code == 200 and r.json()["lorafleet"]["weights_sha256"] == api.acme_v2.sha256
    assert client.get("/v1/models").status_code == 401
