"""Verbs that change tenants, members and invitations (API keys: gateway/services.py).

The membership rules live here and nowhere else (views only parse and answer):

- Only owners and admins manage members and invitations; only an owner may make someone an owner or
  change or remove an owner.
- A tenant always keeps at least one owner: the last owner cannot be demoted, removed, or leave.
- Nobody becomes a member of a tenant because someone else asked: an owner or admin *invites*
  (``do_invite``) and the invitee accepts from their own session (``do_accept_invitation``).
  ``add_member`` is for trusted callers only (a tenant's first owner, management commands, the demo).
- ``do_invite`` reads nothing about accounts: the invitation is stored under the name as typed and
  reaches an account only when that account looks for it. The answer and the work done are the same
  whether or not such an account exists.

Every membership verb first locks the tenant row, so two concurrent requests cannot both remove
"one of two" owners, and re-reads the acting user's membership inside that lock.
Refusals: ``NotAllowed`` (a PermissionDenied: 403 with its sentence), ``LastOwner``,
``AlreadyMember`` and ``InvitationUnusable`` (a ``MembershipRefused``: shown to the user as a message).
"""
from __future__ import annotations

from django.core.exceptions import PermissionDenied
from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from .invitations import hash_token, new_token
from .models import INVITATION_LIFETIME, Invitation, Membership, Role, Tenant


class NotAllowed(PermissionDenied):
    """The acting user's role does not allow this; the message names why."""


class MembershipRefused(Exception):
    """A membership change the rules refuse; ``str()`` is the sentence to show."""


class LastOwner(MembershipRefused):
    pass


class AlreadyMember(MembershipRefused):
    pass


class InvitationUnusable(MembershipRefused):
    """Expired, already accepted, declined or withdrawn."""


@transaction.atomic
def create_tenant(slug: str, name: str = "", *, owner=None) -> Tenant:
    tenant = Tenant(slug=slug, name=name or slug)
    tenant.full_clean()
    tenant.save()
    if owner is not None:
        add_member(tenant, owner, Role.OWNER)
    return tenant


@transaction.atomic
def add_member(tenant: Tenant, user, role: str) -> Membership:
    """Make `user` a member with `role` directly. Trusted callers only — never on behalf of a request
    by someone else: the dashboard invites (``do_invite``) and the invitee accepts."""
    membership, _ = Membership.objects.update_or_create(tenant=tenant, user=user, defaults={"role": role})
    return membership


def _lock_tenant(tenant: Tenant) -> Tenant:
    return Tenant.objects.select_for_update().get(pk=tenant.pk)


def require_manager(tenant: Tenant, actor, *, what: str = "members") -> Membership:
    """The actor's membership of `tenant`; NotAllowed unless they are an owner or admin of it.

    The one rule for "who manages a tenant" (its members, invitations and API keys); `what` names the
    thing in the refusal's sentence.
    """
    membership = Membership.objects.for_tenant(tenant).filter(user=actor).first()
    if membership is None:
        raise NotAllowed(f"Only owners and admins of a tenant can manage its {what}.")
    if not membership.can_manage:
        raise NotAllowed(f"Your role in {tenant.name} is {membership.get_role_display().lower()}; "
                         f"only owners and admins can manage {what}.")
    return membership


def _manager(tenant: Tenant, actor) -> Membership:
    """The actor's membership, read inside the tenant lock; NotAllowed unless owner or admin."""
    return require_manager(tenant, actor)


def _owner_count(tenant: Tenant) -> int:
    return Membership.objects.for_tenant(tenant).filter(role=Role.OWNER).count()


def _last_owner_message(tenant: Tenant) -> str:
    return f"A tenant needs at least one owner; make someone else owner of {tenant.name} first."


# --- invitations -----------------------------------------------------------------------------


@transaction.atomic
def do_invite(tenant: Tenant, invited_as: str, role: str, *, actor) -> tuple[Invitation, str]:
    """Invite whoever has the username or e-mail `invited_as`; return the invitation and its link token.

    An open invitation for the same name is replaced (new role, new expiry, old link dead).
    """
    invited_as = invited_as.strip()
    if not invited_as:
        raise ValueError("Type a username or e-mail address.")
    if role not in Role.values:
        raise ValueError(f"Unknown role {role!r}.")
    tenant = _lock_tenant(tenant)
    granter = _manager(tenant, actor)
    if role == Role.OWNER and granter.role != Role.OWNER:
        raise NotAllowed("Only an owner can invite an owner.")
    # Only the tenant's own members are compared (their names are on the members page already);
    # accounts outside the tenant are never read here.
    members = Membership.objects.for_tenant(tenant).filter(Q(user__username=invited_as) | Q(user__email__iexact=invited_as))
    if members.exists():
        raise AlreadyMember(f"{invited_as} is already a member of {tenant.name}; change their role in the list instead.")
    now = timezone.now()
    Invitation.objects.for_tenant(tenant).open().filter(invited_as__iexact=invited_as).update(revoked_at=now)
    token = new_token()
    invitation = Invitation.objects.create(
        tenant=tenant, invited_as=invited_as, role=role, invited_by=actor, token_hash=hash_token(token),
        created_at=now, expires_at=now + INVITATION_LIFETIME,
    )
    return invitation, token


