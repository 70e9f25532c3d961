"""The docs site builds with `mkdocs build --strict`: a broken link, anchor or API reference, or a
page left out of the nav, fails it. The README's links into the docs are checked against the
built pages."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.integration  # a subprocess: mkdocs

ROOT = Path(__file__).resolve().parents[2]
CONFIG = yaml.safe_load((ROOT / "mkdocs.yml").read_text())


def build(config: Path, site: Path) -> subprocess.CompletedProcess:
    """`mkdocs build --strict` (not `-q`: quiet drops the warnings that strict counts)."""
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config),
                           "-d", str(site)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    site = tmp_path_factory.mktemp("site")
    done = build(ROOT / "mkdocs.yml", site)
    assert done.returncode == 0, done.stdout + done.stderr
    return site


def nav_pages(nav) -> list[str]:
    pages = []
    for entry in nav:
        value = next(iter(entry.values())) if isinstance(entry, dict) else entry
        pages += nav_pages(value) if isinstance(value, list) else [value]
    return pages


def test_every_page_is_in_the_nav_once():
    pages = nav_pages(CONFIG["nav"])
    assert sorted(pages) == sorted(p.name for p in (ROOT / "docs").glob("*.md"))


class Ids(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.ids: set[str] = set()

    def handle_starttag(self, tag, attrs) -> None:
        self.ids.update(value for name, value in attrs if name == "id" and value)


def test_the_site_builds_and_the_readme_links_land(site):
    assert (site / "api" / "index.html").read_text().count('class="doc doc-heading"') >= 20  # mkdocstrings ran
    broken = []
    for target, anchor in re.findall(r"\]\(([^)#\s]+)(?:#([^)\s]+))?\)", (ROOT / "README.md").read_text()):
        if target.startswith("http"):
            continue
        if not (ROOT / target).exists():
            broken.append(target)
        elif anchor and target.startswith("docs/"):
            page = Path(target).relative_to("docs").with_suffix("")
            parser = Ids()
            parser.feed((site / page / "index.html").read_text())
            if anchor not in parser.ids:
                broken.append(f"{target}#{anchor}")
    assert not broken, broken


@pytest.mark.parametrize("link, message", [
    ("[gone](missing.md)", "missing.md"),
    ("[gone](index.md#no-such-heading)", "no-such-heading"),
    ("[gone](../no/such/file.md)", "no/such/file.md"),
    ("\n\n::: art.NoSuchName\n", "art.NoSuchName"),
])
def test_a_broken_link_fails_the_build(tmp_path, link, message):
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "index.md").write_text(f"# Home\n\nA link to the repository: [readme](../README.md). {link}\n")
    (tmp_path / "README.md").write_text("# Readme\n")
    config = {"site_name": "t", "docs_dir": str(docs), "hooks": [str(ROOT / "docs" / "hooks.py")],
              "validation": CONFIG["validation"], "nav": ["index.md"],
              "plugins": [{"mkdocstrings": {"handlers": {"python": {"paths": [str(ROOT / "src")]}}}}]}
    (tmp_path / "mkdocs.yml").write_text(yaml.safe_dump(config))
    done = build(tmp_path / "mkdocs.yml", tmp_path / "site")
    assert done.returncode != 0 and message in done.stdout + done.stderr
