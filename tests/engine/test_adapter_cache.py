"""Adapter cache: storage -> verified -> host LRU -> device pool, as the engine uses it."""
import hashlib
import threading
import time
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save

from inference_worker.adapter_cache import FAILED, LOADING, NO_ROOM, READY, AdapterCache
from inference_worker.lora import NoRoom
from protocol.jobs import AdapterRef

HIDDEN, LAYERS = 32, 2
CONFIG = SimpleNamespace(hidden_size=HIDDEN, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                         intermediate_size=64, num_hidden_layers=LAYERS)


class FakeRunner:
    """Records what lands in which slot, like ModelRunner's adapter API over a pool where every adapter
    takes one page (the real pool's arithmetic is tested in test_memory_pool.py)."""

    config = CONFIG
    max_lora_rank = 16

    def __init__(self, pages: int = 2):
        self.slots = {}
        self.loads = []
        self.pool = SimpleNamespace(num_free=pages)
        self.lora = SimpleNamespace(pages_for=lambda rank, targets: 1)

    def load_adapter(self, weights, *, rank, scale, key=""):
        if self.pool.num_free < 1:
            raise NoRoom("full")
        slot = next(i for i in range(len(self.slots) + 1) if i not in self.slots)
        self.slots[slot] = (rank, scale, weights)
        self.loads.append(slot)
        self.pool.num_free -= 1
        return slot

    def unload_adapter(self, slot):
        del self.slots[slot]
        self.pool.num_free += 1


def adapter_blob(seed: int, r: int = 4, modules=("q_proj", "v_proj"), shape_override=None) -> bytes:
    g = torch.Generator().manual_seed(seed)
    outs = {"q_proj": 32, "v_proj": 16}
    t = {}
    for layer in range(LAYERS):
        for m in modules:
            p = f"base_model.model.model.layers.{layer}.self_attn.{m}"
            t[f"{p}.lora_A.weight"] = torch.randn(r, HIDDEN, generator=g)
            t[f"{p}.lora_B.weight"] = torch.randn(*(shape_override or (outs[m], r)), generator=g)
    return save(t)


def ref_for(blob: bytes, key: str, r: int = 4, alpha: float = 8.0) -> AdapterRef:
    return AdapterRef(version_id=1, sha256=hashlib.sha256(blob).hexdigest(), storage_key=key, rank=r, alpha=alpha,
                      use_rslora=False, target_modules=["q_proj", "v_proj"])


class Store:
    """A dict-backed loader that counts reads and can be slowed down."""

    def __init__(self, delay: float = 0.0):
        self.blobs, self.reads, self.delay = {}, [], delay
        self.lock = threading.Lock()

    def put(self, key, blob):
        self.blobs[key] = blob

    def __call__(self, key):
        with self.lock:
            self.reads.append(key)
        time.sleep(self.delay)
        return self.blobs[key]


def acquire_when_loaded(cache, ref, waiter, timeout=10.0):
    deadline = time.monotonic() + timeout
    while True:
        got = cache.acquire(ref, waiter)
        if got.state != LOADING:
            return got
        assert time.monotonic() < deadline, "load never finished"
        time.sleep(0.005)


def make_cache(store, runner=None, *, pages=2, **kw):
    runner = runner or FakeRunner(pages)
    return AdapterCache(runner, store, **kw), runner


def test_host_lru_keeps_the_recently_used_within_its_byte_budget():
    store = Store()
    refs = {}
    for name in "ABCD":
        blob = adapter_blob(ord(name))
        store.put(name, blob)
        refs[name] = ref_for(blob, name)
    cache, runner = make_cache(store, host_cache_bytes=10**9, pages=1)
    got = acquire_when_loaded(cache, refs["A"], "w-A")
    per_adapter = cache.stats()["host_bytes"]
    assert per_adapter > 0 and got.state == READY
    cache.release(refs["A"].identity)
    cache.close()

    cache, runner = make_cache(store, host_cache_bytes=int(2.5 * per_adapter), pages=1)
    for name in "AB":
        acquire_when_loaded(cache, refs[name], f"w-{name}")
        cache.release(refs[name].identity)
    acquire_when_loaded(cache, refs["A"], "w-A2")  # A is now the most recently used
    cache.release(refs["A"].identity)
    acquire_when_loaded(cache, refs["C"], "w-C")
    cache.release(refs["C"].identity)
    assert cache.host_resident() == [refs["A"].identity, refs["C"].identity]  # B, least recent, went
    assert cache.stats()["host_bytes"] <= 2.5 * per_adapter
    assert cache.stats()["host_evictions"] == 1
    # A second request for a cached version is free: no storage read.
    reads = len(store.reads)
    assert acquire_when_loaded(cache, refs["A"], "w-A3").state == READY
    assert len(store.reads) == reads and cache.stats()["cold_loads"] == 3
    cache.close()


