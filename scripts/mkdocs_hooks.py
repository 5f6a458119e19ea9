"""MkDocs hook (mkdocs.yml): the site's benchmark pages are bench/RESULTS.md and bench/history/peers.md, read at
build time, so a figure is written once. Their links are relative to bench/ on GitHub (the plots live in docs/);
on the site the plots sit beside the page, so `../docs/` is dropped."""
from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGES = {"results.md": ROOT / "bench" / "RESULTS.md", "results-history.md": ROOT / "bench" / "history" / "peers.md"}


def on_page_markdown(markdown: str, page, config, files) -> str:
    source = PAGES.get(page.file.src_uri)
    if source is None:
        return markdown
    return source.read_text(encoding="utf-8").replace("](../docs/", "](").replace("](../../docs/", "](")
