from django.contrib import admin
from django.urls import include, path
from drf_spectacular.views import SpectacularAPIView

from gateway.docs import api_docs
from gateway.metrics import metrics_view

urlpatterns = [
    path("admin/", admin.site.urls),
    path("v1/", include("finetune.urls")),  # OpenAI-compatible Files and fine-tuning jobs (before the gateway's 404)
    path("v1/", include("gateway.urls")),  # OpenAI-compatible inference API
    path("metrics", metrics_view, name="metrics"),  # Prometheus
    path("api/schema/", SpectacularAPIView.as_view(), name="schema"),
    path("api/docs/", api_docs, name="api-docs"),  # rendered on the server: works offline
    path("", include("dashboard.urls")),  # every page: login, tenants, keys, members, adapters, usage, audit, capacity
]
