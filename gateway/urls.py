from django.db.transaction import non_atomic_requests
from django.urls import path, re_path

from . import views

app_name = "gateway"

urlpatterns = [
    path("completions", non_atomic_requests(views.CompletionsView.as_view()), name="completions"),
    path("chat/completions", non_atomic_requests(views.ChatCompletionsView.as_view()), name="chat-completions"),
    path("models", views.ModelsView.as_view(), name="models"),
    path("models/<path:model>", views.ModelDetailView.as_view(), name="model-detail"),
    # anything else under /v1/ (including paths the converters cannot match, e.g. with a newline):
    # a JSON 404 in OpenAI's shape, never Django's HTML page
    re_path(r"^[\s\S]*$", views.unknown_route, name="unknown")  # [\s\S]: newlines too, and still reversible,
]
