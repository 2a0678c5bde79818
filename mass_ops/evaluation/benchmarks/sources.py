"""Which adapter runs a named benchmark, over which user-provided folder (MASS_SPEC §10, ISSUE #18).

Nothing is downloaded: the datasets lie in one folder the user provides, one subfolder per benchmark (``swe/``,
``tb2/``, ``ds/``, ``asta/``; SWE-bench's repositories, clones or bare mirrors, in ``swe/repos/``), given as
`data_dir` or ``$MASS_BENCHMARK_DATA``; the images come from the registry
the user provides (SWE-bench instances name theirs; Terminal-Bench tasks name theirs or take
``$MASS_TB2_IMAGE_PREFIX<task>``; AstaBench's grader image with `astabench` installed is ``$MASS_ASTA_IMAGE`` and its
scoring wrapper ``$MASS_ASTA_SCORE_COMMAND``).
"""

from __future__ import annotations

import os
from pathlib import Path

from mass_ops.evaluation.benchmarks.asta import ASTA, AstaE2EHard
from mass_ops.evaluation.benchmarks.dsbench import DS, DSBench
from mass_ops.evaluation.benchmarks.errors import BenchmarkError
from mass_ops.evaluation.benchmarks.suite import BenchmarkAdapter
from mass_ops.evaluation.benchmarks.swe import SWE, SWEBench
from mass_ops.evaluation.benchmarks.tb2 import TB2, TerminalBench2

DATA_ENV = "MASS_BENCHMARK_DATA"
TB2_PREFIX_ENV = "MASS_TB2_IMAGE_PREFIX"
ASTA_IMAGE_ENV = "MASS_ASTA_IMAGE"
ASTA_COMMAND_ENV = "MASS_ASTA_SCORE_COMMAND"
SUITE = (TB2, SWE, DS, ASTA)  # the benchmarks a `mass_benchmarks` run can choose, in the paper's table order


def data_root(data_dir: str | Path | None = None) -> Path:
    """The folder holding every benchmark's dataset: `data_dir`, else ``$MASS_BENCHMARK_DATA``."""
    chosen = data_dir or os.environ.get(DATA_ENV)
    if not chosen:
        raise BenchmarkError(
            f"benchmarks: no dataset folder; pass --data-dir or set ${DATA_ENV} (nothing is downloaded)"
        )
    return Path(chosen)


def benchmark_adapter(name: str, data_dir: str | Path | None = None) -> BenchmarkAdapter:
    """The adapter of benchmark `name` over ``<data root>/<name>``; BenchmarkError (one line) for an unknown name,
    a missing folder or a missing grader setting."""
    if name not in SUITE:
        raise BenchmarkError(f"benchmark {name!r} is not one of {list(SUITE)}")
    root = data_root(data_dir) / name
    if not root.is_dir():
        raise BenchmarkError(f"benchmark {name}: {root} is not a folder; put the dataset there (nothing is downloaded)")
    if name == SWE:
        return SWEBench(root)
    if name == TB2:
        return TerminalBench2(root, os.environ.get(TB2_PREFIX_ENV, ""))
    if name == DS:
        return DSBench(root)
    image, command = os.environ.get(ASTA_IMAGE_ENV, ""), os.environ.get(ASTA_COMMAND_ENV, "")
    if not image or not command:
        raise BenchmarkError(
            f"benchmark asta: set ${ASTA_IMAGE_ENV} and ${ASTA_COMMAND_ENV} (its grader image and scorer)"
        )
    return AstaE2EHard(root, image, command)
