"""Every dashboard view with alice (owner of acme), bob (viewer in acme) and charlie (owner of globex).

Charlie must get 404 for every object of acme (existence is not leaked); bob may read but not upload,
activate, delete, or manage keys and members (403 with a sentence naming his role).
"""
from __future__ import annotations

import pytest
from django.urls import reverse

from adapters.models import Adapter, AdapterVersion, VersionPointerChange
from gateway.keys import authenticate_api_key
from gateway.models import ApiKey
from tenants.models import Membership, Role


def login(client, user):
    client.force_login(user)
    return client


@pytest.fixture
def as_alice(client, world):
    return login(client, world.alice)


@pytest.fixture
def as_bob(client, world):
    return login(client, world.bob)


@pytest.fixture
def as_charlie(client, world):
    return login(client, world.charlie)


def object_urls(w) -> list[tuple[str, str]]:
    """(method, url) for every view that takes an object of acme."""
    a, v1 = w.acme_adapter, w.acme_v1
    bob_membership = Membership.objects.get(tenant=w.acme, user=w.bob)
    return [
        ("get", reverse("adapters:detail", args=[a.pk])),
        ("get", reverse("adapters:upload", args=[a.pk])),
        ("post", reverse("adapters:upload", args=[a.pk])),
        ("get", reverse("adapters:activate", args=[a.pk, v1.number])),
        ("post", reverse("adapters:activate", args=[a.pk, v1.number])),
        ("get", reverse("adapters:delete", args=[a.pk])),
        ("post", reverse("adapters:delete", args=[a.pk])),
        ("get", reverse("tenants:revoke_key", args=[w.acme_key.pk])),
        ("post", reverse("tenants:revoke_key", args=[w.acme_key.pk])),
        ("post", reverse("tenants:remove_member", args=[bob_membership.pk])),
        ("post", reverse("tenants:change_role", args=[bob_membership.pk])),
    ]


# --- login, logout, switcher -----------------------------------------------------------------


def test_it_redirects_anonymous_users_to_login(client, world):
    response = client.get(reverse("adapters:list"))
    assert response.status_code == 302
    assert response["Location"].startswith("/login/?next=")


def test_it_logs_in_and_out(client, world):
    response = client.post("/login/", {"username": "alice", "password": "alice-password-1"}, follow=True)
    assert response.status_code == 200
    assert b"support-bot" in response.content and b"Acme" in response.content
    client.post("/logout/")
    assert client.get(reverse("adapters:list")).status_code == 302


def test_it_refuses_a_wrong_password(client, world):
    response = client.post("/login/", {"username": "alice", "password": "nope"})
    assert response.status_code == 200
    assert b"correct username and password" in response.content
    assert "_auth_user_id" not in client.session


def test_the_switcher_changes_tenant_only_to_ones_the_user_is_in(as_charlie, world):
    from tenants.services import add_member

    add_member(world.acme, world.charlie, Role.MEMBER)
    assert b"Globex" in as_charlie.get(reverse("adapters:list")).content  # never chose one: first by name, Acme
    as_charlie.post(reverse("tenants:switch"), {"tenant": "globex", "next": "/adapters/"})
    page = as_charlie.get(reverse("adapters:list"))
    assert page.wsgi_request.tenant == world.globex
    Membership.objects.filter(tenant=world.acme, user=world.charlie).delete()
    # a forged slug or a tenant left since is never used
    as_charlie.post(reverse("tenants:switch"), {"tenant": "acme"})
    assert as_charlie.get(reverse("adapters:list")).wsgi_request.tenant == world.globex


def test_a_user_without_tenant_sees_an_explanation(client, db):
    from django.contrib.auth import get_user_model

    dave = get_user_model().objects.create_user("dave", password="x")
    client.force_login(dave)
    response = client.get(reverse("adapters:list"))
    assert response.status_code == 403
    assert b"not in any tenant" in response.content


# --- isolation: charlie gets 404 for every object of acme ----------------------------------


def test_charlie_gets_404_for_every_object_of_acme_and_nothing_changes(as_charlie, world):
    for method, url in object_urls(world):
        response = getattr(as_charlie, method)(url, {"reason": "attack"} if method == "post" else None)
        assert response.status_code == 404, (method, url, response.status_code)
        assert b"support-bot" not in response.content
    world.acme_adapter.refresh_from_db()
    assert world.acme_adapter.active_version == world.acme_v2 and world.acme_adapter.deleted_at is None
    assert ApiKey.objects.get(pk=world.acme_key.pk).revoked_at is None
    assert Membership.objects.filter(tenant=world.acme, user=world.bob).exists()


