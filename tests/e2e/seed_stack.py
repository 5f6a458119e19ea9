"""Seeds the e2e database (run as a subprocess by tests/e2e/conftest.py with the stack's environment):
bases, two tenants with four adapters each, adapters for the failure tests, keys. Prints one JSON line.

    python tests/e2e/seed_stack.py CHECKPOINT_DIR WORK_DIR SUFFIX [light]

`light`: one tenant with two adapters and nothing else (the embedded-default smoke test).
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")

import django  # noqa: E402

django.setup()

from adapters.services import activate_version, create_adapter, register_base_model  # noqa: E402
from adapters.uploads import create_adapter_version  # noqa: E402
from gateway.services import issue_api_key, revoke_api_key  # noqa: E402
from tenants.services import create_tenant  # noqa: E402
from tests.support.peft_factory import make_random_peft_adapter  # noqa: E402


def main(checkpoint: str, work: str, suffix: str, mode: str = "full") -> dict:
    work_dir = Path(work)
    if not Path(checkpoint).exists():
        from demo.tiny_base import build_tiny_base

        build_tiny_base(checkpoint, arch="llama", seed=11)
    bases = {
        role: register_base_model(f"{role}-{suffix}", checkpoint, queue_name=f"e2e.{role}.{suffix}")
        for role in ("main", "idle", "crash")
    }
    out = {"bases": {role: {"slug": b.slug, "sha256": b.sha256, "queue": b.queue_name} for role, b in bases.items()},
           "tenants": {}, "adapters": {}, "keys": {}}
    seed = 0

    def upload(adapter, *, r=8, targets=("q_proj", "v_proj"), activate=None):
        nonlocal seed
        seed += 1
        folder = make_random_peft_adapter(checkpoint, work_dir / f"peft-{seed}", r=r, alpha=2 * r,
                                          target_modules=targets, seed=seed)
        with open(folder / "adapter_config.json", "rb") as cfg, open(folder / "adapter_model.safetensors", "rb") as w:
            v = create_adapter_version(adapter, config_file=cfg, weights_file=w, activate=activate)
        return {"id": v.pk, "number": v.number, "sha256": v.sha256, "storage_key": v.storage_key, "rank": v.rank,
                "alpha": v.alpha, "use_rslora": v.use_rslora, "target_modules": list(v.target_modules)}

    shapes = [dict(r=4), dict(r=8, targets=("q_proj", "k_proj", "v_proj", "o_proj")),
              dict(r=16, targets=("gate_proj", "up_proj", "down_proj")), dict(r=8)]
    if mode == "light":
        shapes = shapes[:2]
    for letter in ("a",) if mode == "light" else ("a", "b"):
        tenant = create_tenant(f"e2e-{letter}-{suffix}", f"Tenant {letter.upper()}")
        out["tenants"][letter] = {"id": tenant.pk, "slug": tenant.slug}
        _, secret = issue_api_key(tenant, "e2e")
        out["keys"][letter] = secret
        for i, shape in enumerate(shapes):
            adapter = create_adapter(tenant, f"{letter}-{i}", bases["main"])
            out["adapters"][adapter.name] = {"tenant": letter, "versions": [upload(adapter, **shape)]}
    if mode == "light":
        return out

    tenant_a = create_tenant(f"e2e-x-{suffix}", "Failures")
    out["tenants"]["x"] = {"id": tenant_a.pk, "slug": tenant_a.slug}
    _, out["keys"]["x"] = issue_api_key(tenant_a, "e2e")
    revoked, out["keys"]["revoked"] = issue_api_key(tenant_a, "revoked")
    revoke_api_key(revoked)
    for name in ("rollback", "corrupt", "vanished", "to-delete"):
        adapter = create_adapter(tenant_a, name, bases["main"])
        out["adapters"][name] = {"tenant": "x", "versions": [upload(adapter)]}
    rollback = tenant_a.adapters.get(name="rollback")
    out["adapters"]["rollback"]["versions"].append(upload(rollback, activate=True))
    create_adapter(tenant_a, "empty", bases["main"])
    crash = create_adapter(tenant_a, "crash", bases["crash"])
    out["adapters"]["crash"] = {"tenant": "x", "versions": [upload(crash)]}

    limited = create_tenant(f"e2e-limited-{suffix}", "Limited")
    limited.requests_per_minute = 3
    limited.save()
    out["tenants"]["limited"] = {"id": limited.pk, "slug": limited.slug}
    _, out["keys"]["limited"] = issue_api_key(limited, "e2e")
    assert activate_version  # re-exported for the rollback test's snippet
    return out


if __name__ == "__main__":
    print(json.dumps(main(*sys.argv[1:5])))
