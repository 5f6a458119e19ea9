"""The current tenant of a dashboard request.

A user may belong to several tenants; the one they are looking at is a tenant slug kept in the
session and re-validated against their Memberships on every request, so a stale or forged slug can
never widen access. A session without a (valid) tenant — a fresh login — lands in the tenant the
user last chose (``Membership.last_used_at``, set by switching or joining), or, if they never chose
one, the first by name. Which tenants someone else made them a member of never decides it.

`tenant_view` is the one decorator every tenant-facing dashboard view wears. It sets
``request.tenant``, ``request.membership`` and ``request.memberships`` (for the switcher) and enforces
the role: viewers read, members write (upload, activate), admins and owners manage (keys, members).
A role refusal is a 403 with a sentence naming the role — it is the user's own tenant, so there is
nothing to hide. Objects of *other* tenants are never reached: views look them up through
``for_tenant(request.tenant)`` and get a 404.
"""
from __future__ import annotations

from collections.abc import Callable
from functools import wraps

from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied
from django.http import HttpRequest, HttpResponse
from django.shortcuts import render

from .models import Invitation, Membership, Tenant
from .services import note_tenant_used

SESSION_KEY = "lorafleet_tenant"


def memberships_of(user) -> list[Membership]:
    return list(Membership.objects.filter(user=user).select_related("tenant").order_by("tenant__name", "tenant__slug"))


def landing_membership(memberships: list[Membership]) -> Membership | None:
    """The membership a session without a tenant starts in: the last used one, else the first by name."""
    used = [m for m in memberships if m.last_used_at is not None]
    if used:
        return max(used, key=lambda m: m.last_used_at)
    return memberships[0] if memberships else None


def current_membership(request: HttpRequest, memberships: list[Membership] | None = None) -> Membership | None:
    """The membership for the session's tenant, or the landing one; None when the user has none."""
    if memberships is None:
        memberships = memberships_of(request.user)
    wanted = request.session.get(SESSION_KEY)
    for membership in memberships:
        if membership.tenant.slug == wanted:
            return membership
    membership = landing_membership(memberships)
    if membership is not None:
        request.session[SESSION_KEY] = membership.tenant.slug  # stays put even if last_used_at moves elsewhere
    return membership


def switch_tenant(request: HttpRequest, slug: str) -> Tenant | None:
    """Make `slug` the current tenant — and the one their next login lands in — if the user is a member
    of it; return it, or None (unchanged)."""
    membership = Membership.objects.filter(user=request.user, tenant__slug=slug).select_related("tenant").first()
    if membership is None:
        return None
    request.session[SESSION_KEY] = membership.tenant.slug
    note_tenant_used(membership)
    return membership.tenant


def tenant_view(view: Callable | None = None, *, write: bool = False, manage: bool = False):
    """Decorate a view so it runs for a logged-in member of the current tenant with enough role.

    Usage: ``@tenant_view`` (any member), ``@tenant_view(write=True)``, ``@tenant_view(manage=True)``.
    """

    def decorator(func: Callable) -> Callable:
        @login_required
        @wraps(func)
        def wrapped(request: HttpRequest, *args, **kwargs) -> HttpResponse:
            memberships = memberships_of(request.user)
            membership = current_membership(request, memberships)
            if membership is None:
                pending = Invitation.objects.addressed_to(request.user).pending().select_related("tenant", "invited_by")
                return render(request, "tenants/no_tenant.html", {"invitations": pending}, status=403)
            request.memberships = memberships
            request.membership = membership
            request.tenant = membership.tenant
            if manage and not membership.can_manage:
                raise PermissionDenied(
                    f"Your role in {membership.tenant.name} is {membership.get_role_display().lower()}; "
                    "only owners and admins can manage API keys and members."
                )
            if write and not membership.can_write:
                raise PermissionDenied(
                    f"Your role in {membership.tenant.name} is {membership.get_role_display().lower()}, "
                    "which is read-only; ask an owner or admin to make you a member to upload or change versions."
                )
            return func(request, *args, **kwargs)

        return wrapped

    return decorator(view) if view is not None else decorator
