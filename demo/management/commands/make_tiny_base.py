"""`manage.py make_tiny_base OUT_DIR`: a thin wrapper over demo.tiny_base.build_tiny_base."""
from __future__ import annotations

import time

from django.core.management.base import BaseCommand, CommandError

from demo.tiny_base import ARCHITECTURES, build_tiny_base


class Command(BaseCommand):
    help = "Build a small Llama-family Hugging Face checkpoint locally (no hub download)."

    def add_arguments(self, parser) -> None:
        parser.add_argument("out_dir")
        parser.add_argument("--arch", choices=ARCHITECTURES, default="llama")
        parser.add_argument("--seed", type=int, default=0)
        parser.add_argument("--hidden", type=int, default=64)
        parser.add_argument("--layers", type=int, default=2)
        parser.add_argument("--heads", type=int, default=4)
        parser.add_argument("--kv-heads", type=int, default=2)
        parser.add_argument("--intermediate", type=int, default=128)
        parser.add_argument("--vocab", type=int, default=512)
        parser.add_argument("--max-position", type=int, default=512)
        parser.add_argument("--tie-embeddings", action="store_true")

    def handle(self, *args, **opts) -> None:
        started = time.perf_counter()
        self.stdout.write(f"Building a tiny {opts['arch']} base in {opts['out_dir']} ...")
        try:
            path = build_tiny_base(
                opts["out_dir"], arch=opts["arch"], seed=opts["seed"], hidden=opts["hidden"],
                layers=opts["layers"], heads=opts["heads"], kv_heads=opts["kv_heads"],
                intermediate=opts["intermediate"], vocab=opts["vocab"], max_position=opts["max_position"],
                tie_embeddings=opts["tie_embeddings"],
            )
        except ValueError as exc:
            raise CommandError(str(exc)) from exc
        self.stdout.write(self.style.SUCCESS(
            f"Wrote {path} ({time.perf_counter() - started:.1f} s): config.json, model.safetensors, tokenizer"))
