import csv

from django.contrib import admin
from django.http import StreamingHttpResponse
from django.urls import path

from adapters.admin import ReadOnlyAdmin

from .models import ApiKey, AuditRecord
from .responses import public_worker_id
from .services import revoke_api_key

CSV_FIELDS = [
    "request_id", "created_at", "finished_at", "route", "tenant_id", "key_prefix", "adapter_name", "version_number",
    "expected_sha256", "weights_sha256", "adapter_identity", "adapter_dtype", "base_slug", "base_sha256", "worker_id",
    "status", "http_status", "error_code", "finish_reason", "attempts", "prompt_tokens", "completion_tokens", "queue_seconds",
    "first_token_seconds", "total_seconds", "cached_tokens", "preemptions",
]


class _Echo:
    def write(self, value):
        return value


@admin.register(AuditRecord)
class AuditRecordAdmin(ReadOnlyAdmin):
    """Read-only: the audit log answers "which weights produced this response?" and never changes."""

    list_display = [
        "request_id", "created_at", "tenant", "adapter_name", "version_number", "short_weights_sha256",
        "status", "http_status", "error_code", "prompt_tokens", "cached_tokens", "completion_tokens", "preemptions",
        "total_seconds",
    ]
    list_filter = ["tenant", "adapter", "version", "status", "base_model", "adapter_dtype", "error_code",
                   ("created_at", admin.DateFieldListFilter)]
    search_fields = ["request_id", "weights_sha256", "expected_sha256", "adapter_identity", "key_prefix"]
    date_hierarchy = "created_at"
    list_select_related = ["tenant"]
    show_full_result_count = False

    def has_change_permission(self, request, obj=None):
        return False

    def get_search_fields(self, request):
        # request_id is a UUID: an exact match on a malformed UUID would raise, so only try valid ones.
        import uuid

        try:
            uuid.UUID(request.GET.get("q", "").strip())
        except ValueError:
            return ["weights_sha256", "expected_sha256", "adapter_identity", "key_prefix"]
        return ["=request_id", "weights_sha256", "expected_sha256", "adapter_identity", "key_prefix"]

    def get_readonly_fields(self, request, obj=None):
        return [*super().get_readonly_fields(request, obj), "public_worker_id"]

    @admin.display(description="worker id shown to the caller")
    def public_worker_id(self, obj):
        """What the response's X-Lorafleet-Worker said, to match a customer's report to worker_id."""
        return public_worker_id(obj.worker_id) or "-"

    @admin.display(description="weights sha256")
    def short_weights_sha256(self, obj):
        return obj.weights_sha256[:12]

    def get_urls(self):
        return [path("csv/", self.admin_site.admin_view(self.export_csv), name="gateway_auditrecord_csv")] + super().get_urls()

    def export_csv(self, request):
        """Stream the rows the change list shows for the same filters and search, as CSV."""
        if not self.has_view_permission(request):
            from django.core.exceptions import PermissionDenied

            raise PermissionDenied
        changelist = self.get_changelist_instance(request)
        rows = changelist.get_queryset(request).values_list(*CSV_FIELDS).iterator(chunk_size=2000)
        writer = csv.writer(_Echo())

        def stream():
            yield writer.writerow(CSV_FIELDS)
            for row in rows:
                yield writer.writerow(row)

        response = StreamingHttpResponse(stream(), content_type="text/csv")
        response["Content-Disposition"] = 'attachment; filename="audit.csv"'
        return response


@admin.register(ApiKey)
class ApiKeyAdmin(admin.ModelAdmin):
    """Keys are issued through the dashboard or `create_api_key`; here they can be inspected and revoked.

    The secret is never stored, so it cannot be shown; the hash is not shown either.
    """

    list_display = ["__str__", "name", "tenant", "bound_adapter", "created_at", "expires_at", "revoked_at", "revoked_by",
                    "last_used_at"]
    list_filter = ["tenant", ("revoked_at", admin.EmptyFieldListFilter)]
    search_fields = ["key_id", "name", "tenant__slug"]
    exclude = ["secret_hash"]
    # Revocation goes through the action below (gateway.services.revoke_api_key records who), never the form.
    readonly_fields = ["tenant", "key_id", "last4", "created_by", "created_at", "last_used_at", "bound_adapter",
                       "revoked_at", "revoked_by"]
    actions = ["revoke"]

    def has_add_permission(self, request):
        return False

    @admin.action(description="Revoke selected keys")
    def revoke(self, request, queryset):
        for key in queryset:
            revoke_api_key(key, actor=request.user)
        self.message_user(request, f"Revoked {queryset.count()} key(s).")
