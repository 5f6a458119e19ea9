"""A trainer on the CPU yields the cores to inference: `manage.py run_trainer` runs LORAFLEET_TRAINER_NICE (default 10)
nicer than it was started, every thread of it, including the ones torch starts later; 0 leaves it; a bad value is
refused naming the variable. (What this buys in another tenant's latency is measured in bench/finetune.py.)"""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from django.core.management import CommandError, call_command

from tests.e2e.conftest import PYTHON, REPO, Proc, wait_until

pytestmark = pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads thread niceness from /proc")


def policy_of(tid: int) -> int | None:
    """The thread's scheduling policy, None when it ended meanwhile."""
    try:
        return os.sched_getscheduler(tid)
    except ProcessLookupError:
        return None


def thread_niceness(pid: int) -> dict[int, int]:
    """Every thread of `pid` and its nice value (/proc/PID/task/TID/stat, field 19)."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
        except OSError:  # the thread ended meanwhile
            continue
        out[int(tid)] = int(stat.rsplit(")", 1)[1].split()[16])
    return out


def expected(increment: int) -> int:
    return min(19, os.getpriority(os.PRIO_PROCESS, 0) + increment)


def test_every_thread_of_the_process_is_lowered_and_torch_threads_started_later_inherit_it():
    code = (
        "import os, threading, time, django, torch\n"
        "django.setup()\n"
        "from finetune.trainer import yield_cpu_to_inference\n"
        "stop = threading.Event()\n"
        "before = threading.Thread(target=stop.wait); before.start()\n"
        "print('niceness', yield_cpu_to_inference(6), flush=True)\n"
        "torch.set_num_threads(2); torch.randn(256, 256) @ torch.randn(256, 256)\n"
        "print('ready', flush=True); time.sleep(60)\n"
    )
    proc = subprocess.Popen([PYTHON, "-c", code], cwd=REPO, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO), "DJANGO_SETTINGS_MODULE": "config.settings"})
    try:
        lines = [proc.stdout.readline().strip(), proc.stdout.readline().strip()]
        assert lines == [f"niceness {expected(6)}", "ready"], lines
        threads = thread_niceness(proc.pid)
        assert len(threads) >= 2 and set(threads.values()) == {expected(6)}, threads
    finally:
        proc.kill()
        proc.wait(timeout=10)


@pytest.fixture
def trainer_env(postgres, transactional_db, tmp_path, ft_base_dir):
    """A base registered in the test database (committed, for the trainer's own connection); the trainer's broker
    is the filesystem transport under tmp_path, so only PostgreSQL is needed."""
    from django.db import connection

    from adapters.services import register_base_model

    register_base_model("tiny-prio", ft_base_dir, max_lora_rank=16)
    for folder in ("queue", "processed", "control", "results"):
        (tmp_path / "var" / "celery" / folder).mkdir(parents=True)
    db = connection.settings_dict
    url = f"postgres://{db['USER']}:{db['PASSWORD'] or ''}@{db['HOST'] or '127.0.0.1'}:{db['PORT'] or 5432}/{db['NAME']}"
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "config.settings", "PYTHONPATH": str(REPO), "DATABASE_URL": url,
           "CELERY_BROKER_URL": "filesystem://", "LORAFLEET_VAR_DIR": str(tmp_path / "var"),
           "LORAFLEET_LOG_LEVEL": "WARNING"}
    for name in ("LORAFLEET_TRAINER_NICE", "MIGRATION_DATABASE_URL", "CELERY_RESULT_BACKEND"):
        env.pop(name, None)
    return env


@pytest.mark.parametrize("setting, increment", [(None, 10), ("3", 3), ("0", 0)])
def test_the_trainer_process_runs_at_the_configured_niceness(trainer_env, tmp_path, setting, increment):
    env = dict(trainer_env) if setting is None else {**trainer_env, "LORAFLEET_TRAINER_NICE": setting}
    trainer = Proc("trainer", [PYTHON, "manage.py", "run_trainer", "--base", "tiny-prio"], env, tmp_path)
    try:
        wait_until(lambda: "ready" in trainer.tail(20000), 120, "trainer ready", (trainer,))
        assert f"on the CPU at niceness {expected(increment)}" in trainer.tail(20000)
        threads = thread_niceness(trainer.popen.pid)
        assert set(threads.values()) == {expected(increment)}, threads
        # nicer than it was started, a yielding trainer's threads are SCHED_IDLE too (a woken inference thread takes
        # the core at once); at 0 it keeps its priority and its policy
        policies = {policy_of(tid) for tid in threads} - {None}
        assert policies == ({os.SCHED_IDLE} if increment else {os.SCHED_OTHER}), policies
        assert ("under SCHED_IDLE" in trainer.tail(20000)) == bool(increment)
    finally:
        trainer.stop()


@pytest.mark.parametrize("value", ["-5", "20", "low"])
def test_a_bad_niceness_is_refused_naming_the_variable(trainer_env, monkeypatch, value):
    monkeypatch.setenv("LORAFLEET_TRAINER_NICE", value)
    before = os.getpriority(os.PRIO_PROCESS, 0)
    with pytest.raises(CommandError, match=f"LORAFLEET_TRAINER_NICE must be a whole number from 0 .* got '{value}'"):
        call_command("run_trainer", "--base", "tiny-prio")
    assert os.getpriority(os.PRIO_PROCESS, 0) == before

