"""Authorisation matrix: every route of the URL resolver × every kind of caller, each cell's status
asserted.

Callers: owner (alice), member (dave), viewer (bob) of acme; charlie (owner of globex, so a user of
another tenant); acme's valid key; globex's key; acme keys that are revoked, expired, or carry a bad
checksum; nobody. Every request targets acme's objects. The expectations below are the contract; a
route added to config/urls.py without a row here fails `test_every_route_has_expectations`.

Cross-tenant callers must never get a 2xx on acme's objects, pages they may open (their own lists)
must not show acme's data, and a refused API request must not reach the queue boundary.

Invitations are the one acme object with an addressee outside acme: the realm's open acme invitation is
addressed to charlie, so he (and only he) may see, accept or decline it; to everyone else, acme's own
owner included, it is a 404 like any object that is not theirs.
"""
from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
from django.db import transaction
from django.test import Client
from django.urls import URLPattern, URLResolver, get_resolver, reverse

pytestmark = [pytest.mark.django_db]


USERS = ("owner", "member", "viewer", "other_user")
KEYS = ("same_key", "other_key", "revoked_key", "expired_key", "badsum_key")
CALLERS = USERS + KEYS + ("anonymous",)
CROSS_TENANT = ("other_user", "other_key")

LOGIN = "login"            # 302 to /login/
ADMIN_LOGIN = "admin_login"  # 302 to /admin/login/
REDIRECT = "redirect"      # 302 somewhere other than a login page
_ANY_BUT_AUTH = "any_but_auth"  # neither refused nor hidden (the row's file has no bytes in storage: a 503 says so)


@dataclass
class Action:
    route: str                                    # namespaced URL name
    method: str
    url: Callable[[object], str]                  # realm -> path
    expect: dict[str, object]                     # caller -> status / LOGIN / REDIRECT
    data: Callable[[object], dict] = field(default=lambda r: {})
    api: bool = False                             # JSON body with the caller's key
    # extra check after the request: (realm, caller, response) -> None
    check: Callable | None = None


def _dash(owner, member, viewer, other_user) -> dict[str, object]:
    """A dashboard row: the four users as given; any key or no credentials -> the login page."""
    return {"owner": owner, "member": member, "viewer": viewer, "other_user": other_user,
            **{k: LOGIN for k in KEYS}, "anonymous": LOGIN}


def _api(same_key, other_key) -> dict[str, object]:
    """An API row: sessions are not credentials there; refused keys and no key -> 401."""
    return {**{u: 401 for u in USERS}, "same_key": same_key, "other_key": other_key,
            "revoked_key": 401, "expired_key": 401, "badsum_key": 401, "anonymous": 401}


def _everyone(status) -> dict[str, object]:
    return {c: status for c in CALLERS}


def _no_acme_in_body(realm, caller, response):
    """Pages a cross-tenant user may open (their own lists) must show nothing of acme's."""
    if caller in CROSS_TENANT and response.status_code == 200:
        body = response.content.decode(errors="replace")
        for marker in ("acme-only", realm.acme_key.prefix, str(realm.acme_audit.request_id), "Acme"):
            assert marker not in body, f"{caller} sees acme's {marker!r}"


def _key_revoked_only_by_owner(realm, caller, response):
    realm.acme_key.refresh_from_db()
    assert (realm.acme_key.revoked_at is not None) == (caller == "owner"), caller


def _bob_removed_only_by_owner(realm, caller, response):
    from tenants.models import Membership

    still = Membership.objects.filter(tenant=realm.acme, user=realm.bob).exists()
    assert still == (caller != "owner"), caller


def _activated_only_by_writers(realm, caller, response):
    realm.acme_adapter.refresh_from_db()
    moved = realm.acme_adapter.active_version_id == realm.acme_v1.pk
    assert moved == (caller in ("owner", "member")), caller


def _deleted_only_by_owner(realm, caller, response):
    realm.acme_adapter.refresh_from_db()
    assert (realm.acme_adapter.deleted_at is not None) == (caller == "owner"), caller


