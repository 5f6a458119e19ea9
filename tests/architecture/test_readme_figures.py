"""The README quotes only figures that bench/RESULTS.md records (scripts/check_readme_figures.py, run by
`make test`): a figure changed on one side alone fails, and says which line and which figure."""
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "check_readme_figures.py"


def run_check(tmp_path: Path, readme: str | None = None, results: str | None = None) -> subprocess.CompletedProcess:
    readme_path, results_path = ROOT / "README.md", ROOT / "bench" / "RESULTS.md"
    if readme is not None:
        readme_path = tmp_path / "README.md"
        readme_path.write_text(readme)
    if results is not None:
        results_path = tmp_path / "RESULTS.md"
        results_path.write_text(results)
    return subprocess.run([sys.executable, str(SCRIPT), "--readme", str(readme_path), "--results", str(results_path)],
                          capture_output=True, text=True, timeout=60)


def test_the_readme_quotes_only_figures_of_the_results_summary(tmp_path):
    out = run_check(tmp_path)
    assert out.returncode == 0, out.stderr


def test_a_figure_changed_in_the_readme_alone_fails_naming_it(tmp_path):
    readme = (ROOT / "README.md").read_text()
    assert "404.7" in readme, "the test edits the mid model's base-only figure; update it with the README"
    out = run_check(tmp_path, readme=readme.replace("404.7", "414.7"))
    assert out.returncode == 1
    assert "'414.7' is quoted in 'How fast'" in out.stderr
    line = next(i for i, text in enumerate(readme.split("\n"), start=1) if "404.7" in text)
    assert f"README.md line {line}:" in out.stderr


def test_a_new_run_recorded_without_updating_the_readme_fails(tmp_path):
    """The summary moves on to a newer run: the README's old figure is no longer the latest one."""
    results = (ROOT / "bench" / "RESULTS.md").read_text()
    summary, rest = results.split("\n## Engine", 1)
    out = run_check(tmp_path, results=summary.replace("375.4", "380.9") + "\n## Engine" + rest.replace("375.4", "~"))
    assert out.returncode == 1
    assert "'375.4' is quoted in 'How fast'" in out.stderr


def test_a_performance_figure_outside_how_fast_must_be_recorded_too(tmp_path):
    readme = (ROOT / "README.md").read_text() + "\nOn a big machine it runs 12345.6 tok/s.\n"
    out = run_check(tmp_path, readme=readme)
    assert out.returncode == 1
    assert "'12345.6 tok/s' is not in bench/RESULTS.md" in out.stderr


def test_a_readme_without_its_how_fast_section_fails_rather_than_proving_nothing(tmp_path):
    readme = (ROOT / "README.md").read_text().replace("## How fast", "## Speed")
    out = run_check(tmp_path, readme=readme)
    assert out.returncode == 1
    assert "no '## How fast' section" in out.stderr


def test_the_readme_reads_as_a_product_page():
    """Issue 49's bounds: at most 250 lines, the two commands on the first screen, no CPU family or model
    numbers (those belong with the runs in bench/RESULTS.md), and every link it gives leads to a file."""
    readme = (ROOT / "README.md").read_text()
    lines = readme.split("\n")
    assert len(lines) <= 250, f"README.md has {len(lines)} lines; move detail into docs/"
    first_screen = "\n".join(lines[:40])
    assert "make demo" in first_screen and "make test" in first_screen
    cpu_ids = re.findall(r"family \d+|model \d+ \(|\bZen \d\b", readme)
    assert not cpu_ids, f"CPU family/model numbers in README.md: {cpu_ids}; cite the run in bench/RESULTS.md instead"
    targets = [t.split("#")[0] for t in re.findall(r"\]\(([^)\s]+)\)", readme) if "://" not in t]
    assert targets, "the README links to its guides"
    missing = [t for t in targets if t and not (ROOT / t).exists()]
    assert not missing, f"README.md links to files that do not exist: {missing}"
