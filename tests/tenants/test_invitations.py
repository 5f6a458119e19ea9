"""Invitations as services (tenants/services.py, tenants/invitations.py): what is stored, who can answer,
when a token stops working, and that inviting reads nothing about accounts."""
from __future__ import annotations

import datetime as dt
import re

import pytest
from django.contrib.auth import get_user_model
from django.db import IntegrityError, connection, transaction
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from tenants.invitations import hash_token, invitation_for_invitee
from tenants.models import INVITATION_LIFETIME, Invitation, Membership, Role
from tenants.services import (
    AlreadyMember,
    InvitationUnusable,
    NotAllowed,
    do_accept_invitation,
    do_decline_invitation,
    do_invite,
    do_revoke_invitation,
)


def test_it_stores_the_token_only_as_a_sha256(world):
    """The clear token appears in no column; its SHA-256 does, and finds the invitation for its invitee."""
    invitation, token = do_invite(world.acme, "charlie", Role.MEMBER, actor=world.alice)
    stored = Invitation.objects.filter(pk=invitation.pk).values().get()
    assert token not in " ".join(str(v) for v in stored.values())
    assert stored["token_hash"] == hash_token(token) and len(token) >= 43  # 32 random bytes
    assert invitation_for_invitee(world.charlie, token=token).pk == invitation.pk
    assert stored["expires_at"] - stored["created_at"] == INVITATION_LIFETIME


def test_it_adds_nobody_until_accepted(world):
    """do_invite creates an invitation and no membership; do_accept_invitation creates the membership
    with the invited role and makes acme charlie's last used tenant."""
    invitation, _ = do_invite(world.acme, "charlie", Role.ADMIN, actor=world.alice)
    assert not Membership.objects.filter(tenant=world.acme, user=world.charlie).exists()
    membership, joined = do_accept_invitation(invitation, world.charlie)
    assert joined and membership.role == Role.ADMIN and membership.last_used_at is not None
    invitation.refresh_from_db()
    assert invitation.accepted_by == world.charlie and invitation.accepted_at is not None


def test_it_does_the_same_database_work_whether_or_not_the_account_exists(world):
    """do_invite runs the same statements for an account (charlie) and a name without one (mallory),
    differing only in the name, the token hash, clocks and savepoint names; accounts are read only as
    members of the tenant."""
    statements = []
    for name in ("charlie", "mallory"):
        with CaptureQueriesContext(connection) as queries:
            invitation, _ = do_invite(world.acme, name, Role.MEMBER, actor=world.alice)
        statements.append([
            re.sub(r"'[^']*'|\"s\d+_x\d+\"", "?", q["sql"].replace(invitation.token_hash, "HASH").replace(name, "NAME"))
            for q in queries
        ])
    assert statements[0] == statements[1]
    assert all("auth_user" not in sql or "tenants_membership" in sql for sql in statements[0])


def test_a_new_invitation_for_the_same_name_replaces_the_open_one(world):
    """Inviting "Charlie" again withdraws the earlier invitation (its link dies) and keeps the new role."""
    first, first_token = do_invite(world.acme, "charlie", Role.VIEWER, actor=world.alice)
    second, _ = do_invite(world.acme, "Charlie", Role.ADMIN, actor=world.alice)
    first.refresh_from_db()
    assert first.revoked_at is not None
    assert list(Invitation.objects.for_tenant(world.acme).open()) == [second]
    with pytest.raises(InvitationUnusable, match="withdrawn or replaced"):
        do_accept_invitation(invitation_for_invitee(world.charlie, token=first_token), world.charlie)


def test_only_the_addressee_can_answer(world):
    """Bob cannot find, accept or decline an invitation addressed to charlie: DoesNotExist, as if missing."""
    invitation, token = do_invite(world.acme, "charlie", Role.OWNER, actor=world.alice)
    with pytest.raises(Invitation.DoesNotExist):
        invitation_for_invitee(world.bob, token=token)
    with pytest.raises(Invitation.DoesNotExist):
        do_accept_invitation(invitation, world.bob)
    with pytest.raises(Invitation.DoesNotExist):
        do_decline_invitation(invitation, world.bob)
    assert Membership.objects.get(tenant=world.acme, user=world.bob).role == Role.VIEWER