def _eve_invited_to_acme_only_by_owner(realm, caller, response):
    """Posting the invite form creates an open acme invitation for eve only as acme's owner, and nobody
    ever makes eve a member: she joins only by accepting, from her own session."""
    from tenants.models import Invitation, Membership

    invited = Invitation.objects.for_tenant(realm.acme).open().filter(invited_as="eve").exists()
    assert invited == (caller == "owner"), caller
    assert not Membership.objects.filter(tenant=realm.acme, user=realm.eve).exists(), caller


def _bob_role_changed_only_by_owner(realm, caller, response):
    from tenants.models import Role

    role = realm.acme.memberships.get(user=realm.bob).role
    assert (role == Role.MEMBER) == (caller == "owner"), (caller, role)


def _acme_members(realm) -> set[str]:
    return set(realm.acme.memberships.values_list("user__username", flat=True))


def _only_the_caller_leaves_never_the_last_owner(realm, caller, response):
    """dave and bob leave acme; alice (acme's only owner) and charlie (globex's) stay; nobody else moves."""
    from tenants.models import Membership

    left = {"member": "dave", "viewer": "bob"}.get(caller)
    assert _acme_members(realm) == {"alice", "bob", "dave"} - {left}, caller
    assert Membership.objects.filter(tenant=realm.globex, user=realm.charlie).exists(), caller


def _invitation_revoked_only_by_owner(realm, caller, response):
    realm.acme_invitation.refresh_from_db()
    assert (realm.acme_invitation.revoked_at is not None) == (caller == "owner"), caller


def _only_the_addressee_accepts(realm, caller, response):
    realm.acme_invitation.refresh_from_db()
    addressee = caller == "other_user"
    assert (realm.acme_invitation.accepted_by_id == realm.charlie.pk) == addressee, caller
    assert _acme_members(realm) == {"alice", "bob", "dave"} | ({"charlie"} if addressee else set()), caller


def _only_the_addressee_declines(realm, caller, response):
    realm.acme_invitation.refresh_from_db()
    assert (realm.acme_invitation.declined_at is not None) == (caller == "other_user"), caller
    assert _acme_members(realm) == {"alice", "bob", "dave"}, caller


def _only_the_addressee_sees_it(realm, caller, response):
    """The invitee's list shows acme's invitation to charlie alone (by its accept URL)."""
    if response.status_code == 200:
        accept_url = reverse("tenants:accept_invitation", args=[realm.acme_invitation.pk])
        assert (accept_url in response.content.decode()) == (caller == "other_user"), caller


def _link_page_is_not_cached(realm, caller, response):
    if response.status_code == 200:
        assert response["Cache-Control"] == "no-store" and response["Referrer-Policy"] == "no-referrer"


def _acme_keys_unchanged_unless_owner(realm, caller, response):
    from gateway.models import ApiKey

    created = ApiKey.objects.for_tenant(realm.acme).filter(name="matrix").exists()
    assert created == (caller == "owner"), caller


def _switch_never_into_foreign_tenant(realm, caller, response):
    if caller == "other_user":
        assert response.wsgi_request.session.get("lorafleet_tenant") != "acme"


def _models_list_is_own(realm, caller, response):
    if response.status_code == 200:
        ids = [m["id"] for m in response.json()["data"]]
        assert ("acme-only" in ids) == (caller == "same_key"), (caller, ids)


def _json_error(response):
    assert response["Content-Type"].startswith("application/json") and "error" in response.json()


COMPLETION = {"model": "acme-only", "prompt": "hello", "max_tokens": 2}
CHAT = {"model": "acme-only", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 2}

