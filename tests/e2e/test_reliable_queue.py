"""The worker's reliable-queue consumer (inference_worker/consumer.py) on a private redis-server.

The gap it closes (docs/RELIABILITY.md): with kombu's BRPOP a job popped by a worker killed before it
recorded the job was in no queue and nowhere else. With BLMOVE the job is in the worker's processing list
from the moment Redis hands it over, so a worker killed at any point leaves it where the others find it.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import redis

from inference_worker.consumer import (
    DEAD_KEY,
    RECLAIM_LOG_KEY,
    REGISTRY_KEY,
    ReliableConsumer,
    decode_task_message,
    processing_key,
)
from tests.e2e.conftest import REPO, wait_until
from transport.replies import RedisChannel, heartbeat_key

POOL = "t.pool"


def publish(url: str, queue: str, *args, task_id: str, name: str = "t.job") -> None:
    """A Celery task message, exactly as the gateway's `app.send_task` writes it."""
    from celery import Celery

    app = Celery("t", broker=url)
    app.send_task(name, args=list(args), queue=queue, routing_key=queue, task_id=task_id, retry=False)


def consumer(url: str, worker_id: str, task, *, concurrency: int = 4, forget_after_s: float = 120) -> ReliableConsumer:
    c = ReliableConsumer(url, worker_id=worker_id, pool=POOL, own=f"{POOL}.worker.{worker_id}", concurrency=concurrency,
                         tasks={"t.job": task}, forget_after_s=forget_after_s)
    redis.Redis.from_url(url).set(heartbeat_key(worker_id), "{}", ex=60)
    c.register()
    return c


VICTIM = """
import sys, threading, time, pathlib
sys.path.insert(0, {repo!r})
import redis
from inference_worker.consumer import ReliableConsumer
from transport.replies import heartbeat_key
url, marker = {url!r}, pathlib.Path({marker!r})
r = redis.Redis.from_url(url)
def task(n):
    marker.write_text(str(n))
    time.sleep(600)  # running when it is killed
c = ReliableConsumer(url, worker_id="victim", pool={pool!r}, own={pool!r} + ".worker.victim", concurrency=2,
                     tasks={{"t.job": task}})
r.set(heartbeat_key("victim"), "{{}}", px=2000)
c.register()
def beat():
    while True:
        r.set(heartbeat_key("victim"), "{{}}", px=2000)
        time.sleep(0.5)
threading.Thread(target=beat, daemon=True).start()
c.start()
time.sleep(600)
"""


def test_a_job_taken_by_a_worker_killed_with_sigkill_is_run_by_another_exactly_once(redis_server, tmp_path):
    url, r = redis_server.url, redis.Redis.from_url(redis_server.url)
    marker = tmp_path / "started"
    victim = subprocess.Popen([sys.executable, "-c", VICTIM.format(repo=str(REPO), url=url, marker=str(marker),
                                                                   pool=POOL)], start_new_session=True)
    try:
        wait_until(lambda: r.hexists(REGISTRY_KEY, "victim"), 30, "the victim registered")
        publish(url, POOL, 1, task_id="job-1")
        publish(url, f"{POOL}.worker.victim", 2, task_id="job-2")
        wait_until(marker.exists, 30, "the victim running a job")
        os.killpg(victim.pid, signal.SIGKILL)
        victim.wait(timeout=10)
    finally:
        if victim.poll() is None:
            os.killpg(victim.pid, signal.SIGKILL)
    taken = r.llen(processing_key("victim", POOL)) + r.llen(processing_key("victim", f"{POOL}.worker.victim"))
    assert taken == 2  # both jobs are in the dead worker's processing lists (concurrency 2), none in a queue

    ran: list[int] = []
    survivor = consumer(url, "survivor", lambda n: ran.append(n))
    assert survivor.reap() == 0  # the victim's heartbeat has not expired yet: its jobs are not touched
    wait_until(lambda: not r.exists(heartbeat_key("victim")), 10, "the victim's heartbeat expired")
    assert survivor.reap() == 2
    survivor.start()
    try:
        wait_until(lambda: len(ran) == 2, 20, "the survivor ran the redelivered jobs")
        time.sleep(0.5)
    finally:
        survivor.stop(grace_s=5)
    assert sorted(ran) == [1, 2]  # each exactly once
    log = [json.loads(x) for x in r.lrange(RECLAIM_LOG_KEY, 0, -1)]
    assert sorted((e["request_id"], e["was"], e["worker"]) for e in log) == [("job-1", "taken", "victim"),
                                                                              ("job-2", "taken", "victim")]
    assert r.llen(POOL) == 0 and r.llen(processing_key("survivor", POOL)) == 0  # acknowledged


def test_a_worker_never_holds_more_jobs_than_task_threads_and_consumes_its_own_queue_and_the_pool(redis_server):
    url = redis_server.url
    lock, running, most, done = threading.Lock(), [0], [0], []

    def task(n):
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        time.sleep(0.05)
        with lock:
            running[0] -= 1
            done.append(n)

    c = consumer(url, "w", task, concurrency=3)
    for i in range(20):
        publish(url, POOL if i % 2 else f"{POOL}.worker.w", i, task_id=f"j{i}")
    c.start()
    try:
        wait_until(lambda: len(done) == 20, 30, "20 jobs")
    finally:
        c.stop(grace_s=5)
    assert sorted(done) == list(range(20)) and most[0] <= 3
    assert (c.counters["taken_own"], c.counters["taken_pool"]) == (10, 10)