def invitation_problem(invitation: Invitation, now=None) -> str | None:
    """Why the invitee can no longer accept or decline this invitation, as a sentence; None if they can."""
    tenant_name = invitation.tenant.name
    if invitation.accepted_at is not None:
        return f"This invitation to {tenant_name} has already been used."
    if invitation.declined_at is not None:
        return f"This invitation to {tenant_name} was declined; ask an owner or admin for a new one."
    if invitation.revoked_at is not None:
        return f"This invitation to {tenant_name} was withdrawn or replaced by a newer one; ask an owner or admin for a new one."
    if invitation.is_expired(now):
        return (f"This invitation to {tenant_name} expired on {invitation.expires_at:%Y-%m-%d %H:%M} UTC; "
                "ask an owner or admin for a new one.")
    return None


def _open_for_invitee(invitation: Invitation, user) -> Invitation:
    """Re-read and lock the invitation as its invitee; InvitationUnusable if it cannot be used."""
    invitation = Invitation.objects.addressed_to(user).select_for_update().select_related("tenant").get(pk=invitation.pk)
    problem = invitation_problem(invitation)
    if problem:
        raise InvitationUnusable(problem)
    return invitation


@transaction.atomic
def do_accept_invitation(invitation: Invitation, user) -> tuple[Membership, bool]:
    """Join the tenant with the invited role; return (membership, joined).

    Someone already a member keeps their role (joined is False): an invitation never changes a role.
    The tenant becomes the user's last used one, so their next login lands there.
    Raises Invitation.DoesNotExist if it is not addressed to `user`, InvitationUnusable if it is spent.
    """
    _lock_tenant(invitation.tenant)
    invitation = _open_for_invitee(invitation, user)
    now = timezone.now()
    membership, joined = Membership.objects.get_or_create(
        tenant=invitation.tenant, user=user, defaults={"role": invitation.role, "last_used_at": now}
    )
    if not joined:
        membership.last_used_at = now
        membership.save(update_fields=["last_used_at"])
    invitation.accepted_at, invitation.accepted_by = now, user
    invitation.save(update_fields=["accepted_at", "accepted_by"])
    return membership, joined


@transaction.atomic
def do_decline_invitation(invitation: Invitation, user) -> Invitation:
    _lock_tenant(invitation.tenant)
    invitation = _open_for_invitee(invitation, user)
    invitation.declined_at = timezone.now()
    invitation.save(update_fields=["declined_at"])
    return invitation


@transaction.atomic
def do_revoke_invitation(invitation: Invitation, *, actor) -> bool:
    """Withdraw an open invitation (its link stops working); return False if it was no longer open."""
    tenant = _lock_tenant(invitation.tenant)
    _manager(tenant, actor)
    return bool(Invitation.objects.for_tenant(tenant).open().filter(pk=invitation.pk).update(revoked_at=timezone.now()))


# --- members ---------------------------------------------------------------------------------


@transaction.atomic
def do_change_role(membership: Membership, role: str, *, actor) -> Membership:
    if role not in Role.values:
        raise ValueError(f"Unknown role {role!r}.")
    tenant = _lock_tenant(membership.tenant)
    granter = _manager(tenant, actor)
    target = Membership.objects.for_tenant(tenant).select_related("user").get(pk=membership.pk)
    if target.role == role:
        return target
    if Role.OWNER in (role, target.role) and granter.role != Role.OWNER:
        raise NotAllowed("Only an owner can make someone an owner or change an owner's role.")
    if target.role == Role.OWNER and _owner_count(tenant) == 1:
        raise LastOwner(_last_owner_message(tenant))
    target.role = role
    target.save(update_fields=["role"])
    return target


@transaction.atomic
def do_remove_member(membership: Membership, *, actor) -> Membership:
    tenant = _lock_tenant(membership.tenant)
    remover = _manager(tenant, actor)
    target = Membership.objects.for_tenant(tenant).select_related("user").get(pk=membership.pk)
    if target.role == Role.OWNER and remover.role != Role.OWNER:
        raise NotAllowed("Only an owner can remove an owner.")
    if target.role == Role.OWNER and _owner_count(tenant) == 1:
        raise LastOwner(_last_owner_message(tenant))
    target.delete()
    return target


@transaction.atomic
def do_leave_tenant(tenant: Tenant, user) -> None:
    """The user leaves the tenant; any role may, except the last owner."""
    tenant = _lock_tenant(tenant)
    membership = Membership.objects.for_tenant(tenant).get(user=user)
    if membership.role == Role.OWNER and _owner_count(tenant) == 1:
        raise LastOwner(f"You are the last owner of {tenant.name}, and a tenant needs at least one owner; "
                        "make someone else owner before you leave.")
    membership.delete()


def note_tenant_used(membership: Membership) -> None:
    """Remember that the user chose this tenant; their next login lands in it."""
    membership.last_used_at = timezone.now()
    Membership.objects.filter(pk=membership.pk).update(last_used_at=membership.last_used_at)