ACTIONS: list[Action] = [
    # --- tenants app ---------------------------------------------------------------------------
    Action("tenants:login", "GET", lambda r: reverse("tenants:login"),
           {**_everyone(200), **{u: REDIRECT for u in USERS}}),
    Action("tenants:logout", "POST", lambda r: reverse("tenants:logout"), _everyone(LOGIN)),  # and the session ends
    Action("tenants:home", "GET", lambda r: reverse("tenants:home"), _dash(REDIRECT, REDIRECT, REDIRECT, REDIRECT)),
    Action("tenants:switch", "POST", lambda r: reverse("tenants:switch"),
           _dash(REDIRECT, REDIRECT, REDIRECT, REDIRECT), data=lambda r: {"tenant": "acme", "next": "/adapters/"},
           check=_switch_never_into_foreign_tenant),
    Action("tenants:keys", "GET", lambda r: reverse("tenants:keys"), _dash(200, 403, 403, 200), check=_no_acme_in_body),
    Action("tenants:keys", "POST", lambda r: reverse("tenants:keys"), _dash(200, 403, 403, 200),
           data=lambda r: {"name": "matrix"}, check=_acme_keys_unchanged_unless_owner),
    Action("tenants:revoke_key", "GET", lambda r: reverse("tenants:revoke_key", args=[r.acme_key.pk]),
           _dash(200, 403, 403, 404)),
    Action("tenants:revoke_key", "POST", lambda r: reverse("tenants:revoke_key", args=[r.acme_key.pk]),
           _dash(REDIRECT, 403, 403, 404), check=_key_revoked_only_by_owner),
    Action("tenants:members", "GET", lambda r: reverse("tenants:members"), _dash(200, 200, 200, 200),
           check=_no_acme_in_body),
    Action("tenants:members", "POST", lambda r: reverse("tenants:members"), _dash(REDIRECT, 403, 403, REDIRECT),
           data=lambda r: {"username": "eve", "role": "viewer"}, check=_eve_invited_to_acme_only_by_owner),
    Action("tenants:change_role", "POST",
           lambda r: reverse("tenants:change_role", args=[r.acme.memberships.get(user=r.bob).pk]),
           _dash(REDIRECT, 403, 403, 404), data=lambda r: {"role": "member"}, check=_bob_role_changed_only_by_owner),
    Action("tenants:remove_member", "POST",
           lambda r: reverse("tenants:remove_member", args=[r.acme.memberships.get(user=r.bob).pk]),
           _dash(REDIRECT, 403, 403, 404), check=_bob_removed_only_by_owner),
    # leave acts on the caller's own current tenant (globex for charlie); a last owner is refused with a message
    Action("tenants:leave", "POST", lambda r: reverse("tenants:leave"),
           _dash(REDIRECT, REDIRECT, REDIRECT, REDIRECT), check=_only_the_caller_leaves_never_the_last_owner),
    Action("tenants:revoke_invitation", "POST",
           lambda r: reverse("tenants:revoke_invitation", args=[r.acme_invitation.pk]),
           _dash(REDIRECT, 403, 403, 404), check=_invitation_revoked_only_by_owner),
    # as the invitee: acme's invitation is addressed to charlie (other_user), a 404 to everyone else
    Action("tenants:invitations", "GET", lambda r: reverse("tenants:invitations"), _dash(200, 200, 200, 200),
           check=_only_the_addressee_sees_it),
    Action("tenants:accept_invitation", "POST",
           lambda r: reverse("tenants:accept_invitation", args=[r.acme_invitation.pk]),
           _dash(404, 404, 404, REDIRECT), check=_only_the_addressee_accepts),
    Action("tenants:decline_invitation", "POST",
           lambda r: reverse("tenants:decline_invitation", args=[r.acme_invitation.pk]),
           _dash(404, 404, 404, REDIRECT), check=_only_the_addressee_declines),
    Action("tenants:invitation_link", "GET",
           lambda r: reverse("tenants:invitation_link", args=[r.acme_invitation_token]),
           _dash(404, 404, 404, 200), check=_link_page_is_not_cached),
    Action("tenants:invitation_link", "POST",
           lambda r: reverse("tenants:invitation_link", args=[r.acme_invitation_token]),
           _dash(404, 404, 404, REDIRECT), data=lambda r: {"answer": "accept"}, check=_only_the_addressee_accepts),
    # --- adapters app --------------------------------------------------------------------------
    Action("adapters:list", "GET", lambda r: reverse("adapters:list"), _dash(200, 200, 200, 200),
           check=_no_acme_in_body),
    Action("adapters:create", "GET", lambda r: reverse("adapters:create"), _dash(200, 200, 403, 200)),
    Action("adapters:detail", "GET", lambda r: reverse("adapters:detail", args=[r.acme_only.pk]),
           _dash(200, 200, 200, 404)),
    Action("adapters:upload", "GET", lambda r: reverse("adapters:upload", args=[r.acme_only.pk]),
           _dash(200, 200, 403, 404)),
    Action("adapters:upload", "POST", lambda r: reverse("adapters:upload", args=[r.acme_only.pk]),
           _dash(400, 400, 403, 404), data=lambda r: {"activate": "on"}),  # no files: a named 400 for writers
    Action("adapters:activate", "GET", lambda r: reverse("adapters:activate", args=[r.acme_adapter.pk, 1]),
           _dash(200, 200, 403, 404)),
    Action("adapters:activate", "POST", lambda r: reverse("adapters:activate", args=[r.acme_adapter.pk, 1]),
           _dash(REDIRECT, REDIRECT, 403, 404), data=lambda r: {"reason": "matrix"}, check=_activated_only_by_writers),
    Action("adapters:delete", "GET", lambda r: reverse("adapters:delete", args=[r.acme_adapter.pk]),
           _dash(200, 403, 403, 404)),
    Action("adapters:delete", "POST", lambda r: reverse("adapters:delete", args=[r.acme_adapter.pk]),
           _dash(REDIRECT, 403, 403, 404), check=_deleted_only_by_owner),
    Action("adapters:usage", "GET", lambda r: reverse("adapters:usage"), _dash(200, 200, 200, 200),
           check=_no_acme_in_body),
    Action("adapters:audit", "GET", lambda r: reverse("adapters:audit"), _dash(200, 200, 200, 200),
           check=_no_acme_in_body),
    Action("adapters:capacity", "GET", lambda r: reverse("adapters:capacity"), _dash(200, 200, 200, 200)),
    # --- the fine-tuning pages (dashboard/views/finetune.py): viewers read, writers upload, start, cancel ---
    Action("finetuning:jobs", "GET", lambda r: reverse("finetuning:jobs"), _dash(200, 200, 200, 200),
           check=lambda r, c, resp: c != "other_user" or _acme_job(r).public_id.encode() not in resp.content),
    # no file: a refusal named on the page the writer comes back to; nothing stored
    Action("finetuning:upload", "POST", lambda r: reverse("finetuning:upload"),
           _dash(REDIRECT, REDIRECT, 403, REDIRECT)),
    Action("finetuning:create", "POST", lambda r: reverse("finetuning:create"), _dash(400, 400, 403, 400),
           data=lambda r: {"training_file": _acme_job(r).training_file.public_id, "suffix": "x", "rank": 8}),
    Action("finetuning:job", "GET", lambda r: reverse("finetuning:job", args=[_acme_job(r).public_id]),
           _dash(200, 200, 200, 404)),
    Action("finetuning:cancel", "POST", lambda r: reverse("finetuning:cancel", args=[_acme_job(r).public_id]),
           _dash(REDIRECT, REDIRECT, 403, 404)),
    # staff only (every tenant's workers and residents): no tenant role reaches it
    Action("operator:workers", "GET", lambda r: reverse("operator:workers"), _dash(404, 404, 404, 404)),
    # --- operator and documentation endpoints (schema and docs public by design; see docs/RELIABILITY.md)
    # /metrics answers only its own bearer token (tests/api/test_metrics.py): no session or API key opens it
    Action("metrics", "GET", lambda r: reverse("metrics"), _everyone(401)),
    Action("schema", "GET", lambda r: reverse("schema"), _everyone(200)),
    Action("api-docs", "GET", lambda r: reverse("api-docs"), _everyone(200)),
    # --- the inference API -----------------------------------------------------------------------
    Action("gateway:completions", "POST", lambda r: reverse("gateway:completions"), _api(200, 404),
           data=lambda r: COMPLETION, api=True),
    Action("gateway:chat-completions", "POST", lambda r: reverse("gateway:chat-completions"), _api(200, 404),
           data=lambda r: CHAT, api=True),
    Action("gateway:models", "GET", lambda r: reverse("gateway:models"), _api(200, 200), api=True,
           check=_models_list_is_own),
    Action("gateway:model-detail", "GET", lambda r: reverse("gateway:model-detail", args=["acme-only"]),
           _api(200, 404), api=True),
    Action("gateway:model-detail", "GET", lambda r: reverse("gateway:model-detail", args=["acme-only@1"]),
           _api(200, 404), api=True),
    # --- the Files and fine-tuning API (OpenAI's shape; finetune/): keys only, another tenant's object is a 404
    Action("finetune:files", "GET", lambda r: reverse("finetune:files"), _api(200, 200), api=True,
           check=lambda r, c, resp: c != "other_key" or _acme_job(r).training_file.public_id.encode() not in resp.content),
    # a JSON body where a multipart upload belongs: refused by what is wrong with it, after the key is accepted
    Action("finetune:files", "POST", lambda r: reverse("finetune:files"), _api(400, 400), api=True,
           data=lambda r: {"purpose": "fine-tune"}, check=lambda r, c, resp: _json_error(resp)),
    Action("finetune:file-detail", "GET",
           lambda r: reverse("finetune:file-detail", args=[_acme_job(r).training_file.public_id]), _api(200, 404),
           api=True),
    Action("finetune:file-content", "GET",
           lambda r: reverse("finetune:file-content", args=[_acme_job(r).training_file.public_id]),
           {**_api(None, 404), "same_key": _ANY_BUT_AUTH}, api=True),
    Action("finetune:jobs", "GET", lambda r: reverse("finetune:jobs"), _api(200, 200), api=True,
           check=lambda r, c, resp: c != "other_key" or _acme_job(r).public_id.encode() not in resp.content),
    # naming acme's base and file: acme's key gets past both (and is refused for the rank, so nothing is queued),
    # another's is a 404
    Action("finetune:jobs", "POST", lambda r: reverse("finetune:jobs"), _api(400, 404), api=True,
           data=lambda r: {"model": r.base.slug, "training_file": _acme_job(r).training_file.public_id,
                           "lora": {"rank": 4096}},
           check=lambda r, c, resp: _json_error(resp)),
    Action("finetune:job-detail", "GET", lambda r: reverse("finetune:job-detail", args=[_acme_job(r).public_id]),
           _api(200, 404), api=True),
    Action("finetune:job-events", "GET", lambda r: reverse("finetune:job-events", args=[_acme_job(r).public_id]),
           _api(200, 404), api=True),
    # other_key before same_key would prove nothing after a cancel: CALLERS has same_key first, so other_key asks
    # to cancel a job that still exists (cancelled jobs stay)
    Action("finetune:job-cancel", "POST", lambda r: reverse("finetune:job-cancel", args=[_acme_job(r).public_id]),
           _api(200, 404), api=True),
    # any other /v1/ path: a JSON 404 whoever asks (it names no object, so it needs no credentials)
    Action("gateway:unknown", "POST", lambda r: "/v1/embeddings", _everyone(404), data=lambda r: COMPLETION,
           api=True, check=lambda r, c, resp: _json_error(resp)),
]

