"""The errors of the benchmark adapters: a leaf module, so every adapter module can raise them without importing
another adapter module (`scoring` re-exports them for the callers that import them from there)."""

from __future__ import annotations

from mass_ops.errors import InputError


class BenchmarkError(InputError):
    """A benchmark dataset, trial or score set is unusable (missing files, wrong row count, missing judge)."""


class EvaluatorNotInstalledError(BenchmarkError):
    """The benchmark's official evaluator is not installed on this machine."""
