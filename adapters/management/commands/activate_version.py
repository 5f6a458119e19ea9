from django.core.management.base import BaseCommand, CommandError

from adapters.models import Adapter, AdapterVersion
from adapters.services import AdapterStateError, activate_version
from tenants.models import Tenant


class Command(BaseCommand):
    help = "Make a version of an adapter live (rollback or roll forward); the move is recorded with the reason."

    def add_arguments(self, parser):
        parser.add_argument("tenant")
        parser.add_argument("name")
        parser.add_argument("version", type=int)
        parser.add_argument("--reason", required=True)

    def handle(self, tenant, name, version, reason, **options):
        tenant_obj = Tenant.objects.filter(slug=tenant).first()
        adapter = tenant_obj and Adapter.objects.for_tenant(tenant_obj).filter(name=name).first()
        if adapter is None:
            raise CommandError(f"Tenant {tenant!r} has no adapter {name!r}.")
        target = AdapterVersion.objects.filter(adapter=adapter, number=version).first()
        if target is None:
            raise CommandError(f"Adapter {name!r} has no version {version}.")
        try:
            change = activate_version(adapter, target, actor=None, reason=reason)
        except AdapterStateError as exc:
            raise CommandError(str(exc)) from None
        frm = f"v{change.from_version.number}" if change.from_version_id else "none"
        self.stdout.write(f"{tenant}/{name}: live version {frm} → v{version}.")