def _acme_job(r):
    """A queued fine-tuning job of acme's (rows only: the pages read them); made again when the savepoint of the
    caller before rolled it back."""
    from finetune.models import FineTuningJob, TrainingFile

    if getattr(r, "acme_job", None) is None or not FineTuningJob.objects.filter(pk=r.acme_job.pk).exists():

        file = TrainingFile.objects.create(tenant=r.acme, filename="acme.jsonl", sha256="d" * 64,
                                           storage_key="datasets/" + "d" * 64 + ".jsonl", size_bytes=10, examples=1)
        r.acme_job = FineTuningJob.objects.create(
            tenant=r.acme, base=r.base, model_name=r.base.slug, training_file=file, suffix="acme-ft", seed=1,
            status="queued", hyperparameters={"n_epochs": 1, "batch_size": 1, "learning_rate_multiplier": 1,
                                              "learning_rate": 2e-4, "lora_rank": 8, "lora_alpha": 16,
                                              "lora_target_modules": ["q_proj", "v_proj"]})
    return r.acme_job


# The Django admin: staff only. No user of the matrix is staff, so every admin page sends everyone
# to the admin login; tested on the index and on every registered model's changelist.
ADMIN_NAMESPACE = "admin"


def _route_names(patterns=None, prefix: str = "") -> list[str]:
    names = []
    for p in patterns if patterns is not None else get_resolver().url_patterns:
        if isinstance(p, URLResolver):
            ns = f"{prefix}{p.namespace}:" if p.namespace else prefix
            names += _route_names(p.url_patterns, ns)
        elif isinstance(p, URLPattern):
            names.append(f"{prefix}{p.name}" if p.name else f"{prefix}<unnamed {p.pattern}>")
    return names


