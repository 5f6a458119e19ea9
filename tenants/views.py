"""Dashboard pages of the tenants app: tenant switcher, API keys, members.

Thin on purpose: parse, call a service in tenants/services.py, render. Every lookup goes through
``for_tenant(request.tenant)``, so another tenant's key or membership is a 404.
"""
from __future__ import annotations

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied
from django.db import transaction
from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.utils.http import url_has_allowed_host_and_scheme
from django.views.decorators.http import require_POST

from . import services
from .context import switch_tenant, tenant_view
from .forms import ApiKeyCreateForm, MemberForm
from .models import ApiKey, Membership, Role


@tenant_view
def home(request: HttpRequest) -> HttpResponse:
    return redirect("adapters:list")


@login_required
@require_POST
def switch(request: HttpRequest) -> HttpResponse:
    tenant = switch_tenant(request, request.POST.get("tenant", ""))
    if tenant is None:
        messages.error(request, "You are not a member of that tenant.")
    else:
        messages.success(request, f"Now working in {tenant.name}.")
    target = request.POST.get("next") or "/"
    if not url_has_allowed_host_and_scheme(target, allowed_hosts={request.get_host()}, require_https=request.is_secure()):
        target = "/"
    # Object pages of the previous tenant would 404 in the new one; land on its list instead.
    return redirect("adapters:list" if target.startswith("/adapters/") else target)


# --- API keys --------------------------------------------------------------------------------


@tenant_view(manage=True)
def keys(request: HttpRequest) -> HttpResponse:
    """List keys and create one. A new key's secret is rendered in this response only, never stored."""
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
    key_list = ApiKey.objects.for_tenant(request.tenant).select_related("bound_adapter", "created_by")
    response = render(
        request,
        "tenants/keys.html",
        {"form": form, "keys": key_list, "created": created, "secret": secret},
        status=400 if request.method == "POST" and created is None else 200,
    )
    if secret:
        response["Cache-Control"] = "no-store"  # the secret must not linger in a cache or the back button
    return response


@tenant_view(manage=True)
def revoke_key(request: HttpRequest, pk: int) -> HttpResponse:
    key = get_object_or_404(ApiKey.objects.for_tenant(request.tenant), pk=pk)
    if request.method == "POST":
        services.revoke_api_key(key, actor=request.user)
        messages.success(request, f"Key {key.prefix}…{key.last4} is revoked; requests using it are refused from now on.")
        return redirect("tenants:keys")
    return render(request, "tenants/key_revoke.html", {"key": key})


# --- members ---------------------------------------------------------------------------------


def _owner_count(tenant) -> int:
    return Membership.objects.for_tenant(tenant).filter(role=Role.OWNER).count()


@tenant_view
def members(request: HttpRequest) -> HttpResponse:
    """Everyone may see who is in the tenant; owners and admins may add members or change roles."""
    form = None
    if request.membership.can_manage:
        form = MemberForm(request.POST or None, granter_role=request.membership.role)
    elif request.method == "POST":
        raise PermissionDenied(
            f"Your role in {request.tenant.name} is {request.membership.get_role_display().lower()}; "
            "only owners and admins can manage members."
        )
    if request.method == "POST" and form.is_valid():
        user, role = form.user, form.cleaned_data["role"]
        existing = Membership.objects.for_tenant(request.tenant).filter(user=user).first()
        if existing and existing.role == Role.OWNER and role != Role.OWNER and request.membership.role != Role.OWNER:
            form.add_error("role", "Only an owner can change an owner's role.")
        elif existing and existing.role == Role.OWNER and role != Role.OWNER and _owner_count(request.tenant) == 1:
            form.add_error("role", "A tenant needs at least one owner; make someone else owner first.")
        else:
            services.add_member(request.tenant, user, role)
            messages.success(request, f"{user.get_username()} is now {Role(role).label.lower()} of {request.tenant.name}.")
            return redirect("tenants:members")
    member_list = Membership.objects.for_tenant(request.tenant).select_related("user").order_by("user__username")
    status = 400 if request.method == "POST" else 200
    return render(request, "tenants/members.html", {"form": form, "members": member_list}, status=status)


@tenant_view(manage=True)
@require_POST
def remove_member(request: HttpRequest, pk: int) -> HttpResponse:
    with transaction.atomic():
        membership = get_object_or_404(Membership.objects.for_tenant(request.tenant).select_for_update(), pk=pk)
        if membership.role == Role.OWNER and request.membership.role != Role.OWNER:
            raise PermissionDenied("Only an owner can remove an owner.")
        if membership.role == Role.OWNER and _owner_count(request.tenant) == 1:
            messages.error(request, "A tenant needs at least one owner; make someone else owner first.")
            return redirect("tenants:members")
        membership.delete()
    messages.success(request, f"{membership.user.get_username()} no longer has access to {request.tenant.name}.")
    return redirect("tenants:members")
