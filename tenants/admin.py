from django.contrib import admin
from django.utils import timezone

from .models import Invitation, Membership, Tenant


class MembershipInline(admin.TabularInline):
    model = Membership
    extra = 0
    autocomplete_fields = ["user"]


@admin.register(Tenant)
class TenantAdmin(admin.ModelAdmin):
    list_display = ["slug", "name", "may_use_base", "requests_per_minute", "max_concurrent_requests", "share_weight",
                    "dedicated", "created_at"]
    list_filter = ["dedicated"]
    search_fields = ["slug", "name"]
    inlines = [MembershipInline]


@admin.register(Membership)
class MembershipAdmin(admin.ModelAdmin):
    list_display = ["user", "tenant", "role", "created_at", "last_used_at"]
    list_filter = ["role", "tenant"]
    search_fields = ["user__username", "tenant__slug"]


@admin.register(Invitation)
class InvitationAdmin(admin.ModelAdmin):
    """Invitations are made from the members page and answered by the invitee; here they can be read and
    withdrawn. Nobody joins from here, and the token's hash is not shown."""

    list_display = ["invited_as", "tenant", "role", "invited_by", "created_at", "expires_at", "accepted_at",
                    "declined_at", "revoked_at"]
    list_filter = ["tenant", "role", ("accepted_at", admin.EmptyFieldListFilter), ("revoked_at", admin.EmptyFieldListFilter)]
    search_fields = ["invited_as", "tenant__slug"]
    exclude = ["token_hash"]
    readonly_fields = ["tenant", "invited_as", "role", "invited_by", "created_at", "expires_at", "accepted_at",
                       "accepted_by", "declined_at", "revoked_at"]
    actions = ["withdraw"]

    def has_add_permission(self, request):
        return False

    @admin.action(description="Withdraw selected invitations")
    def withdraw(self, request, queryset):
        count = queryset.open().update(revoked_at=timezone.now())
        self.message_user(request, f"Withdrew {count} invitation(s).")
