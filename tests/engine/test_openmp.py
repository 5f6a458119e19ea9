"""The engine's OpenMP team is the process's only one (inference_worker/openmp.py): a thread that ran torch's
parallel ops before starting the engine gives its worker threads back, so that libgomp does not throttle the
engine's team (measured: 432 -> 574-588 tok/s on the mid model, 2 CPUs)."""
from __future__ import annotations

import os
import time

import pytest
import torch

from inference_worker.engine import Engine
from inference_worker.model import ModelRunner
from inference_worker.openmp import loaded_runtimes, release_thread_team
from protocol.jobs import GenerationJob

pytestmark = pytest.mark.skipif(torch.get_num_threads() < 2, reason="needs torch with 2 or more intra-op threads")


def _os_threads() -> set[int]:
    return {int(t) for t in os.listdir("/proc/self/task")}


def _still_alive(workers: set[int], timeout: float = 5.0) -> set[int]:
    """Those of `workers` still running once they have had `timeout` seconds to exit. A released libgomp worker
    leaves the pool's barrier and then calls pthread_exit: the releasing call returns before the kernel has
    reaped the thread, so /proc may list it for a moment longer."""
    deadline = time.monotonic() + timeout
    while (alive := workers & _os_threads()) and time.monotonic() < deadline:
        time.sleep(0.01)
    return alive


def _parallel_op() -> None:
    x = torch.randn(2_000_000)
    (x * 2.0).add_(1.0).sum()  # large enough for every ATen parallel_for: this thread's team is built


def _team_of_this_thread() -> set[int]:
    """The OS threads the calling thread's parallel op adds (its OpenMP team's workers), after a release."""
    release_thread_team()
    before = _os_threads()
    _parallel_op()
    return _os_threads() - before


def test_releasing_frees_this_threads_openmp_workers_and_the_next_op_rebuilds_them():
    workers = _team_of_this_thread()
    assert len(workers) == torch.get_num_threads() - 1, workers
    assert release_thread_team() is True
    assert not _still_alive(workers), "the released workers are still alive"
    assert len(_team_of_this_thread()) == torch.get_num_threads() - 1  # the next parallel op builds a new team
    release_thread_team()


def test_starting_the_engine_frees_the_starting_threads_team(tiny_llama):
    runner = ModelRunner(tiny_llama, pool_pages=64, enable_lora=False)
    workers = _team_of_this_thread()  # this thread "built the model": it has a team
    assert workers
    engine = Engine(runner, lambda key: b"", max_running=4).start()
    try:
        assert not _still_alive(workers), "the starting thread kept its OpenMP workers"
        result = engine.generate(GenerationJob("omp", None, prompt_token_ids=[5, 6, 7], max_tokens=3,
                                               temperature=0.0, ignore_eos=True), timeout=60)
        assert result.ok and len(result.token_ids) == 3
    finally:
        engine.stop()



def test_an_idle_engine_holds_no_team_so_two_engines_in_one_process_do_not_throttle_each_other(tiny_llama):
    runner = ModelRunner(tiny_llama, pool_pages=64, enable_lora=False)
    forward = runner.forward_all_positions

    def forward_with_a_large_op(steps, every):
        _parallel_op()  # the tiny model's own ops are below ATen's grain size: make the step build a team
        return forward(steps, every)

    runner.forward_all_positions = forward_with_a_large_op  # type: ignore[method-assign]
    release_thread_team()
    before = _os_threads()
    engine = Engine(runner, lambda key: b"", max_running=4).start()
    try:
        peak: set[int] = set()
        handle = engine.submit(GenerationJob("busy", None, prompt_token_ids=[5, 6, 7], max_tokens=40,
                                             temperature=0.0, ignore_eos=True))
        while not handle.done():
            peak |= _os_threads() - before
        assert handle.result(60).ok
        assert len(peak) >= torch.get_num_threads(), peak  # the engine thread and its team's workers
        deadline = time.monotonic() + 5
        while len(_os_threads() - before) > 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(_os_threads() - before) == 1, "the idle engine kept its OpenMP workers"  # its own thread only
    finally:
        engine.stop()


