"""API key pages: list and create, revoke.

Thin on purpose: who may see and change a tenant's keys, and which adapter a key may be bound to, are
decided in gateway/services.py (a refusal is a 403 naming the role); another tenant's key is a 404.
"""
from __future__ import annotations

from django.contrib import messages
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import redirect, render

from gateway import services
from gateway.models import ApiKey
from tenants.context import tenant_view

from ..forms import ApiKeyCreateForm


@tenant_view
def keys(request: HttpRequest) -> HttpResponse:
    """List keys and create one. A new key's secret is rendered in this response only, never stored."""
    key_list = services.api_keys_for(request.tenant, actor=request.user)
    form = ApiKeyCreateForm(request.POST or None, tenant=request.tenant)
    created = secret = None
    if request.method == "POST" and form.is_valid():
        created, secret = services.issue_api_key(
            request.tenant,
            form.cleaned_data["name"],
            bound_adapter=form.cleaned_data["bound_adapter"],
            expires_at=form.cleaned_data["expires_at"],
            created_by=request.user,
        )
        form = ApiKeyCreateForm(tenant=request.tenant)
    response = render(
        request,
        "tenants/keys.html",
        {"form": form, "keys": key_list, "created": created, "secret": secret},
        status=400 if request.method == "POST" and created is None else 200,
    )
    if secret:
        response["Cache-Control"] = "no-store"  # the secret must not linger in a cache or the back button
    return response


@tenant_view
def revoke_key(request: HttpRequest, pk: int) -> HttpResponse:
    try:
        key = services.api_key_for(request.tenant, pk, actor=request.user)
    except ApiKey.DoesNotExist:
        raise Http404("No such key.") from None
    if request.method == "POST":
        services.revoke_api_key(key, actor=request.user)
        messages.success(request, f"Key {key.prefix}…{key.last4} is revoked; requests using it are refused from now on.")
        return redirect("tenants:keys")
    return render(request, "tenants/key_revoke.html", {"key": key})
