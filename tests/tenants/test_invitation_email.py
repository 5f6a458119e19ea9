"""The invitation e-mail (tenants/invitations.py) and the e-mail settings it is sent with (config/settings.py).

Whether a mail goes out depends only on what the inviter typed (an e-mail address, not a username), never
on whether an account has that address: the inviter's answer, and the mail, are the same either way, so
inviting tells the inviter nothing about accounts. In tests Django swaps in its locmem backend
(``mail.outbox``); the environment decides the backend everywhere else (console by default).
"""
from __future__ import annotations

import ast
import os
import re
import socket
import subprocess
import sys

import pytest
from django.contrib.messages import get_messages
from django.core import mail
from django.test import Client
from django.urls import reverse

from tenants.models import Invitation, Membership, Role

pytestmark = [pytest.mark.django_db]


def _invite_as_alice(world, name: str):
    client = Client()
    client.force_login(world.alice)
    response = client.post(reverse("tenants:members"), {"username": name, "role": "viewer"})
    messages = [str(m) for m in get_messages(response.wsgi_request)]
    return response.status_code, response["Location"], response.content, messages


def test_an_invitation_by_email_sends_one_mail_to_that_address_with_a_link_that_works(world, settings):
    """Charlie's address gets exactly one mail, from DEFAULT_FROM_EMAIL, naming the tenant and role; its
    link lets charlie (and only the account with that address) accept."""
    settings.DEFAULT_FROM_EMAIL = "lorafleet <invites@lorafleet.example>"
    world.charlie.email = "charlie@globex.example"
    world.charlie.save()
    _invite_as_alice(world, "charlie@globex.example")
    assert len(mail.outbox) == 1
    sent = mail.outbox[0]
    assert sent.to == ["charlie@globex.example"] and sent.cc == [] and sent.bcc == []
    assert sent.from_email == "lorafleet <invites@lorafleet.example>"
    assert "Acme" in sent.subject and "as viewer" in sent.body
    path = re.search(r"http://testserver(/invitations/link/[^/\s]+/)", sent.body).group(1)
    bob = Client()
    bob.force_login(world.bob)
    assert bob.get(path).status_code == 404
    charlie = Client()
    charlie.force_login(world.charlie)
    charlie.post(path, {"answer": "accept"})
    assert Membership.objects.get(tenant=world.acme, user=world.charlie).role == Role.VIEWER


def test_the_owner_sees_the_same_answer_and_the_same_mail_whether_or_not_the_account_exists(world):
    """An address with an account (charlie's) and one without: byte-identical answers to alice, and one
    mail each to the typed address, alike but for the address and the link's token."""
    world.charlie.email = "charlie@globex.example"
    world.charlie.save()
    answers, mails = [], []
    for address in ("charlie@globex.example", "mallory@nowhere.example"):
        mail.outbox.clear()
        answers.append(_invite_as_alice(world, address))
        assert [m.to for m in mail.outbox] == [[address]]
        token = re.search(r"/invitations/link/([^/\s]+)/", mail.outbox[0].body).group(1)
        mails.append((mail.outbox[0].subject, mail.outbox[0].body.replace(address, "ADDRESS").replace(token, "TOKEN")))
    assert answers[0] == answers[1]
    assert answers[0][0] == 302 and "Nobody joins until they accept." in answers[0][3][0]
    assert mails[0] == mails[1]
    assert Invitation.objects.for_tenant(world.acme).open().count() == 2
    assert not Membership.objects.filter(tenant=world.acme, user=world.charlie).exists()