def test_every_route_has_expectations():
    """A new route without a row in the matrix fails here, so it cannot be forgotten."""
    covered = {a.route for a in ACTIONS}
    missing = [n for n in _route_names() if not n.startswith(ADMIN_NAMESPACE + ":") and n not in covered]
    assert not missing, f"routes with no authorisation expectations: {missing}"
    for action in ACTIONS:
        assert set(action.expect) == set(CALLERS), action.route


def _client_for(realm, caller: str) -> tuple[Client, dict]:
    client, headers = Client(), {}
    users = {"owner": realm.alice, "member": realm.dave, "viewer": realm.bob, "other_user": realm.charlie}
    secrets = {"same_key": realm.acme_secret, "other_key": realm.globex_secret, "revoked_key": realm.revoked_secret,
               "expired_key": realm.expired_secret, "badsum_key": realm.badsum_secret}
    if caller in users:
        client.force_login(users[caller])
    elif caller in secrets:
        headers["HTTP_AUTHORIZATION"] = f"Bearer {secrets[caller]}"
    return client, headers


def _send(realm, action: Action, caller: str):
    client, headers = _client_for(realm, caller)
    url = action.url(realm)
    if action.api:
        if action.method == "POST":
            return client.post(url, data=json.dumps(action.data(realm)), content_type="application/json", **headers)
        return client.get(url, **headers)
    if action.method == "POST":
        return client.post(url, data=action.data(realm), **headers)
    return client.get(url, **headers)


