"""`manage.py close_abandoned_audit`: finalise audit rows whose web process died while waiting.

The web process that answered finalises each pending row; if that process is killed mid-request the
row would stay pending for ever. Rows pending for longer than the request timeout plus a margin can
no longer be answered by anyone, so they are finalised once as `abandoned` (run it from cron).
"""
from __future__ import annotations

from datetime import timedelta

from django.conf import settings
from django.core.management.base import BaseCommand
from django.utils import timezone

from gateway.models import AuditRecord, AuditStatus


class Command(BaseCommand):
    help = "Finalise audit rows left pending by a web process that died (error code 'abandoned')."

    def add_arguments(self, parser) -> None:
        parser.add_argument("--margin", type=float, default=60.0, help="seconds beyond the request timeout")

    def handle(self, *args, **opts) -> None:
        cutoff = timezone.now() - timedelta(seconds=settings.LORAFLEET_REQUEST_TIMEOUT_S + opts["margin"])
        n = AuditRecord.objects.filter(status=AuditStatus.PENDING, created_at__lt=cutoff).update(
            status=AuditStatus.ERROR, error_code="abandoned", finished_at=timezone.now(),
            error_message="the web process answering this request stopped before it finished",
        )
        self.stdout.write(f"Finalised {n} abandoned audit record(s).")
