from django.db.transaction import non_atomic_requests
from django.urls import path

from . import views

app_name = "gateway"

urlpatterns = [
    path("completions", non_atomic_requests(views.CompletionsView.as_view()), name="completions"),
    path("chat/completions", non_atomic_requests(views.ChatCompletionsView.as_view()), name="chat-completions"),
    path("models", views.ModelsView.as_view(), name="models"),
    path("models/<path:model>", views.ModelDetailView.as_view(), name="model-detail"),
]
