"""The models keep the layers of pyproject's import-linter contract: a relation points at a model of the
same app or of a lower one, never up (tenants is a leaf); and no app finds another's model by name at
run time, which the import linter could not see."""
from __future__ import annotations

import re
import tomllib
from pathlib import Path

from django.apps import apps

ROOT = Path(__file__).resolve().parents[2]
SKIP = {".venv", "var", "node_modules", ".git"}


def django_layers() -> list[str]:
    """The Django apps of the layers contract, top first (config and demo have no models)."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    (layers,) = [c["layers"] for c in config["tool"]["importlinter"]["contracts"] if c["type"] == "layers"]
    return layers


def test_no_model_of_a_lower_app_references_a_higher_one():
    layers = django_layers()
    assert {"dashboard", "gateway", "adapters", "tenants"} <= set(layers)
    upward = []
    for model in apps.get_models():
        app = model._meta.app_label
        if app not in layers:
            continue
        for field in model._meta.get_fields():
            if not (field.is_relation and field.concrete and field.related_model is not None):
                continue  # reverse accessors are the other model's forward relations
            target = field.related_model._meta.app_label
            if target in layers and layers.index(target) < layers.index(app):
                upward.append(f"{model._meta.label}.{field.name} -> {field.related_model._meta.label}")
    assert upward == []


def test_no_app_looks_a_model_up_by_name_outside_migrations():
    pattern = re.compile(r"\bget_" + r"model\(")  # spelled apart so this file does not match itself
    found = []
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT).parts
        if SKIP & set(parts) or "migrations" in parts:
            continue
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), start=1):
            if pattern.search(line):
                found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert found == []
