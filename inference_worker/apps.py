from django.apps import AppConfig


class InferenceWorkerConfig(AppConfig):
    name = "inference_worker"
    default_auto_field = "django.db.models.BigAutoField"
