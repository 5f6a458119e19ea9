"""`manage.py worker_status`: each live worker, its base, and the adapters resident on it.

Read from the heartbeats workers publish every few seconds (Redis in production, files under var/
on the embedded default); a worker silent for one heartbeat TTL (15 s by default) is not listed. The
gateway routes from the same heartbeats: `pool` is the queue the worker shares with its pool (the base's,
or one tenant's dedicated pool), `own` the queue of the adapters it owns.
"""
from __future__ import annotations

import json
import time

from django.core.management.base import BaseCommand

from transport.replies import reply_channel


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
                f"{w['worker_id']}  base={w['base']} ({w['base_sha256'][:12]})  pool={w.get('pool_queue', w['queue'])}"
                f"{'  tenant=' + w['tenant'] if w.get('tenant') else ''}  "
                f"device={w['device']}  running={w['running']}  waiting={w['queue_depth']}  "
                f"tokens={w.get('tokens_generated', 0)}  metrics=:{w.get('metrics_port')}  seen {age:.0f}s ago"
            )
            consumer = w.get("consumer")
            if consumer:
                self.stdout.write(
                    f"    own queue {w.get('own_queue')}: jobs taken {consumer['taken_own']} own + "
                    f"{consumer['taken_pool']} from the pool, {consumer['in_flight']} in flight; "
                    f"{consumer['reclaimed']} reclaimed from dead workers")
            mem = w.get("memory") or {}
            if mem:
                self.stdout.write(
                    f"    pool {mem.get('pages')} pages x {mem.get('page_bytes', 0) / 1e6:.3f} MB: "
                    f"KV {mem.get('kv_blocks_used')} used, adapters ({mem.get('adapter_dtype')}) "
                    f"{mem.get('adapter_pages')} pages "
                    f"({mem.get('adapter_bytes_resident', 0) / 1e6:.1f} MB, by rank {mem.get('resident_adapters_by_rank')}), "
                    f"free {mem.get('free_pages')}; evictions {mem.get('evictions')}, loads {mem.get('device_loads')}, "
                    f"admissions that waited for memory {mem.get('admissions_waited_memory')}")
            resident = w.get("resident_adapters") or []
            if not resident:
                self.stdout.write("    no resident adapters")
            for a in resident:
                self.stdout.write(f"    {a['sha256'][:16]}  {a.get('name') or '(name unknown)'}")
