"""A stand-in OpenAI-compatible model server answering only what readiness needs: `/health`, `/v1/models` and a
one-token `/v1/chat/completions` (the smoke generation).

Run as a script (`python model_server_stub.py --port P --name N [--key-env ENV] [--unhealthy] [--broken-generation]`)
for the local backend's process tests, or in a thread through `serve_in_thread` for the readiness probes.
`broken_generation`: healthy and listing the model, but every generation fails (HTTP 500), as a server whose weights
loaded but whose kernels do not run.
"""

from __future__ import annotations

import argparse
import json
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def handler_for(
    name: str, *, key: str | None = None, healthy: bool = True, broken_generation: bool = False
) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def _send(self, status: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            if self.path == "/health":
                self._send(200 if healthy else 503, {"status": "ok" if healthy else "loading"})
            elif self.path == "/v1/models":
                if key and self.headers.get("Authorization") != f"Bearer {key}":
                    self._send(401, {"error": "unauthorized"})
                else:
                    self._send(200, {"object": "list", "data": [{"id": name, "object": "model"}]})
            else:
                self._send(404, {"error": "not found"})

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
            if self.path != "/v1/chat/completions":
                self._send(404, {"error": "not found"})
            elif key and self.headers.get("Authorization") != f"Bearer {key}":
                self._send(401, {"error": "unauthorized"})
            elif body.get("model") != name:
                self._send(404, {"error": {"message": f"The model `{body.get('model')}` does not exist."}})
            elif broken_generation:
                self._send(500, {"error": {"message": "CUDA error: no kernel image is available"}})
            else:
                choice = {"index": 0, "message": {"role": "assistant", "content": "yes"}, "finish_reason": "length"}
                self._send(200, {"object": "chat.completion", "model": name, "choices": [choice]})

        def log_message(self, *args: object) -> None:
            pass

    return Handler


def serve_in_thread(name: str, **kwargs: object) -> ThreadingHTTPServer:
    """Start the stub on an ephemeral port in a daemon thread; call `.shutdown()` when done."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler_for(name, **kwargs))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--name", required=True)
    parser.add_argument("--key-env")
    parser.add_argument("--unhealthy", action="store_true")
    parser.add_argument("--broken-generation", action="store_true")
    args = parser.parse_args()
    key = os.environ.get(args.key_env) if args.key_env else None
    handler = handler_for(args.name, key=key, healthy=not args.unhealthy, broken_generation=args.broken_generation)
    server = ThreadingHTTPServer(("127.0.0.1", args.port), handler)
    server.serve_forever()


if __name__ == "__main__":
    main()