def test_usernames_match_exactly_and_emails_in_any_case(world):
    User = get_user_model()
    carl = User.objects.create_user("Charlie", email="carl@example.com")
    by_name, _ = do_invite(world.acme, "charlie", Role.MEMBER, actor=world.alice)
    by_email, _ = do_invite(world.acme, "CARL@example.COM", Role.MEMBER, actor=world.alice)
    assert list(Invitation.objects.addressed_to(world.charlie)) == [by_name]
    assert list(Invitation.objects.addressed_to(carl)) == [by_email]


@pytest.mark.parametrize("spend, message", [
    (lambda inv, user: do_accept_invitation(inv, user), "already been used"),
    (lambda inv, user: do_decline_invitation(inv, user), "was declined"),
    (lambda inv, user: do_revoke_invitation(inv, actor=inv.invited_by), "withdrawn"),
    (lambda inv, user: Invitation.objects.filter(pk=inv.pk).update(
        created_at=inv.created_at - dt.timedelta(days=30), expires_at=timezone.now() - dt.timedelta(seconds=1)), "expired on"),
])
def test_a_spent_invitation_is_refused_with_a_sentence(world, spend, message):
    """Used, declined, withdrawn or expired: accepting and declining raise InvitationUnusable saying which."""
    invitation, _ = do_invite(world.acme, "charlie", Role.MEMBER, actor=world.alice)
    spend(invitation, world.charlie)
    Membership.objects.filter(tenant=world.acme, user=world.charlie).delete()
    for answer in (do_accept_invitation, do_decline_invitation):
        with pytest.raises(InvitationUnusable, match=message):
            answer(invitation, world.charlie)
    assert not Membership.objects.filter(tenant=world.acme, user=world.charlie).exists()


def test_accepting_as_a_member_keeps_the_role(world):
    """An invitation never changes a role: bob (viewer) accepting an admin invitation stays viewer."""
    invitation = Invitation.objects.create(
        tenant=world.acme, invited_as="bob", role=Role.ADMIN, invited_by=world.alice, token_hash="0" * 64,
        expires_at=timezone.now() + INVITATION_LIFETIME)
    membership, joined = do_accept_invitation(invitation, world.bob)
    assert not joined and membership.role == Role.VIEWER


def test_inviting_a_member_is_refused(world):
    world.bob.email = "bob@acme.example"
    world.bob.save()
    for name in ("bob", "BOB@acme.example"):
        with pytest.raises(AlreadyMember):
            do_invite(world.acme, name, Role.ADMIN, actor=world.alice)


def test_only_managers_invite_and_withdraw_and_only_owners_invite_owners(world):
    """Bob (viewer) and charlie (not in acme) cannot invite or withdraw; an admin cannot invite an owner."""
    invitation, _ = do_invite(world.acme, "dave", Role.MEMBER, actor=world.alice)
    for actor in (world.bob, world.charlie):
        with pytest.raises(NotAllowed):
            do_invite(world.acme, "eve", Role.MEMBER, actor=actor)
        with pytest.raises(NotAllowed):
            do_revoke_invitation(invitation, actor=actor)
    Membership.objects.filter(tenant=world.acme, user=world.bob).update(role=Role.ADMIN)
    with pytest.raises(NotAllowed, match="Only an owner"):
        do_invite(world.acme, "eve", Role.OWNER, actor=world.bob)
    assert do_revoke_invitation(invitation, actor=world.bob) is True
    assert do_revoke_invitation(invitation, actor=world.bob) is False


def test_the_database_refuses_an_invitation_that_ends_twice(world):
    invitation, _ = do_invite(world.acme, "charlie", Role.MEMBER, actor=world.alice)
    do_accept_invitation(invitation, world.charlie)
    with pytest.raises(IntegrityError), transaction.atomic():
        Invitation.objects.filter(pk=invitation.pk).update(declined_at=timezone.now())


def test_the_database_allows_one_open_invitation_per_name_and_tenant(world):
    do_invite(world.acme, "mallory", Role.MEMBER, actor=world.alice)
    with pytest.raises(IntegrityError), transaction.atomic():
        Invitation.objects.create(tenant=world.acme, invited_as="MALLORY", role=Role.MEMBER, token_hash="1" * 64,
                                  expires_at=timezone.now() + INVITATION_LIFETIME)
    do_invite(world.globex, "mallory", Role.MEMBER, actor=world.charlie)  # another tenant: its own