def test_an_invitation_by_username_sends_no_mail(world):
    """A username is not an address, and the account behind it is never read: no mail, for an existing
    account or a missing one; the invitee finds it on their Invitations page."""
    world.charlie.email = "charlie@globex.example"
    world.charlie.save()
    assert _invite_as_alice(world, "charlie") == _invite_as_alice(world, "mallory")
    assert mail.outbox == []
    charlie = Client()
    charlie.force_login(world.charlie)
    assert b"Acme" in charlie.get(reverse("tenants:invitations")).content


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_mail_server_that_refuses_does_not_fail_the_invitation(world, settings):
    """SMTP to a port nobody listens on: the owner gets the same redirect and message, and the
    invitation stands (the invitee also finds it on their Invitations page)."""
    settings.EMAIL_BACKEND = "django.core.mail.backends.smtp.EmailBackend"
    settings.EMAIL_HOST, settings.EMAIL_PORT = "127.0.0.1", _closed_port()
    settings.EMAIL_USE_TLS = settings.EMAIL_USE_SSL = False
    settings.EMAIL_TIMEOUT = 2
    failed = _invite_as_alice(world, "charlie@globex.example")
    settings.EMAIL_BACKEND = "django.core.mail.backends.locmem.EmailBackend"
    sent = _invite_as_alice(world, "mallory@nowhere.example")
    assert failed == sent and len(mail.outbox) == 1
    assert Invitation.objects.for_tenant(world.acme).open().filter(invited_as="charlie@globex.example").exists()


# --- settings: read from the environment --------------------------------------------------------


def _email_settings(tmp_path, **env) -> subprocess.CompletedProcess:
    code = ("import django, os; os.environ['DJANGO_SETTINGS_MODULE'] = 'config.settings'; django.setup(); "
            "from django.conf import settings as s; "
            "print(repr((s.EMAIL_BACKEND, s.DEFAULT_FROM_EMAIL, s.EMAIL_HOST, s.EMAIL_PORT, s.EMAIL_HOST_USER, "
            "s.EMAIL_HOST_PASSWORD, s.EMAIL_USE_TLS, s.EMAIL_USE_SSL, s.EMAIL_TIMEOUT)))")
    ours = ("DATABASE_URL", "CELERY_", "LORAFLEET_STORAGE", "DJANGO_EMAIL", "DJANGO_DEFAULT_FROM")
    clean = {k: v for k, v in os.environ.items() if not k.startswith(ours)}
    return subprocess.run([sys.executable, "-c", code], env={**clean, "LORAFLEET_VAR_DIR": str(tmp_path), **env},
                          capture_output=True, text=True, timeout=60)


def test_the_embedded_default_prints_mails_instead_of_trying_smtp(tmp_path):
    out = _email_settings(tmp_path)
    assert out.returncode == 0, out.stderr
    backend, from_email, *_ = ast.literal_eval(out.stdout)
    assert backend == "django.core.mail.backends.console.EmailBackend"
    assert from_email == "lorafleet <noreply@localhost>"


def test_smtp_is_configured_from_the_environment(tmp_path):
    out = _email_settings(tmp_path, DJANGO_EMAIL_BACKEND="django.core.mail.backends.smtp.EmailBackend",
                          DJANGO_DEFAULT_FROM_EMAIL="invites@lorafleet.example", DJANGO_EMAIL_HOST="smtp.example",
                          DJANGO_EMAIL_PORT="465", DJANGO_EMAIL_HOST_USER="mailer", DJANGO_EMAIL_HOST_PASSWORD="pw",
                          DJANGO_EMAIL_USE_SSL="1", DJANGO_EMAIL_TIMEOUT="5")
    assert out.returncode == 0, out.stderr
    assert ast.literal_eval(out.stdout) == ("django.core.mail.backends.smtp.EmailBackend", "invites@lorafleet.example",
                                "smtp.example", 465, "mailer", "pw", False, True, 5)


def test_tls_and_ssl_together_are_refused(tmp_path):
    out = _email_settings(tmp_path, DJANGO_EMAIL_USE_TLS="1", DJANGO_EMAIL_USE_SSL="1")
    assert out.returncode != 0 and "DJANGO_EMAIL_USE_SSL" in out.stderr
