"""MkDocs hooks: the pages read the same on GitHub and in the built site.

Lists. GitHub starts a list right under a paragraph line and nests items indented by two spaces;
Python-Markdown needs a blank line before a list and four spaces to nest. `lists` adds both
(outside code fences), so the pages stay written for GitHub.

Links from a page to a repository file outside docs/ (`../benchmarks/README.md`). On GitHub such
a link opens the file. In the built site there is no such page, so a link whose
target exists in the repository becomes a link to it on `repo_url` (or, with none set, its path
as code); a target that does not exist is left alone, so `mkdocs build --strict` fails on it as
on any broken link.
"""

from __future__ import annotations

import re
from pathlib import Path

LINK = re.compile(r"\[([^\]]+)\]\((\.\./[^)#\s]+)(#[^)\s]*)?\)")


ITEM = re.compile(r"^( *)(?:[-*+]|\d+\.) ")


def lists(markdown: str) -> str:
    out: list[str] = []
    fenced = in_list = False
    for line in markdown.split("\n"):
        if line.lstrip().startswith("```"):
            fenced = not fenced
        item = None if fenced else ITEM.match(line)
        if item:
            if not in_list and out and out[-1].strip():
                out.append("")
            in_list = True
            indent = len(item.group(1))
            if indent:
                line = " " * (2 * indent) + line[indent:]
        elif not fenced and line.strip() and not line.startswith(" "):
            in_list = in_list and bool(out) and bool(out[-1].strip())  # a lazy continuation line
        out.append(line)
    return "\n".join(out)


def on_page_markdown(markdown: str, page, config, files) -> str:
    markdown = lists(markdown)
    docs = Path(config["docs_dir"]).resolve()
    root = docs.parent
    page_dir = (docs / page.file.src_path).parent
    repo_url = (config.get("repo_url") or "").rstrip("/")

    def rewrite(match: re.Match) -> str:
        text, target, anchor = match.group(1), match.group(2), match.group(3) or ""
        path = (page_dir / target).resolve()
        if not path.exists() or docs in path.parents or not path.is_relative_to(root):
            return match.group(0)
        relative = path.relative_to(root).as_posix()
        if repo_url:
            return f"[{text}]({repo_url}/blob/main/{relative}{anchor})"
        return text if text.startswith("`") else f"`{relative}`" if text == relative else f"{text} (`{relative}`)"

    return LINK.sub(rewrite, markdown)
