"""Move the process's resident anonymous memory (the model's weights above all) onto 2 MB pages.

A decode step streams every weight of the model once: SmolLM2's 540 MB, far more than the caches hold. On 4 KB
pages each 4 KB of it is a TLB miss, on this project's VM hosts a nested page walk, and the hardware prefetchers
stop at every 4 KB page boundary. oneDNN's packed weights are allocated by torch's allocator (malloc), where the
kernel gives huge pages only when THP is `always`; the common default is `madvise`, so they sit on 4 KB pages.
Measured on the 2-CPU Zen 4 host (bench/RESULTS.md, 2026-12-03), SmolLM2's 64-row GEMMs ran at 147-164 GFLOP/s in
the engine on 4 KB pages and 170-177 on 2 MB pages, and the same GEMMs back to back (bench/limits.py) at 185 and
193.

torch gives no address for a packed (opaque oneDNN) tensor, so this works on the process's mappings instead:
every private anonymous read-write mapping (malloc's heap and its mmap'd chunks) that is almost wholly resident
has its 2 MB-aligned interior collapsed into huge pages now, synchronously (`MADV_COLLAPSE`, Linux 6.1+), after
`MADV_HUGEPAGE` so the kernel keeps it that way. Memory that is resident stays the same size: a mapping counts only
when at least `min_resident` of it is resident, so collapsing adds at most the rest of it. Where the kernel is
older, THP is `never`, or the platform is not Linux, nothing changes and the count says so.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
from dataclasses import dataclass
from pathlib import Path

HUGE = 2 << 20  # x86-64's and arm64's (4 KB granule) transparent huge page
MADV_HUGEPAGE = 14
MADV_COLLAPSE = 25
THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")


@dataclass
class Collapse:
    """What `collapse_resident_memory` did: bytes it asked to collapse, bytes the kernel collapsed, and why the
    rest was left (the first error's name, or a reason)."""

    asked: int = 0
    collapsed: int = 0
    skipped: str = ""
    huge_after: int = 0  # the process's anonymous memory on huge pages afterwards (smaps' AnonHugePages)

    def describe(self) -> str:
        msg = (f"{self.collapsed / 2**20:.0f} of {self.asked / 2**20:.0f} MB of resident memory collapsed to 2 MB pages, "
               f"{self.huge_after / 2**20:.0f} MB on them now")
        return msg + (f" ({self.skipped})" if self.skipped else "")


def thp_mode() -> str:
    """The bracketed word of /sys/kernel/mm/transparent_hugepage/enabled ("always", "madvise", "never"), or ""."""
    try:
        text = THP_ENABLED.read_text()
    except OSError:
        return ""
    return text[text.find("[") + 1:text.find("]")] if "[" in text else ""


def resident_mappings(smaps: str, *, min_resident: float = 0.9) -> list[tuple[int, int]]:
    """[(start, end)] of the 2 MB-aligned interiors of the private anonymous rw mappings in /proc/PID/smaps text
    that are at least `min_resident` resident and not already wholly on huge pages."""
    out: list[tuple[int, int]] = []
    current: dict | None = None
    for line in smaps.splitlines() + ["00000000-00000000 ---p 0 0:0 0"]:  # a sentinel header flushes the last one
        head = line.split(maxsplit=5)
        if head and "-" in head[0] and len(head) >= 5 and not head[0].endswith(":"):
            if current is not None:
                start, end = -(-current["start"] // HUGE) * HUGE, current["end"] // HUGE * HUGE
                size, rss, huge = current["end"] - current["start"], current.get("Rss", 0), current.get("AnonHugePages", 0)
                if end > start and rss >= min_resident * size and huge < end - start:
                    out.append((start, end))
            lo, hi = (int(v, 16) for v in head[0].split("-"))
            name = head[5].strip() if len(head) > 5 else ""
            anon = head[1] == "rw-p" and name in ("", "[heap]")
            current = {"start": lo, "end": hi} if anon else None
        elif current is not None and len(head) >= 2 and head[0] in ("Rss:", "AnonHugePages:"):
            current[head[0][:-1]] = int(head[1]) * 1024  # kB
    return out


def collapse_resident_memory(*, min_resident: float = 0.9) -> Collapse:
    """Collapse this process's resident anonymous memory into 2 MB pages (see the module's text). Call it once the
    weights are in memory; it takes about a second for a few hundred MB (the kernel copies each 2 MB)."""
    result = Collapse()
    if not Path("/proc/self/smaps").exists():
        result.skipped = "no /proc/self/smaps"
        return result
    if thp_mode() in ("", "never"):
        result.skipped = f"transparent huge pages are {thp_mode() or 'not available'}"
        return result
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    for start, end in resident_mappings(Path("/proc/self/smaps").read_text(), min_resident=min_resident):
        result.asked += end - start
        for advice in (MADV_HUGEPAGE, MADV_COLLAPSE):
            if libc.madvise(ctypes.c_void_p(start), end - start, advice) != 0:
                err = ctypes.get_errno()
                if not result.skipped:
                    result.skipped = f"madvise {'MADV_COLLAPSE' if advice == MADV_COLLAPSE else 'MADV_HUGEPAGE'}: " \
                                     f"{os.strerror(err)}"
                break
        else:
            result.collapsed += end - start
    result.huge_after = anon_huge_bytes()
    return result


def anon_huge_bytes() -> int:
    """This process's anonymous memory on transparent huge pages (the sum of smaps' AnonHugePages)."""
    try:
        text = Path("/proc/self/smaps_rollup").read_text()
    except OSError:
        return 0
    return sum(int(line.split()[1]) * 1024 for line in text.splitlines() if line.startswith("AnonHugePages:"))