def test_pinned_adapters_are_never_evicted_and_admission_waits_for_room():
    store = Store()
    refs = {}
    for name in "ABC":
        blob = adapter_blob(ord(name))
        store.put(name, blob)
        refs[name] = ref_for(blob, name)
    cache, runner = make_cache(store, pages=2)
    a = acquire_when_loaded(cache, refs["A"], "a")
    b = acquire_when_loaded(cache, refs["B"], "b")
    assert {a.slot, b.slot} == {0, 1}
    for _ in range(3):  # asking again and again changes nothing while both are in use
        assert acquire_when_loaded(cache, refs["C"], "c").state == NO_ROOM
    assert set(cache.resident()) == {refs["A"].identity, refs["B"].identity}
    assert runner.loads == [a.slot, b.slot]
    cache.release(refs["A"].identity)
    c = cache.acquire(refs["C"], "c")
    assert c.state == READY and c.slot == a.slot  # took the room A freed, B untouched
    assert set(cache.resident()) == {refs["B"].identity, refs["C"].identity}
    assert cache.stats()["evictions"] == 1
    assert runner.slots[c.slot][1] == pytest.approx(8.0 / 4)  # scale alpha/r handed to the runner
    cache.close()


def test_a_corrupted_blob_fails_only_its_own_requests():
    store = Store(delay=0.05)
    good, bad = adapter_blob(1), adapter_blob(2)
    good_ref, bad_ref = ref_for(good, "good"), ref_for(bad, "bad")
    store.put("good", good)
    store.put("bad", bad[:-1] + bytes([bad[-1] ^ 1]))  # one flipped bit in storage
    cache, runner = make_cache(store)
    states = {w: cache.acquire(ref, w).state for w, ref in [("b1", bad_ref), ("g1", good_ref), ("b2", bad_ref)]}
    assert set(states.values()) == {LOADING}
    results = {w: acquire_when_loaded(cache, ref, w) for w, ref in [("b1", bad_ref), ("g1", good_ref), ("b2", bad_ref)]}
    assert results["g1"].state == READY
    for w in ("b1", "b2"):
        assert results[w].state == FAILED and results[w].error_code == "adapter_integrity_error"
    assert bad_ref.identity not in cache.resident() and bad_ref.identity not in cache.host_resident()
    assert len(runner.loads) == 1  # nothing of the bad blob reached a slot


def test_unreadable_or_misshapen_adapters_fail_with_adapter_load_failed():
    store = Store()

    def broken(key):
        raise OSError("bucket unreachable")

    cache, _ = make_cache(broken)
    blob = adapter_blob(3)
    got = acquire_when_loaded(cache, ref_for(blob, "k"), "w")
    assert got.state == FAILED and got.error_code == "adapter_load_failed" and "bucket unreachable" in got.error_message

    wrong = adapter_blob(4, shape_override=(99, 4))  # lora_B rows do not match q_proj's 32 outputs
    store.put("wrong", wrong)
    cache, runner = make_cache(store)
    got = acquire_when_loaded(cache, ref_for(wrong, "wrong"), "w")
    assert got.state == FAILED and got.error_code == "adapter_load_failed"
    assert "lora_B" in got.error_message and "[99, 4]" in got.error_message
    assert runner.loads == []
    store.put("nonsense", b"not safetensors at all")
    got = acquire_when_loaded(cache, ref_for(b"not safetensors at all", "nonsense"), "w2")
    assert got.state == FAILED and got.error_code == "adapter_load_failed"


