"""Tenant pages: home, tenant switcher, members, invitations (as the inviter and as the invitee).

Thin on purpose: parse, call a verb in tenants/services.py (where the membership rules live), answer.
Every lookup of a tenant's object goes through ``for_tenant(request.tenant)``, so another tenant's
membership or invitation is a 404. An invitee reaches an invitation only through
``invitations.invitation_for_invitee`` (their own, by id or link token): anyone else's is a 404 too.
"""
from __future__ import annotations

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied
from django.http import Http404, HttpRequest, HttpResponse, HttpResponseBadRequest
from django.shortcuts import get_object_or_404, redirect, render
from django.urls import reverse
from django.utils.http import url_has_allowed_host_and_scheme
from django.views.decorators.http import require_POST

from tenants import services
from tenants.context import SESSION_KEY, switch_tenant, tenant_view
from tenants.invitations import invitation_for_invitee, send_invitation_email
from tenants.models import Invitation, Membership, Role

from ..forms import InviteForm, RoleForm


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


# --- members ---------------------------------------------------------------------------------

# The same sentence whether or not an account has the typed name: the inviter learns nothing about accounts.
INVITED = ("If an account with that username or e-mail exists, it has been invited to {tenant} as {role}. "
           "Nobody joins until they accept.")


@tenant_view
def members(request: HttpRequest) -> HttpResponse:
    """Everyone may see who is in the tenant; owners and admins also invite, see pending invitations,
    and change roles. E-mail addresses shown are members' own; an invitation shows only what was typed."""
    can_manage = request.membership.can_manage
    if request.method == "POST" and not can_manage:
        raise PermissionDenied(
            f"Your role in {request.tenant.name} is {request.membership.get_role_display().lower()}; "
            "only owners and admins can manage members."
        )
    form = InviteForm(request.POST or None, granter_role=request.membership.role) if can_manage else None
    if request.method == "POST" and form.is_valid():
        role = form.cleaned_data["role"]
        try:
            invitation, token = services.do_invite(request.tenant, form.cleaned_data["username"], role, actor=request.user)
        except services.AlreadyMember as refusal:
            form.add_error("username", str(refusal))
        else:
            send_invitation_email(invitation, request.build_absolute_uri(reverse("tenants:invitation_link", args=[token])))
            messages.success(request, INVITED.format(tenant=request.tenant.name, role=Role(role).label.lower()))
            return redirect("tenants:members")
    member_list = Membership.objects.for_tenant(request.tenant).select_related("user").order_by("user__username")
    pending = None
    if can_manage:
        pending = Invitation.objects.for_tenant(request.tenant).open().select_related("invited_by")
    context = {
        "form": form,
        "members": member_list,
        "invitations": pending,
        "role_choices": RoleForm(granter_role=request.membership.role).fields["role"].choices,
    }
    return render(request, "tenants/members.html", context, status=400 if request.method == "POST" else 200)


@tenant_view(manage=True)
@require_POST
def change_role(request: HttpRequest, pk: int) -> HttpResponse:
    membership = get_object_or_404(Membership.objects.for_tenant(request.tenant), pk=pk)
    form = RoleForm(request.POST, granter_role=request.membership.role)
    if not form.is_valid():
        messages.error(request, "Choose one of the roles offered.")
        return redirect("tenants:members")
    try:
        membership = services.do_change_role(membership, form.cleaned_data["role"], actor=request.user)
    except services.MembershipRefused as refusal:
        messages.error(request, str(refusal))
    else:
        role = membership.get_role_display().lower()
        messages.success(request, f"{membership.user.get_username()} is now {role} of {request.tenant.name}.")
    return redirect("tenants:members")


@tenant_view(manage=True)
@require_POST
def remove_member(request: HttpRequest, pk: int) -> HttpResponse:
    membership = get_object_or_404(Membership.objects.for_tenant(request.tenant), pk=pk)
    try:
        removed = services.do_remove_member(membership, actor=request.user)
    except services.MembershipRefused as refusal:
        messages.error(request, str(refusal))
    else:
        messages.success(request, f"{removed.user.get_username()} no longer has access to {request.tenant.name}.")
    return redirect("tenants:members")


