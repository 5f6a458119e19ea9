"""Fine-tuning in admin: files, jobs with their events, per-tenant limits, and each trained version's provenance.

The audit row links to the adapter version that answered (gateway/admin.py); the version's page here shows how
it was made (the provenance inline), so an answer can be traced to the data and settings behind its weights.
"""
from django.contrib import admin
from django.urls import reverse
from django.utils.html import format_html

from adapters.admin import AdapterVersionAdmin, ReadOnlyAdmin
from adapters.models import AdapterVersion

from .models import AdapterProvenance, FineTuneLimits, FineTuningJob, JobEvent, TrainingFile


@admin.register(TrainingFile)
class TrainingFileAdmin(ReadOnlyAdmin):
    list_display = ["public_id", "tenant", "filename", "examples", "size_bytes", "short_sha256", "created_at",
                    "deleted_at"]
    list_filter = ["tenant", ("deleted_at", admin.EmptyFieldListFilter)]
    search_fields = ["public_id", "filename", "sha256", "tenant__slug"]

    @admin.display(description="sha256")
    def short_sha256(self, obj):
        return obj.sha256[:12]


class JobEventInline(admin.TabularInline):
    model = JobEvent
    extra = 0
    can_delete = False
    fields = ["created_at", "level", "type", "message", "data"]
    readonly_fields = fields
    ordering = ["id"]

    def has_add_permission(self, request, obj=None):
        return False


@admin.register(FineTuningJob)
class FineTuningJobAdmin(ReadOnlyAdmin):
    list_display = ["public_id", "tenant", "base", "suffix", "status", "fine_tuned_model", "trained_tokens",
                    "created_at", "finished_at"]
    list_filter = ["status", "tenant", "base"]
    search_fields = ["public_id", "suffix", "tenant__slug", "trainer_id"]
    inlines = [JobEventInline]


@admin.register(FineTuneLimits)
class FineTuneLimitsAdmin(admin.ModelAdmin):
    list_display = ["tenant", "max_concurrent_jobs", "max_tokens_per_job", "max_tokens_per_day"]
    search_fields = ["tenant__slug"]


_PROVENANCE_FIELDS = ["job_link", "training_file_sha256", "validation_file_sha256", "base_slug", "base_sha256",
                      "hyperparameters", "seed", "steps", "trained_tokens", "train_loss", "valid_loss",
                      "trainer_version", "created_at"]


def _job_link(obj):
    job = FineTuningJob.objects.filter(public_id=obj.job_public_id).first()
    if job is None:
        return obj.job_public_id
    return format_html('<a href="{}">{}</a>', reverse("admin:finetune_finetuningjob_change", args=[job.pk]),
                       obj.job_public_id)


@admin.register(AdapterProvenance)
class AdapterProvenanceAdmin(ReadOnlyAdmin):
    list_display = ["version", "job_public_id", "base_slug", "seed", "train_loss", "valid_loss", "created_at"]
    list_filter = ["version__adapter__tenant", "base_slug"]
    search_fields = ["job_public_id", "training_file_sha256", "version__sha256", "version__adapter__name"]

    def get_readonly_fields(self, request, obj=None):
        return ["version", *_PROVENANCE_FIELDS]

    @admin.display(description="job")
    def job_link(self, obj):
        return _job_link(obj)


class ProvenanceInline(admin.StackedInline):
    model = AdapterProvenance
    verbose_name = verbose_name_plural = "provenance (how these weights were trained)"
    extra = 0
    can_delete = False
    fields = _PROVENANCE_FIELDS
    readonly_fields = fields

    def has_add_permission(self, request, obj=None):
        return False

    @admin.display(description="job")
    def job_link(self, obj):
        return _job_link(obj)


# The version's page (where audit rows link) shows its provenance: adapters/ knows nothing of fine-tuning, so the
# inline is added here, by registering the same admin with it.
admin.site.unregister(AdapterVersion)


@admin.register(AdapterVersion)
class AdapterVersionWithProvenanceAdmin(AdapterVersionAdmin):
    inlines = [*AdapterVersionAdmin.inlines, ProvenanceInline]