def _assert_cell(action: Action, caller: str, response) -> None:
    want = action.expect[caller]
    got = response.status_code
    where = f"{action.method} {action.route} as {caller}"
    location = response.get("Location", "")
    if want == _ANY_BUT_AUTH:  # the key is accepted; what follows is not an authorisation matter
        assert got not in (401, 403, 404), f"{where}: {got}: {response.content[:300]!r}"
    elif want == LOGIN:
        assert got == 302 and location.startswith("/login/"), f"{where}: {got} {location}"
    elif want == ADMIN_LOGIN:
        assert got == 302 and location.startswith("/admin/login/"), f"{where}: {got} {location}"
    elif want == REDIRECT:
        assert got == 302 and not location.startswith("/login/"), f"{where}: {got} {location}"
    else:
        assert got == want, f"{where}: {got}, expected {want}: {response.content[:300]!r}"


@pytest.mark.parametrize("action", ACTIONS, ids=lambda a: f"{a.method}-{a.route}")
def test_matrix_row(realm, action):
    """One route, every caller. Dashboard cells run in a savepoint that is rolled back, so a write by
    one caller cannot change what the next one sees; API cells cannot (the gateway opens a durable
    transaction of its own) and are all reads or refusals except the same-tenant control."""
    for caller in CALLERS:
        before = len(realm.dispatcher.published)
        if action.api:
            response = _send(realm, action, caller)
            _assert_cell(action, caller, response)
            if action.check:
                action.check(realm, caller, response)
        else:
            with transaction.atomic():
                response = _send(realm, action, caller)
                _assert_cell(action, caller, response)
                if action.check:
                    action.check(realm, caller, response)
                transaction.set_rollback(True)
        reached_queue = len(realm.dispatcher.published) - before
        if caller in CROSS_TENANT:
            assert not (200 <= response.status_code < 300 and _targets_acme_object(action)), \
                f"cross-tenant 2xx: {action.route} as {caller}"
        ok_completion = caller == "same_key" and action.route in ("gateway:completions", "gateway:chat-completions")
        assert reached_queue == (1 if ok_completion else 0), f"{action.route} as {caller} enqueued {reached_queue}"


