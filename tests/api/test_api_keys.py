"""API keys: format, checksum, hashing, expiry, revocation (DESIGN.md "API keys")."""
import datetime as dt
import math

import pytest
from django.utils import timezone

from gateway.keys import ALPHABET, ID_LEN, PREFIX, SECRET_LEN, KeyRejected, authenticate_api_key, parse_key
from gateway.models import ApiKey
from gateway.services import api_keys_for, issue_api_key, revoke_api_key


def test_key_has_prefix_entropy_and_checksum(world):
    raw = world.acme_secret
    assert raw.startswith(PREFIX)
    assert SECRET_LEN * math.log2(len(ALPHABET)) >= 128
    key_id, secret = parse_key(raw)
    assert len(key_id) == ID_LEN and len(secret) == SECRET_LEN


def test_secret_is_never_stored(world):
    key = ApiKey.objects.get(pk=world.acme_key.pk)
    _, secret = parse_key(world.acme_secret)
    stored = " ".join(str(getattr(key, f.attname)) for f in ApiKey._meta.fields)
    assert secret not in stored
    assert world.acme_secret not in stored
    assert key.last4 == world.acme_secret[-4:]


def test_it_authenticates_and_records_last_use(world):
    key = authenticate_api_key(world.acme_secret)
    assert key.pk == world.acme_key.pk and key.tenant == world.acme
    assert ApiKey.objects.get(pk=key.pk).last_used_at is not None


def test_mistyped_key_is_refused_without_a_query(world, django_assert_num_queries):
    raw = world.acme_secret
    flipped = raw[:25] + ("A" if raw[25] != "A" else "B") + raw[26:]
    with django_assert_num_queries(0):
        with pytest.raises(KeyRejected) as exc:
            authenticate_api_key(flipped)
    assert exc.value.reason == "bad_checksum"


@pytest.mark.parametrize("raw", ["", "Bearer", "sk-123", "lf_live_short_abc", "lf_live_" + "x" * 60])
def test_malformed_keys_are_refused(db, raw):
    with pytest.raises(KeyRejected) as exc:
        authenticate_api_key(raw)
    assert exc.value.reason == "malformed"


def test_unknown_key_with_valid_checksum_is_refused(world):
    from gateway.keys import generate_key

    forged, _, _ = generate_key()
    with pytest.raises(KeyRejected) as exc:
        authenticate_api_key(forged)
    assert exc.value.reason == "unknown"


def test_revoked_key_is_refused(world):
    revoke_api_key(world.acme_key)
    with pytest.raises(KeyRejected) as exc:
        authenticate_api_key(world.acme_secret)
    assert exc.value.reason == "revoked"


def test_expired_key_is_refused(world):
    key, raw = issue_api_key(world.acme, "short", expires_at=timezone.now() + dt.timedelta(seconds=30))
    ApiKey.objects.filter(pk=key.pk).update(expires_at=timezone.now() - dt.timedelta(seconds=1))
    with pytest.raises(KeyRejected) as exc:
        authenticate_api_key(raw)
    assert exc.value.reason == "expired"


def test_key_cannot_be_bound_to_another_tenants_adapter(world):
    from adapters.models import Adapter

    with pytest.raises(Adapter.DoesNotExist):
        issue_api_key(world.acme, "sneaky", bound_adapter=world.globex_adapter)
    assert not ApiKey.objects.filter(name="sneaky").exists()


def test_key_cannot_be_bound_to_a_deleted_adapter(world):
    from adapters.models import Adapter
    from adapters.services import soft_delete_adapter

    soft_delete_adapter(world.acme_adapter, actor=world.alice)
    with pytest.raises(Adapter.DoesNotExist):
        issue_api_key(world.acme, "late", bound_adapter=world.acme_adapter, created_by=world.alice)


def test_revoking_records_who_and_when_once(world):
    """The first revocation's time and actor stay; revoking again changes nothing."""
    revoke_api_key(world.acme_key, actor=world.alice)
    first = ApiKey.objects.get(pk=world.acme_key.pk)
    assert first.revoked_by == world.alice and first.revoked_at is not None
    revoke_api_key(world.acme_key, actor=world.alice)
    again = ApiKey.objects.get(pk=world.acme_key.pk)
    assert (again.revoked_at, again.revoked_by_id) == (first.revoked_at, world.alice.pk)


def test_only_owners_and_admins_issue_list_and_revoke_keys(world):
    """The rule lives in the service: a viewer (bob) and another tenant's owner (charlie) are refused."""
    from tenants.services import NotAllowed

    for user in (world.bob, world.charlie):
        with pytest.raises(NotAllowed):
            issue_api_key(world.acme, "nope", created_by=user)
        with pytest.raises(NotAllowed):
            revoke_api_key(world.acme_key, actor=user)
        with pytest.raises(NotAllowed):
            api_keys_for(world.acme, actor=user)
    assert ApiKey.objects.get(pk=world.acme_key.pk).revoked_at is None
    assert list(api_keys_for(world.acme, actor=world.alice)) == [world.acme_key]
