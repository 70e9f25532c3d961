"""The JSON a model wrote, found in its answer: models wrap it in prose or a ``` fence."""

from __future__ import annotations

import json
import re
from typing import Any

_FENCED = re.compile(r"```(?:json)?\s*(.*?)```", re.DOTALL)


def json_in_text(content: str) -> Any | None:
    """The first of these that parses: the whole text, each fenced block, the outermost {...};
    None when none does."""
    candidates = [content.strip(), *(m.strip() for m in _FENCED.findall(content))]
    start, end = content.find("{"), content.rfind("}")
    if 0 <= start < end:
        candidates.append(content[start : end + 1])
    for text in candidates:
        try:
            return json.loads(text)
        except ValueError:
            continue
    return None
