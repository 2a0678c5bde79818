"""The proxy forwards only what the agent needs (ISSUE #25.2) and one request cannot stall the others (#25.3): a
hostile agent run through the real runner and proxy probes other routes, methods and request targets and sends
bodies far past the limit; the upstream's own list of what reached it and the published API log are checked."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mass_ops.runtime.qwen_install import QwenInstall
from tests.support.proxy import run_hostile_episode

BODY_LIMIT = 1024**2  # runtime.proxy_max_request_bytes in these episodes


def _run_hostile(
    tmp_path: Path, install: QwenInstall, attack: str, endpoint_path: str = "/v1"
) -> tuple[dict[str, Any], list[tuple[str, str]], list[dict[str, Any]]]:
    """Run `attack` as the agent of one episode; returns its findings, what reached the upstream, the API log."""
    episode = run_hostile_episode(
        tmp_path,
        install,
        attack,
        server_default_tokens=64,
        endpoint_path=endpoint_path,
        proxy_max_request_bytes=BODY_LIMIT,
    )
    return episode.findings, episode.seen, episode.records


PROBES = """
    import json, socket
    from urllib.parse import urlsplit

    auth = {"Authorization": f"Bearer {token}"}
    root = base_url.rsplit("/v1", 1)[0]
    answers = {}
    for name, method, url in [
        ("admin", "GET", root + "/admin"),
        ("delete model", "DELETE", base_url + "/models/x"),
        ("embeddings", "POST", base_url + "/embeddings"),
        ("tokenize", "POST", root + "/tokenize"),
        ("load lora", "POST", base_url + "/load_lora_adapter"),
        ("dot segments", "GET", base_url + "/models/../../admin"),
        ("escaped dots", "GET", base_url + "/models/%2e%2e/%2e%2e/admin"),
        ("chat by GET", "GET", base_url + "/chat/completions"),
        ("trailing slash", "POST", base_url + "/chat/completions/"),
    ]:
        status, _headers, raw = http(method, url, {"model": "metered"}, auth)
        answers[name] = [status, json.loads(raw)["error"]["message"]]

    parts = urlsplit(base_url)
    with socket.create_connection((parts.hostname, parts.port), timeout=10) as sock:
        sock.sendall(b"GET http://evil.example/v1/models HTTP/1.1\\r\\nHost: evil.example\\r\\n"
                     + f"Authorization: Bearer {token}\\r\\nConnection: close\\r\\n\\r\\n".encode())
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    head, _, body = reply.partition(b"\\r\\n\\r\\n")
    answers["absolute uri"] = [int(head.split()[1]), json.loads(body)["error"]["message"]]
    ok, _h, _b = http("GET", base_url + "/models/metered", None, auth)
    report(answers=answers, model_by_id=ok)
"""


def test_only_the_agent_s_routes_reach_the_upstream(tmp_path: Path, hostile_install: QwenInstall) -> None:
    found, seen, records = _run_hostile(tmp_path, hostile_install, PROBES)
    answers = found["answers"]
    assert {name: status for name, (status, _message) in answers.items()} == {
        "admin": 403,
        "delete model": 403,
        "embeddings": 403,
        "tokenize": 403,
        "load lora": 403,
        "dot segments": 403,
        "escaped dots": 403,
        "chat by GET": 403,
        "trailing slash": 403,
        "absolute uri": 400,
    }
    assert all("\n" not in message for _status, message in answers.values())
    assert "not a route the agent may use" in answers["admin"][1]
    assert found["model_by_id"] == 200
    # The upstream saw the runner's preflight and the one allowed probe, nothing else, and never the key's misuse.
    assert set(seen) == {("GET", "/v1/models"), ("GET", "/v1/models/metered")}, seen
    refused = [(r["method"], r["status"], r["rejected"]) for r in records if "rejected" in r]
    assert (
        refused.count(("GET", 403, "route_not_allowed")) == 4 and refused.count(("POST", 403, "route_not_allowed")) == 4
    )
    assert ("DELETE", 403, "route_not_allowed") in refused and ("GET", 400, "bad_request_target") in refused
    assert len(refused) == 10


def test_the_allowlist_follows_the_endpoint_s_client_path(tmp_path: Path, hostile_install: QwenInstall) -> None:
    attack = """
        auth = {"Authorization": f"Bearer {token}"}
        root = base_url.rsplit("/api/v1", 1)[0]
        chat = {"model": "metered", "max_tokens": 4, "messages": []}
        report(
            under=http("POST", base_url + "/chat/completions", chat, auth)[0],
            plain_v1=http("POST", root + "/v1/chat/completions", chat, auth)[0],
        )
    """
    found, seen, _records = _run_hostile(tmp_path, hostile_install, attack, endpoint_path="/api/v1")
    assert (found["under"], found["plain_v1"]) == (200, 403)
    assert ("POST", "/api/v1/chat/completions") in seen and ("POST", "/v1/chat/completions") not in seen


def test_a_body_past_the_limit_is_refused_unread_and_stalls_no_other_request(
    tmp_path: Path, hostile_install: QwenInstall
) -> None:
    attack = """
        import http.client as client, json, threading
        from urllib.parse import urlsplit

        auth = {"Authorization": f"Bearer {token}"}
        parts = urlsplit(base_url)
        huge = b'{"model": "metered", "messages": [{"role": "user", "content": "' + b"x" * (100 * 1024**2) + b'"}]}'
        answers, small = {}, []

        def send(name, chunked):
            connection = client.HTTPConnection(parts.hostname, parts.port, timeout=60)
            try:
                headers = {**auth, "Content-Type": "application/json"}
                if chunked:  # no Content-Length: the proxy finds out while reading
                    body = (huge[i : i + (1 << 20)] for i in range(0, len(huge), 1 << 20))
                    connection.request("POST", parts.path + "/chat/completions", body, headers, encode_chunked=True)
                else:
                    connection.request("POST", parts.path + "/chat/completions", huge, headers)
                response = connection.getresponse()
                answers[name] = [response.status, json.loads(response.read())["error"]["message"]]
            except OSError as exc:  # the proxy may close a connection whose body it will not read
                answers[name] = [None, type(exc).__name__]
            finally:
                connection.close()

        senders = [threading.Thread(target=send, args=(name, name == "chunked")) for name in ("length", "chunked")]
        for sender in senders:
            sender.start()
        while any(sender.is_alive() for sender in senders):  # small requests keep being answered meanwhile
            small.append(http("POST", base_url + "/chat/completions", {"model": "metered", "max_tokens": 2}, auth)[0])
        for sender in senders:
            sender.join()
        report(answers=answers, small=small)
    """
    found, seen, records = _run_hostile(tmp_path, hostile_install, attack)
    answers = found["answers"]
    assert answers["length"][0] == 413 and "larger than 1048576 bytes" in answers["length"][1], answers
    assert answers["chunked"][0] in (413, None), answers  # a client still sending may see the connection close
    assert found["small"] and set(found["small"]) == {200}
    too_large = [r for r in records if r.get("rejected") == "body_too_large"]
    assert len(too_large) == 2 and all(r["status"] == 413 and r["request"] is None for r in too_large)
    assert all(method == "GET" or path == "/v1/chat/completions" for method, path in seen)
    assert len([s for s in seen if s[0] == "POST"]) == len(found["small"]), "no large body reached the upstream"
