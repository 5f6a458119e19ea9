"""The operator page (issue 13): staff see every live worker's memory pool and resident adapters, as
`worker_status` reports them; anyone else gets a 404."""
import time
import uuid

import pytest

pytestmark = pytest.mark.django_db


@pytest.fixture
def heartbeat(settings, tmp_path):
    """A worker's heartbeat in the embedded default's file store, as inference_worker.worker publishes it."""
    from transport import replies

    settings.VAR_DIR = tmp_path
    settings.CELERY_BROKER_URL = "filesystem://"
    settings.LORAFLEET_REPLY_URL = ""
    replies._channel = None
    worker_id = f"tiny@host:{uuid.uuid4().hex[:6]}"
    status = {
        "worker_id": worker_id, "base": "tiny", "base_sha256": "ab" * 32, "queue": "base.tiny", "device": "cpu",
        "running": 3, "queue_depth": 1, "tokens_generated": 1234, "seen_at": time.time(),
        "resident_adapters": [{"identity": "c" * 64, "sha256": "d" * 64, "name": "writer@2"}],
        "memory": {"pages": 400, "page_bytes": 65536, "pool_bytes": 400 * 65536, "kv_blocks_used": 100,
                   "adapter_pages": 20, "free_pages": 280, "adapter_bytes_resident": 20 * 65536,
                   "resident_adapters_by_rank": {"8": 2, "16": 1}, "evictions": 7, "device_loads": 11,
                   "admissions_waited_memory": 4},
    }
    replies.reply_channel().heartbeat(worker_id, status, 15)
    yield status
    replies._channel = None


def test_staff_see_each_workers_pool_and_residents(client, world, heartbeat):
    world.alice.is_staff = True
    world.alice.save()
    client.force_login(world.alice)
    r = client.get("/operator/workers/")
    assert r.status_code == 200
    text = r.content.decode()
    assert heartbeat["worker_id"] in text
    assert "400 pages" in text and "100 (25.0%)" in text and "20 (5.0%" in text
    assert "r8: 2, r16: 1" in text and "writer@2" in text and "7 / 11" in text


def test_everyone_else_gets_a_404_or_the_login_page(client, world, heartbeat):
    client.force_login(world.charlie)  # an owner of a tenant, not staff
    assert client.get("/operator/workers/").status_code == 404
    client.logout()
    r = client.get("/operator/workers/")
    assert r.status_code == 302 and "/login/" in r["Location"]
