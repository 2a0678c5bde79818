"""A real model behind the whole episode path: a random-weight Qwen3-architecture model with the real Qwen3 tokenizer
and chat template, served by `transformers serve` on CPU, driven by real qwen-code through the logging proxy.

The model's output is noise, so the episode may well be a model failure; what is asserted is the plumbing: the
endpoint lists the model under the name the config uses, chat completions went through the proxy with status 200
and usage, the outcome is classified, artifacts are published and the row is recorded.
`transformers serve MODEL_DIR` (transformers 5.24.0) pins the model and lists it in `/v1/models` under the path
it was given, so that path is the served name.
"""

from __future__ import annotations

import gzip
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from mass_ops.layout import EPISODE_FILES
from mass_ops.runtime.pool import EpisodePool
from mass_ops.runtime.qwen_install import QwenInstall
from tests.support.runtime import open_episode_cycle, request, runner_environ

pytestmark = pytest.mark.slow(seconds=20)

CONTEXT_TOKENS = 32768
MAX_TOKENS = 16  # each decoded token costs a pass over qwen-code's ~13 K-token prompt on CPU
READY_TIMEOUT_S = 240


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _listed(base_url: str) -> list[str]:
    with urllib.request.urlopen(f"{base_url}/v1/models", timeout=5) as response:
        return [item["id"] for item in json.load(response)["data"]]


@pytest.fixture(scope="module")
def tiny_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """(endpoint, served model name) of `transformers serve` hosting a freshly built tiny Qwen3."""
    from mass_ops.models.tiny import build_tiny_qwen3

    root = tmp_path_factory.mktemp("tiny")
    model_dir = build_tiny_qwen3(root / "tiny-qwen3", max_position_embeddings=CONTEXT_TOKENS)
    port = _free_port()
    serve = Path(sys.executable).with_name("transformers")
    log = (root / "serve.log").open("wb")
    command = [str(serve), "serve", str(model_dir), "--host", "127.0.0.1", "--port", str(port), "--device", "cpu"]
    command += ["--dtype", "float32"]  # CPU matrix kernels are much faster in float32 than in bfloat16 without AMX
    process = subprocess.Popen(
        command,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        env={**os.environ, "OMP_NUM_THREADS": "2"},
    )
    base_url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            if process.poll() is not None:
                pytest.fail(f"transformers serve exited: {(root / 'serve.log').read_text()[-2000:]}")
            try:
                if str(model_dir) in _listed(base_url):
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                pytest.fail("transformers serve did not list the model in time")
            time.sleep(0.5)
        yield f"{base_url}/v1", str(model_dir)
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        log.close()


def test_qwen_code_episode_against_a_tiny_real_model(
    tiny_server: tuple[str, str], tmp_path: Path, qwen_install: QwenInstall
) -> None:
    endpoint, served_name = tiny_server
    ctx = open_episode_cycle(
        tmp_path,
        endpoint,
        served_name=served_name,
        inference={"context_window_tokens": CONTEXT_TOKENS, "episode_max_output_tokens": MAX_TOKENS},
        max_infra_attempts=1,
        episode_wall_clock_s=400,
        stream_idle_timeout_ms=120000,
    )
    with EpisodePool(ctx, install=qwen_install, environ=runner_environ(), scratch_dir=tmp_path / "scratch") as pool:
        [outcome] = pool.run([request(ctx, "Write hello.py that prints hello, then stop.", seed=1)])

    record = outcome.status_record
    assert outcome.status in ("succeeded", "model_failure", "infra_failure")
    assert record["qwen_code_version"] == "0.21.10" and record["model"] == served_name
    prefix = f"cycles/{ctx.cycle_name}/episodes/{outcome.request.unit.slug}/a{outcome.attempt}"
    for name in EPISODE_FILES.values():
        assert ctx.artifacts.exists(f"{prefix}/{name}"), name
    records = [
        json.loads(line)
        for line in gzip.decompress(ctx.artifacts.get_bytes(f"{prefix}/api_requests.jsonl.gz")).splitlines()
    ]
    chats = [r for r in records if r["path"] == "/v1/chat/completions"]
    ok = [r for r in chats if r["status"] == 200 and r["response"]["usage"]]
    assert ok, [(r["status"], r.get("proxy_error")) for r in chats]
    assert ok[0]["request"]["model"] == served_name and ok[0]["request"]["max_tokens"] == MAX_TOKENS
    # The real tokenizer counted qwen-code's long system prompt and tool list.
    assert ok[0]["response"]["usage"]["prompt_tokens"] > 1000
    assert record["usage"]["requests"] == len(chats) and record["usage"]["prompt_tokens"] > 1000
    [row] = ctx.repo.episodes(ctx.cycle_id)
    assert row.status == outcome.status and row.requests == len(chats) and row.artifacts == outcome.artifacts
