"""Request shapes of the Files and fine-tuning API for the OpenAPI schema (drf-spectacular). The views check bodies
themselves (finetune/params.py, finetune/files.py), naming every refused field; these document the same shapes."""
from __future__ import annotations

from rest_framework import serializers


class FileUpload(serializers.Serializer):
    file = serializers.FileField(help_text="The JSONL dataset: one {\"messages\": [...]} example per line.")
    purpose = serializers.ChoiceField(choices=["fine-tune"])
    model = serializers.CharField(required=False, help_text="lorafleet extension: a base to check every example's "
                                                            "token length against now, instead of at job creation.")


class Hyperparameters(serializers.Serializer):
    n_epochs = serializers.JSONField(required=False, help_text='1-50 or "auto" (3).')
    batch_size = serializers.JSONField(required=False, help_text='1-256 or "auto" (min(8, examples)).')
    learning_rate_multiplier = serializers.JSONField(required=False, help_text='Above 0, at most 100, or "auto" (1).')


class Lora(serializers.Serializer):
    rank = serializers.IntegerField(required=False, min_value=1, help_text="8; at most the base's max_lora_rank.")
    alpha = serializers.IntegerField(required=False, min_value=1, help_text="2 x rank.")
    target_modules = serializers.ListField(child=serializers.CharField(), required=False,
                                           help_text="The base's attention projections.")


class JobCreate(serializers.Serializer):
    model = serializers.CharField(help_text="A base your organisation may use: `slug` or `base/slug`.")
    training_file = serializers.CharField(help_text="`file-…`")
    validation_file = serializers.CharField(required=False, allow_null=True)
    suffix = serializers.CharField(required=False, allow_null=True, max_length=64,
                                   help_text="The adapter the result becomes a version of (created if new).")
    seed = serializers.IntegerField(required=False, allow_null=True, min_value=0)
    hyperparameters = Hyperparameters(required=False)
    method = serializers.JSONField(required=False, help_text='{"type": "supervised", "supervised": '
                                                             '{"hyperparameters": {...}}}')
    metadata = serializers.DictField(child=serializers.CharField(max_length=512), required=False)
    lora = Lora(required=False, help_text="lorafleet extension.")
    auto_activate = serializers.BooleanField(required=False, default=False,
                                             help_text="lorafleet extension: make the new version live at once.")
