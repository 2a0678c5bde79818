"""The route allowlist: what the agent may ask its proxy for, matched on the raw request target."""

from __future__ import annotations

import pytest

from mass_ops.runtime.proxy_access import MODELS_ROUTE, allowed_route


@pytest.mark.parametrize(
    ("method", "target", "route"),
    [
        ("POST", "/v1/chat/completions", "/chat/completions"),
        ("POST", "/v1/chat/completions?x=1", "/chat/completions"),
        ("POST", "/v1/completions", "/completions"),
        ("POST", "/v1/responses", "/responses"),
        ("GET", "/v1/models", MODELS_ROUTE),
        ("GET", "/v1/models/Qwen/Qwen3-4B", MODELS_ROUTE),
        ("GET", "/v1/models/vendor/model:free", MODELS_ROUTE),
        ("GET", "/v1/models/", None),
        ("GET", "/v1/models/.hidden", None),
        ("GET", "/v1/models/a/../b", None),
        ("GET", "/v1/models/a%2F..%2Fb", None),
        ("GET", "/v1/models//x", None),
        ("POST", "/v1/models", None),
        ("PUT", "/v1/chat/completions", None),
        ("POST", "/v1/chat/completions/", None),
        ("POST", "/v2/chat/completions", None),
        ("POST", "/chat/completions", None),
        ("GET", "/health", None),
        ("GET", "http://evil/v1/models", None),
    ],
)
def test_allowed_routes(method: str, target: str, route: str | None) -> None:
    assert allowed_route(method, target, "/v1") == route


def test_an_endpoint_without_a_path_allows_the_routes_at_the_root() -> None:
    assert allowed_route("POST", "/chat/completions", "") == "/chat/completions"
    assert allowed_route("POST", "/v1/chat/completions", "") is None
