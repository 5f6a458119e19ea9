"""Prefix-cache keys: which full KV blocks of a sequence another request may reuse.

A block's KV depends on every token before it and on the weights that computed it: the base and the adapter
(LoRA changes q, k and v, so the same tokens give other keys and values under another adapter). A block's key is
therefore a hash chain (vLLM's automatic prefix caching): the key of block i hashes the key of block i - 1 and the
block's own token ids, and the chain starts from a root that names the tenant, the adapter's identity (weights and
config; "" for the base) and the request's `cache_salt`. Two requests share a block only when all of that is equal:

- never across tenants — a cache shared between tenants would tell one, through its own latency, which prompts
  another sent (the timing side channel vLLM's `cache_salt` closes between users);
- never across adapters or between an adapter and the base — their KV differs;
- never across salts — a tenant may separate its own end users.

The pool keeps the pages and their keys (memory_pool.PagePool); the engine asks `chain` for a sequence's keys,
takes the longest run of cached blocks at the start of a prompt, and keys each block it fills.
"""
from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence


def root_key(tenant: str, adapter_identity: str | None, cache_salt: str = "") -> bytes:
    """The chain's start for one (tenant, adapter or base, salt)."""
    h = hashlib.blake2b(digest_size=16, person=b"lorafleet-kv")
    for part in (tenant, adapter_identity or "", cache_salt):
        b = part.encode()
        h.update(len(b).to_bytes(4, "little"))
        h.update(b)
    return h.digest()


def block_key(parent: bytes, tokens: Sequence[int]) -> bytes:
    """The key of a full block whose tokens are `tokens`, after the block whose key is `parent`."""
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(array("q", tokens).tobytes())
    return h.digest()


def chain(root: bytes, tokens: Sequence[int], block_size: int, known: list[bytes] | None = None) -> list[bytes]:
    """Keys of every full block of `tokens`; `known` (the keys of its first blocks, computed before) is extended
    in place and returned, so a growing sequence hashes each block once."""
    keys = known if known is not None else []
    for i in range(len(keys), len(tokens) // block_size):
        keys.append(block_key(keys[-1] if keys else root, tokens[i * block_size:(i + 1) * block_size]))
    return keys
