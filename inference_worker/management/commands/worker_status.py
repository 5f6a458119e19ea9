"""`manage.py worker_status`: each live worker, its base, and the adapters resident on it.

Read from the heartbeats workers publish every few seconds (Redis in production, files under var/
on the embedded default); a worker silent for 15 s is not listed.
"""
from __future__ import annotations

import json
import time

from django.core.management.base import BaseCommand

from inference_worker.replies import reply_channel


class Command(BaseCommand):
    help = "List live inference workers, their base model and resident adapters."

    def add_arguments(self, parser) -> None:
        parser.add_argument("--json", action="store_true", help="print the raw status objects as JSON")

    def handle(self, *args, **opts) -> None:
        workers = reply_channel().live_workers()
        if opts["json"]:
            self.stdout.write(json.dumps(workers, indent=2))
            return
        if not workers:
            self.stdout.write("No live workers.")
            return
        for w in workers:
            age = time.time() - float(w.get("seen_at", 0))
            self.stdout.write(
                f"{w['worker_id']}  base={w['base']} ({w['base_sha256'][:12]})  queue={w['queue']}  "
                f"device={w['device']}  running={w['running']}  waiting={w['queue_depth']}  "
                f"tokens={w['tokens_generated']}  metrics=:{w.get('metrics_port')}  seen {age:.0f}s ago"
            )
            mem = w.get("memory") or {}
            if mem:
                self.stdout.write(
                    f"    pool {mem.get('pages')} pages x {mem.get('page_bytes', 0) / 1e6:.3f} MB: "
                    f"KV {mem.get('kv_blocks_used')} used, adapters {mem.get('adapter_pages')} pages "
                    f"({mem.get('adapter_bytes_resident', 0) / 1e6:.1f} MB, by rank {mem.get('resident_adapters_by_rank')}), "
                    f"free {mem.get('free_pages')}; evictions {mem.get('evictions')}, loads {mem.get('device_loads')}, "
                    f"admissions that waited for memory {mem.get('admissions_waited_memory')}")
            resident = w.get("resident_adapters") or []
            if not resident:
                self.stdout.write("    no resident adapters")
            for a in resident:
                self.stdout.write(f"    {a['sha256'][:16]}  {a.get('name') or '(name unknown)'}")
