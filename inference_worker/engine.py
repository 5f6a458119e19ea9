"""The engine: one thread that runs continuous (iteration-level) batching over one ModelRunner.

Any thread may `submit(job)`; the engine thread, at every step,
  1. takes new jobs and cancellations from its inbox,
  2. admits waiting requests in arrival order (FCFS) while KV blocks and adapter slots allow,
  3. builds one batch: a prefill chunk for requests still reading their prompt (a per-step token budget
     chunks long prompts) and one decode token for the others, ordered so that each adapter's tokens are
     contiguous (the segments SGMV consumes), and runs ONE `runner.forward` over all of it,
  4. samples, checks stop conditions, streams text, and retires finished requests at once, freeing
     their KV blocks and unpinning their adapters.

Memory (one pool for KV blocks and adapters, memory_pool.py). KV blocks for a request's whole budget
(prompt + max_tokens) are reserved at admission, so a running request can never run out of cache and
nothing needs preempting; the price is that a request that stops early held blocks it did not use until
it finished. Under pressure the engine *queues*: a request whose KV blocks or adapter pages are not free
waits (idle adapters are evicted first, least recently used, to give pages back), and counts once in
`admissions_waited_memory`. It *refuses* at once only what can never fit: prompt + max_tokens beyond the
pool (`prompt_too_long`), or an adapter whose pages plus the request's KV exceed the pool
(`adapter_too_large`). It never preempts a running request.

Fairness: a request whose adapter is still loading (off-thread) does not hold up those behind it; a
request that waits for memory does, so nothing later can keep taking the pages it waits for (no
starvation).

Failures are per request: a bad adapter, an over-long prompt or bad parameters end that request with an
error code; if a forward pass raises, the batch is re-run sequence by sequence to find the culprit.
"""
from __future__ import annotations

import heapq
import itertools
import logging
import math
import queue
import threading
import time
from collections import defaultdict, deque
from typing import Callable, Iterator

import torch

from protocol import jobs
from protocol.jobs import GenerationJob, GenerationResult

from .adapter_cache import FAILED, LOADING, NO_ROOM, AdapterCache
from .metrics import EngineMetrics
from .model import SeqStep
from .sampling import IncrementalText, NonFiniteLogits, RequestSampler, SamplingParams, sample_next_tokens

log = logging.getLogger(__name__)


class RequestHandle:
    """What `submit` returns: wait for the result, stream text deltas, or cancel. Thread-safe."""

    def __init__(self, request_id: str, engine: "Engine"):
        self.request_id = request_id
        self._engine = engine
        self._cond = threading.Condition()
        self._text = ""  # text that is final (will never be taken back by a stop string)
        self._result: GenerationResult | None = None

    def result(self, timeout: float | None = None) -> GenerationResult:
        with self._cond:
            if not self._cond.wait_for(lambda: self._result is not None, timeout):
                raise TimeoutError(f"request {self.request_id} not done after {timeout} s")
            return self._result

    def done(self) -> bool:
        return self._result is not None

    def cancel(self) -> None:
        """Ends the request at the next step; its result has finish_reason 'cancelled'."""
        self._engine._post(("cancel", self))

    def stream(self, timeout: float | None = None) -> Iterator[str]:
        """Yields text deltas as they are generated and ends when the request ends (check `result()`
        for how it ended). Text that could still turn out to be the start of a stop string is held back."""
        sent = 0
        while True:
            with self._cond:
                if not self._cond.wait_for(lambda: len(self._text) > sent or self._result is not None, timeout):
                    raise TimeoutError(f"request {self.request_id}: no token for {timeout} s")
                text, finished = self._text, self._result is not None
            if len(text) > sent:
                yield text[sent:]
                sent = len(text)
            if finished:
                return

    # engine side
    def _publish(self, text: str) -> None:
        if len(text) != len(self._text):
            with self._cond:
                self._text = text
                self._cond.notify_all()

    def _finish(self, result: GenerationResult) -> None:
        with self._cond:
            if result.status == "ok" or result.finish_reason == "cancelled":
                self._text = result.text
            self._result = result
            self._cond.notify_all()


