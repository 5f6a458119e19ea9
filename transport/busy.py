"""Which inference engines on this host are running requests, for a CPU trainer that shares their cores (issue 50).

A trainer (`manage.py run_trainer`) and an inference worker on one CPU host share its cores, caches and memory
bandwidth. Niceness and SCHED_IDLE decide who runs first, not that a chat's decode steps stream the base's weights
while the trainer streams its own: with the niceness alone another tenant's chat took 1.05-1.19x its solo time while
a job trained (bench/RESULTS.md). So each engine marks, in a file of its own, whether it has requests in hand
(`EngineBusyFlag`, written on the step loop's idle <-> busy transitions only: nothing per step), and a trainer
watches those files (`EngineWatcher`) and holds its work between one layer and the next while any engine is busy
(`YieldGate`, called from hooks on the model's layers and LoRA weights: finetune/training.py). It waits at most
`max_pause_s` at a stretch and then works `grace_s` regardless, so training still progresses under a constant load.
The arithmetic is untouched: the same ops in the same order, later.

Files: <dir>/engine-<pid>, one byte, b"1" busy or b"0" idle; <dir> is LORAFLEET_ENGINE_SIGNAL_DIR, by default
<LORAFLEET_VAR_DIR>/run/engines, so a worker and a trainer on one host started with the same settings see the same
directory (in containers: a shared volume). A file whose process is gone counts as idle and is removed by the watcher.
"""
from __future__ import annotations

import os
import threading
import time
from pathlib import Path

PREFIX = "engine-"


def signal_dir() -> Path:
    """LORAFLEET_ENGINE_SIGNAL_DIR, else <VAR_DIR>/run/engines (settings.VAR_DIR where Django is configured)."""
    raw = os.environ.get("LORAFLEET_ENGINE_SIGNAL_DIR", "").strip()
    if raw:
        return Path(raw)
    try:
        from django.conf import settings

        var = Path(settings.VAR_DIR)
    except Exception:  # no Django settings: the environment's var dir, as config/settings.py reads it
        var = Path(os.environ.get("LORAFLEET_VAR_DIR", Path(__file__).resolve().parent.parent / "var"))
    return var / "run" / "engines"


class EngineBusyFlag:
    """This process's engine's flag: `set(True)` when its step loop has requests in hand, `set(False)` when idle.
    Only a change writes (one byte, at offset 0: never a half-written file)."""

    def __init__(self, directory: Path | None = None) -> None:
        directory = Path(directory) if directory is not None else signal_dir()
        directory.mkdir(parents=True, exist_ok=True)
        self.path = directory / f"{PREFIX}{os.getpid()}"
        self._fd: int | None = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        self._busy: bool | None = None
        self.set(False)

    def set(self, busy: bool) -> None:
        if busy is self._busy or self._fd is None:
            return
        os.pwrite(self._fd, b"1" if busy else b"0", 0)
        self._busy = busy

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
            self.path.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True


def busy_engines(directory: Path) -> list[int]:
    """The pids of the engines in `directory` marked busy; files of processes that are gone are removed."""
    busy = []
    try:
        entries = list(os.scandir(directory))
    except FileNotFoundError:
        return busy
    for entry in entries:
        if not entry.name.startswith(PREFIX):
            continue
        try:
            pid = int(entry.name[len(PREFIX):])
        except ValueError:
            continue
        try:
            with open(entry.path, "rb") as f:
                marked = f.read(1) == b"1"
        except FileNotFoundError:
            continue
        if not _alive(pid):
            Path(entry.path).unlink(missing_ok=True)
        elif marked:
            busy.append(pid)
    return busy


class EngineWatcher(threading.Thread):
    """Reads the engines' flags every `poll_s`; `idle` is set while none is busy."""

    def __init__(self, directory: Path | None = None, poll_s: float = 0.002) -> None:
        super().__init__(name="engine-watcher", daemon=True)
        self.directory = Path(directory) if directory is not None else signal_dir()
        self.poll_s = poll_s
        self.idle = threading.Event()
        self.idle.set()
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.is_set():
            if busy_engines(self.directory):
                self.idle.clear()
            else:
                self.idle.set()
            self._stop_event.wait(self.poll_s)
        self.idle.set()

    def stop(self) -> None:
        self._stop_event.set()
        self.join(timeout=5)


class YieldGate:
    """`wait()`: return at once while the engines are idle, else wait until they are, for at most `max_pause_s` at a
    stretch; after a wait that ran out, `grace_s` of work go through without waiting. `paused_s`, `pauses`: how long
    and how often it held the caller."""

    def __init__(self, watcher: EngineWatcher, *, max_pause_s: float = 30.0, grace_s: float = 2.0) -> None:
        self.watcher, self.max_pause_s, self.grace_s = watcher, float(max_pause_s), float(grace_s)
        self.paused_s, self.pauses = 0.0, 0
        self._grace_until = 0.0

    def wait(self) -> None:
        if self.watcher.idle.is_set():
            return
        now = time.monotonic()
        if now < self._grace_until:
            return
        self.pauses += 1
        waited = self.watcher.idle.wait(self.max_pause_s)
        after = time.monotonic()
        self.paused_s += after - now
        if not waited:
            self._grace_until = after + self.grace_s