def test_charlie_lists_only_his_own_adapters_keys_and_audit(as_charlie, world):
    adapters = as_charlie.get(reverse("adapters:list")).content.decode()
    assert reverse("adapters:detail", args=[world.globex_adapter.pk]) in adapters
    assert reverse("adapters:detail", args=[world.acme_adapter.pk]) not in adapters
    keys = as_charlie.get(reverse("tenants:keys")).content.decode()
    assert world.globex_key.prefix in keys and world.acme_key.prefix not in keys


def test_charlie_cannot_bind_a_key_to_an_acme_adapter(as_charlie, world):
    response = as_charlie.post(reverse("tenants:keys"), {"name": "x", "bound_adapter": world.acme_adapter.pk})
    assert response.status_code == 400
    assert b"Select a valid choice" in response.content
    assert not ApiKey.objects.filter(name="x").exists()


# --- roles: bob (viewer) reads, cannot write or manage -------------------------------------


def test_bob_can_read_adapters_versions_usage_audit_members(as_bob, world):
    for url in [reverse("adapters:list"), reverse("adapters:detail", args=[world.acme_adapter.pk]),
                reverse("adapters:usage"), reverse("adapters:audit"), reverse("tenants:members"),
                reverse("adapters:capacity")]:
        assert as_bob.get(url).status_code == 200, url
    detail = as_bob.get(reverse("adapters:detail", args=[world.acme_adapter.pk])).content
    assert b"Make live" not in detail and b"Upload new version" not in detail


def test_bob_cannot_upload_activate_delete_or_manage(as_bob, world):
    for method, url in object_urls(world) + [("get", reverse("adapters:create")), ("post", reverse("adapters:create")),
                                             ("get", reverse("tenants:keys")), ("post", reverse("tenants:keys")),
                                             ("post", reverse("tenants:members"))]:
        if url == reverse("adapters:detail", args=[world.acme_adapter.pk]):
            continue
        data = {"reason": "r", "name": "k", "username": "bob", "role": "owner"} if method == "post" else None
        response = getattr(as_bob, method)(url, data)
        assert response.status_code == 403, (method, url, response.status_code)
        assert b"viewer" in response.content
    world.acme_adapter.refresh_from_db()
    assert world.acme_adapter.active_version == world.acme_v2 and world.acme_adapter.deleted_at is None
    assert ApiKey.objects.for_tenant(world.acme).count() == 1
    assert Membership.objects.get(tenant=world.acme, user=world.bob).role == Role.VIEWER


def test_a_member_may_upload_and_activate_but_not_manage_keys(client, world):
    from tenants.services import add_member

    add_member(world.acme, world.bob, Role.MEMBER)
    client.force_login(world.bob)
    assert client.get(reverse("adapters:upload", args=[world.acme_adapter.pk])).status_code == 200
    response = client.post(reverse("adapters:activate", args=[world.acme_adapter.pk, 1]), {"reason": "rollback"})
    assert response.status_code == 302
    response = client.get(reverse("tenants:keys"))
    assert response.status_code == 403 and b"only owners and admins" in response.content


# --- adapters ------------------------------------------------------------------------------


def test_the_list_shows_live_version_rank_and_24h_usage(as_alice, world):
    from gateway.models import AuditRecord

    AuditRecord.objects.create(route="/v1/completions", tenant=world.acme, adapter=world.acme_adapter,
                               adapter_name="support-bot", status="ok", prompt_tokens=10, completion_tokens=5,
                               total_seconds=0.2)
    html = as_alice.get(reverse("adapters:list")).content.decode()
    row = html[html.index("support-bot"):]
    assert "v2" in row and "bbbbbbbbbbbb" in row and "<td class=\"num\">15</td>" in row
    assert "New adapter" in html


def test_alice_creates_an_adapter_and_a_duplicate_name_is_refused(as_alice, world):
    response = as_alice.post(reverse("adapters:create"), {"name": "summariser", "base": world.base.pk})
    adapter = Adapter.objects.for_tenant(world.acme).get(name="summariser")
    assert response["Location"] == reverse("adapters:upload", args=[adapter.pk])
    response = as_alice.post(reverse("adapters:create"), {"name": "summariser", "base": world.base.pk})
    assert response.status_code == 400 and b"already has an adapter with that name" in response.content


