"""The runner's weights on 2 MB pages (inference_worker.huge_pages): which mappings it touches, and that a real
collapse keeps every value while moving the memory onto huge pages."""
from __future__ import annotations

import pytest

from inference_worker.huge_pages import HUGE, resident_mappings, thp_mode

MB = 1 << 20


def _mapping(lo: int, hi: int, perms: str, name: str, rss_kb: int, huge_kb: int = 0) -> str:
    return (f"{lo:x}-{hi:x} {perms} 00000000 00:00 0 {name}\n"
            f"Size:           {(hi - lo) // 1024} kB\nRss:            {rss_kb} kB\n"
            f"AnonHugePages:  {huge_kb} kB\nVmFlags: rd wr mr mw me ac\n")


def test_only_resident_private_anonymous_memory_is_chosen_and_only_its_aligned_interior():
    base = 0x7F0000000000
    smaps = "".join([
        _mapping(base + 4096, base + 8 * MB + 4096, "rw-p", "", rss_kb=8 * 1024),  # malloc'd weights, resident
        _mapping(base + 16 * MB, base + 24 * MB, "rw-p", "[heap]", rss_kb=8 * 1024),
        _mapping(base + 32 * MB, base + 40 * MB, "rw-p", "", rss_kb=1024),  # mostly untouched: its RSS would grow
        _mapping(base + 48 * MB, base + 56 * MB, "rw-p", "", rss_kb=8 * 1024, huge_kb=8 * 1024),  # already huge
        _mapping(base + 64 * MB, base + 72 * MB, "r--p", "/models/x.safetensors", rss_kb=8 * 1024),  # a file
        _mapping(base + 80 * MB, base + 88 * MB, "rw-s", "/dev/zero (deleted)", rss_kb=8 * 1024),  # shared
        _mapping(base + 96 * MB, base + 96 * MB + 3 * MB, "rw-p", "[stack]", rss_kb=3 * 1024),
        _mapping(base + 100 * MB + 4096, base + 102 * MB + 4096, "rw-p", "", rss_kb=2048),  # no whole 2 MB inside
    ])
    chosen = resident_mappings(smaps)
    assert chosen == [(base + 2 * MB, base + 8 * MB), (base + 16 * MB, base + 24 * MB)]
    assert all(lo % HUGE == 0 and hi % HUGE == 0 for lo, hi in chosen)


_COLLAPSE_IN_A_FRESH_PROCESS = """
import json, torch
from inference_worker.huge_pages import anon_huge_bytes, collapse_resident_memory
MB = 1 << 20
weights = torch.randn(32 * MB // 4, generator=torch.Generator().manual_seed(0))  # 32 MB from torch's allocator
before_sum, before_huge = weights.double().sum().item(), anon_huge_bytes()
done = collapse_resident_memory()
print(json.dumps({"collapsed": done.collapsed, "skipped": done.skipped, "before_huge": before_huge,
                  "huge_after": done.huge_after, "same": weights.double().sum().item() == before_sum,
                  "describe": done.describe()}))
"""


@pytest.mark.skipif(thp_mode() in ("", "never"), reason="the kernel has transparent huge pages off")
def test_a_collapse_moves_resident_weights_onto_huge_pages_and_keeps_every_value():
    """In a process of its own: in the test run's, earlier tests' collapses leave freed huge pages in the heap, and a
    new tensor can land on them (then only 8 of its 32 MB were still on 4 KB pages to move)."""
    import json
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run([sys.executable, "-c", _COLLAPSE_IN_A_FRESH_PROCESS], cwd=root, capture_output=True,
                         text=True, timeout=300, check=True).stdout
    done = json.loads(out.strip().splitlines()[-1])
    if "MADV_COLLAPSE" in done["skipped"] and done["collapsed"] == 0:
        pytest.skip(f"this kernel cannot collapse on request (Linux 6.1+): {done['skipped']}")
    assert done["collapsed"] > 0 and done["huge_after"] >= done["before_huge"] + 16 * MB, done["describe"]
    assert done["same"]  # the same bytes, on other pages
    assert "MB on them now" in done["describe"]
