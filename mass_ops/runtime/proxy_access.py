"""What the agent may send through its proxy and what it presents (docs/proxy.md, "Token and key" and "Routes").

The agent holds a per-episode token (`new_agent_token`), never the upstream key (`upstream_key_from_env`), and may
use only the generation routes and the model list under the endpoint's client path (`allowed_route`). Placeholder
keys (`DEFAULT_KEY_VALUE`, anything under `MIN_REDACTED_SECRET` bytes) are never redacted from records.
"""

from __future__ import annotations

import os
import re
import secrets
from collections.abc import Mapping

from mass_ops.errors import InputError

# The largest request body the proxy reads (`runtime.proxy_max_request_bytes`); a full 256K-token context is ~1 MB.
MAX_REQUEST_BYTES = 32 * 1024**2
DEFAULT_CLIENT_PATH = "/v1"
# Headers that carry credentials: with token auth the agent's are dropped and the proxy sets its own.
CREDENTIAL_HEADERS = frozenset({"authorization", "api-key", "x-api-key"})
BEARER = "bearer "
TOKEN_BYTES = 32  # secrets.token_urlsafe(32): 256 random bits
DEFAULT_KEY_VALUE = "EMPTY"  # what a local vLLM accepts when it was started without --api-key (the reference default)
MIN_REDACTED_SECRET = 8  # shorter "keys" (e.g. EMPTY) are placeholders; replacing them would corrupt ordinary text
REDACTION = b"[REDACTED]"

CHAT_ROUTE = "/chat/completions"
COMPLETIONS_ROUTE = "/completions"
RESPONSES_ROUTE = "/responses"
MODELS_ROUTE = "/models"
GENERATION_ROUTES = (CHAT_ROUTE, COMPLETIONS_ROUTE, RESPONSES_ROUTE)
# A model id in `GET <client path>/models/<id>` ("Qwen/Qwen3-4B", "vendor/model:free"): no segment starting with a
# dot and no percent-escape, so no upstream can read it as another path.
MODEL_ID = re.compile(r"[A-Za-z0-9_~:@+-][A-Za-z0-9._~:@+-]*(?:/[A-Za-z0-9_~:@+-][A-Za-z0-9._~:@+-]*)*")


class ProxyConfigError(InputError):
    """The proxy cannot start as asked (key variable, upstreams, arguments)."""


def new_agent_token() -> str:
    """A fresh per-episode token: what the agent presents to its proxy instead of a key."""
    return secrets.token_urlsafe(TOKEN_BYTES)


def upstream_key_from_env(name: str, environ: Mapping[str, str] | None = None) -> str:
    """The upstream key from variable `name` ("EMPTY" when unset, as a local server without --api-key accepts).

    Whitespace would break the Authorization header: refused with one line naming the variable, never the value.
    """
    value = (os.environ if environ is None else environ).get(name, "") or DEFAULT_KEY_VALUE
    if any(char.isspace() for char in value):
        raise ProxyConfigError(f"episode proxy: environment variable {name} (the API key) contains whitespace")
    return value


def allowed_route(method: str, raw_path: str, client_path: str) -> str | None:
    """The route `method raw_path` asks for (one of GENERATION_ROUTES or MODELS_ROUTE), or None when the agent may
    not use it. `raw_path` is the request target as sent (not percent-decoded); its query string is ignored."""
    path = raw_path.partition("?")[0]
    if not path.startswith(client_path + "/"):
        return None
    route = path[len(client_path) :]
    if method == "POST" and route in GENERATION_ROUTES:
        return route
    if method == "GET" and (
        route == MODELS_ROUTE
        or (route.startswith(MODELS_ROUTE + "/") and MODEL_ID.fullmatch(route[len(MODELS_ROUTE) + 1 :]))
    ):
        return MODELS_ROUTE
    return None
