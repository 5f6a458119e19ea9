from django.contrib import admin
from django.urls import include, path

urlpatterns = [
    path("admin/", admin.site.urls),
    path("", include("tenants.urls")),  # dashboard: login, tenant switcher, keys, members
    path("", include("adapters.urls")),  # dashboard: adapters, versions, usage, audit, capacity
]
