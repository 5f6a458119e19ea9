"""The request path of /v1/completions and /v1/chat/completions (DESIGN.md "Request path").

    authenticate -> rate limits -> parse -> bind the adapter -> build and measure the prompt
      -> pending audit row (committed) -> publish on the base's queue (after the commit)
      -> wait for the worker's reply (or stream it) -> finalise the audit row once -> answer

Every exit, success or failure, leaves exactly one audit row (see gateway/audit.py), counts in
/metrics, and carries the request id in `X-Lorafleet-Request-Id`.
"""
from __future__ import annotations

import logging
import time

from django.conf import settings
from django.db import DatabaseError, connection, transaction
from django.http import HttpResponse, JsonResponse, StreamingHttpResponse

from adapters.models import AdapterVersion
from protocol.errors import ErrorCode
from protocol.jobs import AdapterRef, GenerationJob, GenerationResult, JobMeta

from . import audit, input_bounds, metrics, request_guard
from .auth import KeyRefused, authenticate
from .binding import Target, resolve_target
from .errors import ApiError, database_unavailable, from_worker, internal_error, invalid, queue_unavailable, timed_out
from .limits import TenantSlot
from .params import GenerationParams, parse_chat, parse_completion, parse_json_body, read_body
from .prompts import chat_prompt, count_and_check, tokenizer_for
from .queue import QueueUnavailable, ReplyTimeout, get_dispatcher
from .responses import Shapes, TokenText, metadata, metadata_headers, served_by, sse

log = logging.getLogger(__name__)


def serve(request, *, route: str, chat: bool) -> HttpResponse:
    draft = audit.AuditDraft(route=route)
    slot: TenantSlot | None = None
    streaming = False
    metrics.IN_FLIGHT.inc()
    try:
        try:
            # A body of megabytes is read, parsed, bound and measured in its key's and tenant's turn, so that a
            # flood of them waits on itself, not on every other tenant (gateway/input_bounds.py)
            with input_bounds.LargeBodyTurn(request) as turn:
                key = authenticate(request)
                draft.tenant, draft.key_prefix = key.tenant, key.prefix
                slot = TenantSlot(key.tenant).__enter__()
                turn.take(key.tenant)
                params = (parse_chat if chat else parse_completion)(parse_json_body(read_body(request)))
                draft.n = params.n
                draft.target = target = resolve_target(key, params.model)
                check_logit_bias(target.base, params)
                if chat:  # the text for the audit; the ids are what the worker reads (one BOS, the template's)
                    params.prompt, params.prompt_token_ids = chat_prompt(target.base, params.messages)
                draft.prompt_text = params.prompt if params.prompt is not None else repr(params.prompt_token_ids)
                count_and_check(target.base, params, param="messages" if chat else "prompt")
            response = _enqueue_and_answer(draft, target, params, chat=chat, request=request, slot=slot)
            streaming = isinstance(response, StreamingHttpResponse)
            return response
        except KeyRefused as err:
            if err.key is not None:  # 401 after the key row was found (revoked/expired): on the record
                draft.tenant, draft.key_prefix = err.key.tenant, err.key.prefix
                audit.record_refusal(draft, http_status=err.status, error_code=err.code,
                                     error_message=f"{err.reason}: {err.message}")
            return _error(draft, err)
        except ApiError as err:
            draft.refused_adapter = getattr(err, "adapter", None)
            if draft.tenant is not None and draft.record_id is None:
                audit.record_refusal(draft, http_status=err.status, error_code=err.code, error_message=err.message)
            return _error(draft, err)
    except DatabaseError as exc:
        # PostgreSQL restarting or unreachable: a clean, retryable answer (the audit row cannot be written
        # either; a pending one is closed later by close_abandoned_audit). One line, no traceback: an outage
        # under traffic would otherwise write one per request.
        log.warning("database unavailable while serving %s: %s: %s", draft.request_id, type(exc).__name__,
                    str(exc).strip().splitlines()[0] if str(exc).strip() else "")
        return _error(draft, database_unavailable())
    except Exception:  # the guard around the whole path: one row and our own words, whatever raised (issue 47)
        log.exception("internal error while serving %s", draft.request_id)
        err = internal_error()
        request_guard.close_failed(draft, err)
        return _error(draft, err)
    finally:
        if not streaming:  # a stream releases its slot and counts itself when it ends
            metrics.IN_FLIGHT.dec()
            if slot is not None:
                slot.__exit__(None, None, None)


