"""Which weights answer a request: derived from the principal, never trusted from the body alone.

- A key bound to an adapter always uses that adapter; a request naming anything else is refused.
- Otherwise `model` names an adapter of the key's tenant: `name` (its active version) or `name@N`
  (pinned). Another tenant's adapter, a missing one and a malformed name all get the same 404.
- The base model is served only when named explicitly as `base/<slug>` and the tenant may use it; a
  tenant that may not gets the same 404 as for a missing model (which bases exist is not its business).
  Adapter names cannot contain "/", so the two namespaces never collide — and a request for an
  adapter never silently falls back to the base.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from adapters.models import Adapter, AdapterVersion, BaseModel

from .errors import ApiError, adapter_deleted, adapter_not_found, adapter_not_ready

BASE_PREFIX = "base/"
_MODEL_RE = re.compile(r"^(?P<name>[A-Za-z0-9][A-Za-z0-9._-]{0,63})(?:@(?P<number>[1-9][0-9]{0,8}))?$")


@dataclass
class Target:
    base: BaseModel
    adapter: Adapter | None = None
    version: AdapterVersion | None = None

    @property
    def model_id(self) -> str:
        """What the response's `model` field says: exactly which weights answered."""
        if self.adapter is None:
            return BASE_PREFIX + self.base.slug
        return f"{self.adapter.name}@{self.version.number}"


def parse_model_name(model: str) -> tuple[str, int | None] | None:
    match = _MODEL_RE.match(model or "")
    if match is None:
        return None
    number = match.group("number")
    return match.group("name"), int(number) if number else None


def resolve_target(key, model: str) -> Target:
    """Resolve `model` for this key, or raise the ApiError the caller must get (404/403/410/409)."""
    tenant = key.tenant
    model = (model or "").strip()
    if key.bound_adapter_id is not None:
        return _resolve_bound(key, model)
    if model.startswith(BASE_PREFIX):
        return _resolve_base(tenant, model)
    parsed = parse_model_name(model)
    if parsed is None:
        raise adapter_not_found(model)
    name, number = parsed
    adapter = Adapter.objects.for_tenant(tenant).select_related("base", "active_version").filter(name=name).first()
    if adapter is None:
        raise adapter_not_found(model)
    return _resolve_version(adapter, number, model)


def _resolve_bound(key, model: str) -> Target:
    adapter = (
        Adapter.objects.for_tenant(key.tenant).select_related("base", "active_version")
        .filter(pk=key.bound_adapter_id).first()
    )
    if adapter is None:  # cannot happen while the foreign key protects it; never serve something else
        raise adapter_not_found(model)
    parsed = parse_model_name(model) if model else (adapter.name, None)
    if parsed is None or parsed[0] != adapter.name:
        raise ApiError(
            403, "adapter_mismatch",
            f"This API key is bound to the adapter {adapter.name!r}; it cannot call {model!r}.",
            type="permission_error", param="model",
        )
    return _resolve_version(adapter, parsed[1], model or adapter.name)


def _resolve_version(adapter: Adapter, number: int | None, model: str) -> Target:
    err = None
    if adapter.is_deleted:
        err = adapter_deleted(adapter.name)
    elif number is None:
        version = adapter.active_version
        if version is None:
            err = adapter_not_ready(adapter.name)
    else:
        version = AdapterVersion.objects.filter(adapter=adapter, number=number).first()
        if version is None:
            err = adapter_not_found(model)
    if err is not None:
        err.adapter = adapter  # the caller's own adapter: the audit row names it
        raise err
    return Target(base=adapter.base, adapter=adapter, version=version)


def _resolve_base(tenant, model: str) -> Target:
    base = BaseModel.objects.usable_by(tenant).filter(slug=model[len(BASE_PREFIX):]).first()
    if base is None:
        raise adapter_not_found(model)
    return Target(base=base)
