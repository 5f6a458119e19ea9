"""Members and invitations through the dashboard, with alice (owner of acme), bob (viewer in acme) and
charlie (owner of globex).

Nobody joins a tenant without accepting from their own session; the inviter gets the same answer whether
or not an account has the typed name; the members page shows no e-mail of a non-member; a fresh login
lands in the tenant last used; members can leave, the last owner cannot; charlie finds none of acme's
invitations (404).
"""
from __future__ import annotations

import datetime as dt
import re

import pytest
from django.contrib.auth import get_user_model
from django.contrib.messages import get_messages
from django.core import mail
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.urls import reverse

from tenants.models import Invitation, Membership, Role
from tenants.services import do_invite


def _as(user) -> Client:
    client = Client()
    client.force_login(user)
    return client


@pytest.fixture
def as_alice(world):
    return _as(world.alice)


@pytest.fixture
def as_charlie(world):
    return _as(world.charlie)


def _invite(client, name: str, role: str = "member"):
    return client.post(reverse("tenants:members"), {"username": name, "role": role})


def _messages(response) -> list[str]:
    return [str(m) for m in get_messages(response.wsgi_request)]


def _link(token: str) -> str:
    return reverse("tenants:invitation_link", args=[token])


# --- invite, accept, decline, withdraw -------------------------------------------------------


def test_it_invites_and_the_invitee_accepts_with_the_invited_role(as_alice, as_charlie, world):
    """Charlie sees alice's invitation on his Invitations page, accepts it, and is then an admin of acme
    working in acme."""
    response = _invite(as_alice, "charlie", "admin")
    assert response.status_code == 302
    assert not Membership.objects.filter(tenant=world.acme, user=world.charlie).exists()
    page = as_charlie.get(reverse("tenants:invitations")).content.decode()
    invitation = Invitation.objects.get(tenant=world.acme, invited_as="charlie")
    assert "Acme" in page and reverse("tenants:accept_invitation", args=[invitation.pk]) in page
    response = as_charlie.post(reverse("tenants:accept_invitation", args=[invitation.pk]), follow=True)
    assert Membership.objects.get(tenant=world.acme, user=world.charlie).role == Role.ADMIN
    assert "You joined Acme as admin." in response.content.decode()
    assert response.wsgi_request.tenant == world.acme
    assert b"No pending invitations" in as_charlie.get(reverse("tenants:invitations")).content


def test_it_finds_an_invitation_by_the_accounts_email_in_any_case(as_alice, as_charlie, world):
    """An invitation typed as an e-mail reaches the account with that e-mail, whatever the letter case."""
    world.charlie.email = "charlie@globex.example"
    world.charlie.save()
    _invite(as_alice, "Charlie@Globex.Example", "viewer")
    invitation = Invitation.objects.get(tenant=world.acme)
    as_charlie.post(reverse("tenants:accept_invitation", args=[invitation.pk]))
    assert Membership.objects.get(tenant=world.acme, user=world.charlie).role == Role.VIEWER


def test_it_declines_and_nobody_joins(as_alice, as_charlie, world):
    """A declined invitation adds no membership, leaves the invitee's list and the owner's pending list."""
    _invite(as_alice, "charlie")
    invitation = Invitation.objects.get(tenant=world.acme)
    response = as_charlie.post(reverse("tenants:decline_invitation", args=[invitation.pk]), follow=True)
    assert "You declined the invitation to Acme." in response.content.decode()
    assert not Membership.objects.filter(tenant=world.acme, user=world.charlie).exists()
    as_charlie.post(reverse("tenants:accept_invitation", args=[invitation.pk]))
    assert not Membership.objects.filter(tenant=world.acme, user=world.charlie).exists()
    members_page = as_alice.get(reverse("tenants:members")).content.decode()
    assert reverse("tenants:revoke_invitation", args=[invitation.pk]) not in members_page


def test_it_withdraws_a_pending_invitation(as_alice, as_charlie, world):
    """Alice withdraws her invitation: charlie can no longer accept it, by id or by link, and is told why."""
    invitation, token = do_invite(world.acme, "charlie", Role.MEMBER, actor=world.alice)
    response = as_alice.post(reverse("tenants:revoke_invitation", args=[invitation.pk]), follow=True)
    assert "is withdrawn" in response.content.decode()
    response = as_charlie.post(reverse("tenants:accept_invitation", args=[invitation.pk]), follow=True)
    assert "was withdrawn" in response.content.decode()
    assert as_charlie.get(_link(token)).status_code == 410
    as_charlie.post(_link(token), {"answer": "accept"})
    assert not Membership.objects.filter(tenant=world.acme, user=world.charlie).exists()