@tenant_view
@require_POST
def leave(request: HttpRequest) -> HttpResponse:
    """The user leaves the current tenant (any role; not the last owner)."""
    try:
        services.do_leave_tenant(request.tenant, request.user)
    except services.MembershipRefused as refusal:
        messages.error(request, str(refusal))
        return redirect("tenants:members")
    request.session.pop(SESSION_KEY, None)
    messages.success(request, f"You left {request.tenant.name}.")
    return redirect("tenants:home")


@tenant_view(manage=True)
@require_POST
def revoke_invitation(request: HttpRequest, pk: int) -> HttpResponse:
    invitation = get_object_or_404(Invitation.objects.for_tenant(request.tenant), pk=pk)
    if services.do_revoke_invitation(invitation, actor=request.user):
        messages.success(request, f"The invitation for {invitation.invited_as} is withdrawn; its link no longer works.")
    else:
        messages.success(request, f"The invitation for {invitation.invited_as} was no longer pending.")
    return redirect("tenants:members")


# --- invitations, as the invitee -------------------------------------------------------------


def _own_invitation(request: HttpRequest, **lookup) -> Invitation:
    try:
        return invitation_for_invitee(request.user, **lookup)
    except Invitation.DoesNotExist:
        raise Http404("No such invitation.") from None


@login_required
def invitations(request: HttpRequest) -> HttpResponse:
    """The logged-in user's own pending invitations (found by their username and e-mail)."""
    pending = Invitation.objects.addressed_to(request.user).pending().select_related("tenant", "invited_by")
    return render(request, "tenants/invitations.html", {"invitations": pending})


@login_required
@require_POST
def accept_invitation(request: HttpRequest, pk: int) -> HttpResponse:
    return _answer(request, _own_invitation(request, pk=pk), accept=True)


@login_required
@require_POST
def decline_invitation(request: HttpRequest, pk: int) -> HttpResponse:
    return _answer(request, _own_invitation(request, pk=pk), accept=False)


@login_required
def invitation_link(request: HttpRequest, token: str) -> HttpResponse:
    """The e-mailed link. GET only shows the invitation (link scanners must not accept it); POST answers."""
    invitation = _own_invitation(request, token=token)
    if request.method == "POST":
        if request.POST.get("answer") not in ("accept", "decline"):
            return HttpResponseBadRequest("Answer accept or decline.")
        return _answer(request, invitation, accept=request.POST["answer"] == "accept")
    problem = services.invitation_problem(invitation)
    response = render(request, "tenants/invitation.html", {"invitation": invitation, "problem": problem, "token": token},
                      status=410 if problem else 200)
    response["Cache-Control"] = "no-store"
    response["Referrer-Policy"] = "no-referrer"  # the token is in this page's URL
    return response


def _answer(request: HttpRequest, invitation: Invitation, *, accept: bool) -> HttpResponse:
    try:
        if accept:
            membership, joined = services.do_accept_invitation(invitation, request.user)
        else:
            services.do_decline_invitation(invitation, request.user)
    except services.InvitationUnusable as refusal:
        messages.error(request, str(refusal))
        return redirect("tenants:invitations")
    tenant = invitation.tenant
    if not accept:
        messages.success(request, f"You declined the invitation to {tenant.name}.")
        return redirect("tenants:invitations")
    request.session[SESSION_KEY] = tenant.slug  # land in it now; do_accept_invitation made it the last used
    if joined:
        messages.success(request, f"You joined {tenant.name} as {membership.get_role_display().lower()}.")
    else:
        role = membership.get_role_display().lower()
        messages.success(request, f"You were already in {tenant.name}; your role ({role}) is unchanged.")
    return redirect("tenants:home")