def _decode_attention():
    """Inputs for one layer's decode attention of 64 sequences; the call; its check."""
    from kernels import paged_decode_attention

    B, kv, g, hd, bs = 64, 2, 2, 32, 16
    pages = torch.randn(B * 4, 2 * kv, bs * hd)
    blocks = torch.arange(B * 4, dtype=torch.int64).view(B, 4)
    lens = torch.full((B,), 60, dtype=torch.int64)
    q = torch.randn(B, kv * g, hd)

    def run():
        return paged_decode_attention(q, pages, blocks, lens, kv_heads=kv, window=None, scale=0.2,
                                      threads=torch.get_num_threads())

    def check(got) -> None:
        assert got is not None and got.shape == (B, kv * g * hd)

    return run, check


def _fleet_lora():
    """Inputs for one projection's LoRA of a decode batch of 64 tokens over 16 adapters (weights above
    kernels.cpu.PARALLEL_BYTES, so the native kernel goes parallel); the call; its check against the reference."""
    from kernels import LoraMapping, add_lora
    from kernels.cpu import PARALLEL_BYTES
    from kernels.reference import add_lora_reference
    from kernels.testing import random_pool

    ranks, d_in, d_out = [16] * 16, 576, 1536
    assert sum(ranks) * (d_in + d_out) * 4 >= PARALLEL_BYTES
    pool = random_pool({"p": (d_in, d_out)}, {"p": ranks}, seed=5)
    mapping = LoraMapping.build([t % len(ranks) for t in range(64)], len(ranks))
    x = torch.randn(64, d_in)
    scales = torch.full((len(ranks),), 0.5)
    want = add_lora_reference(torch.zeros(64, d_out), x, pool.buffer, pool.tables["p"], mapping, scales)
    out = torch.zeros(64, d_out)

    def run():
        return add_lora(out, x, pool.buffer, pool.tables["p"], mapping, scales, backend="cpu")

    def check(got) -> None:
        torch.testing.assert_close(got, want.float(), rtol=1e-4, atol=1e-4)

    return run, check


@pytest.mark.parametrize("kernel", [_decode_attention, _fleet_lora], ids=["decode attention", "SGMV"])
def test_the_native_kernels_run_on_the_callers_openmp_team(kernel):
    """The native decode attention and SGMV take the calling thread's OpenMP team (kernels/csrc/sgmv_cpu.c:
    those workers spin between torch's ops and join at once, where helper threads of the kernel's own could
    not run beside them): on a thread with no team, the kernel builds the team and torch's next parallel op
    reuses it, adding no thread. Only one OpenMP runtime is loaded: the kernel library's libgomp is the copy
    torch brought, or each thread would hold two teams. Inputs are made before, and results checked after, on
    the test's thread: on the fresh thread the kernel is the first parallel work."""
    import threading

    from kernels import cpu_native

    if cpu_native.load() is None:
        pytest.skip("no C compiler: the kernels fall back to torch")
    assert len(loaded_runtimes()) == 1, loaded_runtimes()
    run, check = kernel()
    added: dict[str, set[int]] = {}
    results: list = []
    failed: list[BaseException] = []

    def on_a_fresh_thread() -> None:
        try:
            release_thread_team()
            before = _os_threads()
            results.append(run())
            after_kernel = _os_threads()
            _parallel_op()
            added["kernel"], added["torch"] = after_kernel - before, _os_threads() - after_kernel
            release_thread_team()
        except BaseException as exc:  # noqa: BLE001  (reported on the test's thread below)
            failed.append(exc)

    t = threading.Thread(target=on_a_fresh_thread)
    t.start()
    t.join(timeout=60)
    assert not failed, failed
    check(results[0])
    assert len(added["kernel"]) == torch.get_num_threads() - 1, added  # the team's workers
    assert added["torch"] == set(), added  # torch's op ran on that same team
