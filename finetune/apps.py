from django.apps import AppConfig


class FinetuneConfig(AppConfig):
    name = "finetune"
    verbose_name = "Fine-tuning"
    default_auto_field = "django.db.models.BigAutoField"
