"""qwen-code runtime: the installer's logic against fake npm/node, and one real qwen-code episode (slow).

The smoke test runs the real pinned qwen-code on Node 22 against the policy stand-in, through the logging proxy, in
an empty workspace. Its settings.json is deliberately minimal and local to this test; the episode runner builds the
real one.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import stat
import subprocess
from pathlib import Path
from typing import Any

import pytest

from mass_ops.runtime.proxy import LoggingProxy
from mass_ops.runtime.qwen_install import (
    QWEN_CODE_VERSION,
    RUNTIME_DIR_ENV,
    QwenInstallError,
    default_runtime_dir,
    ensure_qwen_code,
)
from tests.policy_server import PolicyServer, PolicyServerConfig, RequestKind, classify_request

FAKE_NPM = r"""#!/bin/bash
# Fake npm: `npm install --prefix DIR [flags] SPEC` lays out what the real package would, and logs the call.
echo "$*" >> "$FAKE_NPM_LOG"
[ -n "$FAKE_NPM_FAIL" ] && { echo "npm ERR! 404 Not Found: $FAKE_NPM_FAIL" >&2; exit 1; }
prefix="$3"; spec="${@: -1}"
case "$spec" in
  @qwen-code/qwen-code@*)
    dir="$prefix/node_modules/@qwen-code/qwen-code"; mkdir -p "$dir"
    printf '{"name": "@qwen-code/qwen-code", "version": "%s", "bin": {"qwen": "cli-entry.js"}}' "${spec##*@}" \
      > "$dir/package.json"
    echo "// entry" > "$dir/cli-entry.js" ;;
  node-*@22)
    dir="$prefix/node_modules/${spec%@22}/bin"; mkdir -p "$dir"
    printf '#!/bin/sh\necho v22.9.0\n' > "$dir/node"; chmod +x "$dir/node" ;;
  *) echo "unexpected spec $spec" >&2; exit 2 ;;
esac
"""


def _executable(path: Path, text: str) -> None:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


@pytest.fixture
def fake_toolchain(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Path]:
    """PATH with a fake npm and a system `node` that reports v20 (too old), and the npm call log."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _executable(bin_dir / "npm", FAKE_NPM)
    _executable(bin_dir / "node", "#!/bin/sh\necho v20.19.0\n")
    log = tmp_path / "npm-calls.log"
    log.touch()
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    monkeypatch.setenv("FAKE_NPM_LOG", str(log))
    return {"bin": bin_dir, "log": log, "runtime": tmp_path / "runtime"}


def _npm_calls(log: Path) -> list[str]:
    return log.read_text().splitlines()


def test_installs_node_and_pinned_qwen_once(fake_toolchain: dict[str, Path]) -> None:
    runtime = fake_toolchain["runtime"]
    install = ensure_qwen_code(runtime)
    calls = _npm_calls(fake_toolchain["log"])
    assert len(calls) == 2
    assert calls[0].startswith("install --prefix ") and calls[0].endswith("@22")
    assert calls[1].endswith(f"@qwen-code/qwen-code@{QWEN_CODE_VERSION}")
    assert install.version == QWEN_CODE_VERSION
    assert install.node_bin.is_relative_to(runtime / "node") and install.node_bin.name == "node"
    assert install.qwen_entry == (runtime / "qwen/node_modules/@qwen-code/qwen-code/cli-entry.js").resolve()
    assert install.argv("--version") == [str(install.node_bin), str(install.qwen_entry), "--version"]
    assert not list(runtime.glob("*.staging"))

    again = ensure_qwen_code(runtime)  # idempotent: nothing reinstalled
    assert again == install and len(_npm_calls(fake_toolchain["log"])) == 2


def test_version_change_replaces_only_the_qwen_tree(fake_toolchain: dict[str, Path]) -> None:
    runtime = fake_toolchain["runtime"]
    ensure_qwen_code(runtime)
    other = ensure_qwen_code(runtime, version="0.21.2")
    calls = _npm_calls(fake_toolchain["log"])
    assert len(calls) == 3 and calls[-1].endswith("@qwen-code/qwen-code@0.21.2")
    manifest = json.loads((other.qwen_entry.parent / "package.json").read_text())
    assert manifest["version"] == "0.21.2" and other.version == "0.21.2"


def test_system_node_22_is_used_when_present(fake_toolchain: dict[str, Path]) -> None:
    _executable(fake_toolchain["bin"] / "node", "#!/bin/sh\necho v22.12.0\n")
    install = ensure_qwen_code(fake_toolchain["runtime"])
    assert install.node_bin == (fake_toolchain["bin"] / "node").resolve()
    assert [c for c in _npm_calls(fake_toolchain["log"]) if c.endswith("@22")] == []
    assert not (fake_toolchain["runtime"] / "node").exists()