def test_it_accepts_through_the_emailed_link(as_alice, as_charlie, world):
    """An invitation typed as an e-mail address is mailed with a link; its GET only shows the invitation,
    the POST accepts it."""
    world.charlie.email = "charlie@globex.example"
    world.charlie.save()
    _invite(as_alice, "charlie@globex.example", "viewer")
    assert len(mail.outbox) == 1 and mail.outbox[0].to == ["charlie@globex.example"]
    path = re.search(r"http://testserver(/invitations/link/[^/\s]+/)", mail.outbox[0].body).group(1)
    page = as_charlie.get(path)
    assert page.status_code == 200 and b"Accept" in page.content and page["Cache-Control"] == "no-store"
    assert not Membership.objects.filter(tenant=world.acme, user=world.charlie).exists()
    as_charlie.post(path, {"answer": "accept"})
    assert Membership.objects.get(tenant=world.acme, user=world.charlie).role == Role.VIEWER


def test_it_refuses_an_expired_token_with_a_clear_message(as_charlie, world):
    """An expired link answers 410 with the expiry date, and accepting it adds nobody."""
    invitation, token = do_invite(world.acme, "charlie", Role.MEMBER, actor=world.alice)
    Invitation.objects.filter(pk=invitation.pk).update(
        created_at=invitation.created_at - dt.timedelta(days=8), expires_at=invitation.created_at - dt.timedelta(days=1))
    page = as_charlie.get(_link(token))
    assert page.status_code == 410 and b"expired on" in page.content
    response = as_charlie.post(_link(token), {"answer": "accept"}, follow=True)
    assert "expired on" in response.content.decode()
    assert not Membership.objects.filter(tenant=world.acme, user=world.charlie).exists()


def test_it_refuses_a_used_token(as_charlie, world):
    """A link works once: after it was accepted, it answers 410 "already been used", even after leaving."""
    invitation, token = do_invite(world.acme, "charlie", Role.ADMIN, actor=world.alice)
    as_charlie.post(_link(token), {"answer": "accept"})
    assert Membership.objects.get(tenant=world.acme, user=world.charlie).role == Role.ADMIN
    Membership.objects.filter(tenant=world.acme, user=world.charlie).delete()
    page = as_charlie.get(_link(token))
    assert page.status_code == 410 and b"already been used" in page.content
    as_charlie.post(_link(token), {"answer": "accept"})
    assert not Membership.objects.filter(tenant=world.acme, user=world.charlie).exists()


def test_a_third_user_cannot_accept_someone_elses_invitation(world):
    """Bob holds charlie's invitation id and link: every way in is a 404, and nothing changes."""
    invitation, token = do_invite(world.globex, "charlie-friend", Role.OWNER, actor=world.charlie)
    bob = _as(world.bob)
    for method, url, data in [
        ("post", reverse("tenants:accept_invitation", args=[invitation.pk]), {}),
        ("post", reverse("tenants:decline_invitation", args=[invitation.pk]), {}),
        ("get", _link(token), None),
        ("post", _link(token), {"answer": "accept"}),
    ]:
        assert getattr(bob, method)(url, data).status_code == 404, (method, url)
    assert not Membership.objects.filter(tenant=world.globex, user=world.bob).exists()
    assert Invitation.objects.get(pk=invitation.pk).is_open
    assert b"Globex" not in bob.get(reverse("tenants:invitations")).content


def test_a_forged_token_is_a_404(as_charlie, world):
    assert as_charlie.get(_link("not-a-token")).status_code == 404


# --- enumeration ---------------------------------------------------------------------------


def test_it_answers_the_same_for_existing_and_missing_accounts(world):
    """Inviting charlie (an account) and mallory (none) gives byte-identical responses and the same
    message, after the same number of queries; neither joins."""
    answers = []
    for name in ("charlie", "mallory"):
        client = _as(world.alice)
        with CaptureQueriesContext(connection) as queries:
            response = _invite(client, name, "viewer")
        answers.append((response.status_code, response["Location"], response.content, _messages(response), len(queries)))
    assert answers[0] == answers[1]
    assert answers[0][:4] == (302, reverse("tenants:members"), b"", [
        "If an account with that username or e-mail exists, it has been invited to Acme as viewer. "
        "Nobody joins until they accept."])
    assert Membership.objects.for_tenant(world.acme).count() == 2


