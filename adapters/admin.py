from django import forms
from django.contrib import admin, messages
from django.shortcuts import redirect, render
from django.urls import path, reverse

from .models import Adapter, AdapterVersion, BaseModel, VersionPointerChange
from .services import AdapterStateError, activate_version


class ReadOnlyAdmin(admin.ModelAdmin):
    """For records that never change after creation: every field read-only, no add, no delete."""

    def get_readonly_fields(self, request, obj=None):
        return [f.name for f in self.model._meta.fields]

    def has_add_permission(self, request):
        return False

    def has_delete_permission(self, request, obj=None):
        return False


@admin.register(BaseModel)
class BaseModelAdmin(admin.ModelAdmin):
    list_display = ["slug", "display_name", "architecture", "max_lora_rank", "queue_name", "short_sha256", "created_at"]
    search_fields = ["slug", "display_name", "sha256"]
    readonly_fields = ["sha256", "shape_manifest", "architecture", "created_at"]

    @admin.display(description="sha256")
    def short_sha256(self, obj):
        return obj.sha256[:12]


class AdapterVersionInline(admin.TabularInline):
    model = AdapterVersion
    extra = 0
    can_delete = False
    fields = ["number", "sha256", "rank", "alpha", "use_rslora", "target_modules", "size_bytes", "created_by", "created_at"]
    readonly_fields = fields
    show_change_link = True

    def has_add_permission(self, request, obj=None):
        return False


class PointerHistoryInline(admin.TabularInline):
    model = VersionPointerChange
    verbose_name_plural = "Pointer history (rollbacks and roll-forwards)"
    extra = 0
    can_delete = False
    fields = ["at", "from_version", "to_version", "actor", "reason"]
    readonly_fields = fields
    ordering = ["-at", "-id"]

    def has_add_permission(self, request, obj=None):
        return False


class ActivateVersionForm(forms.Form):
    version = forms.ModelChoiceField(queryset=AdapterVersion.objects.none())
    reason = forms.CharField(max_length=500, widget=forms.TextInput(attrs={"size": 60}))

    def __init__(self, adapter, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.fields["version"].queryset = AdapterVersion.objects.filter(adapter=adapter).order_by("-number")
        self.fields["version"].label_from_instance = lambda v: (
            f"v{v.number} · {v.sha256[:12]} · r={v.rank}" + (" (live)" if v.pk == adapter.active_version_id else "")
        )


@admin.register(Adapter)
class AdapterAdmin(admin.ModelAdmin):
    list_display = ["name", "tenant", "base", "live_version", "deleted_at", "created_at"]
    list_filter = ["tenant", "base", ("deleted_at", admin.EmptyFieldListFilter)]
    search_fields = ["name", "tenant__slug"]
    readonly_fields = ["active_version", "created_at", "created_by"]
    inlines = [AdapterVersionInline, PointerHistoryInline]
    actions = ["activate_chosen_version"]

    @admin.display(description="live version")
    def live_version(self, obj):
        return f"v{obj.active_version.number}" if obj.active_version_id else "—"

    def get_urls(self):
        custom = [
            path(
                "<int:adapter_id>/activate/",
                self.admin_site.admin_view(self.activate_view),
                name="adapters_adapter_activate",
            )
        ]
        return custom + super().get_urls()

    @admin.action(description="Make a chosen version live (rollback / roll forward)…")
    def activate_chosen_version(self, request, queryset):
        if queryset.count() != 1:
            self.message_user(request, "Choose exactly one adapter.", messages.WARNING)
            return None
        return redirect(reverse("admin:adapters_adapter_activate", args=[queryset.get().pk]))

    def activate_view(self, request, adapter_id: int):
        adapter = self.get_object(request, str(adapter_id))
        if adapter is None or not self.has_change_permission(request, adapter):
            return self._get_obj_does_not_exist_redirect(request, self.model._meta, str(adapter_id))
        form = ActivateVersionForm(adapter, request.POST or None)
        if request.method == "POST" and form.is_valid():
            version = form.cleaned_data["version"]
            try:
                change = activate_version(adapter, version, actor=request.user, reason=form.cleaned_data["reason"])
            except AdapterStateError as exc:
                form.add_error(None, str(exc))
            else:
                frm = f"v{change.from_version.number}" if change.from_version_id else "none"
                self.message_user(request, f"{adapter}: live version moved {frm} → v{version.number}.")
                return redirect(reverse("admin:adapters_adapter_change", args=[adapter.pk]))
        context = {
            **self.admin_site.each_context(request),
            "opts": self.model._meta,
            "adapter": adapter,
            "form": form,
            "title": f"Make a version of {adapter} live",
        }
        return render(request, "admin/adapters/adapter/activate.html", context)


@admin.register(AdapterVersion)
class AdapterVersionAdmin(ReadOnlyAdmin):
    """Versions are immutable: everything is read-only, nothing is deleted."""

    list_display = ["adapter", "number", "short_sha256", "rank", "alpha", "use_rslora", "size_bytes", "created_at"]
    list_filter = ["adapter__tenant", "adapter__base", "use_rslora"]
    search_fields = ["sha256", "adapter__name", "adapter__tenant__slug"]

    @admin.display(description="sha256")
    def short_sha256(self, obj):
        return obj.sha256[:12]


@admin.register(VersionPointerChange)
class VersionPointerChangeAdmin(ReadOnlyAdmin):
    list_display = ["adapter", "from_version", "to_version", "actor", "reason", "at"]
    list_filter = ["adapter__tenant"]
    search_fields = ["adapter__name", "reason"]
    date_hierarchy = "at"
