from django.apps import AppConfig


class DemoConfig(AppConfig):
    """`make demo`'s setup: the demo base (SmolLM2 imported from GGUF, or a tiny one trained locally),
    its style adapters, tenants and keys. Nothing in the worker imports it."""

    name = "demo"
    default_auto_field = "django.db.models.BigAutoField"
