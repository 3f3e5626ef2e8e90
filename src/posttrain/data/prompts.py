"""`data.prompt_file` and `data.system_prompt_file`: NeMo-RL's prompt files,
applied to every row's messages before they are tokenized.

    t = read_templates("examples/prompts/cot.txt", None)
    t.apply([{"role": "user", "content": "2+2? Let's think ..."}], {"problem": "2+2?"})
        -> [{"role": "user", "content": "Think step-by-step ... inside of \\\\boxed{} tags.:\\n2+2?\\n\\n..."}]

A prompt file is read as NeMo-RL reads it: its whole text (not stripped)
is a Python str.format template whose one `{}` is the problem, and whose
literal braces are doubled: NeMo-RL's cot.txt writes `\\\\boxed{{}}`, which
gives `\\\\boxed{}`. So an existing NeMo-RL prompt file gives the same text
here. A template that str.format cannot fill with exactly one value (a
single-brace `\\boxed{}` beside the `{}`, a `{name}`, a lone `}`), or whose
only `{}` follows `\\boxed` (the problem would land inside it), is refused
when it is read, with the fix, rather than giving a wrong prompt.

The problem is the row's extra_info `problem` or `question` (posttrain's
math and gsm8k preprocessors keep the raw problem there, without their
instruction sentence), else the content of its last user message; the
filled template replaces that user message. A system prompt file's text
is used as it is: a system message placed first, in place of the row's own
leading system message if it has one (an empty file adds none, as in NeMo-RL).

A row with images marks them in its user message with verl's `<image>` (or
`<video>`) placeholders; when the filled template holds none (the problem
came from extra_info, without them), the message's placeholders go first,
as NeMo-RL puts a row's images before its text, so no image loses its place:

    t.apply([{"role": "user", "content": "<image>Find x. You FIRST think ..."}], {"problem": "Find x."})
        -> [{"role": "user", "content": "<image>Think step-by-step ...:\nFind x.\n\n..."}]
"""

from __future__ import annotations

import re
import string
from dataclasses import dataclass
from pathlib import Path

from posttrain.errors import ConfigError

_DOUBLE = "write literal braces doubled, as NeMo-RL's prompt files do (\\boxed{{}}), and one {} where the problem goes"


@dataclass(frozen=True)
class PromptTemplates:
    prompt: str | None = None  # a str.format template with one {} for the problem
    system: str | None = None  # a system message's text

    def apply(self, messages, extra_info: dict | None) -> list[dict]:
        """The row's messages (a list of {role, content}, or a plain string:
        one user message) with the templates applied; the row is not changed."""
        msgs = [{"role": "user", "content": messages}] if isinstance(messages, str) else [dict(m) for m in messages]
        if self.prompt is not None:
            users = [i for i, m in enumerate(msgs) if m.get("role") == "user"]
            text = self.prompt.format(problem_of(extra_info, msgs[users[-1]]["content"] if users else None, msgs))
            if users:
                msgs[users[-1]]["content"] = _placeholders_kept(msgs[users[-1]]["content"], text)
            else:
                msgs.append({"role": "user", "content": text})
        if self.system:
            while msgs and msgs[0].get("role") == "system":
                msgs.pop(0)
            msgs.insert(0, {"role": "system", "content": self.system})
        return msgs


_PLACEHOLDER = re.compile(r"<image>|<video>")


def _placeholders_kept(old, text: str) -> str:
    """`text`, after the image/video placeholders of the message it replaces when it has none of its own."""
    if not isinstance(old, str) or _PLACEHOLDER.search(text):
        return text
    return "".join(_PLACEHOLDER.findall(old)) + text


def problem_of(extra_info: dict | None, user_content: str | None, msgs: list[dict]) -> str:
    """extra_info's `problem` or `question` (a non-blank string), else the last
    user message's content, else the last message's."""
    for key in ("problem", "question"):
        value = (extra_info or {}).get(key)
        if isinstance(value, str) and value.strip():
            return value
    if user_content is not None:
        return user_content
    return msgs[-1]["content"] if msgs else ""


def read_templates(prompt_file: str | None, system_prompt_file: str | None) -> PromptTemplates | None:
    """The templates data.prompt_file / data.system_prompt_file name, checked;
    None when neither is set. A missing, unreadable or unusable file is a
    ConfigError naming the key, the path and the fix."""
    if prompt_file is None and system_prompt_file is None:
        return None
    prompt = None
    if prompt_file is not None:
        prompt = read_file("data.prompt_file", prompt_file, "to keep the dataset's own prompts")
        check_template(prompt_file, prompt)
    system = None
    if system_prompt_file is not None:
        system = read_file("data.system_prompt_file", system_prompt_file, "to add no system message")
    return PromptTemplates(prompt, system)


def read_file(key: str, path: str, unset_means: str) -> str:
    p = Path(path)
    if not p.is_file():
        where = "" if p.is_absolute() else f" (looked in {Path.cwd()})"
        what = "is a directory, not a file" if p.is_dir() else "does not exist"
        raise ConfigError(f"{key}={path} {what}{where}; give the prompt file, or set {key}=null {unset_means}")
    try:
        with open(p, encoding="utf-8") as fh:  # as NeMo-RL reads it: the whole text, not stripped
            return fh.read()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{key}={path} cannot be read as UTF-8 text ({type(e).__name__}); fix the file, or set "
                          f"{key}=null {unset_means}") from None


def check_template(path: str, text: str) -> None:
    """The template takes exactly one positional `{}` (or `{0}`), as str.format(problem) needs."""
    key = f"data.prompt_file={path}"
    try:
        fields = [(literal, name, spec, conv) for literal, name, spec, conv in string.Formatter().parse(text)
                  if name is not None]
    except ValueError as e:  # e.g. "Single '}' encountered in format string"
        raise ConfigError(f"{key}: the template is read with Python's str.format, as NeMo-RL reads it, and it "
                          f"fails ({e}); {_DOUBLE}") from None
    if not fields:
        raise ConfigError(f"{key} has no {{}} where the problem goes; add one, or give the file as "
                          "data.system_prompt_file if it is a system prompt")
    if len(fields) > 1 or fields[0][1] not in ("", "0") or fields[0][3]:
        shown = ", ".join("{" + name + (f"!{conv}" if conv else "") + (f":{spec}" if spec else "") + "}"
                          for _, name, spec, conv in fields)
        raise ConfigError(f"{key} has {len(fields)} replacement field{'s' if len(fields) > 1 else ''} ({shown}) "
                          f"where str.format fills exactly one {{}} with the problem; {_DOUBLE}")
    if re.search(r"\\(boxed|fbox)\s*$", fields[0][0]):
        raise ConfigError(f"{key}: its only {{}} follows \\boxed, so the problem would go inside \\boxed{{}}; "
                          f"{_DOUBLE}")


__all__ = ["PromptTemplates", "check_template", "problem_of", "read_templates"]
