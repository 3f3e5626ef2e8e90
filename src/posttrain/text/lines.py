"""Text helpers shared by error messages and input checks.

    one_line(ValueError("bad\\nmore"))              # "ValueError: bad"
    invalid_text({"prompt": ["ok", "\\ud800"]})     # "prompt[1] holds text that is not valid unicode ..."
    printable("a\\nb"), repr_cut(value), clipped(value)   # a value shown in a one-line message
"""

from __future__ import annotations


def printable(value) -> str:
    """A value for a one-line message: as typed, or repr'd when it holds a newline or another unprintable character
    ('a\\nb')."""
    text = str(value)
    return text if text.isprintable() else repr(value)


def cut(text: str, limit: int) -> str:
    """`text` cut at `limit` characters, "..." marking the cut."""
    return text if len(text) <= limit else text[:limit] + "..."


def repr_cut(value, limit: int = 80) -> str:
    """A value's repr for a message, cut at `limit` characters."""
    return cut(repr(value), limit)


def clipped(value, limit: int = 60) -> str:
    """A value for a message: text as it is, anything else repr'd; cut at `limit` characters."""
    return cut(value if isinstance(value, str) else repr(value), limit)


def one_line(e: BaseException) -> str:
    """An exception as one log line: its type and the first line of its text (at most 200 characters)."""
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0][:200]}" if text else type(e).__name__


def invalid_text(value, where: str = "", _within: tuple = ()) -> str | None:
    """Where `value` (a string, or dicts and lists of them) holds text that is
    not valid unicode (a lone surrogate, which UTF-8 cannot encode), e.g.
    "prompt[0].content holds ...", or None."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return f"{where or 'a value'} holds text that is not valid unicode (a lone surrogate)"
        return None
    # a YAML alias can make a list that holds itself (&a [*a, *a]): each container is walked once per path,
    # and no deeper than any real row or config goes
    if not isinstance(value, (dict, list, tuple)) or id(value) in _within or len(_within) > 50:
        return None
    within = (*_within, id(value))
    if isinstance(value, dict):
        for k, v in value.items():
            k_text = printable(k)  # the reason stays one line
            name = f"{where}.{k_text}" if where else k_text
            found = invalid_text(k, f"a key of {where or 'the row'}", within) or invalid_text(v, name, within)
            if found:
                return found
    else:
        for j, v in enumerate(value):
            found = invalid_text(v, f"{where}[{j}]", within)
            if found:
                return found
    return None