def test_the_same_name_in_another_tenant_is_fine(as_charlie, world):
    response = as_charlie.post(reverse("adapters:create"), {"name": "summariser", "base": world.base.pk})
    assert response.status_code == 302


def test_detail_shows_versions_live_badge_and_history(as_alice, world):
    html = as_alice.get(reverse("adapters:detail", args=[world.acme_adapter.pk])).content.decode()
    v2_row = html[html.index('data-version="2"'):html.index('data-version="1"')]
    assert "badge-live" in v2_row and "Make live" not in v2_row
    v1_row = html[html.index('data-version="1"'):html.index("</tbody>")]
    assert "Make live" in v1_row
    assert 'data-full="' + "a" * 64 + '"' in html  # the full sha256 behind the copy button
    assert "better" in html and "first" in html  # pointer history reasons


def test_activate_asks_for_confirmation_naming_from_and_to(as_alice, world):
    html = as_alice.get(reverse("adapters:activate", args=[world.acme_adapter.pk, 1])).content.decode()
    assert "v2</span> → <span class=\"badge badge-next\">v1" in html and "rollback" in html


def test_activate_moves_the_pointer_and_records_who_and_why(as_alice, world):
    url = reverse("adapters:activate", args=[world.acme_adapter.pk, 1])
    assert as_alice.post(url, {"reason": ""}).status_code == 400
    response = as_alice.post(url, {"reason": "v2 answers in French"})
    assert response.status_code == 302
    world.acme_adapter.refresh_from_db()
    assert world.acme_adapter.active_version == world.acme_v1
    change = VersionPointerChange.objects.for_tenant(world.acme).first()
    assert (change.from_version, change.to_version, change.actor, change.reason) == (
        world.acme_v2, world.acme_v1, world.alice, "v2 answers in French")
    html = as_alice.get(reverse("adapters:detail", args=[world.acme_adapter.pk])).content.decode()
    assert "badge-live" in html[html.index('data-version="1"'):]


def test_activate_of_a_missing_version_is_404(as_alice, world):
    assert as_alice.get(reverse("adapters:activate", args=[world.acme_adapter.pk, 9])).status_code == 404


def test_delete_asks_then_soft_deletes(as_alice, world):
    url = reverse("adapters:delete", args=[world.acme_adapter.pk])
    assert b"410 Gone" in as_alice.get(url).content
    assert as_alice.post(url)["Location"] == reverse("adapters:list")
    assert Adapter.objects.get(pk=world.acme_adapter.pk).deleted_at is not None
    assert as_alice.get(reverse("adapters:detail", args=[world.acme_adapter.pk])).status_code == 404
    assert b"support-bot" not in as_alice.get(reverse("adapters:list")).content


# --- uploads -------------------------------------------------------------------------------


def test_upload_stores_a_version_and_answers_json_for_the_progress_bar(as_alice, real_base, dash_files, upload_files):
    url = reverse("adapters:upload", args=[real_base.writer.pk])
    response = as_alice.post(url, upload_files(dash_files.good1), HTTP_ACCEPT="application/json")
    assert response.status_code == 201, response.content
    data = response.json()
    version = AdapterVersion.objects.get(adapter=real_base.writer, number=1)
    assert data["number"] == 1 and data["sha256"] == version.sha256 and data["live"] is True
    response = as_alice.post(url, upload_files(dash_files.good2), HTTP_ACCEPT="application/json")
    assert response.json()["number"] == 2 and response.json()["live"] is False  # not asked to go live
    real_base.writer.refresh_from_db()
    assert real_base.writer.active_version.number == 1


def test_upload_with_activate_makes_it_live(as_alice, real_base, dash_files, upload_files):
    url = reverse("adapters:upload", args=[real_base.writer.pk])
    as_alice.post(url, upload_files(dash_files.good1), HTTP_ACCEPT="application/json")
    response = as_alice.post(url, {**upload_files(dash_files.good2), "activate": "on"}, HTTP_ACCEPT="application/json")
    assert response.json()["live"] is True
    real_base.writer.refresh_from_db()
    assert real_base.writer.active_version.number == 2


