"""Dashboard forms. Choice querysets are always narrowed to the current tenant.

The invitation form looks nothing up: whether an account has the typed name is not the inviter's
business (tenants.services.do_invite).
"""
from __future__ import annotations

from datetime import date, timedelta

from django import forms
from django.utils import timezone

from adapters import capacity
from adapters.models import Adapter, BaseModel, adapter_name_validator
from gateway.models import AuditStatus
from tenants.models import Role

# --- adapters ---------------------------------------------------------------------------------


class AdapterCreateForm(forms.Form):
    name = forms.CharField(max_length=64, validators=[adapter_name_validator],
                           help_text="Clients call it by this name (the `model` field). Letters, digits, . _ -")
    # Only the bases the tenant may use are offered, and only they are accepted (another is "not a valid choice",
    # as one that does not exist).
    base = forms.ModelChoiceField(queryset=BaseModel.objects.none(), empty_label=None,
                                  help_text="Every version of this adapter must fit this base model's shapes.")
    description = forms.CharField(max_length=500, required=False, widget=forms.Textarea(attrs={"rows": 2}))

    def __init__(self, *args, tenant, **kwargs):
        super().__init__(*args, **kwargs)
        self.tenant = tenant
        self.fields["base"].queryset = BaseModel.objects.usable_by(tenant)
        self.fields["base"].label_from_instance = lambda base: f"{base.display_name} ({base.architecture})"

    def clean_name(self):
        name = self.cleaned_data["name"]
        # Deleted adapters keep their name (audit rows and pointer history refer to it).
        if Adapter.objects.for_tenant(self.tenant).filter(name=name).exists():
            raise forms.ValidationError("This tenant already has an adapter with that name.")
        return name


class UploadForm(forms.Form):
    """The two files of a PEFT folder. Django has already streamed them to temporary files."""

    config_file = forms.FileField(label="adapter_config.json")
    weights_file = forms.FileField(label="adapter_model.safetensors")
    activate = forms.BooleanField(required=False, label="Make this version live once it is validated")


class ActivateForm(forms.Form):
    reason = forms.CharField(max_length=500, widget=forms.Textarea(attrs={"rows": 2}),
                             help_text="Recorded in the pointer history with your name and the time.")


class AuditFilterForm(forms.Form):
    q = forms.CharField(required=False, label="Request id", widget=forms.TextInput(attrs={"placeholder": "request id"}))
    adapter = forms.ModelChoiceField(queryset=None, required=False, empty_label="All adapters")
    version = forms.IntegerField(required=False, min_value=1, widget=forms.NumberInput(attrs={"placeholder": "any"}))
    status = forms.ChoiceField(required=False)
    date_from = forms.DateField(required=False, label="From", widget=forms.DateInput(attrs={"type": "date"}))
    date_to = forms.DateField(required=False, label="To", widget=forms.DateInput(attrs={"type": "date"}))

    def __init__(self, *args, tenant, **kwargs):
        super().__init__(*args, **kwargs)
        self.fields["adapter"].queryset = Adapter.objects.for_tenant(tenant)
        self.fields["adapter"].label_from_instance = lambda adapter: adapter.name
        self.fields["status"].choices = [("", "Any status"), *AuditStatus.choices]

    # The view turns dates into datetimes a day apart (date_to is inclusive): the first and last days a
    # calendar can name (0001-01-01, 9999-12-31) would overflow `datetime`, so they are a form error.
    _FIRST, _LAST = date.min + timedelta(days=1), date.max - timedelta(days=1)

    def _in_range(self, name: str):
        value = self.cleaned_data[name]
        if value is not None and not self._FIRST <= value <= self._LAST:
            raise forms.ValidationError(f"Pick a date between {self._FIRST.isoformat()} and {self._LAST.isoformat()}.")
        return value

    def clean_date_from(self):
        return self._in_range("date_from")

    def clean_date_to(self):
        return self._in_range("date_to")


class UsageWindowForm(forms.Form):
    window = forms.ChoiceField(choices=[("24h", "Last 24 hours"), ("7d", "Last 7 days")], required=False)


TARGET_CHOICES = [("attention-only", "attention-only (q, k, v, o)"), ("all-linear", "all-linear (+ gate, up, down)")]
DTYPE_CHOICES = [("bf16", "bf16"), ("fp16", "fp16"), ("fp32", "fp32"), ("fp8", "fp8")]


class CapacityForm(forms.Form):
    """Inputs of adapters.capacity.plan_capacity. `model` is "preset:<name>" or "base:<slug>" of a base the tenant
    may use (the published presets are for everyone)."""

    model = forms.ChoiceField(label="Base model")
    rank = forms.IntegerField(min_value=1, max_value=1024, initial=16)
    targets = forms.ChoiceField(choices=TARGET_CHOICES, initial="all-linear")
    dtype = forms.ChoiceField(choices=DTYPE_CHOICES, initial="bf16", label="Weights dtype")
    kv_dtype = forms.ChoiceField(choices=DTYPE_CHOICES, initial="bf16", label="KV cache dtype")
    adapters = forms.IntegerField(min_value=0, max_value=10_000_000, initial=100, label="Resident adapters")
    gpu_gb = forms.FloatField(min_value=0.5, max_value=10_000, initial=80, label="GPU memory (GB)")
    context_len = forms.IntegerField(min_value=1, max_value=10_000_000, initial=4096, label="Context length")

    def __init__(self, *args, tenant, **kwargs):
        super().__init__(*args, **kwargs)
        self.bases = BaseModel.objects.usable_by(tenant)
        choices = [(f"preset:{name}", name) for name in capacity.PRESET_NAMES]
        # the family (model_type) beside a registered base's name: which adapters fit it (Phi-3's name fused modules)
        choices += [(f"base:{b.slug}", f"{b.display_name} (registered, {b.architecture})") for b in self.bases]
        self.fields["model"].choices = choices
        self.fields["model"].initial = choices[0][0]

    def manifest(self) -> tuple[str, dict]:
        kind, _, name = self.cleaned_data["model"].partition(":")
        if kind == "base":
            base = self.bases.get(slug=name)
            return base.display_name, base.shape_manifest
        return name, capacity.preset_manifest(name)


# --- API keys ---------------------------------------------------------------------------------


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
        self.fields["bound_adapter"].queryset = Adapter.objects.for_tenant(tenant).live()
        self.fields["bound_adapter"].label_from_instance = lambda adapter: adapter.name

    def clean_expires_at(self):
        expires_at = self.cleaned_data.get("expires_at")
        if expires_at is not None and expires_at <= timezone.now():
            raise forms.ValidationError("The expiry must be in the future.")
        return expires_at


def _grantable_roles(granter_role: str) -> list[tuple[str, str]]:
    # Only an owner can make another owner; an admin cannot promote past itself.
    return [c for c in Role.choices if granter_role == Role.OWNER or c[0] != Role.OWNER]


# --- members ----------------------------------------------------------------------------------


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