class _Request:
    """Engine-private state of one request."""

    __slots__ = (
        "job", "handle", "key", "prompt_ids", "out_ids", "blocks", "num_computed", "slot", "ident",
        "sampler", "text", "stop_ids", "t_submit", "t_admit", "t_first", "done", "waited_memory", "counted",
    )

    def __init__(self, job: GenerationJob, handle: RequestHandle, key: int):
        self.job = job
        self.handle = handle
        self.key = key  # unique per engine: the adapter cache's waiter id
        self.prompt_ids: list[int] = []
        self.out_ids: list[int] = []
        self.blocks: list[int] = []
        self.num_computed = 0  # tokens of this sequence already in the KV cache
        self.slot = -1
        self.ident: str | None = None  # identity of the adapter pinned in `slot` (released when the request ends)
        self.sampler: RequestSampler | None = None  # None = greedy
        self.text: IncrementalText | None = None
        self.stop_ids: frozenset[int] = frozenset()
        self.t_submit = time.perf_counter()
        self.t_admit: float | None = None
        self.t_first: float | None = None
        self.done = False
        self.waited_memory = False  # counted once in admissions_waited_memory
        self.counted = False  # counted in its tenant's active requests (engine._active)


W_PROMPT, W_OUTPUT = 1.0, 2.0  # VTC weights of a prompt token and a generated token (the paper's)


