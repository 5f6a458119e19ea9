"""Dashboard forms for API keys, invitations and roles. Querysets are always narrowed to the current tenant.

The invitation form looks nothing up: whether an account has the typed name is not the inviter's
business (services.do_invite).
"""
from __future__ import annotations

from django import forms
from django.apps import apps
from django.utils import timezone

from .models import Role


class ApiKeyCreateForm(forms.Form):
    name = forms.CharField(max_length=100, help_text="What uses this key, e.g. “billing-service prod”.")
    bound_adapter = forms.ModelChoiceField(
        queryset=None,
        required=False,
        empty_label="Any adapter of this tenant",
        help_text="A bound key can only call this adapter; requests naming another are refused.",
    )
    expires_at = forms.DateTimeField(
        required=False,
        widget=forms.DateTimeInput(attrs={"type": "datetime-local"}),
        help_text="Optional. Leave empty for a key that never expires (you can revoke it any time).",
    )

    def __init__(self, *args, tenant, **kwargs):
        super().__init__(*args, **kwargs)
        # adapters depends on tenants, not the other way round: look the model up by name.
        adapter_model = apps.get_model("adapters", "Adapter")
        self.fields["bound_adapter"].queryset = adapter_model.objects.for_tenant(tenant).live()
        self.fields["bound_adapter"].label_from_instance = lambda adapter: adapter.name

    def clean_expires_at(self):
        expires_at = self.cleaned_data.get("expires_at")
        if expires_at is not None and expires_at <= timezone.now():
            raise forms.ValidationError("The expiry must be in the future.")
        return expires_at


def _grantable_roles(granter_role: str) -> list[tuple[str, str]]:
    # Only an owner can make another owner; an admin cannot promote past itself.
    return [c for c in Role.choices if granter_role == Role.OWNER or c[0] != Role.OWNER]


class InviteForm(forms.Form):
    """Invite someone by username or e-mail to join the tenant with a role; they accept or decline."""

    username = forms.CharField(max_length=254, label="Username or e-mail")
    role = forms.ChoiceField(choices=Role.choices, initial=Role.MEMBER)

    def __init__(self, *args, granter_role: str, **kwargs):
        super().__init__(*args, **kwargs)
        self.fields["role"].choices = _grantable_roles(granter_role)

    def clean_username(self):
        return self.cleaned_data["username"].strip()


class RoleForm(forms.Form):
    """Change the role of someone already in the tenant."""

    role = forms.ChoiceField(choices=Role.choices)

    def __init__(self, *args, granter_role: str, **kwargs):
        super().__init__(*args, **kwargs)
        self.fields["role"].choices = _grantable_roles(granter_role)
