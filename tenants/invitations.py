"""Invitation tokens, the lookup that finds an invitation for its invitee, and the e-mail carrying the link.

- A token is 32 random bytes (url-safe base64). Only its SHA-256 is stored (NIST 800-63B allows a fast
  hash for a high-entropy secret); the clear token exists in the invitation e-mail and nowhere else.
- An invitation is reachable only by the account it is addressed to (``addressed_to``): by id from
  the invitee's own list, or by the link's token. Missing, someone else's, or a token that matches
  nothing all raise the same ``Invitation.DoesNotExist`` (a 404), so neither existence nor addressee
  leaks.
- Whether an invitation can still be accepted (expired, already used, declined, withdrawn) is decided
  by the verbs in services.py, which answer with a sentence for the invitee.
"""
from __future__ import annotations

import hashlib
import logging
import secrets
import smtplib

from django.core.mail import send_mail

from .models import Invitation

logger = logging.getLogger(__name__)

TOKEN_BYTES = 32


def new_token() -> str:
    return secrets.token_urlsafe(TOKEN_BYTES)


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def invitation_for_invitee(user, *, pk: int | None = None, token: str | None = None) -> Invitation:
    """The invitation with this id or link token that is addressed to `user`; DoesNotExist otherwise."""
    invitations = Invitation.objects.addressed_to(user).select_related("tenant", "invited_by")
    if token is not None:
        return invitations.get(token_hash=hash_token(token))
    return invitations.get(pk=pk)


def looks_like_email(invited_as: str) -> bool:
    return "@" in invited_as and "." in invited_as.rsplit("@", 1)[-1]


def send_invitation_email(invitation: Invitation, link: str) -> bool:
    """Mail the link to an invitation typed as an e-mail address; return whether a mail went out.

    Whether to send depends only on what the inviter typed, never on whether an account has that
    address, so sending says nothing about accounts. A mail failure is logged, not raised: the
    invitee also finds the invitation on their Invitations page.
    """
    if not looks_like_email(invitation.invited_as):
        return False
    inviter = invitation.invited_by.get_username() if invitation.invited_by else "An owner"
    body = (
        f"{inviter} invited you to join {invitation.tenant.name} on lorafleet as "
        f"{invitation.get_role_display().lower()}.\n\n"
        f"Log in with the account that has this e-mail address, then accept or decline here:\n{link}\n\n"
        f"The link works once and expires on {invitation.expires_at:%Y-%m-%d %H:%M} UTC. "
        "If you did not expect this, ignore it: nothing happens unless you accept.\n"
    )
    try:
        send_mail(f"Invitation to {invitation.tenant.name} on lorafleet", body, None, [invitation.invited_as])
    except (OSError, smtplib.SMTPException):
        logger.warning("Could not send the invitation e-mail for invitation %s", invitation.pk, exc_info=True)
        return False
    return True