def test_a_stopping_worker_hands_its_queue_back_and_late_publishes_are_still_reaped(redis_server):
    url, r = redis_server.url, redis.Redis.from_url(redis_server.url)
    c = consumer(url, "leaving", lambda n: None)
    c.start()
    c.stop(grace_s=2)
    assert not r.exists(heartbeat_key("leaving")) and r.hexists(REGISTRY_KEY, "leaving")
    publish(url, f"{POOL}.worker.leaving", 5, task_id="late")  # a web that had not yet seen it leave
    other = consumer(url, "other", lambda n: None, forget_after_s=0.5)  # the reaper's setting decides
    assert other.reap() == 1 and r.llen(POOL) == 1  # back to the pool, where any worker takes it
    time.sleep(0.6)
    other.reap()  # dead for longer than forget_after_s: forgotten, with kombu's binding for its queue
    assert not r.hexists(REGISTRY_KEY, "leaving") and not r.hexists(DEAD_KEY, "leaving")
    assert not r.exists(f"_kombu.binding.{POOL}.worker.leaving")


def test_a_worker_restarted_with_the_same_id_runs_what_its_previous_process_had_taken(redis_server):
    """A container restarted with the same hostname and pid gets the same worker id, and a live heartbeat at
    once, so no reaper would ever return what the crashed process had taken: the new process does."""
    url, r = redis_server.url, redis.Redis.from_url(redis_server.url)
    publish(url, POOL, 3, task_id="old")
    r.lmove(POOL, processing_key("w", POOL), "RIGHT", "LEFT")  # taken by the previous process, never finished
    ran: list[int] = []
    c = consumer(url, "w", lambda n: ran.append(n))
    c.start()
    try:
        wait_until(lambda: ran == [3], 20, "the job the previous process had taken")
    finally:
        c.stop(grace_s=2)


def test_unknown_tasks_and_foreign_messages_are_dropped_not_retried(redis_server):
    url, r = redis_server.url, redis.Redis.from_url(redis_server.url)
    ran = []
    c = consumer(url, "w", lambda n: ran.append(n))
    publish(url, POOL, 1, task_id="x", name="someone.else")
    r.lpush(POOL, b"not json")
    publish(url, POOL, 2, task_id="y")
    c.start()
    try:
        wait_until(lambda: ran == [2] and c.counters["dropped"] == 2, 20, "the good job run, two dropped")
    finally:
        c.stop(grace_s=2)
    assert r.llen(POOL) == 0 and r.llen(processing_key("w", POOL)) == 0


def test_the_message_format_is_celerys(redis_server):
    publish(redis_server.url, POOL, {"job": 1}, {"meta": 2}, task_id="abc")
    raw = redis.Redis.from_url(redis_server.url).rpop(POOL)
    assert decode_task_message(raw) == ("t.job", "abc", [{"job": 1}, {"meta": 2}], {})


def test_a_final_answer_marks_the_request_done_in_the_same_transaction(redis_server):
    channel = RedisChannel(redis_server.url)
    channel.push("r1", {"type": "delta", "text": "a"})
    assert not channel.is_done("r1")
    channel.push("r1", {"type": "final", "result": {}})
    assert channel.is_done("r1")  # a redelivered copy of r1 is acknowledged without running (tasks.py)


def test_a_worker_learns_done_attempts_and_cancel_in_one_round_trip(redis_server):
    channel = RedisChannel(redis_server.url)
    r = redis.Redis.from_url(redis_server.url)
    channel.is_done("warm")  # the channel's connection is open (its handshake commands are not counted)
    before = r.info("stats")["total_commands_processed"]
    assert channel.begin("r2") == (False, 1, False)
    commands = r.info("stats")["total_commands_processed"] - before - 1  # less the INFO itself
    assert commands <= 6, commands  # MULTI, EXISTS, INCR, EXPIRE, EXISTS, EXEC: one round trip
    assert channel.begin("r2") == (False, 2, False)  # a redelivery is the second attempt
    r.set("lorafleet:cancel:r2", 1)
    assert channel.begin("r2") == (False, 3, True)
    channel.push("r2", {"type": "final", "result": {}})
    assert channel.begin("r2")[0] is True
    assert 0 < r.ttl("lorafleet:attempts:r2") <= 24 * 3600


def test_live_workers_lists_beating_workers_in_two_round_trips_however_many_keys_the_database_holds(redis_server):
    """The web refreshes this list every second per process (gateway/routing.py); it used to SCAN the keyspace,
    which holds a day of requests' attempt and done flags (30k round trips at 100 requests/s)."""
    channel = RedisChannel(redis_server.url)
    r = redis.Redis.from_url(redis_server.url)
    pipe = r.pipeline(transaction=False)
    for i in range(20_000):
        pipe.set(f"lorafleet:attempts:req-{i}", 1, ex=600)
    pipe.execute()
    channel.heartbeat("w-live", {"worker_id": "w-live"}, 30)
    channel.heartbeat("w-expiring", {"worker_id": "w-expiring"}, 0.2)
    channel.heartbeat("w-gone", {"worker_id": "w-gone"}, 30)
    channel.forget_worker("w-gone")
    time.sleep(0.4)
    before = r.info("stats")["total_commands_processed"]
    workers = channel.live_workers()
    commands = r.info("stats")["total_commands_processed"] - before - 1  # less the INFO itself
    assert [w["worker_id"] for w in workers] == ["w-live"]
    assert 25 < workers[0]["expires_in_s"] <= 30
    # SMEMBERS; GET + PTTL for each of the two members; one SREM (a SCAN of these 20,000 keys took 40 and more)
    assert commands <= 6, f"{commands} commands for one refresh"
    assert r.smembers("lorafleet:workers") == {b"w-live"}  # the expired one is pruned as it is read


@pytest.fixture(autouse=True)
def _no_django_broker(monkeypatch):
    monkeypatch.delenv("CELERY_BROKER_URL", raising=False)
