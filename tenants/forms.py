"""Dashboard forms for API keys and members. Querysets are always narrowed to the current tenant."""
from __future__ import annotations

from django import forms
from django.apps import apps
from django.contrib.auth import get_user_model
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


class MemberForm(forms.Form):
    """Add a registered user to the tenant, or change the role of one already in it."""

    username = forms.CharField(max_length=150, label="Username or e-mail")
    role = forms.ChoiceField(choices=Role.choices, initial=Role.MEMBER)

    def __init__(self, *args, granter_role: str, **kwargs):
        super().__init__(*args, **kwargs)
        if granter_role != Role.OWNER:
            # Only an owner can make another owner; an admin cannot promote past itself.
            self.fields["role"].choices = [c for c in Role.choices if c[0] != Role.OWNER]

    def clean_username(self):
        value = self.cleaned_data["username"].strip()
        users = get_user_model().objects
        user = users.filter(username=value).first() or users.filter(email__iexact=value).first()
        if user is None:
            raise forms.ValidationError("No user with that username or e-mail; they need an account first.")
        self.user = user
        return value
