"""The program in a completion: the code a policy wrote, out of the text around it."""

from __future__ import annotations

import re

# A fenced block: three backticks, an optional language tag on the same line, the body, three
# backticks at the start of a line (or the end of the text, for a completion cut at its length cap).
_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)(?:^[ \t]*```|\Z)", re.DOTALL | re.MULTILINE)
PYTHON_TAGS = frozenset({"python", "py", "python3"})


def program_from_completion(text: str, *, whole_text_when_unfenced: bool) -> str | None:
    """The program of `text`: the body of its last fenced block tagged python (```python, ```py,
    ```python3), else of its last untagged block; with no such block, the whole text when
    `whole_text_when_unfenced`, else None (the completion is scored `unparsable`). Blocks tagged
    with another language are never the program."""
    tagged, untagged = None, None
    for match in _FENCE.finditer(text):
        tag, body = match.group(1).lower(), match.group(2)
        if tag in PYTHON_TAGS:
            tagged = body
        elif not tag:
            untagged = body
    if tagged is not None:
        return tagged
    if untagged is not None:
        return untagged
    return text if whole_text_when_unfenced else None
