from django.core.exceptions import ValidationError
from django.core.management.base import BaseCommand, CommandError

from tenants.services import create_tenant


class Command(BaseCommand):
    help = "Create a tenant."

    def add_arguments(self, parser):
        parser.add_argument("slug")
        parser.add_argument("--name", default="")

    def handle(self, slug, name, **options):
        try:
            tenant = create_tenant(slug, name)
        except ValidationError as exc:
            raise CommandError("; ".join(f"{k}: {' '.join(v)}" for k, v in exc.message_dict.items())) from None
        self.stdout.write(f"Created tenant {tenant.slug} ({tenant.name}).")
