"""Every dashboard page, mounted at the site root.

Two URL namespaces, named after what the pages are about (every `{% url %}` and `reverse()` uses them):
``tenants:`` for logging in, switching tenant, API keys, members and invitations; ``adapters:`` for
adapters and their versions, usage, the audit log and the capacity planner; ``finetuning:`` for datasets and
fine-tuning jobs.
"""
from django.contrib.auth import views as auth_views
from django.urls import include, path

from .views import adapters, finetune, keys, members, operator, reports

tenant_pages = [
    path("login/", auth_views.LoginView.as_view(template_name="registration/login.html", redirect_authenticated_user=True),
         name="login"),
    path("logout/", auth_views.LogoutView.as_view(), name="logout"),
    path("", members.home, name="home"),
    path("switch/", members.switch, name="switch"),
    path("keys/", keys.keys, name="keys"),
    path("keys/<int:pk>/revoke/", keys.revoke_key, name="revoke_key"),
    path("members/", members.members, name="members"),
    path("members/<int:pk>/role/", members.change_role, name="change_role"),
    path("members/<int:pk>/remove/", members.remove_member, name="remove_member"),
    path("members/leave/", members.leave, name="leave"),
    path("members/invitations/<int:pk>/revoke/", members.revoke_invitation, name="revoke_invitation"),
    # as the invitee: their own invitations, by id or by the e-mailed link's token
    path("invitations/", members.invitations, name="invitations"),
    path("invitations/<int:pk>/accept/", members.accept_invitation, name="accept_invitation"),
    path("invitations/<int:pk>/decline/", members.decline_invitation, name="decline_invitation"),
    path("invitations/link/<str:token>/", members.invitation_link, name="invitation_link"),
]

adapter_pages = [
    path("adapters/", adapters.adapter_list, name="list"),
    path("adapters/new/", adapters.adapter_create, name="create"),
    path("adapters/<int:pk>/", adapters.adapter_detail, name="detail"),
    path("adapters/<int:pk>/upload/", adapters.upload, name="upload"),
    path("adapters/<int:pk>/versions/<int:number>/activate/", adapters.activate, name="activate"),
    path("adapters/<int:pk>/delete/", adapters.adapter_delete, name="delete"),
    path("usage/", reports.usage_page, name="usage"),
    path("audit/", reports.audit, name="audit"),
    path("capacity/", reports.capacity_page, name="capacity"),
]

finetune_pages = [  # a tenant's datasets and fine-tuning jobs (viewers read; writers upload, start, cancel)
    path("fine-tuning/", finetune.jobs, name="jobs"),
    path("fine-tuning/files/", finetune.upload_file, name="upload"),
    path("fine-tuning/jobs/new/", finetune.create_job, name="create"),
    path("fine-tuning/jobs/<str:job_id>/", finetune.job_detail, name="job"),
    path("fine-tuning/jobs/<str:job_id>/cancel/", finetune.cancel, name="cancel"),
]

operator_pages = [  # staff only: every worker, its memory pool and resident adapters
    path("operator/workers/", operator.workers, name="workers"),
]

urlpatterns = [
    path("", include((tenant_pages, "tenants"))),
    path("", include((adapter_pages, "adapters"))),
    path("", include((finetune_pages, "finetuning"))),
    path("", include((operator_pages, "operator"))),
]
