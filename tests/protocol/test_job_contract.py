"""The gateway <-> worker contract (protocol.jobs, protocol.errors) survives the trip as JSON, and is read
the same way on both sides: one place builds and parses the job's metadata, error codes are ErrorCode."""
from __future__ import annotations

import json
import time

import pytest

from protocol.errors import ErrorCode
from protocol.jobs import AdapterRef, GenerationJob, GenerationResult, JobMeta


def over_the_wire(d: dict) -> dict:
    return json.loads(json.dumps(d))


def test_a_job_and_its_meta_round_trip_through_json():
    ref = AdapterRef(version_id=3, sha256="a" * 64, storage_key="adapters/a.safetensors", rank=8, alpha=16,
                     use_rslora=False, target_modules=["q_proj", "v_proj"], name="bot@3")
    job = GenerationJob(request_id="r1", adapter=ref, prompt="hi", stop=["\n"], tenant="7")
    meta = JobMeta(deadline=time.time() + 30, stream=True, base_slug="tiny", base_sha256="0" * 64, max_attempts=2)
    assert GenerationJob.from_dict(over_the_wire(job.to_dict())) == job
    assert JobMeta.from_dict(over_the_wire(meta.to_dict())) == meta


def test_meta_from_an_older_or_newer_gateway_is_read_with_defaults():
    assert JobMeta.from_dict(None) == JobMeta()
    meta = JobMeta.from_dict({"deadline": "12.5", "stream": 1, "max_attempts": "4", "from_the_future": True})
    assert (meta.deadline, meta.stream, meta.max_attempts, meta.base_sha256) == (12.5, True, 4, "")


@pytest.mark.parametrize("code", list(ErrorCode), ids=str)
def test_a_results_error_code_is_the_enum_and_travels_as_its_value(code):
    result = GenerationResult(request_id="r1", status="error", error_code=code.value, error_message="boom")
    assert result.error_code is code
    wire = over_the_wire(result.to_dict())
    assert wire["error_code"] == code.value
    assert GenerationResult.from_dict(wire).error_code is code


def test_an_unknown_error_code_is_read_as_internal_error_and_named_in_the_message():
    result = GenerationResult.from_dict({"request_id": "r1", "status": "error", "error_code": "gpu_on_fire",
                                         "error_message": "boom"})
    assert result.error_code is ErrorCode.INTERNAL_ERROR and "gpu_on_fire" in result.error_message


def test_every_code_has_an_http_status():
    assert all(400 <= code.http_status < 600 for code in ErrorCode)
    assert ErrorCode.ADAPTER_TOO_LARGE.http_status == 422 and ErrorCode.ENGINE_STOPPED.http_status == 503