class Engine:
    def __init__(
        self,
        runner,
        loader: Callable[[str], bytes],
        *,
        max_running: int = 64,
        host_cache_bytes: int = 2 << 30,
        prefill_chunk: int = 256,
        loader_threads: int = 2,
        fair: bool = True,
    ):
        self.runner = runner
        self.tokenizer = runner.tokenizer
        self.max_running = max_running
        self.prefill_chunk = max(1, int(prefill_chunk))
        self.lora_enabled = getattr(runner, "lora", None) is not None
        self.cache = AdapterCache(runner, loader, host_cache_bytes=host_cache_bytes,
                                  loader_threads=loader_threads, on_loaded=self._wake_up) if self.lora_enabled else None
        self.metrics = EngineMetrics()
        self.block_size = int(runner.block_size)
        self.allocator = runner.kv.allocator
        self.total_blocks = int(self.allocator.num_free)  # pool pages KV may ever hold (fixed slots excluded)
        self.max_context = int(getattr(runner.config, "max_position_embeddings"))
        self.eos_ids = self._eos_ids()
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._waiting: deque[_Request] = deque()
        self._running: list[_Request] = []
        self._by_handle: dict[int, _Request] = {}
        self._keys = itertools.count()
        # Virtual token counters (Sheng et al., "Fairness in Serving LLMs", OSDI 2024): service received per
        # tenant, prompt tokens weighted W_PROMPT and generated tokens W_OUTPUT. Admission and the prefill
        # budget go to the tenant with the least service first; a tenant that becomes active starts at the
        # least counter among the active, so idle time is not banked. Work-conserving: one busy tenant gets
        # everything.
        self.fair = fair  # False: every job counts as one tenant, i.e. plain FIFO (for comparisons)
        self._vtc: dict[str, float] = defaultdict(float)
        self._active: dict[str, int] = defaultdict(int)  # tenant -> requests waiting or running
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._closed = False  # set when the loop has ended; submissions then fail at once

    def _eos_ids(self) -> frozenset[int]:
        ids: set[int] = set()
        for src in (self.runner.config, self.tokenizer):
            for attr in ("eos_token_id", "eos_token_ids"):
                v = getattr(src, attr, None)
                if isinstance(v, int):
                    ids.add(v)
                elif isinstance(v, (list, tuple, set, frozenset)):
                    ids.update(int(x) for x in v)
        return frozenset(ids)

    # ---- public API ----------------------------------------------------------------------------

    def start(self) -> "Engine":
        if self._thread is None:
            self._stopping = self._closed = False
            self._thread = threading.Thread(target=self._loop, name="lorafleet-engine", daemon=True)
            self._thread.start()
        return self

    def stop(self, timeout: float = 30.0) -> None:
        """Stops the step loop; requests not finished end with error `engine_stopped`."""
        self._stopping = True
        self._wake_up()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        if self.cache is not None:
            self.cache.close()

    def submit(self, job: GenerationJob) -> RequestHandle:
        """Thread-safe; returns at once. Validation and tokenization happen on the engine thread."""
        handle = RequestHandle(job.request_id, self)
        self._post(("submit", handle, job))
        if self._closed:  # the loop is gone: nobody else will answer what is in the inbox
            self._fail_inbox()
        return handle

    def generate(self, job: GenerationJob, timeout: float | None = None) -> GenerationResult:
        return self.submit(job).result(timeout)

    def resident_adapters(self) -> list[str]:
        return self.cache.resident() if self.cache is not None else []

    def stats(self) -> dict:
        s = self.metrics.snapshot()
        s["queue_depth"] = len(self._waiting) + self._inbox.qsize()
        s["running"] = len(self._running)
        s["free_kv_blocks"] = int(self.allocator.num_free)
        s["total_kv_blocks"] = self.total_blocks
        s["memory"] = self.runner.memory_report()
        if self.cache is not None:
            s["cache"] = self.cache.stats()
            s["resident_adapters"] = self.cache.resident()
        else:
            s["cache"] = {}
            s["resident_adapters"] = []
        return s

    # ---- engine thread -------------------------------------------------------------------------

    def _post(self, msg) -> None:
        self._inbox.put(msg)
        self._wake_up()

    def _wake_up(self) -> None:
        self._wake.set()

    def _loop(self) -> None:
        while not self._stopping:
            try:
                self._drain_inbox()
                self._admit()
                if not self._running:
                    self._wake.wait(0.05)
                    self._wake.clear()
                    continue
                self._step()
            except Exception:  # a bug must not kill the worker: fail what is in flight, keep serving
                log.exception("engine step failed")
                for req in list(self._running):
                    self._fail(req, jobs.INTERNAL_ERROR, "the engine failed while running this request")
                self._running = [r for r in self._running if not r.done]
        self._drain_inbox()
        for req in list(self._running) + list(self._waiting):
            self._fail(req, jobs.ENGINE_STOPPED, "the engine stopped before this request finished")
        self._running, self._waiting = [], deque()
        self._closed = True
        self._fail_inbox()

    def _fail_inbox(self) -> None:
        """After the loop ended: answer every submission still queued with `engine_stopped`."""
        for msg in self._take_inbox():
            if msg[0] == "submit":
                handle, job = msg[1], msg[2]
                handle._finish(GenerationResult(request_id=job.request_id, status="error",
                                                error_code=jobs.ENGINE_STOPPED,
                                                error_message="the engine is not running"))

    def _take_inbox(self) -> Iterator[tuple]:
        while True:
            try:
                yield self._inbox.get_nowait()
            except queue.Empty:
                return

    def _drain_inbox(self) -> None:
        for msg in self._take_inbox():
            if msg[0] == "submit":
                self._accept(msg[1], msg[2])
            else:
                req = self._by_handle.get(id(msg[1]))
                if req is not None and not req.done:
                    self._finish(req, "cancelled", error=(jobs.CANCELLED, "cancelled by the caller"))
                    self._running = [r for r in self._running if not r.done]

    def _accept(self, handle: RequestHandle, job: GenerationJob) -> None:
        if not self.fair:
            job.tenant = ""
        req = _Request(job, handle, next(self._keys))
        self._by_handle[id(handle)] = req
        self.metrics.requests_submitted += 1
        try:
            err = self._prepare(req)
        except Exception as exc:  # e.g. the tokenizer refusing the input: this request only
            log.exception("preparing request %s failed", job.request_id)
            err = (jobs.INVALID_REQUEST, f"the prompt could not be prepared: {exc}")
        if err is not None:
            self._fail(req, *err)
        else:
            t = job.tenant
            if self._active[t] == 0:  # becomes active: no banking of idle time
                others = [self._vtc[x] for x, n in self._active.items() if n > 0]
                if others:
                    self._vtc[t] = max(self._vtc[t], min(others))
            self._active[t] += 1
            req.counted = True
            self._waiting.append(req)

    def _prepare(self, req: _Request) -> tuple[str, str] | None:
        """Tokenize and validate; returns (code, message) when the request cannot run."""
        job = req.job
        params = SamplingParams.from_job(job)
        problem = params.validate()
        if problem is None and job.max_tokens < 1:
            problem = "max_tokens must be >= 1"
        if problem is not None:
            return jobs.INVALID_REQUEST, problem
        if job.adapter is not None and not self.lora_enabled:
            return jobs.ADAPTER_LOAD_FAILED, "this worker runs with LoRA disabled and serves the base model only"
        if job.prompt_token_ids is not None:
            ids = [int(t) for t in job.prompt_token_ids]
        else:
            ids = self.tokenizer.encode(job.prompt or "", add_special_tokens=True)
        if not ids:
            return jobs.INVALID_REQUEST, "the prompt is empty"
        vocab = int(self.runner.config.vocab_size)
        if any(t < 0 or t >= vocab for t in ids):
            return jobs.INVALID_REQUEST, f"prompt token ids must be in 0..{vocab - 1}"
        req.prompt_ids = ids
        if len(ids) + job.max_tokens > self.max_context:
            return jobs.PROMPT_TOO_LONG, (
                f"prompt of {len(ids)} tokens + max_tokens {job.max_tokens} exceeds the context of {self.max_context}"
            )
        need = self._blocks_needed(req)
        if need > self.total_blocks:
            return jobs.PROMPT_TOO_LONG, (
                f"prompt of {len(ids)} tokens + max_tokens {job.max_tokens} needs more KV cache than this worker has"
            )
        if job.adapter is not None and not self.runner.lora.fixed_pages:
            pages = self.cache.pages_for(job.adapter)
            if pages + need > self.total_blocks:
                return jobs.ADAPTER_TOO_LARGE, (
                    f"adapter {job.adapter.name or job.adapter.sha256[:12]} (rank {job.adapter.rank}) takes {pages} "
                    f"pages of this worker's memory pool; with this request's {need} KV blocks that exceeds the "
                    f"pool's {self.total_blocks} pages")
        req.sampler = None if params.greedy else RequestSampler(params)
        req.text = IncrementalText(self.tokenizer, ids, job.stop)
        req.stop_ids = frozenset(int(t) for t in job.stop_token_ids)
        return None

    def _blocks_needed(self, req: _Request) -> int:
        return math.ceil((len(req.prompt_ids) + req.job.max_tokens) / self.block_size)

    def _admit(self) -> None:
        """Admission bounded by max_running and by the memory pool, which KV blocks and resident adapters
        share, in fair order: the tenant with the least virtual service first, each tenant's requests in
        arrival order. A request that waits for memory holds the line (nothing behind it takes the pages it
        waits for, so it cannot starve) and holds no pin while it waits (so waiting requests cannot deadlock
        each other). A request whose adapter is still loading does not hold the line."""
        if not self._waiting:
            return
        queues: dict[str, deque[_Request]] = defaultdict(deque)
        for req in self._waiting:
            if not req.done:  # cancelled while waiting
                queues[req.job.tenant].append(req)
        heap = [(self._vtc[t], q[0].key, t) for t, q in queues.items()]
        heapq.heapify(heap)
        kept: list[_Request] = []
        while heap:
            _, _, t = heapq.heappop(heap)
            req = queues[t].popleft()
            outcome = "full" if len(self._running) >= self.max_running else self._try_admit(req)
            if outcome in ("full", "blocked"):  # the line stops here: keep everything not yet admitted
                kept.append(req)
                for q in queues.values():
                    kept.extend(q)
                break
            if outcome == "loading":
                kept.append(req)
            elif outcome == "admitted":
                self._vtc[t] += W_PROMPT * len(req.prompt_ids)
            if queues[t]:
                heapq.heappush(heap, (self._vtc[t], queues[t][0].key, t))
        kept.sort(key=lambda r: r.key)
        self._waiting = deque(kept)

    def _try_admit(self, req: _Request) -> str:
        """'admitted', 'failed', 'loading' (its adapter loads off-thread) or 'blocked' (waits for memory)."""
        ref = req.job.adapter
        if ref is not None and req.ident is None:
            got = self.cache.acquire(ref, req.key)
            if got.state == FAILED:
                self._fail(req, got.error_code, got.error_message)
                return "failed"
            if got.state == LOADING:
                return "loading"
            if got.state == NO_ROOM:  # pinned adapters and KV blocks leave no run of pages for it
                self._wait_for_memory(req)
                return "blocked"
            req.slot, req.ident = got.slot, ref.identity
        need = self._blocks_needed(req)
        if self.allocator.num_free < need and self.cache is not None:
            self.cache.reclaim(need)  # idle adapters give their pages back to the KV cache
        if self.allocator.num_free < need:
            if req.ident is not None:  # wait unpinned: the adapter stays resident unless room is needed
                self.cache.release(req.ident)
                req.slot, req.ident = -1, None
            self._wait_for_memory(req)
            return "blocked"
        req.blocks = self.allocator.allocate(need)
        req.t_admit = time.perf_counter()
        self._running.append(req)
        return "admitted"

    def _wait_for_memory(self, req: _Request) -> None:
        if not req.waited_memory:
            req.waited_memory = True
            self.metrics.admissions_waited_memory += 1

    def _step(self) -> None:
        t0 = time.perf_counter()
        # Prefill budget goes to the tenant with the least service first (VTC), and within a tenant in
        # admission order, so an old long prompt is not starved by its own tenant's newer ones.
        budget = self.prefill_chunk
        batch: list[tuple[_Request, SeqStep]] = []
        for req in sorted(self._running, key=lambda r: (self._vtc[r.job.tenant], r.key)):
            start = req.num_computed
            left = len(req.prompt_ids) - start
            if left > 0:
                if budget <= 0:
                    continue
                n = min(left, budget)
                budget -= n
                toks = req.prompt_ids[start : start + n]
            else:
                toks = [req.out_ids[-1]]
            batch.append((req, SeqStep(block_table=req.blocks, start_pos=start, token_ids=toks, slot=req.slot)))
        batch.sort(key=lambda rs: rs[1].slot)  # stable: each adapter's tokens contiguous
        steps = [s for _, s in batch]

        tf = time.perf_counter()
        logits, failed = self._forward(steps)  # [len(steps), vocab]
        forward_s = time.perf_counter() - tf

        rows, reqs, samplers = [], [], []
        for i, (req, step) in enumerate(batch):
            if i in failed:
                self._fail(req, jobs.INTERNAL_ERROR, f"the forward pass failed for this request: {failed[i]}")
                continue
            req.num_computed += len(step.token_ids)
            if req.num_computed >= len(req.prompt_ids):  # logits of the last token: sample
                if req.sampler is not None:
                    samplers.append((len(rows), req.sampler))
                rows.append(i)
                reqs.append(req)
        if rows:
            sel = logits if len(rows) == len(batch) else logits[torch.tensor(rows, device=logits.device)]
            tokens, bad = sample_next_tokens(sel, samplers)
            now = time.perf_counter()
            for row, (req, tok) in enumerate(zip(reqs, tokens)):
                if row in bad:
                    code = jobs.NON_FINITE_LOGITS if isinstance(bad[row], NonFiniteLogits) else jobs.INTERNAL_ERROR
                    self._fail(req, code, str(bad[row]) or repr(bad[row]))
                    continue
                try:
                    self._on_token(req, tok, now)
                except Exception as exc:  # detokenization or a stop check failing: this request only
                    log.exception("request %s failed after its forward pass", req.job.request_id)
                    self._fail(req, jobs.INTERNAL_ERROR, f"post-processing a token failed: {exc!r}")
        self._running = [r for r in self._running if not r.done]
        self.metrics.record_step(
            batch_size=len(steps), tokens=sum(len(s.token_ids) for s in steps),
            distinct_adapters=len({s.slot for s in steps}), forward_s=forward_s,
            step_s=time.perf_counter() - t0,
        )

    def _forward(self, steps: list) -> tuple[torch.Tensor, dict[int, str]]:
        """One forward pass; if it raises, each sequence alone, so one bad request fails alone.
        (Re-running a step rewrites the same KV entries with the same values.)"""
        try:
            return self.runner.forward(steps), {}
        except Exception as exc:
            log.warning("batched forward failed (%r); isolating", exc)
        rows, failed = [], {}
        vocab = int(self.runner.config.vocab_size)
        for i, s in enumerate(steps):
            try:
                rows.append(self.runner.forward([s])[0])
            except Exception as exc:
                failed[i] = repr(exc)
                rows.append(torch.zeros(vocab))
        dev = next((r.device for r in rows), "cpu")
        return torch.stack([r.to(dev) for r in rows]), failed

    def _on_token(self, req: _Request, tok: int, now: float) -> None:
        if req.t_first is None:
            req.t_first = now
        req.out_ids.append(tok)
        self.metrics.tokens_generated += 1
        self._vtc[req.job.tenant] += W_OUTPUT
        job = req.job
        if tok in req.stop_ids or (tok in self.eos_ids and not job.ignore_eos):
            self._finish(req, "stop")
            return
        if req.text.append(tok):
            self._finish(req, "stop")
            return
        if len(req.out_ids) >= job.max_tokens:
            self._finish(req, "length")
            return
        req.handle._publish(req.text.text[: req.text.stable_text_len(False)])

    def _release(self, req: _Request, scrub: bool = False) -> None:
        if req.blocks:
            if scrub:  # a failed request may leave NaN/inf keys; padded gathers of later sequences read blocks
                self.runner.pool.data[:, req.blocks] = 0
            self.allocator.free(req.blocks)
            req.blocks = []
        if req.ident is not None:
            self.cache.release(req.ident)
            req.ident = None
        elif req.job.adapter is not None and self.cache is not None:
            self.cache.forget(req.key)

    def _finish(self, req: _Request, reason: str, error: tuple[str, str] | None = None) -> None:
        if req.done:
            return
        req.done = True
        self._release(req, scrub=error is not None and error[0] != jobs.CANCELLED)
        if req.counted:  # it was waiting or running: its tenant has one request fewer in the engine
            req.counted = False
            self._active[req.job.tenant] -= 1
        self._by_handle.pop(id(req.handle), None)
        if req.text is not None:
            if reason != "cancelled":
                req.text.flush()
            text = req.text.text
        else:
            text = ""
        now = time.perf_counter()
        job = req.job
        if error is None:
            self.metrics.requests_finished += 1
        elif error[0] == jobs.CANCELLED:
            self.metrics.requests_cancelled += 1
        else:
            self.metrics.requests_failed += 1
        self.metrics.prompt_tokens += len(req.prompt_ids)
        req.handle._finish(GenerationResult(
            request_id=job.request_id,
            status="ok" if error is None else "error",
            error_code=None if error is None else error[0],
            error_message=None if error is None else error[1],
            token_ids=list(req.out_ids),
            text=text,
            finish_reason=reason,
            prompt_tokens=len(req.prompt_ids),
            completion_tokens=len(req.out_ids),
            adapter_sha256=job.adapter.sha256 if (job.adapter is not None and req.t_admit is not None) else None,
            adapter_identity=job.adapter.identity if (job.adapter is not None and req.t_admit is not None) else None,
            queued_s=((req.t_admit or now) - req.t_submit),
            first_token_s=None if req.t_first is None else req.t_first - req.t_submit,
            total_s=now - req.t_submit,
        ))

    def _fail(self, req: _Request, code: str, message: str) -> None:
        self._finish(req, None, error=(code, message))
