"""The embedded default — no DATABASE_URL, no CELERY_BROKER_URL: SQLite, Celery's filesystem transport
and the file reply channel under var/. What `make demo` runs: a real worker and web process answer."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import httpx

from tests.e2e.conftest import REPO, Stack


def test_the_embedded_default_answers_completions_and_streams(tmp_path):
    env = {k: v for k, v in os.environ.items()
           if k not in ("DATABASE_URL", "CELERY_BROKER_URL", "CELERY_RESULT_BACKEND", "LORAFLEET_STORAGE")}
    env.update(DJANGO_SETTINGS_MODULE="config.settings", PYTHONPATH=str(REPO), LORAFLEET_VAR_DIR=str(tmp_path / "var"),
               LORAFLEET_LOG_LEVEL="WARNING", TRITON_INTERPRET="1")
    env.pop("LORAFLEET_STORAGE_DIR", None)
    stack = Stack(tmp_path, env)
    try:
        run = lambda *args: subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True,  # noqa: E731
                                           text=True, timeout=300)
        out = run("manage.py", "migrate", "--noinput")
        assert out.returncode == 0, out.stderr[-3000:]
        out = run(str(REPO / "tests/e2e/seed_stack.py"), str(tmp_path / "tiny"), str(tmp_path), "emb", "light")
        assert out.returncode == 0, out.stderr[-3000:]
        seed = json.loads(out.stdout.strip().splitlines()[-1])
        url = stack.start_web("web-embedded")
        stack.start_worker(seed["bases"]["main"]["slug"], "worker-embedded")
        headers = {"Authorization": f"Bearer {seed['keys']['a']}"}
        r = httpx.post(url + "/v1/completions", headers=headers, timeout=60,
                       json={"model": "a-0", "prompt": "Once upon a time", "max_tokens": 6, "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["lorafleet"]["weights_sha256"] == seed["adapters"]["a-0"]["versions"][0]["sha256"]
        r2 = httpx.post(url + "/v1/completions", headers=headers, timeout=60,
                        json={"model": "a-0", "prompt": "Once upon a time", "max_tokens": 6, "temperature": 0,
                              "stream": True})
        chunks = [json.loads(line[6:]) for line in r2.text.split("\n\n") if line.startswith("data: {")]
        assert r2.text.endswith("data: [DONE]\n\n")
        assert "".join(c["choices"][0]["text"] for c in chunks) == r.json()["choices"][0]["text"]
        beats = list((tmp_path / "var" / "celery" / "replies" / "workers").glob("*.json"))  # worker_status reads these
        assert [json.loads(b.read_text())["base"] for b in beats] == [seed["bases"]["main"]["slug"]]
    finally:
        stack.close()