def test_a_superuser_invited_does_not_become_a_member_without_accepting(as_alice, world):
    """Inviting a superuser is an invitation like any other: root is not in acme until root accepts."""
    root = get_user_model().objects.create_superuser("root", "root@example.com", "root-password-1")
    existing = _invite(as_alice, "root", "owner")
    missing = _invite(as_alice, "nobody-here", "owner")
    assert (existing.status_code, existing.content) == (missing.status_code, missing.content)
    assert not Membership.objects.filter(user=root).exists()
    client = _as(root)
    assert client.get(reverse("adapters:list")).status_code == 403  # no tenant yet; the invitation is listed
    assert b"Acme" in client.get(reverse("adapters:list")).content
    invitation = Invitation.objects.get(invited_as="root")
    client.post(reverse("tenants:decline_invitation", args=[invitation.pk]))
    assert not Membership.objects.filter(user=root).exists()


def test_the_members_page_never_shows_a_non_members_email(as_alice, world):
    """Invited by username, charlie's e-mail appears nowhere on acme's members page (nor does the
    superuser's); members' own addresses and what alice typed do."""
    world.charlie.email = "charlie@globex.example"
    world.charlie.save()
    world.bob.email = "bob@acme.example"
    world.bob.save()
    get_user_model().objects.create_superuser("root", "root@example.com", "root-password-1")
    _invite(as_alice, "charlie")
    _invite(as_alice, "root")
    for viewer in (as_alice, _as(world.bob)):
        page = viewer.get(reverse("tenants:members")).content.decode()
        assert "charlie@globex.example" not in page and "root@example.com" not in page
        assert "bob@acme.example" in page
    assert "charlie" in as_alice.get(reverse("tenants:members")).content.decode()  # the pending invitation, as typed


def test_only_owners_and_admins_see_pending_invitations(as_alice, world):
    """Bob (viewer) sees the members, not what alice typed into invitations."""
    _invite(as_alice, "someone@elsewhere.example")
    assert b"someone@elsewhere.example" in as_alice.get(reverse("tenants:members")).content
    assert b"someone@elsewhere.example" not in _as(world.bob).get(reverse("tenants:members")).content


# --- roles -----------------------------------------------------------------------------------


def test_bob_cannot_invite_withdraw_or_change_roles(as_alice, world):
    """A viewer's attempts are 403 naming his role, and change nothing."""
    invitation, _ = do_invite(world.acme, "dave", Role.MEMBER, actor=world.alice)
    bob = _as(world.bob)
    alice_membership = Membership.objects.get(tenant=world.acme, user=world.alice)
    for url, data in [
        (reverse("tenants:members"), {"username": "eve", "role": "owner"}),
        (reverse("tenants:revoke_invitation", args=[invitation.pk]), {}),
        (reverse("tenants:change_role", args=[alice_membership.pk]), {"role": "viewer"}),
    ]:
        response = bob.post(url, data)
        assert response.status_code == 403 and b"viewer" in response.content, url
    assert list(Invitation.objects.for_tenant(world.acme).open().values_list("invited_as", flat=True)) == ["dave"]
    assert Membership.objects.get(pk=alice_membership.pk).role == Role.OWNER


def test_an_admin_cannot_invite_or_make_an_owner(world):
    """Only an owner makes owners: an admin's invitation as owner is refused, and so is a promotion."""
    Membership.objects.filter(tenant=world.acme, user=world.bob).update(role=Role.ADMIN)
    bob = _as(world.bob)
    assert _invite(bob, "charlie", "owner").status_code == 400
    assert not Invitation.objects.exists()
    assert _invite(bob, "charlie", "admin").status_code == 302
    bob_membership = Membership.objects.get(tenant=world.acme, user=world.bob)
    bob.post(reverse("tenants:change_role", args=[bob_membership.pk]), {"role": "owner"})
    assert Membership.objects.get(pk=bob_membership.pk).role == Role.ADMIN


