import datetime as dt

from django.core.management.base import BaseCommand, CommandError
from django.utils import timezone

from adapters.models import Adapter
from gateway.services import issue_api_key
from tenants.models import Tenant


class Command(BaseCommand):
    help = "Issue an API key for a tenant and print its secret (shown once; only a hash is stored)."

    def add_arguments(self, parser):
        parser.add_argument("tenant", help="tenant slug")
        parser.add_argument("--adapter", help="bind the key to this adapter of the tenant")
        parser.add_argument("--name", default="cli")
        parser.add_argument("--expires-in-days", type=int, default=None)

    def handle(self, tenant, adapter, name, expires_in_days, **options):
        try:
            tenant_obj = Tenant.objects.get(slug=tenant)
        except Tenant.DoesNotExist:
            raise CommandError(f"No tenant {tenant!r}.") from None
        bound = None
        if adapter:
            bound = Adapter.objects.for_tenant(tenant_obj).live().filter(name=adapter).first()
            if bound is None:
                raise CommandError(f"Tenant {tenant} has no adapter {adapter!r}.")
        expires = timezone.now() + dt.timedelta(days=expires_in_days) if expires_in_days else None
        key, secret = issue_api_key(tenant_obj, name, bound_adapter=bound, expires_at=expires)
        self.stderr.write(f"Key {key.prefix}…{key.last4} for {tenant}" + (f", bound to {adapter}" if bound else "") +
                          ". The secret below is shown once; store it now.")
        self.stdout.write(secret)
