"""A stand-in for qwen-code (tests and benchmarks only, never shipped): a light OpenAI-compatible agent process.

It is started by the real `EpisodeRunner` exactly as qwen-code is (`QwenInstall(node_bin=python, qwen_entry=this
file)`), reads the same inputs — prompt on stdin, `$QWEN_HOME/settings.json`, the key from the variable its
`envKey` names — talks to the endpoint through the episode's logging proxy with streamed chat completions, and
writes qwen-code's `stream-json` events. It starts in tens of milliseconds, so pool and runner mechanics can be
exercised many times on two cores where real qwen-code (seconds of Node start-up) cannot.

Directives in the prompt (one line `@agent key=value ...`):
  requests=N   chat completions to make (default 3; tool calls from the policy advance the conversation and
               `write_file` calls are carried out inside the workspace)
  sleep=S      then sleep S seconds (default 0), after starting a child `sleep` in the process group and a
               grandchild in its own session (`setsid`); their pids go to `pids.txt` in the workspace
  leak=1       write the key into `leak.txt` and echo it in an assistant message (a careless agent)
  dump=1       write `agent_env.json`: its argv, the names of its environment variables, and those variables'
               values except the key's (which is only reported as present or not)
  result=R     final result subtype (default success; anything else is an error result: a model failure)
On an HTTP error or a broken connection it reports `[API Error: …]` and a success result, as qwen-code does.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

SYSTEM_PROMPT = "You are Qwen Code, an interactive CLI agent (stand-in)."


def _emit(event: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(event) + "\n")
    sys.stdout.flush()


def _assistant(content: list[dict[str, Any]]) -> None:
    _emit({"type": "assistant", "message": {"role": "assistant", "content": content}})


def _directives(prompt: str) -> dict[str, str]:
    for line in prompt.splitlines():
        if line.startswith("@agent"):
            return dict(part.split("=", 1) for part in line.split()[1:] if "=" in part)
    return {}


def _chat(base_url: str, key: str, body: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    """One streamed completion; returns {content, tool_calls} or raises RuntimeError('[API Error: …]')."""
    content: list[str] = []
    calls: dict[int, dict[str, Any]] = {}
    try:
        status, events = _post_sse(base_url, "/chat/completions", key, json.dumps(body).encode(), timeout_s)
        if status >= 400:
            raise RuntimeError(f"[API Error: {status} {b''.join(events)[:200].decode(errors='replace')}]")
        done = False
        for line in events:
            text = line.decode("utf-8").strip()
            if not text.startswith("data:"):
                continue
            data = text[5:].strip()
            if data == "[DONE]":
                done = True
                break
            for choice in json.loads(data).get("choices") or []:
                delta = choice.get("delta") or {}
                content.append(delta.get("content") or "")
                for fragment in delta.get("tool_calls") or []:
                    call = calls.setdefault(fragment["index"], {"id": None, "name": "", "arguments": ""})
                    call["id"] = call["id"] or fragment.get("id")
                    function = fragment.get("function") or {}
                    call["name"] = call["name"] or function.get("name") or ""
                    call["arguments"] += function.get("arguments") or ""
    except (OSError, ValueError) as exc:
        raise RuntimeError(f"[API Error: Connection error ({type(exc).__name__})]") from None
    if not done:
        raise RuntimeError("[API Error: terminated (stream ended without [DONE])]")
    return {"content": "".join(content), "tool_calls": [calls[i] for i in sorted(calls)]}


def _post_sse(base_url: str, path: str, key: str, body: bytes, timeout_s: float) -> tuple[int, Any]:
    """A minimal HTTP/1.1 POST (stdlib `socket` only: http.client's imports cost more than this whole agent's
    work); returns the status and an iterator over the response body's lines (chunked or not)."""
    parts = urlsplit(base_url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    sock = socket.create_connection((host, port), timeout=timeout_s)
    head = (
        f"POST {parts.path.rstrip('/')}{path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
        f"Authorization: Bearer {key}\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    )
    sock.sendall(head.encode() + body)
    reader = sock.makefile("rb")
    status = int(reader.readline().split()[1])
    headers = {}
    while (line := reader.readline().strip()) != b"":
        name, _, value = line.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip()

    def body_bytes() -> Any:
        if headers.get("transfer-encoding", "").lower() == "chunked":
            while True:
                size_line = reader.readline()
                if not size_line:
                    raise ConnectionError("connection closed inside a chunked body")
                size = int(size_line.split(b";")[0], 16)
                if size == 0:
                    return
                chunk = reader.read(size)
                if len(chunk) < size:
                    raise ConnectionError("connection closed inside a chunk")
                reader.readline()
                yield chunk
        else:
            yield reader.read(int(headers["content-length"])) if "content-length" in headers else reader.read()

    def lines() -> Any:
        pending = b""
        try:
            for chunk in body_bytes():
                pending += chunk
                *complete, pending = pending.split(b"\n")
                yield from complete
            if pending:
                yield pending
        finally:
            sock.close()

    return status, lines()


def _spawn_children(workspace: Path) -> None:
    import subprocess  # only this directive needs it; the import is costly at start-up

    child = subprocess.Popen(["sleep", "1000"])
    detached = subprocess.Popen(["sleep", "1001"], start_new_session=True)  # leaves the process group
    (workspace / "pids.txt").write_text(f"{child.pid}\n{detached.pid}\n")


def main() -> int:
    started = time.monotonic()
    workspace = Path.cwd()
    settings = json.loads((Path(os.environ["QWEN_HOME"]) / "settings.json").read_text())
    provider = settings["modelProviders"]["openai"][0]
    key = os.environ[provider["envKey"]]
    generation = provider["generationConfig"]
    prompt = sys.stdin.read()
    options = _directives(prompt)
    session = os.urandom(16).hex()
    _emit({"type": "system", "subtype": "init", "session_id": session, "cwd": str(workspace), "model": provider["id"]})

    system = f"{SYSTEM_PROMPT}\nI'm currently working in the directory: {workspace}"
    messages: list[dict[str, Any]] = [{"role": "system", "content": system}, {"role": "user", "content": prompt}]
    final_text = ""
    for _ in range(int(options.get("requests", "3"))):
        body = {
            "model": provider["id"],
            "messages": messages,
            "stream": True,
            "stream_options": {"include_usage": True},
            **generation.get("samplingParams", {}),
            **generation.get("extra_body", {}),
        }
        try:
            reply = _chat(provider["baseUrl"], key, body, generation.get("timeout", 60000) / 1000)
        except RuntimeError as exc:
            final_text = str(exc)
            _assistant([{"type": "text", "text": final_text}])
            break
        final_text = reply["content"] or final_text
        if reply["content"]:
            _assistant([{"type": "text", "text": reply["content"]}])
        assistant: dict[str, Any] = {"role": "assistant", "content": reply["content"] or None}
        if reply["tool_calls"]:
            assistant["tool_calls"] = [
                {"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
                for c in reply["tool_calls"]
            ]
        messages.append(assistant)
        for call in reply["tool_calls"]:
            arguments = json.loads(call["arguments"] or "{}")
            _assistant([{"type": "tool_use", "id": call["id"], "name": call["name"], "input": arguments}])
            if call["name"] == "write_file":
                target = Path(arguments["file_path"]).resolve()
                if target.is_relative_to(workspace.resolve()):
                    target.parent.mkdir(parents=True, exist_ok=True)
                    target.write_text(arguments["content"])
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": "ok"})

    if options.get("dump") == "1":
        visible = {name: value for name, value in os.environ.items() if name != provider["envKey"]}
        dump = {"argv": sys.argv, "env": visible, "key_present": bool(os.environ.get(provider["envKey"]))}
        (workspace / "agent_env.json").write_text(json.dumps(dump, indent=2))
    if options.get("leak") == "1":
        (workspace / "leak.txt").write_text(f"the key is {key}\n")
        _assistant([{"type": "text", "text": f"My key: {key}"}])
    if float(options.get("sleep", "0")) > 0:
        _spawn_children(workspace)
        time.sleep(float(options["sleep"]))

    subtype = options.get("result", "success")
    result: dict[str, Any] = {
        "type": "result",
        "subtype": subtype,
        "session_id": session,
        "is_error": subtype != "success",
        "duration_ms": int((time.monotonic() - started) * 1000),
        "result": final_text,
    }
    if subtype != "success":
        result["error"] = {"message": f"stand-in agent stopped: {subtype}"}
    _emit(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