def test_upload_refusal_says_which_tensor_and_stores_nothing(as_alice, real_base, dash_files, upload_files, adapter_storage_dir):
    url = reverse("adapters:upload", args=[real_base.writer.pk])
    response = as_alice.post(url, upload_files(dash_files.bad), HTTP_ACCEPT="application/json")
    assert response.status_code == 400
    data = response.json()
    assert data["ok"] is False and "lora_A" in data["error"] and "[8, 64]" in data["error"].replace("(", "[").replace(")", "]")
    assert not AdapterVersion.objects.filter(adapter=real_base.writer).exists()
    assert not any(p.is_file() for p in adapter_storage_dir.rglob("*"))


def test_upload_without_javascript_renders_the_error_next_to_the_form(as_alice, real_base, dash_files, upload_files):
    url = reverse("adapters:upload", args=[real_base.writer.pk])
    response = as_alice.post(url, upload_files(dash_files.bad))
    assert response.status_code == 400
    assert b"Upload refused." in response.content and b"lora_A" in response.content
    response = as_alice.post(url, upload_files(dash_files.good1), follow=True)
    assert b"Version 1 uploaded" in response.content


def test_upload_with_a_missing_file_names_it(as_alice, real_base, dash_files, upload_files):
    files = upload_files(dash_files.good1)
    del files["weights_file"]
    response = as_alice.post(reverse("adapters:upload", args=[real_base.writer.pk]), files, HTTP_ACCEPT="application/json")
    assert response.status_code == 400 and response.json()["field"] == "weights_file"


def test_upload_hands_django_temp_files_straight_to_the_service(as_alice, real_base, dash_files, upload_files,
                                                                 settings, monkeypatch):
    """Above FILE_UPLOAD_MAX_MEMORY_SIZE Django streams to disk; the view must pass those objects on,
    not read them into bytes."""
    from django.core.files.uploadedfile import TemporaryUploadedFile

    import adapters.uploads

    settings.FILE_UPLOAD_MAX_MEMORY_SIZE = 0
    seen = {}
    real = adapters.uploads.create_adapter_version

    def spy(adapter, *, config_file, weights_file, **kwargs):
        seen.update(config=config_file, weights=weights_file)
        return real(adapter, config_file=config_file, weights_file=weights_file, **kwargs)

    monkeypatch.setattr(adapters.uploads, "create_adapter_version", spy)
    response = as_alice.post(reverse("adapters:upload", args=[real_base.writer.pk]), upload_files(dash_files.good1),
                             HTTP_ACCEPT="application/json")
    assert response.status_code == 201
    assert isinstance(seen["weights"], TemporaryUploadedFile) and isinstance(seen["config"], TemporaryUploadedFile)


# --- keys ----------------------------------------------------------------------------------


def test_alice_creates_a_key_and_sees_the_secret_once(as_alice, world):
    response = as_alice.post(reverse("tenants:keys"), {"name": "ci", "bound_adapter": world.acme_adapter.pk})
    assert response.status_code == 200 and response["Cache-Control"] == "no-store"
    secret = response.context["secret"]
    assert secret.encode() in response.content and b"only time the full key is shown" in response.content
    key = authenticate_api_key(secret)
    assert key.tenant == world.acme and key.bound_adapter == world.acme_adapter and key.created_by == world.alice
    again = as_alice.get(reverse("tenants:keys")).content
    assert secret.encode() not in again and key.last4.encode() in again


def test_a_key_expiry_in_the_past_is_refused(as_alice, world):
    response = as_alice.post(reverse("tenants:keys"), {"name": "old", "expires_at": "2001-01-01T00:00"})
    assert response.status_code == 400 and b"must be in the future" in response.content


def test_alice_revokes_a_key(as_alice, world):
    url = reverse("tenants:revoke_key", args=[world.acme_key.pk])
    assert b"cannot be undone" in as_alice.get(url).content
    as_alice.post(url)
    key = ApiKey.objects.get(pk=world.acme_key.pk)
    assert key.revoked_at is not None and key.revoked_by == world.alice
    page = as_alice.get(reverse("tenants:keys")).content
    assert b"revoked" in page and b"by alice" in page


# --- members -------------------------------------------------------------------------------


