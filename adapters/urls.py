"""Dashboard routes of the adapters app (mounted at the site root: /adapters/…, /usage/, /audit/, /capacity/)."""
from django.urls import path

from . import views

app_name = "adapters"

urlpatterns = [
    path("adapters/", views.adapter_list, name="list"),
    path("adapters/new/", views.adapter_create, name="create"),
    path("adapters/<int:pk>/", views.adapter_detail, name="detail"),
    path("adapters/<int:pk>/upload/", views.upload, name="upload"),
    path("adapters/<int:pk>/versions/<int:number>/activate/", views.activate, name="activate"),
    path("adapters/<int:pk>/delete/", views.adapter_delete, name="delete"),
    path("usage/", views.usage_page, name="usage"),
    path("audit/", views.audit, name="audit"),
    path("capacity/", views.capacity_page, name="capacity"),
]
