from django.core.management.base import BaseCommand, CommandError

from adapters.manifest import ManifestError
from adapters.services import register_base_model


class Command(BaseCommand):
    help = "Register (or refresh) a base model from a local Hugging Face checkpoint folder."

    def add_arguments(self, parser):
        parser.add_argument("slug")
        parser.add_argument("path")
        parser.add_argument("--display-name", default="")
        parser.add_argument("--max-rank", type=int, default=None)
        parser.add_argument("--queue", default=None)

    def handle(self, slug, path, display_name, max_rank, queue, **options):
        try:
            base = register_base_model(slug, path, display_name=display_name, max_lora_rank=max_rank, queue_name=queue)
        except (ManifestError, FileNotFoundError) as exc:
            raise CommandError(str(exc)) from None
        m = base.shape_manifest
        self.stdout.write(
            f"Registered base {base.slug}: {base.architecture}, {m['num_layers']} layers, hidden {m['hidden_size']}, "
            f"{m['num_parameters']:,} parameters, sha256 {base.sha256}, queue {base.queue_name}, max rank {base.max_lora_rank}."
        )
