"""Dashboard edges of the adapters app that used to end in the wrong answer: an over-limit upload from the
page's script said "your role cannot upload" (its CSRF token was cut off with the body), and the audit
log's last calendar day was a 500."""
from __future__ import annotations

from pathlib import Path

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile
from django.test import Client
from django.urls import reverse

from adapters.models import AdapterVersion

pytestmark = pytest.mark.django_db

APP_JS = Path(__file__).resolve().parents[2] / "static" / "js" / "app.js"


@pytest.fixture
def alice_client(alice) -> Client:
    client = Client(enforce_csrf_checks=True)
    client.force_login(alice)
    return client


def _oversized_files(peft_adapters) -> dict:
    folder = peft_adapters.good
    return {
        "config_file": SimpleUploadedFile("adapter_config.json", (folder / "adapter_config.json").read_bytes()),
        "weights_file": SimpleUploadedFile("adapter_model.safetensors", b"\0" * (1024 * 1024)),
    }


def test_the_upload_script_sends_the_csrf_token_in_a_header():
    script = APP_JS.read_text()
    assert 'xhr.setRequestHeader("X-CSRFToken", csrf.value)' in script
    assert "csrfmiddlewaretoken" in script


def test_an_upload_over_the_limit_with_the_csrf_header_gets_the_size_error(alice_client, adapter, peft_adapters,
                                                                           blob_dir, settings):
    """What the page's script sends: the token in X-CSRFToken, the body declared far over the cap (so
    Django reads none of it, the token field included)."""
    url = reverse("adapters:upload", args=[adapter.pk])
    assert alice_client.get(url).status_code == 200  # sets the CSRF cookie, as opening the page does
    token = alice_client.cookies[settings.CSRF_COOKIE_NAME].value
    settings.LORAFLEET_MAX_UPLOAD_BYTES = 1000

    r = alice_client.post(url, _oversized_files(peft_adapters), HTTP_ACCEPT="application/json", HTTP_X_CSRFTOKEN=token)
    assert r.status_code == 413, r.content[:300]
    assert r.json()["ok"] is False and "larger than the upload limit" in r.json()["error"]
    # without the header the same body is a CSRF refusal: what the page showed as a role error
    r = alice_client.post(url, _oversized_files(peft_adapters), HTTP_ACCEPT="application/json")
    assert r.status_code == 403
    assert not AdapterVersion.objects.exists()
    assert not any(p.is_file() for p in blob_dir.rglob("*"))


@pytest.mark.parametrize("query", [{"date_to": "9999-12-31"}, {"date_from": "0001-01-01"},
                                   {"date_from": "9999-12-31", "date_to": "9999-12-31"}])
def test_the_audit_log_names_a_date_it_cannot_use_instead_of_failing(alice_client, adapter, query):
    r = alice_client.get(reverse("adapters:audit"), query)
    assert r.status_code == 200
    assert "Pick a date between 0001-01-02 and 9999-12-30." in r.content.decode()


def test_the_audit_log_still_filters_by_the_last_usable_day(alice_client, adapter):
    from gateway.models import AuditRecord

    AuditRecord.objects.create(route="completions", tenant=adapter.tenant, adapter=adapter)
    r = alice_client.get(reverse("adapters:audit"), {"date_from": "2000-01-01", "date_to": "9999-12-30"})
    assert r.status_code == 200 and "Pick a date" not in r.content.decode()
    assert len(r.context["page"]) == 1