def test_ten_concurrent_requests_for_a_cold_adapter_make_one_load():
    store = Store(delay=0.2)
    blob = adapter_blob(5)
    ref = ref_for(blob, "k")
    store.put("k", blob)
    cache, runner = make_cache(store)
    barrier = threading.Barrier(10)
    answers = []

    def request(i):
        barrier.wait()
        answers.append(cache.acquire(ref, f"w{i}").state)

    threads = [threading.Thread(target=request, args=(i,)) for i in range(10)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert answers == [LOADING] * 10
    slots = {acquire_when_loaded(cache, ref, f"w{i}").slot for i in range(10)}
    assert len(slots) == 1
    assert store.reads == ["k"] and cache.stats()["cold_loads"] == 1 and len(runner.loads) == 1
    assert cache.pinned() == {ref.identity: 10}


def test_a_mapped_blob_on_disk_loads_the_same_weights_and_a_hostile_header_is_refused(tmp_path):
    from safetensors.torch import load

    from inference_worker.adapter_cache import map_file

    blob = adapter_blob(6)
    (tmp_path / "good").write_bytes(blob)
    cache, runner = make_cache(lambda key: map_file(tmp_path / key))
    got = acquire_when_loaded(cache, ref_for(blob, "good"), "w")
    assert got.state == READY
    _, _, weights = runner.slots[got.slot]
    expected = load(blob)
    assert weights.keys() == expected.keys() and all(torch.equal(weights[k], expected[k]) for k in expected)

    # Offsets that overlap: safetensors' own writer never makes them; the worker's in-place parse must
    # refuse them (two tensors viewing one byte range) before any view is made.
    import json
    import struct

    header = {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight":
              {"dtype": "F32", "shape": [4, HIDDEN], "data_offsets": [0, 4 * HIDDEN * 4]},
              "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight":
              {"dtype": "F32", "shape": [32, 4], "data_offsets": [0, 32 * 4 * 4]}}
    raw = json.dumps(header).encode()
    hostile = struct.pack("<Q", len(raw)) + raw + bytes(4 * HIDDEN * 4)
    (tmp_path / "hostile").write_bytes(hostile)
    cache, runner = make_cache(lambda key: map_file(tmp_path / key))
    got = acquire_when_loaded(cache, ref_for(hostile, "hostile"), "w")
    assert got.state == FAILED and got.error_code == "adapter_load_failed" and "overlaps" in got.error_message
    assert runner.loads == []
    (tmp_path / "empty").write_bytes(b"")
    got = acquire_when_loaded(cache, ref_for(b"", "empty"), "w2")
    assert got.state == FAILED and got.error_code == "adapter_load_failed"


def test_the_same_weights_with_another_config_are_another_adapter():
    """Issue 12: two tenants upload the same safetensors bytes with different lora_alpha. The cache keys by
    identity (weights + config), so each is loaded with its own scale; neither serves the other's."""
    store = Store()
    blob = adapter_blob(7)
    store.put("tenant-a", blob)
    store.put("tenant-b", blob)
    a, b = ref_for(blob, "tenant-a", alpha=8.0), ref_for(blob, "tenant-b", alpha=64.0)
    assert a.sha256 == b.sha256 and a.identity != b.identity
    cache, runner = make_cache(store)
    got_b = acquire_when_loaded(cache, b, "b")  # B first, on a fresh worker
    got_a = acquire_when_loaded(cache, a, "a")
    assert got_a.slot != got_b.slot
    assert runner.slots[got_b.slot][1] == pytest.approx(64.0 / 4)
    assert runner.slots[got_a.slot][1] == pytest.approx(8.0 / 4)
    assert set(cache.resident()) == {a.identity, b.identity}


def test_reclaim_evicts_idle_adapters_only():
    """The KV cache asks for pages: idle adapters give theirs back (least recently used first); a pinned
    adapter never does."""
    store = Store()
    refs = {}
    for name in "AB":
        blob = adapter_blob(ord(name))
        store.put(name, blob)
        refs[name] = ref_for(blob, name)
    cache, runner = make_cache(store, pages=2)
    acquire_when_loaded(cache, refs["A"], "a")
    acquire_when_loaded(cache, refs["B"], "b")
    cache.release(refs["A"].identity)
    assert runner.pool.num_free == 0
    assert cache.reclaim(1) is True and cache.resident() == [refs["B"].identity]
    assert cache.reclaim(2) is False and cache.resident() == [refs["B"].identity]  # B is pinned