def _targets_acme_object(action: Action) -> bool:
    """Rows that address one acme object (rather than the caller's own list pages). The invitee's routes
    are not here: acme's invitation is addressed to the cross-tenant user, whose 2xx is the point."""
    return action.route in ("tenants:revoke_key", "tenants:change_role", "tenants:remove_member",
                            "tenants:revoke_invitation", "adapters:detail", "adapters:upload",
                            "adapters:activate", "adapters:delete", "gateway:completions",
                            "gateway:chat-completions", "gateway:model-detail", "finetuning:job", "finetuning:cancel")


def test_admin_is_staff_only(realm):
    """Every registered model's admin changelist (and the index) sends every matrix caller to the admin login."""
    from django.contrib import admin

    urls = [reverse("admin:index")] + [
        reverse(f"admin:{m._meta.app_label}_{m._meta.model_name}_changelist") for m in admin.site._registry
    ]
    for url in urls:
        for caller in CALLERS:
            client, headers = _client_for(realm, caller)
            response = client.get(url, **headers)
            assert response.status_code == 302 and response["Location"].startswith("/admin/login/"), (url, caller)


def test_cross_tenant_api_never_reaches_the_queue(realm):
    """globex's key naming acme's adapter in every spelling: 404 each time, nothing published."""
    client = Client()
    headers = {"HTTP_AUTHORIZATION": f"Bearer {realm.globex_secret}"}
    names = ["acme-only", "acme-only@1", "acme-only@latest", f"acme-only@{realm.acme_only_v1.pk}",
             "acme/acme-only", " acme-only", "ACME-ONLY"]
    for name in names:
        for path, body in (("/v1/completions", {**COMPLETION, "model": name}),
                           ("/v1/chat/completions", {**CHAT, "model": name})):
            response = client.post(path, data=json.dumps(body), content_type="application/json", **headers)
            assert 400 <= response.status_code < 500, (name, response.status_code)
    assert realm.dispatcher.published == []


def test_empty_upload_post_is_a_named_400(realm):
    """Found by this suite (was a 500: an unbound form has no errors to name); fixed in 695289f."""
    client = Client()
    client.force_login(realm.alice)
    response = client.post(reverse("adapters:upload", args=[realm.acme_only.pk]))
    assert response.status_code == 400


def test_every_named_route_reverses():
    """reverse() must work for every named route: templates, redirects and this matrix all depend on it."""
    from django.urls import reverse

    for name in _route_names():
        if name.startswith("admin:") or name in ("gateway:model-detail", "gateway:unknown", "gateway:models"):
            continue
        try:
            reverse(name)
        except Exception as exc:  # NoReverseMatch for routes with arguments is fine; anything else is the bug
            assert type(exc).__name__ == "NoReverseMatch", f"{name}: {exc!r}"
