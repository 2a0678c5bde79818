"""Store URLs made safe to print: passwords and signing secrets replaced by ``***``.

`mask_url` takes one URL (``postgresql://user:pass@host/db``, ``s3://bucket/p?X-Amz-Signature=...``, a presigned
HTTPS link) and masks the password of its user part and the value of every query parameter whose name says it is a
secret. `mask_secrets` does the same to every URL inside a longer text (an error message from a driver), plus
``key=value`` pairs of libpq connection strings such as ``password=...``.

Both work on text, never parse-and-rebuild, so an unparseable URL is still masked (and never echoed whole).
"""

from __future__ import annotations

import re

MASK = "***"

# Query parameters (and libpq keywords) whose value is a credential. Compared case-insensitively, exactly or, for
# names like "X-Amz-Signature" / "aws_secret_access_key", by the words they contain.
_SECRET_WORDS = ("password", "passwd", "pwd", "secret", "token", "signature", "credential", "sig", "apikey", "api_key")
_SECRET_NAMES = frozenset({"key", "access_key", "sessiontoken", "x-amz-security-token", "x-amz-credential"})

# scheme://user:password@  — the password ends at the last '@' before the host (passwords may contain '@' unescaped
# in sloppy URLs, but never '/'); user and password each stop at whitespace or quotes.
_USERINFO = re.compile(r"(?P<head>\b[A-Za-z][A-Za-z0-9+.-]*://[^\s:/@'\"]*:)(?P<password>[^\s/'\"]*)(?P<at>@)")
_QUERY_PARAM = re.compile(r"(?P<sep>[?&;])(?P<name>[A-Za-z0-9_.-]+)=(?P<value>[^&#\s'\"]*)")
# libpq "key=value" connection strings and "password=..." fragments inside driver messages.
_KEYWORD_VALUE = re.compile(r"(?P<name>\b[A-Za-z_][A-Za-z0-9_-]*)=(?P<value>'(?:[^'\\]|\\.)*'|[^\s&;'\"]+)")


def is_secret_name(name: str) -> bool:
    """Whether a parameter called `name` holds a credential (``password``, ``X-Amz-Signature``, ``token`` ...)."""
    lowered = name.lower()
    if lowered in _SECRET_NAMES or lowered in _SECRET_WORDS:
        return True
    words = re.split(r"[-_.]", lowered)
    return any(word in _SECRET_WORDS for word in words) or any(
        secret in lowered for secret in ("password", "secret", "signature", "token")
    )


def _mask_param(match: re.Match[str]) -> str:
    if is_secret_name(match["name"]) and match["value"]:
        return f"{match['sep']}{match['name']}={MASK}"
    return match[0]


def _mask_keyword(match: re.Match[str]) -> str:
    if is_secret_name(match["name"]) and match["value"]:
        return f"{match['name']}={MASK}"
    return match[0]


def _mask_userinfo(match: re.Match[str]) -> str:
    return f"{match['head']}{MASK}{match['at']}" if match["password"] else match[0]


def mask_url(url: object) -> str:
    """`url` as text with its password and secret query values replaced by ``***`` (safe to log or print)."""
    text = url if isinstance(url, str) else _render(url)
    text = _USERINFO.sub(_mask_userinfo, text)
    return _QUERY_PARAM.sub(_mask_param, text)


def mask_secrets(text: str) -> str:
    """`text` with every URL masked as by `mask_url` and every ``password=...``-like pair masked too."""
    return _KEYWORD_VALUE.sub(_mask_keyword, mask_url(text))


def _render(url: object) -> str:
    # A SQLAlchemy URL renders with its password hidden; anything else is rendered and then masked as text.
    render = getattr(url, "render_as_string", None)
    if callable(render):
        return str(render(hide_password=True))
    return str(url)
