"""Request and response shapes for the OpenAPI schema (drf-spectacular). The views validate bodies
with gateway/params.py, which names every refused field; these serializers document the same shapes."""
from __future__ import annotations

from rest_framework import serializers


class _Common(serializers.Serializer):
    model = serializers.CharField(help_text="`name` (active version) or `name@N` of one of your adapters, or "
                                            "`base/<slug>` for the base model when your organisation may use it.")
    max_tokens = serializers.IntegerField(required=False, min_value=1, default=16)
    temperature = serializers.FloatField(required=False, min_value=0, max_value=2, default=1.0)
    top_p = serializers.FloatField(required=False, min_value=0, max_value=1, default=1.0)
    top_k = serializers.IntegerField(required=False, min_value=0, default=0, help_text="lorafleet extension; 0 = off.")
    seed = serializers.IntegerField(required=False, allow_null=True)
    stop = serializers.JSONField(required=False, help_text="A string or a list of up to 4 strings.")
    stream = serializers.BooleanField(required=False, default=False)
    stream_options = serializers.JSONField(required=False, help_text='{"include_usage": true}')
    ignore_eos = serializers.BooleanField(required=False, default=False)
    n = serializers.IntegerField(required=False, min_value=1, max_value=1)
    user = serializers.CharField(required=False)


class CompletionRequest(_Common):
    prompt = serializers.JSONField(help_text="A string, a list of one string, or a list of token ids.")


class ChatMessage(serializers.Serializer):
    role = serializers.ChoiceField(choices=["system", "developer", "user", "assistant"])
    content = serializers.CharField()


class ChatRequest(_Common):
    messages = ChatMessage(many=True)
    max_completion_tokens = serializers.IntegerField(required=False, min_value=1)


class Lorafleet(serializers.Serializer):
    request_id = serializers.UUIDField()
    adapter = serializers.CharField(allow_null=True)
    version = serializers.IntegerField(allow_null=True)
    weights_sha256 = serializers.CharField(allow_null=True, help_text="sha256 of the weights the worker verified.")
    base_model = serializers.CharField()
    base_sha256 = serializers.CharField()
    worker_id = serializers.CharField(allow_null=True)


class Usage(serializers.Serializer):
    prompt_tokens = serializers.IntegerField()
    completion_tokens = serializers.IntegerField()
    total_tokens = serializers.IntegerField()


class CompletionChoice(serializers.Serializer):
    index = serializers.IntegerField()
    text = serializers.CharField(allow_blank=True)
    finish_reason = serializers.CharField(allow_null=True)
    logprobs = serializers.JSONField(allow_null=True)


class CompletionResponse(serializers.Serializer):
    id = serializers.CharField()
    object = serializers.CharField()
    created = serializers.IntegerField()
    model = serializers.CharField()
    choices = CompletionChoice(many=True)
    usage = Usage()
    lorafleet = Lorafleet()


class AssistantMessage(serializers.Serializer):
    role = serializers.CharField()
    content = serializers.CharField(allow_blank=True)


class ChatChoice(serializers.Serializer):
    index = serializers.IntegerField()
    message = AssistantMessage()
    finish_reason = serializers.CharField(allow_null=True)
    logprobs = serializers.JSONField(allow_null=True)


class ChatResponse(CompletionResponse):
    choices = ChatChoice(many=True)


class ErrorBody(serializers.Serializer):
    message = serializers.CharField()
    type = serializers.CharField()
    param = serializers.CharField(allow_null=True)
    code = serializers.CharField(allow_null=True)


class ErrorResponse(serializers.Serializer):
    error = ErrorBody()


class ModelEntry(serializers.Serializer):
    id = serializers.CharField()
    object = serializers.CharField()
    created = serializers.IntegerField()
    owned_by = serializers.CharField()
    lorafleet = serializers.JSONField()


class ModelList(serializers.Serializer):
    object = serializers.CharField()
    data = ModelEntry(many=True)
