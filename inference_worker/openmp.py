"""One OpenMP team per process: the engine thread's.

torch's CPU ops run their parallel regions on OpenMP (libgomp in the torch wheel; oneDNN's GEMMs too). Every
thread that ever runs a parallel region becomes the master of its own team and keeps that team's worker
threads for its whole life. Once the process holds more OpenMP threads than CPUs, libgomp "throttles": every
team's idle workers spin for ~100 iterations instead of ~300,000 before they sleep, so each of the thousands
of small parallel regions of a forward step (norms, RoPE, attention, KV gathers) pays a futex wake-up.

The engine steps on a thread of its own, and the thread that built the model (packing weights, scrubbing the
pool) had already made a team. Measured on this project's 2-CPU machine, mid model, base-only: the same step
loop ran 545 tok/s on the thread that built the model and 432 tok/s on a second thread; elementwise ops took
1.2-3.5x longer there (silu * up 60 -> 212 us). Freeing the other thread's team restores the full speed.

`release_thread_team()` frees the *calling* thread's team (OpenMP 5.0's `omp_pause_resource_all` with
`omp_pause_soft`; libgomp frees only the caller's pool, and only outside a parallel region). The next parallel
region on that thread simply builds a new team. It is called by `Engine.start` on the starting thread, by
adapter loader threads after each load, and by the engine thread itself when it goes idle (so that two engines
in one process — a benchmark's, a test's — do not throttle each other: with both alive, the mid model's
base-only pass fell from 564 to 429 tok/s). On a worker the running engine's team is then the only one.
No-op (False) where no OpenMP runtime with that call is loaded.
"""
from __future__ import annotations

import ctypes
import threading

OMP_PAUSE_SOFT = 1
_RUNTIMES = ("libgomp", "libiomp", "libomp")
_lock = threading.Lock()
_pause = None  # the runtime's omp_pause_resource_all, once found
_looked = False


def loaded_runtimes() -> list[str]:
    """The paths of the OpenMP runtimes mapped into this process (empty where /proc is not there)."""
    try:
        with open("/proc/self/maps") as maps:
            return sorted({line.split()[-1] for line in maps
                           if any(name in line.rsplit("/", 1)[-1] for name in _RUNTIMES)})
    except OSError:  # not Linux
        return []


def _find_pause():
    global _pause, _looked
    with _lock:
        if _looked:
            return _pause
        _looked = True
        for path in loaded_runtimes():
            try:
                fn = ctypes.CDLL(path).omp_pause_resource_all
            except (OSError, AttributeError):
                continue
            fn.argtypes, fn.restype = [ctypes.c_int], ctypes.c_int
            _pause = fn
            break
        return _pause


def release_thread_team() -> bool:
    """Free the calling thread's OpenMP worker threads; True when the runtime did."""
    import torch  # noqa: F401  (the runtime is loaded with torch)

    pause = _find_pause()
    return pause is not None and pause(OMP_PAUSE_SOFT) == 0
