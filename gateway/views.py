"""The OpenAI-compatible API under /v1/. Thin: serving.py holds the request path, binding.py the rules."""
from __future__ import annotations

from django.http import JsonResponse
from drf_spectacular.extensions import OpenApiAuthenticationExtension
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, OpenApiResponse, extend_schema
from rest_framework import exceptions
from rest_framework.authentication import BaseAuthentication
from rest_framework.parsers import JSONParser
from rest_framework.views import APIView

from adapters.models import Adapter, BaseModel

from . import serializers as s
from .auth import KeyRefused, authenticate
from .binding import BASE_PREFIX, resolve_target
from .errors import ApiError
from .serving import serve

_ERRORS = {code: OpenApiResponse(s.ErrorResponse)
           for code in (400, 401, 403, 404, 409, 410, 413, 422, 429, 502, 503, 504)}
_SSE = OpenApiResponse(OpenApiTypes.STR, description="With `stream: true`: server-sent events, one OpenAI chunk "
                                                     "per `data:` line, then `data: [DONE]`.")


class ApiKeyInHeader(BaseAuthentication):
    """Documents `Authorization: Bearer <key>` in the schema. It authenticates nothing itself: the views
    check the key (gateway/auth.py) so that every refusal is answered in OpenAI's error shape."""

    def authenticate(self, request):
        return None

    def authenticate_header(self, request) -> str:
        return 'Bearer realm="lorafleet"'


class ApiKeyScheme(OpenApiAuthenticationExtension):
    target_class = ApiKeyInHeader
    name = "bearerAuth"

    def get_security_definition(self, auto_schema):
        return {"type": "http", "scheme": "bearer", "description": "An API key: `lf_live_…`."}


class OpenAIView(APIView):
    """The body is read raw and checked by gateway/params.py (DRF never parses it: JSONParser is listed
    for the schema only), so every refusal is answered in OpenAI's error shape."""

    authentication_classes = [ApiKeyInHeader]
    permission_classes: list = []
    parser_classes = [JSONParser]

    def perform_content_negotiation(self, request, force=False):
        # `Accept: text/event-stream` (streaming clients) must not be a 406: the view picks the format.
        return super().perform_content_negotiation(request, force=True)

    def handle_exception(self, exc):
        """DRF's own refusals (405, malformed headers...) in OpenAI's error shape too, in our words: no answer
        carries a library's text (issue 47)."""
        if isinstance(exc, exceptions.APIException):
            codes = exc.get_codes()
            code = codes if isinstance(codes, str) else "invalid_request"
            if isinstance(exc, exceptions.MethodNotAllowed):
                message = f"This route does not accept {self.request.method[:16]!r}; see /api/docs/."
            else:
                message = f"The request was refused (HTTP {exc.status_code}); see /api/docs/."
            return ApiError(exc.status_code, code, message).response()
        return super().handle_exception(exc)


class CompletionsView(OpenAIView):
    @extend_schema(
        operation_id="create_completion", request=s.CompletionRequest,
        responses={(200, "application/json"): s.CompletionResponse, (200, "text/event-stream"): _SSE, **_ERRORS},
        description="Text completion with one of your adapters. `stream: true` answers with server-sent events.",
    )
    def post(self, request):
        return serve(request._request, route="completions", chat=False)


class ChatCompletionsView(OpenAIView):
    @extend_schema(
        operation_id="create_chat_completion", request=s.ChatRequest,
        responses={(200, "application/json"): s.ChatResponse, (200, "text/event-stream"): _SSE, **_ERRORS},
        description="Chat completion; messages are rendered with the base model's chat template.",
    )
    def post(self, request):
        return serve(request._request, route="chat.completions", chat=True)


def _adapter_entry(adapter: Adapter) -> dict:
    version = adapter.active_version
    return {
        "id": adapter.name, "object": "model", "created": int(adapter.created_at.timestamp()),
        "owned_by": adapter.tenant.slug,
        "lorafleet": {
            "kind": "adapter", "base_model": adapter.base.slug,
            "active_version": version.number if version else None,
            "weights_sha256": version.sha256 if version else None,
        },
    }


def _base_entry(base: BaseModel) -> dict:
    return {"id": BASE_PREFIX + base.slug, "object": "model", "created": int(base.created_at.timestamp()),
            "owned_by": "lorafleet", "lorafleet": {"kind": "base", "base_model": base.slug, "base_sha256": base.sha256}}


def _authenticated(request):
    try:
        return authenticate(request._request), None
    except KeyRefused as err:
        return None, err.response()


class ModelsView(OpenAIView):
    @extend_schema(operation_id="list_models", responses={200: s.ModelList, 401: OpenApiResponse(s.ErrorResponse)})
    def get(self, request):
        """Your adapters (a bound key sees only its own) and, if your organisation may use it, the base."""
        key, refusal = _authenticated(request)
        if refusal is not None:
            return refusal
        adapters = Adapter.objects.for_tenant(key.tenant).live().select_related("tenant", "base", "active_version")
        if key.bound_adapter_id is not None:
            adapters = adapters.filter(pk=key.bound_adapter_id)
        data = [_adapter_entry(a) for a in adapters]
        if key.tenant.may_use_base and key.bound_adapter_id is None:
            data += [_base_entry(b) for b in BaseModel.objects.all()]
        return JsonResponse({"object": "list", "data": data})


class ModelDetailView(OpenAIView):
    @extend_schema(operation_id="retrieve_model", responses={200: s.ModelEntry, **_ERRORS},
                   parameters=[OpenApiParameter("model", str, OpenApiParameter.PATH)])
    def get(self, request, model: str):
        key, refusal = _authenticated(request)
        if refusal is not None:
            return refusal
        try:
            target = resolve_target(key, model)
        except ApiError as err:
            return err.response()
        if target.adapter is None:
            return JsonResponse(_base_entry(target.base))
        entry = _adapter_entry(target.adapter)
        entry["id"] = model
        entry["lorafleet"].update(version=target.version.number, weights_sha256=target.version.sha256)
        return JsonResponse(entry)


def unknown_route(request, *args, **kwargs):
    return ApiError(404, "not_found", f"No API route {request.path!r}; see /api/docs/.").response()