def test_failed_npm_leaves_the_previous_install_intact(
    fake_toolchain: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    runtime = fake_toolchain["runtime"]
    first = ensure_qwen_code(runtime)
    monkeypatch.setenv("FAKE_NPM_FAIL", "@qwen-code/qwen-code@9.9.9")
    with pytest.raises(QwenInstallError, match=r"npm install @qwen-code/qwen-code@9\.9\.9 failed \(exit 1\).*404"):
        ensure_qwen_code(runtime, version="9.9.9")
    assert not list(runtime.glob("*.staging"))
    monkeypatch.delenv("FAKE_NPM_FAIL")
    assert ensure_qwen_code(runtime) == first


def test_runtime_dir_defaults(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(RUNTIME_DIR_ENV, str(tmp_path / "rt"))
    assert default_runtime_dir() == (tmp_path / "rt").resolve()
    monkeypatch.delenv(RUNTIME_DIR_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    # Not the package's own folder: that is site-packages when mass-ops is installed from a wheel.
    assert default_runtime_dir() == (tmp_path / "cache" / "mass-ops" / "runtime").resolve()


def test_missing_npm_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    empty_bin = tmp_path / "bin"
    empty_bin.mkdir()
    monkeypatch.setenv("PATH", str(empty_bin))
    with pytest.raises(QwenInstallError, match="npm is required"):
        ensure_qwen_code(tmp_path / "runtime")


# --- the real thing ---------------------------------------------------------------------------------------------

MODEL = "smoke-policy"
KEY_VAR = "SMOKE_MODEL_API_KEY"
FAKE_KEY = "sk-smoke-not-a-real-key-4242"
SEED = 7


def _minimal_settings(base_url: str) -> dict[str, Any]:
    """Just enough qwen-code settings to reach one OpenAI-compatible endpoint (the runner builds the real ones)."""
    provider = {
        "id": MODEL,
        "envKey": KEY_VAR,  # the *name* of the variable; the key itself never touches disk
        "baseUrl": base_url,
        "generationConfig": {"timeout": 120000, "maxRetries": 0, "samplingParams": {"max_tokens": 2048, "seed": SEED}},
    }
    return {
        "$version": 4,
        "modelProviders": {"openai": [provider]},
        "security": {"auth": {"selectedType": "openai"}},
        "model": {"name": MODEL},
        "telemetry": {"enabled": False},
    }


@pytest.mark.slow
def test_real_qwen_code_episode_through_proxy(tmp_path: Path) -> None:
    if shutil.which("npm") is None and not (default_runtime_dir() / "qwen").exists():
        pytest.skip("npm is not installed and no qwen-code runtime is cached")
    install = ensure_qwen_code()
    workspace, qwen_home, log = tmp_path / "workspace", tmp_path / "qwen_home", tmp_path / "api_requests.jsonl"
    workspace.mkdir()
    qwen_home.mkdir()

    async def episode() -> tuple[int, bytes, bytes, dict[str, Any]]:
        async with (
            PolicyServer(PolicyServerConfig(models=(MODEL,))) as server,
            LoggingProxy(server.base_url, log) as proxy,
        ):
            (qwen_home / "settings.json").write_text(json.dumps(_minimal_settings(f"{proxy.url}/v1")))
            env = {
                "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
                "HOME": str(tmp_path),
                "QWEN_HOME": str(qwen_home),
                KEY_VAR: FAKE_KEY,
                "QWEN_TELEMETRY_ENABLED": "false",
                "QWEN_CODE_SUPPRESS_YOLO_WARNING": "1",
                "NO_PROXY": "127.0.0.1,localhost",
            }
            process = await asyncio.create_subprocess_exec(
                *install.argv("--model", MODEL, "--approval-mode", "yolo", "--output-format", "stream-json"),
                cwd=workspace,
                env=env,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
            )
            prompt = b"Produce research_report.md and results/metrics.json for the task.\n"
            stdout, stderr = await asyncio.wait_for(process.communicate(prompt), timeout=240)
            return process.returncode or 0, stdout, stderr, server.stats.as_dict()

    returncode, stdout, stderr, stats = asyncio.run(episode())
    assert returncode == 0, stderr.decode(errors="replace")[-2000:]

    events = [json.loads(line) for line in stdout.decode().splitlines() if line.strip()]
    results = [e for e in events if e.get("type") == "result"]
    assert any(r["subtype"] == "success" and r["is_error"] is False for r in results)
    tool_uses = [
        block["name"]
        for e in events
        if e.get("type") == "assistant"
        for block in e["message"]["content"]
        if isinstance(block, dict) and block.get("type") == "tool_use"
    ]
    assert {"write_file", "run_shell_command", "agent"} <= set(tool_uses)

    report = workspace / "research_report.md"
    metrics = json.loads((workspace / "results" / "metrics.json").read_text())
    assert report.read_text().startswith("# Research report")
    assert metrics["seed"] == SEED  # the sampling seed travelled settings.json → request → policy

    records = [json.loads(line) for line in log.read_text().splitlines()]
    kinds = [classify_request(r["request"]) for r in records if r["path"] == "/v1/chat/completions"]
    assert kinds.count(RequestKind.ORCHESTRATOR) >= 4 and kinds.count(RequestKind.SUBAGENT) >= 2
    assert stats["by_kind"]["orchestrator"] == kinds.count(RequestKind.ORCHESTRATOR)
    # The policy's scripted calls match the tool schemas this qwen-code pin actually declares.
    orchestrator = next(r for r in records if classify_request(r["request"]) is RequestKind.ORCHESTRATOR)
    first_tools = {t["function"]["name"]: t["function"]["parameters"] for t in orchestrator["request"]["tools"]}
    assert {"file_path", "content"} <= set(first_tools["write_file"]["properties"])
    assert "command" in first_tools["run_shell_command"]["properties"]
    assert {"prompt", "subagent_type", "run_in_background"} <= set(first_tools["agent"]["properties"])
    written = {}
    for record in records:
        assert record["status"] == 200 and record["stream"] is True and "proxy_error" not in record
        assert record["response"]["done"] is True and record["response"]["n_bad_chunks"] == 0
        for call in record["response"]["choices"][0]["message"]["tool_calls"] or []:
            if call["function"]["name"] == "write_file":
                arguments = json.loads(call["function"]["arguments"])  # reassembled from several fragments
                written[arguments["file_path"]] = arguments["content"]
    assert written[str(report)] == report.read_text()
    assert json.loads(written[str(workspace / "results" / "metrics.json")]) == metrics
    for path in (log, qwen_home / "settings.json"):
        assert FAKE_KEY not in path.read_text()