def _error(draft: audit.AuditDraft, err: ApiError, meta: dict | None = None) -> HttpResponse:
    response = err.response(metadata_headers(meta) if meta else {"X-Lorafleet-Request-Id": str(draft.request_id)})
    metrics.observe(draft.route, err.status, _tenant_label(draft), draft.elapsed())
    return response


def _tenant_label(draft: audit.AuditDraft) -> str:
    return draft.tenant.slug if draft.tenant is not None else "-"


def request_timeout(request) -> float:
    """The server's limit, or less if the caller asks (`X-Lorafleet-Timeout: <seconds>`)."""
    limit = float(settings.LORAFLEET_REQUEST_TIMEOUT_S)
    asked = request.META.get("HTTP_X_LORAFLEET_TIMEOUT")
    if asked:
        try:
            value = float(asked)
        except ValueError:
            raise ApiError(400, "invalid_parameter", "X-Lorafleet-Timeout must be a number of seconds.",
                           param="X-Lorafleet-Timeout") from None
        if value > 0:
            limit = min(limit, value)
    return limit


def adapter_ref(name: str, v: AdapterVersion) -> AdapterRef:
    """The version as the worker sees it; its `.identity` is what an answer from it must name."""
    return AdapterRef(version_id=v.pk, sha256=v.sha256, storage_key=v.storage_key, rank=v.rank, alpha=v.alpha,
                      use_rslora=v.use_rslora, target_modules=list(v.target_modules), name=f"{name}@{v.number}")


def check_logit_bias(base, params: GenerationParams) -> None:
    vocab = int(base.shape_manifest.get("vocab_size") or 0)
    if vocab and any(t >= vocab for t in params.logit_bias):
        raise invalid(f"logit_bias names token ids at or above the vocabulary size {vocab}.", param="logit_bias")


def build_job(draft: audit.AuditDraft, target: Target, params: GenerationParams) -> GenerationJob:
    adapter = adapter_ref(target.adapter.name, target.version) if target.adapter is not None else None
    return GenerationJob(
        request_id=str(draft.request_id), adapter=adapter, prompt=params.prompt,
        prompt_token_ids=params.prompt_token_ids, max_tokens=params.max_tokens, temperature=params.temperature,
        top_p=params.top_p, top_k=params.top_k, seed=params.seed, stop=list(params.stop),
        ignore_eos=params.ignore_eos, tenant=str(draft.tenant.pk) if draft.tenant is not None else "",
        n=params.n, logprobs=params.logprobs,
        prompt_logprobs=params.logprobs if params.echo and params.logprobs is not None else None,
        presence_penalty=params.presence_penalty, frequency_penalty=params.frequency_penalty,
        repetition_penalty=params.repetition_penalty, logit_bias=[[t, b] for t, b in params.logit_bias.items()],
        tenant_weight=float(draft.tenant.share_weight) if draft.tenant is not None else 1.0,
        cache_salt=params.cache_salt,
    )


