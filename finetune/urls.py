from django.db.transaction import non_atomic_requests
from django.urls import path

from . import api

app_name = "finetune"

# Mounted under /v1/ before the gateway's routes (whose last pattern answers every unknown /v1/ path).
urlpatterns = [
    path("files", non_atomic_requests(api.FilesView.as_view()), name="files"),
    path("files/<str:file_id>", api.FileDetailView.as_view(), name="file-detail"),
    path("files/<str:file_id>/content", api.FileContentView.as_view(), name="file-content"),
    path("fine_tuning/jobs", non_atomic_requests(api.JobsView.as_view()), name="jobs"),
    path("fine_tuning/jobs/<str:job_id>", api.JobDetailView.as_view(), name="job-detail"),
    path("fine_tuning/jobs/<str:job_id>/cancel", api.JobCancelView.as_view(), name="job-cancel"),
    path("fine_tuning/jobs/<str:job_id>/events", api.JobEventsView.as_view(), name="job-events"),
]
