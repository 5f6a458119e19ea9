"""upload_adapter TENANT NAME PEFT_DIR --base SLUG: the scripted twin of the dashboard's upload form."""
from pathlib import Path

from django.core.exceptions import ValidationError
from django.core.files import File
from django.core.management.base import BaseCommand, CommandError

from adapters.models import Adapter, BaseModel
from adapters.services import create_adapter
from adapters.storage import BlobStorageError
from adapters.uploads import create_adapter_version
from adapters.validation import CONFIG_FILE, WEIGHTS_FILE, AdapterValidationError
from tenants.models import Tenant


class Command(BaseCommand):
    help = (f"Upload a PEFT LoRA folder ({CONFIG_FILE} + {WEIGHTS_FILE}) as the next version of a tenant's "
            f"adapter, creating the adapter on BASE if it does not exist. Prints the version number and sha256.")

    def add_arguments(self, parser):
        parser.add_argument("tenant", help="tenant slug")
        parser.add_argument("name", help="adapter name (unique within the tenant)")
        parser.add_argument("peft_dir", help="folder written by PEFT's save_pretrained")
        parser.add_argument("--base", required=True, help="base model slug")
        parser.add_argument("--activate", action="store_true",
                            help="make this version live (the first version always goes live)")

    def handle(self, tenant, name, peft_dir, base, activate, **options):
        folder = Path(peft_dir)
        config_path, weights_path = folder / CONFIG_FILE, folder / WEIGHTS_FILE
        if not config_path.is_file():
            raise CommandError(f"{folder} has no {CONFIG_FILE}.")
        if not weights_path.is_file():
            hint = " (pickled adapter_model.bin files are refused; re-save with safetensors)" \
                if (folder / "adapter_model.bin").exists() else ""
            raise CommandError(f"{folder} has no {WEIGHTS_FILE}{hint}.")
        try:
            tenant_obj = Tenant.objects.get(slug=tenant)
        except Tenant.DoesNotExist:
            raise CommandError(f"No tenant {tenant!r}.") from None
        try:
            base_obj = BaseModel.objects.get(slug=base)
        except BaseModel.DoesNotExist:
            raise CommandError(f"No base model {base!r}; register it with register_base.") from None

        adapter = Adapter.objects.for_tenant(tenant_obj).filter(name=name).first()
        if adapter is None:
            try:
                adapter = create_adapter(tenant_obj, name, base_obj)
            except ValidationError as exc:
                raise CommandError(f"Cannot create adapter {name!r}: {'; '.join(exc.messages)}") from None
        elif adapter.base_id != base_obj.pk:
            raise CommandError(f"Adapter {name!r} is on base {adapter.base.slug!r}, not {base!r}.")

        try:
            with open(config_path, "rb") as cfg, open(weights_path, "rb") as weights:
                version = create_adapter_version(adapter, config_file=File(cfg, name=CONFIG_FILE),
                                                 weights_file=File(weights, name=WEIGHTS_FILE),
                                                 activate=True if activate else None)
        except AdapterValidationError as exc:
            raise CommandError(f"Refused ({exc.field}): {exc}") from None
        except BlobStorageError as exc:
            raise CommandError(str(exc)) from None
        live = " (live)" if adapter.active_version_id == version.pk else ""
        self.stdout.write(f"{tenant_obj.slug}/{adapter.name} version {version.number}{live} "
                          f"sha256 {version.sha256}")
