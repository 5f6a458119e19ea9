from django.apps import AppConfig


class DashboardConfig(AppConfig):
    """Every page a person sees (tenants' pages; the operator's are in Django's admin). No models."""

    name = "dashboard"