def shapes_for(draft, target: Target, params: GenerationParams, *, chat: bool) -> Shapes:
    token_text = None
    if params.logprobs is not None:
        token_text = TokenText(tokenizer_for(target.base), as_ids=params.tokens_as_ids)
    echo = None
    if params.echo and not chat:
        echo = params.prompt if params.prompt is not None else tokenizer_for(target.base).decode(
            params.prompt_token_ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    return Shapes(chat=chat, request_id=draft.request_id, model=target.model_id, token_text=token_text, echo=echo)


def _enqueue_and_answer(draft, target: Target, params: GenerationParams, *, chat: bool, request, slot) -> HttpResponse:
    timeout = request_timeout(request)
    job = build_job(draft, target, params)
    meta = JobMeta(
        deadline=time.time() + timeout, stream=params.stream, base_slug=target.base.slug,
        base_sha256=target.base.sha256, max_attempts=int(getattr(settings, "LORAFLEET_MAX_ATTEMPTS", 3)),
    )
    dispatcher = get_dispatcher()
    # The job is published only once its pending audit row is committed: no answer without a record.
    # `durable=True` makes this block the outermost transaction (Django raises if anything wraps it;
    # the views are non_atomic_requests), so the row is committed when the block exits and the job is
    # published right after — what on_commit would do, without a way to defer it past the wait below.
    with transaction.atomic(durable=True):
        audit.open_pending(draft)
    try:
        dispatcher.publish(job, meta.to_dict(), queue=target.base.queue_name, expires_s=timeout)
    except QueueUnavailable as exc:
        err = queue_unavailable()
        audit.finalise(draft, ok=False, http_status=err.status, error_code=err.code, error_message=str(exc))
        return _error(draft, err)
    metrics.ENQUEUED.labels(base=target.base.slug).inc()
    if not connection.in_atomic_block:
        connection.close()  # do not hold a database connection while waiting on a worker

    deadline = time.monotonic() + timeout
    events = dispatcher.events(str(draft.request_id), deadline)
    shapes = shapes_for(draft, target, params, chat=chat)
    try:
        first = next(events)
    except (ReplyTimeout, StopIteration):
        return _fail_waiting(draft, dispatcher, timed_out(timeout))
    except QueueUnavailable as exc:
        return _fail_waiting(draft, dispatcher, queue_unavailable("lost the reply channel"), detail=str(exc))

    if first["type"] == "final":
        result = GenerationResult.from_dict(first["result"])
        worker_id, attempts = first.get("worker_id", ""), first.get("attempts")
        err = _result_error(target, result)
        meta_out = metadata(draft.request_id, target, worker_id=worker_id, **served_by(result))
        if err is not None:
            audit.finalise(draft, ok=False, http_status=err.status, error_code=err.code, error_message=err.audit_text,
                           result=result, worker_id=worker_id, attempts=attempts)
            return _error(draft, err, meta_out)
        if not params.stream:
            response = JsonResponse(shapes.full(result, meta_out))  # built first: the row says what the caller got
            for name, value in metadata_headers(meta_out).items():
                response[name] = value
            audit.finalise(draft, ok=True, http_status=200, result=result, worker_id=worker_id, attempts=attempts,
                           logprobs_returned=params.logprobs is not None)
            metrics.observe_prompt(target.base.slug, result)
            metrics.observe(draft.route, 200, _tenant_label(draft), draft.elapsed())
            return response
    stream = _stream(draft, target, params, shapes, first, events, dispatcher, slot)
    head = metadata(draft.request_id, target, worker_id=first.get("worker_id"),
                    **served_by(first["result"] if first["type"] == "final" else first))
    response = StreamingHttpResponse(stream, content_type="text/event-stream")
    response["Cache-Control"] = "no-cache"
    response["X-Accel-Buffering"] = "no"
    for name, value in metadata_headers(head).items():
        response[name] = value
    return response


def _result_error(target: Target, result: GenerationResult) -> ApiError | None:
    if not result.ok:
        return from_worker(result.error_code, result.error_message)
    if target.adapter is None:
        return None
    if result.adapter_sha256 != target.version.sha256:
        # The worker must only ever serve the exact weights asked for; never pass off others as them.
        return from_worker(ErrorCode.ADAPTER_INTEGRITY_ERROR,
                           f"the worker served weights {result.adapter_sha256!r}, not the version's {target.version.sha256}")
    expected = adapter_ref(target.adapter.name, target.version).identity
    if result.adapter_identity != expected:
        # The same bytes under another rank, alpha, rsLoRA or targets is another adapter (another scale);
        # an answer that does not name the version's identity is not proof it served this version.
        return from_worker(ErrorCode.ADAPTER_INTEGRITY_ERROR, f"the worker served adapter identity "
                                                              f"{result.adapter_identity!r}, not the version's {expected}")
    return None


def _fail_waiting(draft, dispatcher, err: ApiError, detail: str = "") -> HttpResponse:
    dispatcher.cancel(str(draft.request_id))  # a worker that has not started it yet will drop it
    audit.finalise(draft, ok=False, http_status=err.status, error_code=err.code, error_message=detail or err.message)
    return _error(draft, err)


class _ChoiceStream:
    """What one choice has sent so far in a stream."""

    __slots__ = ("text", "lps", "started", "offset")

    def __init__(self):
        self.text, self.lps, self.started, self.offset = "", 0, False, 0


def _stream(draft, target, params, shapes: Shapes, first: dict, events, dispatcher, slot):
    """SSE body, OpenAI's chunk shapes with `index` per choice: each choice's first chunk (chat: with the
    role; completions with echo: with the prompt), its text and logprobs as they come, then one chunk per
    choice with its finish_reason, the usage chunk if asked, then [DONE]. The very first chunk and the
    finish chunks carry the lorafleet object."""
    finalised = False
    status = 200
    choices = [_ChoiceStream() for _ in range(params.n)]
    prompt_lps: list | None = None
    logprobs_sent = False
    is_first = True

    def piece(i: int, text: str, entries: list | None, meta: dict | None) -> bytes:
        """One content chunk of choice i, with the echoed prompt in front of its first."""
        nonlocal logprobs_sent
        c = choices[i]
        prompt = None
        if not c.started and shapes.echo is not None:
            text = shapes.echo + text
            prompt = prompt_lps
        lps = shapes.logprobs(entries if entries is not None else ([] if shapes.token_text else None),
                              offset=c.offset, prompt=prompt)
        logprobs_sent = logprobs_sent or lps is not None
        chunk = shapes.chunk(text, index=i, first=not c.started, meta=meta, logprobs=lps)
        c.started = True
        c.offset += len(text)
        return sse(chunk)

    try:
        event = first
        while True:
            if event["type"] == "delta":
                i = int(event.get("index", 0))
                if event.get("prompt_logprobs") is not None:
                    prompt_lps = event["prompt_logprobs"]
                text, entries = event.get("text", ""), event.get("logprobs")
                if 0 <= i < len(choices) and (text or entries):
                    meta = metadata(draft.request_id, target, worker_id=event.get("worker_id"),
                                    **served_by(event)) if is_first else None
                    choices[i].text += text
                    choices[i].lps += len(entries or [])
                    yield piece(i, text, entries, meta)
                    is_first = False
            else:
                result = GenerationResult.from_dict(event["result"])
                worker_id, attempts = event.get("worker_id", ""), event.get("attempts")
                meta = metadata(draft.request_id, target, worker_id=worker_id, **served_by(result))
                err = _result_error(target, result)
                if err is not None:
                    audit.finalise(draft, ok=False, http_status=200, error_code=err.code,
                                   error_message=err.audit_text, result=result, worker_id=worker_id, attempts=attempts,
                                   logprobs_returned=logprobs_sent)
                    finalised, status = True, err.status
                    yield sse({**err.body(), "lorafleet": meta})
                    return
                if result.prompt_logprobs is not None:
                    prompt_lps = result.prompt_logprobs
                done = result.all_choices()[:len(choices)]
                for c in done:
                    sent = choices[c.index]
                    rest = c.text[len(sent.text):] if c.text.startswith(sent.text) else ""
                    entries = (c.logprobs or [])[sent.lps:] if c.logprobs is not None else None
                    if rest or entries or not sent.started:
                        yield piece(c.index, rest, entries, meta if is_first else None)
                        is_first = False
                audit.finalise(draft, ok=True, http_status=200, result=result, worker_id=worker_id, attempts=attempts,
                               logprobs_returned=params.logprobs is not None)
                finalised = True
                metrics.observe_prompt(target.base.slug, result)
                for c in done:
                    yield sse(shapes.chunk("", index=c.index, finish_reason=c.finish_reason, meta=meta))
                if params.include_usage:
                    yield sse(shapes.usage_chunk(result))
                yield sse("[DONE]")
                return
            try:
                event = next(events)
            except (ReplyTimeout, StopIteration):
                err = timed_out(round(draft.elapsed(), 1))
                break
            except QueueUnavailable:
                err = queue_unavailable("lost the reply channel")
                break
        # the stream broke after it started: say so in-band, the status line has already gone out
        dispatcher.cancel(str(draft.request_id))
        audit.finalise(draft, ok=False, http_status=200, error_code=err.code, error_message=err.message,
                       logprobs_returned=logprobs_sent)
        finalised, status = True, err.status
        yield sse(err.body())
    except Exception:  # our own failure after the status line went out: in-band, and on the record once
        log.exception("internal error while streaming %s", draft.request_id)
        err = internal_error()
        if not finalised:
            request_guard.close_failed(draft, err, http_status=200)
            finalised, status = True, err.status
        yield sse(err.body())
    finally:
        if not finalised:  # the client went away mid-stream
            dispatcher.cancel(str(draft.request_id))
            audit.finalise(draft, ok=False, http_status=200, error_code="client_disconnected",
                           error_message="the client closed the connection before the answer ended",
                           logprobs_returned=logprobs_sent)
            status = 499
        metrics.observe(draft.route, status, _tenant_label(draft), draft.elapsed())
        metrics.IN_FLIGHT.dec()
        if slot is not None:
            slot.__exit__(None, None, None)
