"""The membership rules as services: owner-only actions, the last owner, leaving, and the landing tenant."""
from __future__ import annotations

import datetime as dt

import pytest
from django.utils import timezone

from tenants.context import landing_membership, memberships_of
from tenants.models import Membership, Role
from tenants.services import (
    LastOwner,
    NotAllowed,
    add_member,
    create_tenant,
    do_change_role,
    do_leave_tenant,
    do_remove_member,
)


def _membership(tenant, user) -> Membership:
    return Membership.objects.get(tenant=tenant, user=user)


def test_the_last_owner_cannot_be_demoted_removed_or_leave(world):
    """Alice is acme's only owner: every way of making acme ownerless raises LastOwner and changes nothing."""
    alice = _membership(world.acme, world.alice)
    with pytest.raises(LastOwner, match="at least one owner"):
        do_change_role(alice, Role.ADMIN, actor=world.alice)
    with pytest.raises(LastOwner):
        do_remove_member(alice, actor=world.alice)
    with pytest.raises(LastOwner, match="last owner of Acme"):
        do_leave_tenant(world.acme, world.alice)
    assert _membership(world.acme, world.alice).role == Role.OWNER


def test_with_a_second_owner_the_first_may_step_down_or_leave(world):
    do_change_role(_membership(world.acme, world.bob), Role.OWNER, actor=world.alice)
    do_change_role(_membership(world.acme, world.alice), Role.ADMIN, actor=world.alice)
    do_leave_tenant(world.acme, world.alice)
    assert list(Membership.objects.for_tenant(world.acme).values_list("user__username", "role")) == [("bob", "owner")]


def test_an_admin_cannot_touch_owners_or_make_one(world):
    """Bob as admin: promoting to owner, demoting or removing alice (owner) are NotAllowed."""
    Membership.objects.filter(tenant=world.acme, user=world.bob).update(role=Role.ADMIN)
    bob, alice = _membership(world.acme, world.bob), _membership(world.acme, world.alice)
    with pytest.raises(NotAllowed):
        do_change_role(bob, Role.OWNER, actor=world.bob)
    with pytest.raises(NotAllowed):
        do_change_role(alice, Role.VIEWER, actor=world.bob)
    with pytest.raises(NotAllowed):
        do_remove_member(alice, actor=world.bob)
    assert _membership(world.acme, world.alice).role == Role.OWNER


def test_a_viewer_or_outsider_cannot_change_or_remove(world):
    bob = _membership(world.acme, world.bob)
    for actor in (world.bob, world.charlie):
        with pytest.raises(NotAllowed):
            do_change_role(bob, Role.ADMIN, actor=actor)
        with pytest.raises(NotAllowed):
            do_remove_member(bob, actor=actor)
    assert _membership(world.acme, world.bob).role == Role.VIEWER


def test_a_member_of_any_role_can_leave(world):
    do_leave_tenant(world.acme, world.bob)
    assert not Membership.objects.filter(tenant=world.acme, user=world.bob).exists()
    with pytest.raises(Membership.DoesNotExist):
        do_leave_tenant(world.acme, world.bob)


def test_the_landing_tenant_is_the_last_used_else_the_first_by_name(world):
    """Without any choice recorded: first by name (Acme before Zeta, whatever the slugs); then the last used."""
    zeta = create_tenant("a-zeta", "Zeta", owner=world.alice)
    assert landing_membership(memberships_of(world.alice)).tenant == world.acme
    now = timezone.now()
    Membership.objects.filter(tenant=zeta, user=world.alice).update(last_used_at=now - dt.timedelta(days=1))
    assert landing_membership(memberships_of(world.alice)).tenant == zeta
    Membership.objects.filter(tenant=world.acme, user=world.alice).update(last_used_at=now)
    assert landing_membership(memberships_of(world.alice)).tenant == world.acme
    assert landing_membership([]) is None


def test_add_member_is_direct_for_trusted_callers(world):
    """add_member (first owners, commands, the demo) still makes a membership without an invitation."""
    add_member(world.globex, world.bob, Role.VIEWER)
    assert _membership(world.globex, world.bob).role == Role.VIEWER


def test_two_owners_leaving_at_once_leave_one_owner(postgres, transactional_db, world):
    """Alice and bob, acme's two owners, leave at the same moment: the tenant lock makes the second see
    one owner left, so exactly one leaves and acme keeps an owner (PostgreSQL: real row locks)."""
    import threading

    from django.db import connection

    Membership.objects.filter(tenant=world.acme, user=world.bob).update(role=Role.OWNER)
    barrier, outcomes = threading.Barrier(2), []

    def leave(user):
        try:
            barrier.wait()
            do_leave_tenant(world.acme, user)
            outcomes.append("left")
        except LastOwner:
            outcomes.append("refused")
        finally:
            connection.close()

    threads = [threading.Thread(target=leave, args=(user,)) for user in (world.alice, world.bob)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert sorted(outcomes) == ["left", "refused"]
    assert Membership.objects.for_tenant(world.acme).filter(role=Role.OWNER).count() == 1
