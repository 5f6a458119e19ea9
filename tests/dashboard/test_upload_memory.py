"""A 200 MB upload through the real upload view keeps the web process's peak memory growth under 64 MB.

The web process is a real `manage.py runserver` subprocess (its own SQLite and storage under tmp_path,
the size cap raised to 300 MB), and the client streams the multipart body from a generator, so
neither side ever holds the file. Growth is the process's peak RSS (VmHWM, reset through
/proc/<pid>/clear_refs after a warm-up upload, and RSS sampled every 5 ms) minus its RSS before. The weights are random
bytes, so validation refuses them at the end — what is measured is the streaming. (Checked to fail:
with FILE_UPLOAD_MAX_MEMORY_SIZE raised to 1 GB, so Django keeps the upload in memory, growth is ~400 MiB.)
"""
from __future__ import annotations

import json
import os
import secrets
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

REPO = Path(__file__).resolve().parents[2]
UPLOAD_BYTES = 200 * 1024 * 1024
MAX_GROWTH_BYTES = 64 * 1024 * 1024

SETUP = """
from django.contrib.auth import get_user_model
from adapters.manifest import shape_manifest_from_config
from adapters.models import BaseModel
from adapters.services import create_adapter
from tenants.services import create_tenant
alice = get_user_model().objects.create_user("alice", password="alice-password-1")
acme = create_tenant("acme", "Acme", owner=alice)
manifest = shape_manifest_from_config({"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512,
    "max_position_embeddings": 512})
base = BaseModel.objects.create(slug="tiny", display_name="Tiny", sha256="0" * 64, architecture="llama",
    shape_manifest=manifest, queue_name="base.tiny")
print(create_adapter(acme, "big", base, created_by=alice).pk)
"""

CONFIG = json.dumps({"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": 8, "lora_alpha": 16,
                     "target_modules": ["q_proj", "v_proj"], "bias": "none"}).encode()


def _status_kb(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"{field} not in /proc/{pid}/status")


def _bytes_written(pid: int) -> int:
    """Bytes the process passed to write() (files; socket sends are not counted)."""
    fields = dict(line.split(": ") for line in Path(f"/proc/{pid}/io").read_text().splitlines())
    return int(fields["wchar"])


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def multipart(boundary: str, csrf: str, weights_size: int, block: bytes):
    """(content length, generator) of a multipart body whose weights part is streamed block by block."""
    head = (
        f"--{boundary}\r\nContent-Disposition: form-data; name=\"csrfmiddlewaretoken\"\r\n\r\n{csrf}\r\n"
        f"--{boundary}\r\nContent-Disposition: form-data; name=\"config_file\"; filename=\"adapter_config.json\"\r\n"
        "Content-Type: application/json\r\n\r\n"
    ).encode() + CONFIG + (
        f"\r\n--{boundary}\r\nContent-Disposition: form-data; name=\"weights_file\"; "
        "filename=\"adapter_model.safetensors\"\r\nContent-Type: application/octet-stream\r\n\r\n"
    ).encode()
    tail = f"\r\n--{boundary}--\r\n".encode()

    def body():
        yield head
        left = weights_size
        while left:
            chunk = block[:min(left, len(block))]
            left -= len(chunk)
            yield chunk
        yield tail

    return len(head) + weights_size + len(tail), body()


@pytest.fixture
def web_server(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "CELERY_BROKER_URL")}
    env.update(LORAFLEET_VAR_DIR=str(tmp_path / "var"), LORAFLEET_STORAGE="filesystem",
               LORAFLEET_MAX_UPLOAD_BYTES=str(300 * 1024 * 1024), DJANGO_SETTINGS_MODULE="config.settings",
               LORAFLEET_LOG_LEVEL="WARNING", TMPDIR=str(tmp_path))
    manage = [sys.executable, str(REPO / "manage.py")]
    subprocess.run([*manage, "migrate", "--noinput", "-v", "0"], cwd=REPO, env=env, check=True, timeout=120)
    adapter_pk = int(subprocess.run([*manage, "shell", "-c", SETUP], cwd=REPO, env=env, check=True, timeout=60,
                                    capture_output=True, text=True).stdout.split()[-1])
    port = _free_port()
    log = open(tmp_path / "server.log", "wb")
    server = subprocess.Popen([*manage, "runserver", f"127.0.0.1:{port}", "--noreload"], cwd=REPO, env=env,
                              stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            httpx.get(url + "/login/", timeout=1)
            break
        except httpx.TransportError:
            assert server.poll() is None, (tmp_path / "server.log").read_text()
            time.sleep(0.2)
    try:
        yield url, server.pid, adapter_pk
    finally:
        server.terminate()
        server.wait(timeout=10)
        log.close()


def test_a_200_mb_upload_keeps_web_memory_growth_under_64_mb(web_server):
    url, pid, adapter_pk = web_server
    client = httpx.Client(base_url=url, timeout=120)
    client.get("/login/")
    client.post("/login/", data={"username": "alice", "password": "alice-password-1",
                                 "csrfmiddlewaretoken": client.cookies["csrftoken"]}, follow_redirects=False)
    upload_url = f"/adapters/{adapter_pk}/upload/"
    assert client.get(upload_url).status_code == 200
    csrf = client.cookies["csrftoken"]
    block = secrets.token_bytes(1024 * 1024)
    headers = {"Accept": "application/json", "X-CSRFToken": csrf}

    def send(size: int) -> httpx.Response:
        boundary = "lorafleet" + secrets.token_hex(16)
        length, body = multipart(boundary, csrf, size, block)
        return client.post(upload_url, content=body, headers={
            **headers, "Content-Type": f"multipart/form-data; boundary={boundary}", "Content-Length": str(length)})

    warm = send(4 * 1024 * 1024)  # imports and first-use allocations of the whole path happen here
    assert warm.status_code == 400 and warm.json()["ok"] is False

    try:
        Path(f"/proc/{pid}/clear_refs").write_text("5")  # reset VmHWM to the current RSS
        hwm_reset = True
    except OSError:  # some kernels/containers refuse it; the sampler below still sees the peak
        hwm_reset = False
    baseline = _status_kb(pid, "VmRSS")
    written_before = _bytes_written(pid)
    samples, done = [baseline], threading.Event()

    def sample():
        while not done.is_set():
            samples.append(_status_kb(pid, "VmRSS"))
            time.sleep(0.005)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    started = time.monotonic()
    try:
        response = send(UPLOAD_BYTES)
    finally:
        done.set()
        sampler.join()
    seconds = time.monotonic() - started
    peak = max(samples + ([_status_kb(pid, "VmHWM")] if hwm_reset else []))
    growth = peak - baseline
    written_after = _bytes_written(pid)

    # The whole body reached the view and the service answered with a validation error, in words.
    assert response.status_code == 400, response.text[:500]
    assert response.json()["ok"] is False and response.json()["error"]
    # ... after all 200 MB went through: Django's temporary file and the service's spool were written.
    assert written_after - written_before >= 2 * UPLOAD_BYTES
    print(f"\n200 MB upload: {seconds:.1f} s, web RSS {baseline / 2**20:.1f} MiB -> peak {peak / 2**20:.1f} MiB "
          f"(growth {growth / 2**20:.1f} MiB)")
    assert growth < MAX_GROWTH_BYTES, f"peak RSS grew by {growth / 2**20:.1f} MiB while streaming 200 MB"
