"""Bases are listed to a tenant's users only where the tenant may use them.

The API answers 404 for a base the tenant may not use (tests/api/test_auth_and_binding.py); the capacity planner
and the new-adapter form must not show it either, nor accept it when posted by hand. acme (alice, bob) is barred
from the bases here; globex (charlie) is not.
"""
from __future__ import annotations

import re

import pytest
from django.urls import reverse

from adapters.models import Adapter, BaseModel

pytestmark = pytest.mark.django_db


@pytest.fixture
def barred(world):
    """A second registered base, and acme barred from using bases."""
    BaseModel.objects.create(slug="secret-70b", display_name="Secret 70B", sha256="1" * 64, architecture="llama",
                             shape_manifest={"modules": {}}, queue_name="base.secret-70b")
    world.acme.may_use_base = False
    world.acme.save()
    return world


def unsalted(html: str) -> str:
    """The page without what differs on every response (the CSRF token, a CSP nonce)."""
    return re.sub(r'(csrfmiddlewaretoken" value|nonce)="[^"]*"', r'\1=""', html)


def page(client, user, name: str, **params) -> str:
    client.force_login(user)
    response = client.get(reverse(name), params)
    assert response.status_code == 200
    return response.content.decode()


@pytest.mark.parametrize("user", ["alice", "bob"])
def test_a_tenant_that_may_not_use_bases_sees_none_on_the_capacity_page(client, barred, user):
    html = page(client, getattr(barred, user), "adapters:capacity")
    assert "llama-2-7b" in html  # the published presets stay: they are arithmetic, not a base on this platform
    assert "Secret 70B" not in html and "base:secret-70b" not in html
    assert "base:tiny" not in html and "Tiny (registered" not in html


def test_a_tenant_that_may_use_bases_sees_them_all_on_the_capacity_page(client, barred):
    html = page(client, barred.charlie, "adapters:capacity")
    assert "Secret 70B (registered, llama)" in html and "Tiny (registered, llama)" in html


def test_asking_the_planner_for_a_base_the_tenant_may_not_use_is_a_form_error_like_a_missing_one(client, barred):
    params = {"rank": 8, "targets": "attention-only", "dtype": "fp32", "kv_dtype": "fp32", "adapters": 10,
              "gpu_gb": 1, "context_len": 256}
    barred_answer = page(client, barred.alice, "adapters:capacity", model="base:secret-70b", **params)
    missing_answer = page(client, barred.alice, "adapters:capacity", model="base:no-such-base", **params)
    assert "Select a valid choice" in barred_answer and "Secret 70B" not in barred_answer
    assert unsalted(barred_answer.replace("secret-70b", "no-such-base")) == unsalted(missing_answer)  # no leak


def test_the_new_adapter_form_offers_only_usable_bases(client, barred):
    html = page(client, barred.charlie, "adapters:create")
    assert f'value="{BaseModel.objects.get(slug="secret-70b").pk}"' in html and "<select" in html

    html = page(client, barred.alice, "adapters:create")
    assert "Secret 70B" not in html and "Tiny" not in html
    assert 'id="no-usable-base"' in html and 'name="base"' not in html


def test_posting_a_base_the_tenant_may_not_use_creates_nothing(client, barred):
    client.force_login(barred.alice)
    secret = BaseModel.objects.get(slug="secret-70b")
    response = client.post(reverse("adapters:create"), {"name": "sneaky", "base": secret.pk})
    assert response.status_code == 400
    assert not Adapter.objects.filter(name="sneaky").exists()


def test_allowing_the_tenant_again_lists_the_bases_again(client, barred):
    barred.acme.may_use_base = True
    barred.acme.save()
    html = page(client, barred.alice, "adapters:capacity")
    assert "Secret 70B (registered, llama)" in html and "Tiny (registered, llama)" in html
    client.post(reverse("adapters:create"), {"name": "allowed", "base": BaseModel.objects.get(slug="secret-70b").pk})
    assert Adapter.objects.get(tenant=barred.acme, name="allowed").base.slug == "secret-70b"


def test_every_listing_of_a_base_names_its_family(client, world):
    """Which adapters fit a base depends on its family (a Phi-3's name qkv_proj, a Qwen3's q_proj is 4096 -> 4096 at
    head_dim 128): the planner's choices and its plan, the new-adapter form, the adapter list and page all say it."""
    from adapters.capacity import preset_manifest
    from adapters.services import create_adapter

    qwen = BaseModel.objects.create(slug="qwen3-8b", display_name="Qwen3 8B", sha256="2" * 64, architecture="qwen3",
                                    shape_manifest=preset_manifest("qwen3-8b"), queue_name="base.qwen3-8b")
    adapter = create_adapter(world.acme, "qwen-bot", qwen, created_by=world.alice)
    html = page(client, world.alice, "adapters:capacity", model="base:qwen3-8b", rank=8, targets="attention-only",
                dtype="bf16", kv_dtype="bf16", adapters=10, gpu_gb=80, context_len=4096)
    assert ">Qwen3 8B (registered, qwen3)</option>" in html and ">Tiny (registered, llama)</option>" in html
    assert '<h2>Qwen3 8B <span class="muted" id="plan-family">(qwen3)</span>, rank 8' in html
    assert "<dt>Model family (model_type)</dt><dd>qwen3</dd>" in html
    preset = page(client, world.alice, "adapters:capacity", model="preset:llama-3-8b", rank=8,
                  targets="attention-only", dtype="bf16", kv_dtype="bf16", adapters=10, gpu_gb=80, context_len=4096)
    assert "<dt>Model family (model_type)</dt><dd>llama</dd>" in preset  # a preset's family too

    html = page(client, world.alice, "adapters:create")
    assert f'<option value="{qwen.pk}">Qwen3 8B (qwen3)</option>' in html
    html = page(client, world.alice, "adapters:list")
    assert 'Qwen3 8B <span class="muted small base-family">qwen3</span>' in html
    assert 'Tiny <span class="muted small base-family">llama</span>' in html  # support-bot
    detail = client.get(reverse("adapters:detail", args=[adapter.pk])).content.decode()
    assert 'on Qwen3 8B <span class="base-family">(qwen3)</span>' in detail
