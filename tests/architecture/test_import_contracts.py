"""The arrows between the parts point one way only (DESIGN.md, pyproject's [tool.importlinter]): the
contracts hold on the tree, and a planted upward import breaks them."""
import subprocess
import sys
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def lint_imports() -> subprocess.CompletedProcess:
    exe = Path(sys.executable).with_name("lint-imports")
    return subprocess.run([str(exe), "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_the_import_contracts_hold():
    out = lint_imports()
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert "BROKEN" not in out.stdout


def test_a_planted_upward_import_breaks_them():
    """tenants (a leaf) importing gateway, and the kernels importing Django: both are caught."""
    planted = [ROOT / "tenants" / f"_planted_{uuid.uuid4().hex[:8]}.py",
               ROOT / "kernels" / f"_planted_{uuid.uuid4().hex[:8]}.py"]
    planted[0].write_text("import gateway.models  # noqa\n")
    planted[1].write_text("import django  # noqa\n")
    try:
        out = lint_imports()
    finally:
        for p in planted:
            p.unlink()
    assert out.returncode != 0
    assert f"tenants.{planted[0].stem} -> gateway.models" in out.stdout
    assert f"kernels.{planted[1].stem} -> django" in out.stdout
