"""Keep credentials out of everything a run writes or prints.

A secret is the value of a credential-named variable (HF_TOKEN, WANDB_API_KEY,
AWS_SECRET_ACCESS_KEY, DB_PASSWORD, ...) or the password of a URL
(`s3://user:pass@host/...`). Redacting replaces it with `***`; the real value
stays where it is used (the process environment, a job's runtime_env).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping
from typing import Any

MASK = "***"

# The name's last word names a credential: HF_TOKEN, WANDB_API_KEY, PGPASSWORD, accessToken.
# Only the last word, so MAX_TOKENS, TOKENIZERS_PARALLELISM, HF_TOKEN_PATH and KEY_FIELD are not
# secrets; KEY only as a word of its own (not MONKEY), the others also as a suffix (PGPASSWORD).
_LAST_WORD = re.compile(r"^KEY$|(APIKEY|TOKEN|SECRET|PASSWORD|PASSWD|PASSPHRASE)$")
# A word that makes the name a secret wherever it stands: SECRET_KEY_BASE, DB_PASSWORD_PROD.
_ANY_WORD = {"SECRET", "PASSWORD", "PASSWD"}
# Names ending in KEY that name a column, not a credential (posttrain's data.prompt_key,
# verl's response_key): tests/test_secrets.py checks every config key against the rule.
NOT_SECRET = {"PROMPT_KEY", "RESPONSE_KEY", "ANSWER_KEY", "LABEL_KEY", "REWARD_FN_KEY", "SORT_KEY", "IMAGE_KEY",
              "VIDEO_KEY", "MESSAGES_KEY", "TOOLS_KEY", "ENABLE_THINKING_KEY", "TEACHER_KEY"}
# Values this short or this common would mangle ordinary text if masked everywhere.
_TRIVIAL = {"", "0", "1", "true", "false", "yes", "no", "none", "null", "on", "off"}
MIN_SECRET_LENGTH = 6
# scheme://user:password@host; the password may hold '@' (the last one ends it), not '/' or spaces.
# Also scheme:/user:... : a URL that went through pathlib.Path lost a slash.
_URL_PASSWORD = re.compile(r"([A-Za-z][A-Za-z0-9+.\-]*:/?/[^\s:/@\"'<>]*):([^\s/\"'<>]+)@")


def is_secret_name(name: str) -> bool:
    """Whether a variable or config key named `name` holds a credential.

    >>> [is_secret_name(n) for n in ("HF_TOKEN", "WANDB_API_KEY", "db.password", "MAX_TOKENS", "data.prompt_key")]
    [True, True, True, False, False]
    """
    leaf = str(name).rsplit(".", 1)[-1]  # a config key's own name: data.prompt_key -> prompt_key
    # words split at '_', '-', ... and at camelCase humps: accessKey -> access, Key
    words = [w.upper() for w in re.findall(r"[A-Z]?[a-z0-9]+|[A-Z0-9]+(?![a-z])", leaf)]
    if not words or "_".join(words) in NOT_SECRET:
        return False
    # PWD alone is the working directory; MYSQL_PWD is a password
    return (bool(_LAST_WORD.search(words[-1])) or any(w in _ANY_WORD for w in words)
            or (words[-1] == "PWD" and len(words) > 1))


def redact_url(text: str) -> str:
    """The password of every `scheme://user:password@host` in `text` -> `***` (the user stays).

    >>> redact_url("s3://alice:hunter2@minio:9000/runs and http://host:8265/x")
    's3://alice:***@minio:9000/runs and http://host:8265/x'
    """
    return _URL_PASSWORD.sub(lambda m: f"{m.group(1)}:{MASK}@", text)


def secret_values(environ: Mapping[str, str] | None = None) -> list[str]:
    """The values of the credential-named variables in `environ` (default os.environ), longest first;
    short or trivial ones ("1", "true", under 6 characters) are left out.

    >>> secret_values({"HF_TOKEN": "hf_abcdef123", "RAY_TOKEN": "1", "PATH": "/usr/bin"})
    ['hf_abcdef123']
    """
    environ = os.environ if environ is None else environ
    found = {str(v) for k, v in environ.items() if is_secret_name(k) and v is not None
             and len(str(v).strip()) >= MIN_SECRET_LENGTH and str(v).strip().lower() not in _TRIVIAL}
    return sorted(found, key=lambda v: (-len(v), v))  # longest first: one secret may contain another


def redact_text(text: str, values: Iterable[str] | None = None) -> str:
    """URL passwords and every occurrence of a secret value (`values`, default secret_values()) -> `***`.

    >>> redact_text("token hf_abcdef123 at https://u:pw1@h/", values=["hf_abcdef123"])
    'token *** at https://u:***@h/'
    """
    text = redact_url(str(text))
    for value in secret_values() if values is None else values:
        text = text.replace(value, MASK)
    return text


def redact_mapping(obj: Any, values: Iterable[str] | None = None) -> Any:
    """A copy of nested dicts/lists with the values of credential-named keys -> `***` (None and ""
    stay: nothing to hide) and every string through redact_text.

    >>> redact_mapping({"env_vars": {"HF_TOKEN": "hf_x", "HOME": "/h"}, "data": {"prompt_key": "prompt"}})
    {'env_vars': {'HF_TOKEN': '***', 'HOME': '/h'}, 'data': {'prompt_key': 'prompt'}}
    """
    values = secret_values() if values is None else list(values)
    if isinstance(obj, Mapping):
        return {k: MASK if is_secret_name(k) and v not in (None, "") else redact_mapping(v, values)
                for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(redact_mapping(v, values) for v in obj)
    if isinstance(obj, str):
        return redact_text(obj, values)
    return obj


def matches_redacted(saved: Any, value: Any) -> bool:
    """Whether `value` could be what was saved as `saved` after redaction: each `***` in a saved
    string stands for anything, so a resumed run's real secret is not a config difference.

    >>> matches_redacted("s3://u:***@h/a", "s3://u:pw@h/a"), matches_redacted("s3://u:***@h/a", "s3://u:pw@h/b")
    (True, False)
    """
    if saved == value:
        return True
    if isinstance(saved, str) and MASK in saved:
        pattern = ".*".join(re.escape(part) for part in saved.split(MASK))
        return re.fullmatch(pattern, str(value) if value is not None else "", re.DOTALL) is not None
    if isinstance(saved, list) and isinstance(value, (list, tuple)) and len(saved) == len(value):
        return all(matches_redacted(s, v) for s, v in zip(saved, value))
    if isinstance(saved, dict) and isinstance(value, dict) and saved.keys() == value.keys():
        return all(matches_redacted(saved[k], value[k]) for k in saved)
    return False
