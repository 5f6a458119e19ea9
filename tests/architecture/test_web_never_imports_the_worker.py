"""The web apps reach the worker only through the protocol, the reply channel (transport/) and Celery
messages: pyproject's contract forbids the whole `inference_worker` package to them, so no module of the
worker (its tasks and management commands included) can become a web dependency unnoticed."""
import uuid

from tests.architecture.test_import_contracts import ROOT, lint_imports


def test_a_web_app_importing_any_worker_module_breaks_the_contract():
    planted = ROOT / "gateway" / f"_planted_{uuid.uuid4().hex[:8]}.py"
    planted.write_text("import inference_worker.tasks  # noqa\n")
    try:
        out = lint_imports()
    finally:
        planted.unlink()
    assert out.returncode != 0
    assert f"gateway.{planted.stem} -> inference_worker.tasks" in out.stdout


def test_the_reply_channel_imports_no_app():
    """transport sits below web and worker alike: an import of either from it is caught."""
    planted = ROOT / "transport" / f"_planted_{uuid.uuid4().hex[:8]}.py"
    planted.write_text("import gateway.models  # noqa\n")
    try:
        out = lint_imports()
    finally:
        planted.unlink()
    assert out.returncode != 0
    assert f"transport.{planted.stem} -> gateway.models" in out.stdout