def test_inviting_a_member_says_they_are_already_in(as_alice, world):
    """A member's name (shown on the page already) gets a plain answer instead of an invitation."""
    response = _invite(as_alice, "bob", "admin")
    assert response.status_code == 400 and b"already a member of Acme" in response.content
    assert not Invitation.objects.exists()


# --- landing tenant after login ---------------------------------------------------------------


def _login(username: str, password: str) -> Client:
    client = Client()
    assert client.post(reverse("tenants:login"), {"username": username, "password": password}).status_code == 302
    return client


def test_a_fresh_login_lands_in_the_last_used_tenant(world):
    """Charlie is in acme and globex; he switches to acme, logs out, and a fresh login lands in acme — then
    he switches to globex, and the next fresh login lands in globex."""
    invitation, _ = do_invite(world.acme, "charlie", Role.MEMBER, actor=world.alice)
    _as(world.charlie).post(reverse("tenants:accept_invitation", args=[invitation.pk]))
    client = _login("charlie", "charlie-password-1")
    assert client.get(reverse("adapters:list")).wsgi_request.tenant == world.acme  # joined last
    client.post(reverse("tenants:switch"), {"tenant": "globex"})
    client.post(reverse("tenants:logout"))
    client = _login("charlie", "charlie-password-1")
    assert client.get(reverse("adapters:list")).wsgi_request.tenant == world.globex


def test_a_login_without_a_chosen_tenant_lands_in_the_first_by_name_not_by_who_added_them(world):
    """With no tenant ever chosen, the first by name is used (Acme < Zeta, although zeta's slug sorts first)."""
    from tenants.services import add_member, create_tenant

    zeta = create_tenant("aaa-zeta", "Zeta", owner=world.alice)
    add_member(zeta, world.charlie, Role.VIEWER)
    add_member(world.acme, world.charlie, Role.VIEWER)
    client = _login("charlie", "charlie-password-1")
    assert client.get(reverse("adapters:list")).wsgi_request.tenant == world.acme


# --- leaving -----------------------------------------------------------------------------------


def test_a_member_can_leave(world):
    """Bob leaves acme with the Leave button: he is no longer a member and is told so."""
    bob = _as(world.bob)
    assert reverse("tenants:leave").encode() in bob.get(reverse("tenants:members")).content
    response = bob.post(reverse("tenants:leave"), follow=True)
    assert "You left Acme." in response.content.decode()
    assert not Membership.objects.filter(tenant=world.acme, user=world.bob).exists()
    assert response.status_code == 403 and b"not in any tenant" in response.content


def test_the_last_owner_cannot_leave(as_alice, world):
    """Alice, acme's only owner, is refused with a sentence; once bob is owner too, she may leave."""
    response = as_alice.post(reverse("tenants:leave"), follow=True)
    assert "a tenant needs at least one owner" in response.content.decode()
    assert Membership.objects.filter(tenant=world.acme, user=world.alice, role=Role.OWNER).exists()
    bob_membership = Membership.objects.get(tenant=world.acme, user=world.bob)
    as_alice.post(reverse("tenants:change_role", args=[bob_membership.pk]), {"role": "owner"})
    as_alice.post(reverse("tenants:leave"))
    assert not Membership.objects.filter(tenant=world.acme, user=world.alice).exists()


def test_leaving_needs_a_post(as_alice, world):
    assert as_alice.get(reverse("tenants:leave")).status_code == 405


# --- isolation -------------------------------------------------------------------------------


def test_charlie_cannot_see_or_act_on_acme_invitations(as_alice, as_charlie, world):
    """Charlie (owner of globex) gets 404 withdrawing acme's invitation and never sees it listed."""
    invitation, _ = do_invite(world.acme, "dave@acme.example", Role.MEMBER, actor=world.alice)
    assert as_charlie.post(reverse("tenants:revoke_invitation", args=[invitation.pk])).status_code == 404
    assert as_charlie.post(reverse("tenants:accept_invitation", args=[invitation.pk])).status_code == 404
    assert as_charlie.post(reverse("tenants:decline_invitation", args=[invitation.pk])).status_code == 404
    assert b"dave@acme.example" not in as_charlie.get(reverse("tenants:members")).content
    assert b"dave@acme.example" not in as_charlie.get(reverse("tenants:invitations")).content
    assert Invitation.objects.get(pk=invitation.pk).is_open
