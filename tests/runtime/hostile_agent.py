"""A hostile stand-in for qwen-code (tests only, never shipped): it runs an attack instead of doing the task.

Started by the real `EpisodeRunner` exactly as qwen-code is (`QwenInstall(node_bin=python, qwen_entry=this file)`),
it reads the same inputs — prompt on stdin, `$QWEN_HOME/settings.json`, its token from the variable `envKey` names —
and then executes the Python source that follows a line `@hostile` in the prompt, with these names bound:

    settings   the parsed settings.json        base_url   the endpoint qwen-code would call (the episode's proxy)
    token      the agent's bearer token        workspace  its working folder (a Path)
    http(method, url, body=None, headers=None, timeout=10) -> (status, headers dict, body bytes); never raises for
               an HTTP status, raises OSError when nothing answered
    report(**findings)  what the attack observed: one `HOSTILE_REPORT <json>` assistant message in the stream log

The attack's own exceptions are reported (`report(error=...)`) and the agent still ends with a success result, as
qwen-code ends an episode, so the platform's records of it are produced the normal way. Tests read the findings with
`hostile_findings(stream_text)`.
"""

from __future__ import annotations

import http.client as http_client
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

REPORT_MARK = "HOSTILE_REPORT "


def _emit(event: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(event) + "\n")
    sys.stdout.flush()


def report(**findings: Any) -> None:
    """Record what the attack saw (one assistant message; tests parse it back)."""
    text = REPORT_MARK + json.dumps(findings, default=str)
    _emit({"type": "assistant", "message": {"role": "assistant", "content": [{"type": "text", "text": text}]}})


def http(
    method: str,
    url: str,
    body: bytes | dict[str, Any] | None = None,
    headers: dict[str, str] | None = None,
    timeout: float = 10.0,
) -> tuple[int, dict[str, str], bytes]:
    """One plain HTTP/1.1 exchange with `url` (http only); a dict body is sent as JSON."""
    parts = urlsplit(url)
    payload = json.dumps(body).encode() if isinstance(body, dict) else body
    sent = dict(headers or {})
    if isinstance(body, dict):
        sent.setdefault("Content-Type", "application/json")
    connection = http_client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port or 80, timeout=timeout)
    try:
        target = parts.path + (f"?{parts.query}" if parts.query else "")
        connection.request(method, target or "/", body=payload, headers=sent)
        response = connection.getresponse()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()
    finally:
        connection.close()


def hostile_findings(stream_text: str) -> list[dict[str, Any]]:
    """Every `report(...)` of a hostile agent, in order, from its stream-json output."""
    found: list[dict[str, Any]] = []
    for line in stream_text.splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if event.get("type") != "assistant":
            continue
        for part in event["message"].get("content", []):
            text = part.get("text", "") if isinstance(part, dict) else ""
            if text.startswith(REPORT_MARK):
                found.append(json.loads(text[len(REPORT_MARK) :]))
    return found


def main() -> int:
    started = time.monotonic()
    settings = json.loads((Path(os.environ["QWEN_HOME"]) / "settings.json").read_text())
    provider = settings["modelProviders"]["openai"][0]
    prompt = sys.stdin.read()
    _emit({"type": "system", "subtype": "init", "session_id": "hostile", "cwd": os.getcwd(), "model": provider["id"]})
    _marker, _, source = prompt.partition("@hostile\n")
    scope = {
        "settings": settings,
        "base_url": provider["baseUrl"].rstrip("/"),
        "token": os.environ.get(provider["envKey"], ""),
        "workspace": Path.cwd(),
        "http": http,
        "report": report,
        "__name__": "__hostile__",
    }
    try:
        exec(compile(source, "<attack>", "exec"), scope)
    except BaseException as exc:  # an attack that fails is a finding too
        report(error=f"{type(exc).__name__}: {exc}", trace=traceback.format_exc(limit=3))
    _emit(
        {
            "type": "result",
            "subtype": "success",
            "session_id": "hostile",
            "is_error": False,
            "duration_ms": int((time.monotonic() - started) * 1000),
            "result": "done",
        }
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
