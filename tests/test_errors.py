"""The error root: every error mass-ops raises on purpose has a kind, and commands exit by that kind."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import pytest
import typer

import mass_ops
from mass_ops.cli import failure
from mass_ops.errors import EXIT_FAILURE, EXIT_INPUT, InfrastructureError, InputError, MassOpsError, exit_code_for

# Exceptions that are control flow, not errors a command reports.
NOT_REPORTED = {"Terminated", "PublishAborted"}


def mass_ops_exceptions() -> list[type[BaseException]]:
    found = {}
    for info in pkgutil.walk_packages(mass_ops.__path__, "mass_ops."):
        if info.name.startswith("mass_ops.train.trainer"):
            continue  # imported by torchrun only (heavy)
        module = importlib.import_module(info.name)
        for _, value in inspect.getmembers(module, inspect.isclass):
            if issubclass(value, BaseException) and value.__module__ == module.__name__:
                found[value.__qualname__ + "@" + value.__module__] = value
    return list(found.values())


def test_every_value_or_runtime_error_of_mass_ops_has_a_kind():
    classes = mass_ops_exceptions()
    assert len(classes) > 40, "the walker found too few error classes"
    without_kind = [
        f"{cls.__module__}.{cls.__qualname__}"
        for cls in classes
        if issubclass(cls, ValueError | RuntimeError) and not issubclass(cls, MassOpsError)
    ]
    assert without_kind == []


def test_the_two_kinds_keep_their_standard_bases():
    assert issubclass(InputError, ValueError) and exit_code_for(InputError("x")) == EXIT_INPUT
    assert issubclass(InfrastructureError, RuntimeError) and exit_code_for(InfrastructureError("x")) == EXIT_FAILURE
    assert exit_code_for(ValueError("x")) is None


@pytest.mark.parametrize(
    ("error", "code", "words"),
    [
        (InputError("tasks.train: 999 is not a task"), 2, "render: tasks.train: 999 is not a task"),
        (InfrastructureError("3 episodes failed"), 1, "render failed: 3 episodes failed; rerun to resume"),
        (ValueError("math domain error"), 1, "render failed: internal error (ValueError: math domain error)"),
    ],
)
def test_a_command_exits_by_the_kind_of_its_error(error, code, words, capsys):
    exit_ = failure("render", error)
    assert isinstance(exit_, typer.Exit) and exit_.exit_code == code
    err = capsys.readouterr().err.strip()
    assert err.startswith(words) and "\n" not in err


def test_control_flow_exceptions_are_not_errors():
    names = {cls.__qualname__ for cls in mass_ops_exceptions()}
    assert names >= NOT_REPORTED
