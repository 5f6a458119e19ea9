"""The operator page (staff only): every live worker, its memory pool and the adapters resident in it.

Read from the heartbeats workers publish every few seconds (what `manage.py worker_status` prints); the
figures are the worker's own (protocol.memory's arithmetic), never recomputed here. Not tenant-scoped: it
shows every tenant's adapters by name, so anyone but staff gets a 404, as for any page they may not see.
"""
from __future__ import annotations

import time

from django.contrib.auth.decorators import login_required
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import render

from transport.replies import ChannelUnavailable, reply_channel


def _mb(n) -> str:
    return f"{(n or 0) / 1e6:,.1f} MB"


@login_required
def workers(request: HttpRequest) -> HttpResponse:
    if not request.user.is_staff:
        raise Http404("No such page.")
    error, rows = None, []
    try:
        live = reply_channel().live_workers()
    except ChannelUnavailable as exc:
        live, error = [], f"The worker heartbeat store cannot be reached: {exc}"
    for w in live:
        mem = w.get("memory") or {}
        pages = mem.get("pages") or 0
        rows.append({
            "worker": w, "memory": mem, "seen_s": max(0.0, time.time() - float(w.get("seen_at", 0))),
            "pool": _mb(mem.get("pool_bytes")), "page": _mb(mem.get("page_bytes")),
            "kv_pct": 100 * (mem.get("kv_blocks_used") or 0) / pages if pages else 0,
            "adapter_pct": 100 * (mem.get("adapter_pages") or 0) / pages if pages else 0,
            "adapters": _mb(mem.get("adapter_bytes_resident")),
            "by_rank": sorted((int(r), n) for r, n in (mem.get("resident_adapters_by_rank") or {}).items()),
        })
    return render(request, "dashboard/operator.html", {"rows": rows, "error": error})
