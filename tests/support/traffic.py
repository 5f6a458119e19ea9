"""Closed-loop client threads for the real-stack tests: each sends short completions, one after another, until
its model chooser says stop (None) or the traffic is stopped; every outcome is recorded with its timing."""
from __future__ import annotations

import threading
import time
from collections.abc import Callable

import httpx


class Traffic:
    """`clients` threads; `next_model(client, turn)` names the model of a client's next request, or None to stop
    that client. `with Traffic(...) as t:` starts them; leaving the block stops them (with until_stopped=False
    it waits for `next_model` to run out instead) and checks every client got its last answer."""

    def __init__(self, url: str, key: str, next_model: Callable[[int, int], str | None], clients: int, *,
                 timeout: float = 150, join_s: float | None = None, until_stopped: bool = True):
        self.url, self.key, self.timeout = url, key, timeout
        self._next_model = next_model
        self._until_stopped = until_stopped
        self._join_s = timeout + 10 if join_s is None else join_s
        self.outcomes: list[dict] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._client, args=(i,), daemon=True) for i in range(clients)]

    def _client(self, i: int) -> None:
        n = 0
        with httpx.Client(timeout=self.timeout) as http:
            while not (self._until_stopped and self._stop.is_set()) and (model := self._next_model(i, n)) is not None:
                n += 1
                started = time.monotonic()
                outcome = {"client": i, "model": model, "started": started}
                try:
                    r = http.post(self.url + "/v1/completions", headers={"Authorization": f"Bearer {self.key}"},
                                  json={"model": model, "prompt": f"Client {i} turn {n}", "max_tokens": 4,
                                        "temperature": 0})
                    outcome.update(status=r.status_code, request_id=r.headers.get("X-Lorafleet-Request-Id"),
                                   code=None if r.status_code == 200 else r.json()["error"]["code"])
                except Exception as exc:  # a transport failure is a lost request: recorded, asserted on
                    outcome.update(status=None, request_id=None, code=f"transport: {exc!r}")
                outcome["seconds"] = time.monotonic() - started
                with self._lock:
                    self.outcomes.append(outcome)

    def __enter__(self) -> Traffic:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=self._join_s)
        assert not any(t.is_alive() for t in self._threads), "a client never got an answer"

    def count(self) -> int:
        with self._lock:
            return len(self.outcomes)
