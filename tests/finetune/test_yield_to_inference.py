"""A CPU trainer holds its work while an inference engine on the same host has requests in hand
(transport/busy.py): the engine's flag file, the watcher that reads every engine's flag, the gate training
waits at, and the engine's step loop marking itself busy exactly while it serves."""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest

from transport.busy import EngineBusyFlag, EngineWatcher, YieldGate, busy_engines


def wait_for(predicate, timeout: float = 5.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.005)
    return predicate()


def test_the_flag_file_says_busy_only_while_set(tmp_path):
    flag = EngineBusyFlag(tmp_path)
    assert flag.path.name == f"engine-{os.getpid()}" and flag.path.read_bytes() == b"0"
    assert busy_engines(tmp_path) == []
    flag.set(True)
    assert flag.path.read_bytes() == b"1" and busy_engines(tmp_path) == [os.getpid()]
    flag.set(False)
    assert busy_engines(tmp_path) == []
    flag.close()
    assert not flag.path.exists()


def test_a_busy_flag_left_by_a_process_that_is_gone_counts_as_idle_and_is_removed(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True)
    stale = tmp_path / f"engine-{int(dead.stdout)}"
    stale.write_bytes(b"1")  # a worker killed mid-request never wrote b"0"
    (tmp_path / "engine-notapid").write_bytes(b"1")
    assert busy_engines(tmp_path) == []
    assert not stale.exists()
    assert busy_engines(tmp_path / "missing") == []


def test_the_gate_holds_while_any_engine_is_busy_and_lets_go_when_it_is_idle(tmp_path):
    flag = EngineBusyFlag(tmp_path)
    watcher = EngineWatcher(tmp_path, poll_s=0.005)
    watcher.start()
    gate = YieldGate(watcher, max_pause_s=10)
    try:
        gate.wait()  # idle: no hold
        assert gate.pauses == 0
        flag.set(True)
        assert wait_for(lambda: not watcher.idle.is_set())
        released = []
        holder = threading.Thread(target=lambda: (gate.wait(), released.append(time.monotonic())))
        holder.start()
        time.sleep(0.3)
        assert not released, "the gate let training run while the engine was busy"
        let_go = time.monotonic()
        flag.set(False)
        holder.join(5)
        assert released and released[0] - let_go < 0.5
        assert gate.pauses == 1 and 0.25 < gate.paused_s < 5
    finally:
        watcher.stop()
        flag.close()


def test_a_hold_is_bounded_then_work_goes_on_for_the_grace_period(tmp_path):
    """Under a load that never ends training still progresses: at most max_pause_s held, then grace_s unheld."""
    flag = EngineBusyFlag(tmp_path)
    flag.set(True)
    watcher = EngineWatcher(tmp_path, poll_s=0.005)
    watcher.start()
    gate = YieldGate(watcher, max_pause_s=0.2, grace_s=0.5)
    try:
        assert wait_for(lambda: not watcher.idle.is_set())
        t0 = time.monotonic()
        gate.wait()
        held = time.monotonic() - t0
        assert 0.15 < held < 1.0
        t1 = time.monotonic()
        gate.wait()  # within the grace period: no hold
        assert time.monotonic() - t1 < 0.05 and gate.pauses == 1
        time.sleep(0.55)
        t2 = time.monotonic()
        gate.wait()  # the grace is over and the engine still busy: held again
        assert time.monotonic() - t2 > 0.15 and gate.pauses == 2
    finally:
        watcher.stop()
        flag.close()


@pytest.mark.parametrize("bad", ["0", "-3", "soon"])
def test_a_bad_hold_bound_is_refused_by_name(monkeypatch, bad):
    from django.core.exceptions import ImproperlyConfigured

    from finetune.trainer import trainer_yield_max_s

    monkeypatch.setenv("LORAFLEET_TRAINER_YIELD_MAX_S", bad)
    with pytest.raises(ImproperlyConfigured, match="LORAFLEET_TRAINER_YIELD_MAX_S must be a number of seconds"):
        trainer_yield_max_s()


def test_the_engine_is_marked_busy_while_a_request_is_in_hand_and_idle_after(tmp_path):
    from demo.tiny_base import build_tiny_base
    from inference_worker.engine import Engine
    from inference_worker.model import ModelRunner
    from protocol.jobs import GenerationJob

    tiny_llama = build_tiny_base(tmp_path / "base", arch="llama", seed=1)
    flag = EngineBusyFlag(tmp_path / "flags")
    engine = Engine(ModelRunner(tiny_llama, pool_pages=64, enable_lora=False), lambda key: b"",
                    busy_flag=flag).start()
    seen: list[bytes] = []
    try:
        assert wait_for(lambda: flag.path.read_bytes() == b"0")
        handle = engine.submit(GenerationJob(request_id="r", adapter=None, prompt="Once upon a time", max_tokens=80,
                                             temperature=0.0, ignore_eos=True))
        for _ in handle.stream(timeout=60):
            seen.append(flag.path.read_bytes())
        assert handle.result(timeout=60).ok
        # the first 10 chunks came while 70 more tokens were still to write (the last ones may be read after the engine
        # finished the request and marked itself idle: that is right)
        assert len(seen) >= 10 and set(seen[:10]) == {b"1"}, "not marked busy while the answer was written"
        assert wait_for(lambda: flag.path.read_bytes() == b"0"), "still marked busy after the answer"
    finally:
        engine.stop()
        flag.close()