def test_alice_invites_a_member_who_accepts_and_changes_a_role(client, world):
    """Adding a member is an invitation: charlie is in acme only after he accepts, with the invited role."""
    login(client, world.alice).post(reverse("tenants:members"), {"username": "charlie", "role": "viewer"})
    assert not Membership.objects.filter(tenant=world.acme, user=world.charlie).exists()
    client.force_login(world.charlie)
    invitation = world.acme.invitations.get(invited_as="charlie")
    client.post(reverse("tenants:accept_invitation", args=[invitation.pk]))
    assert Membership.objects.get(tenant=world.acme, user=world.charlie).role == Role.VIEWER
    client.force_login(world.alice)
    bob_membership = Membership.objects.get(tenant=world.acme, user=world.bob)
    client.post(reverse("tenants:change_role", args=[bob_membership.pk]), {"role": "admin"})
    assert Membership.objects.get(tenant=world.acme, user=world.bob).role == Role.ADMIN


def test_the_last_owner_cannot_be_demoted_or_removed(as_alice, world):
    alice_membership = Membership.objects.get(tenant=world.acme, user=world.alice)
    response = as_alice.post(reverse("tenants:change_role", args=[alice_membership.pk]), {"role": "viewer"}, follow=True)
    assert b"at least one owner" in response.content
    response = as_alice.post(reverse("tenants:remove_member", args=[alice_membership.pk]), follow=True)
    assert b"at least one owner" in response.content
    assert Membership.objects.filter(pk=alice_membership.pk, role=Role.OWNER).exists()


def test_inviting_an_unknown_name_adds_nobody(as_alice, world):
    response = as_alice.post(reverse("tenants:members"), {"username": "mallory", "role": "member"}, follow=True)
    assert b"If an account with that username or e-mail exists" in response.content
    assert Membership.objects.for_tenant(world.acme).count() == 2


def test_alice_removes_bob(as_alice, world):
    membership = Membership.objects.get(tenant=world.acme, user=world.bob)
    as_alice.post(reverse("tenants:remove_member", args=[membership.pk]))
    assert not Membership.objects.filter(pk=membership.pk).exists()


# --- capacity ------------------------------------------------------------------------------


def test_capacity_page_shows_the_plan_and_the_rank_by_targets_table(as_bob, world):
    from adapters import capacity

    response = as_bob.get(reverse("adapters:capacity"), {
        "model": "preset:llama-2-7b", "rank": 16, "targets": "all-linear", "dtype": "bf16", "kv_dtype": "bf16",
        "adapters": 1000, "gpu_gb": 80, "context_len": 4096,
    })
    assert response.status_code == 200
    plan = capacity.plan_capacity(capacity.preset_manifest("llama-2-7b"), rank=16, targets="all-linear",
                                  num_adapters=1000, gpu_gb=80, context_len=4096)
    html = response.content.decode()
    assert str(plan.lora_params_per_adapter) in html and str(plan.max_concurrent_sequences) in html
    assert plan.verdict.split(":")[0] in html
    table = html[html.index('id="capacity-table"'):html.index("</table>", html.index('id="capacity-table"'))]
    assert table.count("<tr") == 1 + 10  # header + 5 ranks x 2 target presets
    assert html.count("<rect") >= 10  # the chart


def test_capacity_page_works_for_a_registered_base_and_by_default(as_alice, real_base):
    assert b"FITS" in as_alice.get(reverse("adapters:capacity")).content
    response = as_alice.get(reverse("adapters:capacity"), {
        "model": "base:tiny-real", "rank": 8, "targets": "attention-only", "dtype": "fp32", "kv_dtype": "fp32",
        "adapters": 10, "gpu_gb": 1, "context_len": 256,
    })
    assert b"Tiny Llama" in response.content and b"FITS" in response.content


def test_a_storage_failure_is_our_503_not_a_refusal(as_alice, real_base, dash_files, upload_files, monkeypatch):
    import adapters.uploads
    from adapters.storage import BlobStorageError

    def broken(*args, **kwargs):
        raise BlobStorageError("S3 is down")

    monkeypatch.setattr(adapters.uploads, "create_adapter_version", broken)
    response = as_alice.post(reverse("adapters:upload", args=[real_base.writer.pk]), upload_files(dash_files.good1),
                             HTTP_ACCEPT="application/json")
    assert response.status_code == 503 and "try again" in response.json()["error"]
    assert "S3" not in response.json()["error"]  # internals stay in the server log
