"""Every figure the README quotes is in bench/RESULTS.md: the README and the results page cannot drift apart.

    python scripts/check_readme_figures.py [--readme README.md] [--results bench/RESULTS.md]

The README quotes the latest run; bench/RESULTS.md's "Summary" table is where each benchmark's latest figure
lives. So:
- every figure in the README's "How fast" section (a decimal such as 404.7, a ratio such as 3.47×, a
  percentage, a duration in ms, the run's date and time) must appear in RESULTS.md's "Summary" section;
- every ratio, tok/s, ms or % figure elsewhere in the README must appear somewhere in RESULTS.md.
Numbers inside `code` (commands and their flags) are not figures. A figure matches only whole: 1.3 is not
found in 1.30, nor 0.93 in 10.93. Exits 1 with one line per figure that is missing, naming its README line.
"""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HOW_FAST = "How fast"
SUMMARY = "Summary"

_CODE = re.compile(r"`[^`]*`")
_DATE = r"\d{4}-\d{2}-\d{2}"
_TIME = r"(?<!\d)\d{1,2}:\d{2}(?!\d)"
_NUMBER = r"(?<![\w.])\d+(?:[.,]\d+)*"
# a figure in the How-fast section: any decimal, or a number carrying a unit or a ratio sign
_FIGURE = re.compile(rf"{_DATE}|{_TIME}|{_NUMBER}(?:\s?(?:×|x\b|%|ms\b|s\b|tok/s))?")
# a figure anywhere else in the README: only numbers that carry a unit of performance
_PERF = re.compile(rf"{_NUMBER}\s?(?:×|%|ms\b|tok/s)")


def section(markdown: str, title: str, level: str = "##") -> tuple[int, str] | None:
    """The text of the section whose heading starts with `title` (up to the next heading of the same level),
    and the line number its heading is on; None when there is none."""
    lines = markdown.split("\n")
    for i, line in enumerate(lines):
        if line.startswith(f"{level} ") and line[len(level) + 1:].strip().startswith(title):
            end = next((j for j in range(i + 1, len(lines)) if lines[j].startswith(f"{level} ")), len(lines))
            return i + 1, "\n".join(lines[i:end])
    return None


def _value(figure: str) -> str:
    """The figure without its unit: '3.47×' -> '3.47', '58%' -> '58', '75.7 ms' -> '75.7'."""
    if re.fullmatch(_DATE, figure) or re.fullmatch(_TIME, figure):
        return figure
    return re.match(r"\d+(?:[.,]\d+)*", figure).group()  # type: ignore[union-attr]


def _is_figure(figure: str) -> bool:
    if re.fullmatch(_DATE, figure) or re.fullmatch(_TIME, figure):
        return True
    value = _value(figure)
    return value != figure or "." in value  # a unit or a decimal; bare integers are counts (64 requests)


def contains(text: str, figure: str) -> bool:
    value = _value(figure)
    return re.search(rf"(?<![\d.]){re.escape(value)}(?![\d]|\.\d)", text) is not None


def figures(text: str, pattern: re.Pattern[str], first_line: int) -> list[tuple[int, str]]:
    """(README line, figure) for each figure in `text`, whose first line is README line `first_line`."""
    found = []
    for offset, line in enumerate(text.split("\n")):
        prose = _CODE.sub(" ", line)
        for match in pattern.finditer(prose):
            figure = match.group().strip()
            if pattern is _PERF or _is_figure(figure):
                found.append((first_line + offset, figure))
    return found


def check(readme: str, results: str) -> list[str]:
    """One sentence per problem; empty when the README and RESULTS.md agree."""
    how_fast = section(readme, HOW_FAST)
    if how_fast is None:
        return [f"README.md has no '## {HOW_FAST}' section: the check has nothing to compare."]
    summary = section(results, SUMMARY)
    if summary is None:
        return [f"bench/RESULTS.md has no '## {SUMMARY}' section: the README's figures must come from it."]
    start, how_fast_text = how_fast
    quoted = figures(how_fast_text, _FIGURE, start)
    if not quoted:
        return [f"README.md's '{HOW_FAST}' section quotes no figure: the check would prove nothing."]
    problems = [f"README.md line {line}: '{figure}' is quoted in '{HOW_FAST}' but is not in bench/RESULTS.md's "
                f"'{SUMMARY}' table. Quote the latest run's figure as the summary gives it, or update the summary."
                for line, figure in quoted if not contains(summary[1], figure)]
    lines = readme.split("\n")
    how_fast_lines = range(start, start + how_fast_text.count("\n") + 1)
    for i, line in enumerate(lines, start=1):
        if i in how_fast_lines:
            continue
        for _, figure in figures(line, _PERF, i):
            if not contains(results, figure):
                problems.append(f"README.md line {i}: '{figure}' is not in bench/RESULTS.md. A figure the README "
                                f"quotes must come from a recorded run.")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--readme", type=Path, default=ROOT / "README.md")
    parser.add_argument("--results", type=Path, default=ROOT / "bench" / "RESULTS.md")
    args = parser.parse_args(argv)
    problems = check(args.readme.read_text(encoding="utf-8"), args.results.read_text(encoding="utf-8"))
    for problem in problems:
        print(problem, file=sys.stderr)
    if problems:
        return 1
    print(f"{args.readme.name}: every figure it quotes is in {args.results.name}.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
