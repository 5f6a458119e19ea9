"""Request and response shapes for the OpenAPI schema (drf-spectacular). The views validate bodies
with gateway/params.py, which names every refused field; these serializers document the same shapes."""
from __future__ import annotations

from rest_framework import serializers


class _Common(serializers.Serializer):
    model = serializers.CharField(help_text="`name` (active version) or `name@N` of one of your adapters, or "
                                            "`base/<slug>` for the base model when your organisation may use it.")
    max_tokens = serializers.IntegerField(
        required=False, min_value=1,
        help_text="Completions: 16 when left out. Chat: until a stop or the model's context when left out. At most "
                  "LORAFLEET_MAX_TOKENS_CAP when the server sets one.")
    temperature = serializers.FloatField(required=False, min_value=0, max_value=2, default=1.0)
    top_p = serializers.FloatField(required=False, min_value=0, max_value=1, default=1.0)
    top_k = serializers.IntegerField(required=False, min_value=0, default=0, help_text="lorafleet extension; 0 = off.")
    seed = serializers.IntegerField(required=False, allow_null=True)
    stop = serializers.JSONField(required=False, help_text="A string or a list of up to 4 strings.")
    stream = serializers.BooleanField(required=False, default=False)
    stream_options = serializers.JSONField(required=False, help_text='{"include_usage": true}')
    ignore_eos = serializers.BooleanField(required=False, default=False)
    n = serializers.IntegerField(required=False, min_value=1, max_value=8, default=1,
                                 help_text="Choices; the prompt is prefilled once for all of them.")
    presence_penalty = serializers.FloatField(required=False, min_value=-2, max_value=2, default=0.0)
    frequency_penalty = serializers.FloatField(required=False, min_value=-2, max_value=2, default=0.0)
    repetition_penalty = serializers.FloatField(required=False, min_value=0, max_value=2, default=1.0,
                                                help_text="lorafleet extension (vLLM's); 1 = off.")
    logit_bias = serializers.DictField(child=serializers.FloatField(min_value=-100, max_value=100), required=False,
                                       help_text='{"<token id>": bias}')
    return_tokens_as_token_ids = serializers.BooleanField(
        required=False, default=False, help_text='lorafleet extension (vLLM\'s): logprob tokens as "token_id:<id>".')
    user = serializers.CharField(required=False)
    cache_salt = serializers.CharField(
        required=False, max_length=256,
        help_text="lorafleet extension (vLLM's): requests reuse each other's cached prompt prefix only with the same "
                  "salt (the cache is always separate per organisation and adapter).")


class CompletionRequest(_Common):
    prompt = serializers.JSONField(help_text="A string, a list of one string, or a list of token ids.")
    logprobs = serializers.IntegerField(required=False, allow_null=True, min_value=0, max_value=5,
                                        help_text="Alternatives per token; the log-softmax of the model's logits "
                                                  "before any sampling parameter.")
    echo = serializers.BooleanField(required=False, default=False)
    best_of = serializers.IntegerField(required=False, allow_null=True, min_value=1,
                                       help_text="Only equal to n: server-side ranking is not built.")


class ChatMessage(serializers.Serializer):
    role = serializers.ChoiceField(choices=["system", "developer", "user", "assistant"])
    content = serializers.CharField()


class ChatRequest(_Common):
    messages = ChatMessage(many=True)
    max_completion_tokens = serializers.IntegerField(required=False, min_value=1)
    logprobs = serializers.BooleanField(required=False, default=False)
    top_logprobs = serializers.IntegerField(required=False, allow_null=True, min_value=0, max_value=20,
                                            help_text="Needs logprobs: true.")


class Lorafleet(serializers.Serializer):
    request_id = serializers.UUIDField()
    adapter = serializers.CharField(allow_null=True)
    version = serializers.IntegerField(allow_null=True)
    weights_sha256 = serializers.CharField(allow_null=True, help_text="sha256 of the weights the worker verified.")
    adapter_identity = serializers.CharField(allow_null=True, help_text="sha256 over those weights' sha256 and the "
                                             "adapter's rank, alpha, rsLoRA and target modules, as served.")
    adapter_dtype = serializers.CharField(allow_null=True, help_text="How the worker held the adapter's weights: "
                                          "float32, or float16 / bfloat16 from a 16-bit adapter pool.")
    base_model = serializers.CharField()
    base_sha256 = serializers.CharField()
    worker_id = serializers.CharField(allow_null=True)


class PromptTokensDetails(serializers.Serializer):
    cached_tokens = serializers.IntegerField(help_text="Prompt tokens read from the worker's prefix cache.")


class Usage(serializers.Serializer):
    prompt_tokens = serializers.IntegerField()
    prompt_tokens_details = PromptTokensDetails()
    completion_tokens = serializers.IntegerField(help_text="Tokens of every choice.")
    total_tokens = serializers.IntegerField()


class CompletionLogprobs(serializers.Serializer):
    tokens = serializers.ListField(child=serializers.CharField(allow_blank=True))
    token_logprobs = serializers.ListField(child=serializers.FloatField(allow_null=True))
    top_logprobs = serializers.ListField(child=serializers.DictField(child=serializers.FloatField(), allow_null=True))
    text_offset = serializers.ListField(child=serializers.IntegerField())


class CompletionChoice(serializers.Serializer):
    index = serializers.IntegerField()
    text = serializers.CharField(allow_blank=True)
    finish_reason = serializers.CharField(allow_null=True)
    logprobs = CompletionLogprobs(allow_null=True)


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


class TopLogprob(serializers.Serializer):
    token = serializers.CharField(allow_blank=True)
    logprob = serializers.FloatField()
    bytes = serializers.ListField(child=serializers.IntegerField(), allow_null=True)


class TokenLogprob(TopLogprob):
    top_logprobs = TopLogprob(many=True)


class ChatLogprobs(serializers.Serializer):
    content = TokenLogprob(many=True, allow_null=True)
    refusal = TokenLogprob(many=True, allow_null=True)


class ChatChoice(serializers.Serializer):
    index = serializers.IntegerField()
    message = AssistantMessage()
    finish_reason = serializers.CharField(allow_null=True)
    logprobs = ChatLogprobs(allow_null=True)


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
