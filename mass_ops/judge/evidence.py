"""Evidence bundles: what a judge or the optimizer sees of one workspace (MASS_SPEC §5, §3.3 step B), as raw data.

Python computes what the reference's code computes — the representative tree, the preflight of required files and of
the plots the task names, which files are excerpted, their caps and cuts, the optimizer's ``results/`` JSON appendix —
and hands it over as plain values (`EvidenceBundle.variables`, `ResultsAppendix.variables`). Every word, heading,
marker, fence and separator is the template ``evidence.j2`` (macros ``evidence`` and ``results_appendix``).

Two cuts depend on marker text: the token cap counts the tokens of its marker, and the appendix's total counts the
characters of its per-file marker. Those texts are the template's macros ``token_cut_marker`` and
``appendix_cut_marker`` (`CutMarkers`), so a template with other wording still gets the reference's computation.

Files are read whole up to `WHOLE_READ_BYTES` (newlines translated as Python's text mode does); a larger file is read
only as far as its excerpt can show (`read_text`), so a hostile 500 MB report costs what its excerpt shows.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import re
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mass_ops.errors import InputError
from mass_ops.store.untrusted import read_capped

if TYPE_CHECKING:
    from mass_ops.prompts import PromptSet

logger = logging.getLogger(__name__)

EVIDENCE_TEMPLATE = "evidence.j2"
SKIPPED_DIRS = frozenset({".git", "__pycache__", ".pytest_cache", ".mypy_cache", "node_modules", ".venv", "venv"})
BINARY_SUFFIXES = frozenset(
    {
        ".parquet", ".pq", ".npy", ".npz", ".pkl", ".pickle", ".pt", ".pth", ".onnx", ".bin", ".h5", ".hdf5",
        ".feather", ".arrow", ".png", ".jpg", ".jpeg", ".gif", ".webp", ".pdf", ".zip", ".tar", ".gz",
    }
)  # fmt: skip
TREE_MAX_ENTRIES = 400
TREE_MAX_DEPTH = 6
TREE_MAX_CHILDREN = 100
PREFLIGHT_FILES = ("research_report.md", "deliverables/index.json", "results/metrics.json", "requirements.txt")
PREFLIGHT_MAX_PLOTS = 40
# (path, category): JSON files take the JSON caps, the others (report, requirements.txt) the report's.
EXCERPT_FILES = (
    ("research_report.md", "report"),
    ("deliverables/index.json", "json"),
    ("results/metrics.json", "json"),
    ("results/model_comparison.json", "json"),
    ("requirements.txt", "report"),
)
ENTRY_SCRIPT_PATTERN = re.compile(r"run_.*\.py|main\.py|pipeline\.py", re.DOTALL)
TEST_FILE_PATTERN = re.compile(r"test_.*\.py", re.DOTALL)
MAX_ENTRY_SCRIPTS = 4
TEST_FILE_CAP = 8000  # characters and tokens: the first test file takes min(8000, code cap) of each
# Token caps keep len/4 characters at each end, shrunk by this factor until the excerpt fits, at most this many
# times; then a last excerpt of this many characters at each end.
_TOKEN_SHRINK = 0.7
_TOKEN_SHRINK_ROUNDS = 24
_TOKEN_LAST_RESORT = 256
# Files up to this size are read whole (the reference reads every file whole); larger ones only at their two ends.
WHOLE_READ_BYTES = 4 << 20
_SYNC_BYTES = 8  # bytes read beyond a window: decoding from the middle of a file re-synchronises within 3

# Files the optimizer's results/ appendix never includes: raw dumps, and per-task files known to be huge.
APPENDIX_EXCLUDED_NAMES = frozenset({"raw_records.json", "pilot_raw_records.json"})
APPENDIX_EXCLUDED_BY_TASK: dict[int, frozenset[str]] = {
    57: frozenset({"data_quality_issues.json"}),
    202: frozenset(
        {
            "curve_data.json",
            "distances_angles_predictions.json",
            "distances_only_predictions.json",
            *(f"run_{family}_family_s{seed}.json" for family in ("B0", "B1", "M1", "M2", "M3") for seed in range(3)),
            *(f"run_{family}_random_s0.json" for family in ("B0", "B1", "M1", "M2", "M3")),
        }
    ),
    207: frozenset({"esmfold_plddts.json"}),
    220: frozenset(
        {"invariant_baseline_test_results.json", "se3_gvp_small_test_results.json", "se3_gvp_test_results.json"}
    ),
}

# PNG paths in a task text: full paths ending in deliverables/plots/X.png, and bare names (mapped into plots/).
_PLOT_PATH = re.compile(r"([\w./\\-]+deliverables/plots/[\w.-]+\.png)", re.IGNORECASE)
_PLOT_NAME = re.compile(r"(?:deliverables/plots/|\b)([a-z0-9_-]+\.png)\b", re.IGNORECASE)
_BACKTICKS = re.compile(r"`+")


class EvidenceError(InputError):
    """A workspace cannot be turned into evidence (missing folder, bundles of different tasks)."""


# -- token counting ------------------------------------------------------------------------------------------------


def _chars_over_four(text: str) -> int:
    return max(1, math.ceil(len(text) / 4))


_O200K_LOCK = threading.Lock()


def _o200k_counter() -> Callable[[str], int] | None:
    """tiktoken's o200k_base encoder, or None when it cannot be loaded (no cached BPE file and no network)."""
    with _O200K_LOCK:  # loading may download the tables: once per process, not once per judging thread
        return _load_o200k()


@functools.cache
def _load_o200k() -> Callable[[str], int] | None:
    try:
        import tiktoken

        encoding = tiktoken.get_encoding("o200k_base")
    except Exception as exc:  # any failure to load means: use the character estimate
        logger.warning("tiktoken o200k_base unavailable (%s); counting evidence tokens as ceil(chars/4)", exc)
        return None
    # Special-token text in a workspace is counted as ordinary text (the reference's encoder would raise).
    return lambda text: len(encoding.encode(text, disallowed_special=()))


def token_counter(model: str) -> Callable[[str], int]:
    """Token counter of the reference: tiktoken o200k_base for models named ``gpt-…`` (any case, surrounding spaces
    ignored), else max(1, ceil(chars / 4)); the estimate too where the o200k tables cannot be loaded."""
    if model.strip().lower().startswith("gpt-"):
        counter = _o200k_counter()
        if counter is not None:
            return counter
    return _chars_over_four


# -- caps and cut markers ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class EvidenceCaps:
    """Size caps of the excerpts of one bundle: characters per category, optional tokens per category."""

    report_chars: int = 28000
    json_chars: int = 24000
    code_chars: int = 12000
    report_tokens: int | None = None
    json_tokens: int | None = 50000
    code_tokens: int | None = 10000
    token_model: str = ""

    @classmethod
    def local(cls, token_model: str) -> EvidenceCaps:
        """In-loop defaults on a local server: no report token cap, JSON 50000 and code 10000 tokens."""
        return cls(token_model=token_model)

    @classmethod
    def remote(cls, token_model: str) -> EvidenceCaps:
        """OpenRouter caps of the reference (report 12000, JSON 6000, code 4000 tokens)."""
        return cls(report_tokens=12000, json_tokens=6000, code_tokens=4000, token_model=token_model)


@dataclass(frozen=True)
class CutMarkers:
    """Marker texts whose size enters a computation, as the templates write them."""

    token: str  # between head and tail of a token-capped excerpt; its tokens count against the cap
    appendix: str  # between head and tail of a capped appendix file; its characters count against the total

    @classmethod
    def of(cls, prompts: PromptSet | None = None) -> CutMarkers:
        """The markers of ``evidence.j2`` in `prompts` (default: the shipped templates)."""
        from mass_ops.prompts import shipped_prompts

        chosen = prompts or shipped_prompts()
        return cls(
            token=chosen.macro(EVIDENCE_TEMPLATE, "token_cut_marker")(),
            appendix=chosen.macro(EVIDENCE_TEMPLATE, "appendix_cut_marker")(),
        )


# A piece of a capped excerpt: ("text", text) of the file, or ("token_cut", start, stop), a slice of the token marker.
Segment = tuple[Any, ...]


def _length(segment: Segment) -> int:
    return len(segment[1]) if segment[0] == "text" else segment[2] - segment[1]


def _take(segments: Sequence[Segment], start: int, stop: int) -> list[Segment]:
    """Characters [start, stop) of the text the segments spell, as segments."""
    taken: list[Segment] = []
    position = 0
    for segment in segments:
        size = _length(segment)
        low, high = max(start - position, 0), min(stop - position, size)
        if low < high:
            if segment[0] == "text":
                taken.append(("text", segment[1][low:high]))
            else:
                taken.append(("token_cut", segment[1] + low, segment[1] + high))
        position += size
    return taken


def cut_tokens(text: str, max_tokens: int, count: Callable[[str], int], marker: str) -> tuple[list[Segment], bool]:
    """The reference's token cap: len/4 characters of head and of tail around `marker`, both shrunk ×0.7 (at most 24
    times) until the excerpt fits `max_tokens`, else 256 characters of each; the marker alone when it does not fit
    by itself. Returns the segments and whether anything was cut."""
    if max_tokens <= 0 or count(text) <= max_tokens:
        return [("text", text)], False
    cut: Segment = ("token_cut", 0, len(marker))
    if count(marker) >= max_tokens:
        return [cut], True
    keep = max(1, len(text) // 4)
    for _ in range(_TOKEN_SHRINK_ROUNDS):
        if count(text[:keep] + marker + text[-keep:]) <= max_tokens:
            return [("text", text[:keep]), cut, ("text", text[-keep:])], True
        keep = max(1, int(keep * _TOKEN_SHRINK))
    return [("text", text[:_TOKEN_LAST_RESORT]), cut, ("text", text[-_TOKEN_LAST_RESORT:])], True


def cut_chars(segments: Sequence[Segment], max_chars: int) -> tuple[list[Segment], int | None]:
    """The reference's character cap: max_chars // 2 characters of head and of tail (Python's ``text[-0:]`` quirk
    kept: a cap below 2 keeps the whole text as tail); returns the two pieces and the number of characters cut
    between them (None: nothing cut)."""
    total = sum(_length(segment) for segment in segments)
    if total <= max_chars:
        return list(segments), None
    half = max_chars // 2
    head = _take(segments, 0, half)
    tail = _take(segments, total - half if half > 0 else 0, total)
    omitted = total - sum(_length(s) for s in head) - sum(_length(s) for s in tail)
    return [*head, ("char_cut", omitted), *tail], omitted


def cap_excerpt(
    text: str, max_chars: int, max_tokens: int | None, count: Callable[[str], int], token_marker: str
) -> tuple[list[dict[str, Any]], bool]:
    """The token cap (when set) first, then the character cap (MASS_SPEC §5); the excerpt as template parts
    ({kind: text, text} | {kind: token_cut, start, stop} | {kind: char_cut, omitted}) and whether anything was cut."""
    segments: list[Segment] = [("text", text)]
    token_cut = False
    if max_tokens is not None:
        segments, token_cut = cut_tokens(text, max_tokens, count, token_marker)
    segments, omitted = cut_chars(segments, max_chars)
    return [_part(segment) for segment in segments], token_cut or omitted is not None


def _part(segment: Segment) -> dict[str, Any]:
    if segment[0] == "text":
        return {"kind": "text", "text": segment[1]}
    if segment[0] == "token_cut":
        return {"kind": "token_cut", "start": segment[1], "stop": segment[2]}
    return {"kind": "char_cut", "omitted": segment[1]}


def longest_backtick_run(*texts: str) -> int:
    """The longest run of backticks in any of `texts` (templates size their fences with it)."""
    return max((len(run) for text in texts for run in _BACKTICKS.findall(text)), default=0)


# -- reading -------------------------------------------------------------------------------------------------------


def _decode(data: bytes) -> str:
    """UTF-8 with replacement and newlines translated, as ``Path.read_text(errors="replace")`` reads."""
    return data.decode("utf-8", errors="replace").replace("\r\n", "\n").replace("\r", "\n")


def read_text(path: Path, max_chars: int) -> str | None:
    """The text of `path` (None when it is not a readable regular file): the whole file up to `WHOLE_READ_BYTES`;
    beyond, its first and last 4 × `max_chars` bytes, decoded and joined, so a cap of `max_chars` characters cuts
    it at the same places as the whole text (the token cap's shrink then starts from this text's length)."""
    window = 4 * max(max_chars, 1) + _SYNC_BYTES
    ends = read_capped(path, head=window, tail=window)
    if ends is None:
        return None
    if not ends.tail:  # the whole file fitted in the two windows
        return _decode(ends.head)
    if ends.size > WHOLE_READ_BYTES:
        return _decode(ends.head) + _decode(ends.tail)
    whole = read_capped(path, head=WHOLE_READ_BYTES)
    return None if whole is None else _decode(whole.head + whole.tail)


# -- directory tree ------------------------------------------------------------------------------------------------


def _suffix(name: str) -> str:
    """`PurePath.suffix` of a file name: from the last dot, unless the name starts or ends there."""
    dot = name.rfind(".")
    return name[dot:] if 0 < dot < len(name) - 1 else ""


def directory_tree(root: Path, name: str | None = None) -> dict[str, Any]:
    """The representative tree as the reference walks it: folders first then names ignoring case (ties in listing
    order), tool folders skipped, folders of more than 100 entries elided, at most 400 entries (elision lines not
    counted), entries up to depth 6 (deeper ones dropped without a mark). `name` is the root's label."""
    lines: list[dict[str, Any]] = []
    budget = TREE_MAX_ENTRIES
    truncated = False

    def walk(folder: Path, depth: int) -> None:
        nonlocal budget, truncated
        if budget <= 0:
            truncated = True
            return
        if depth > TREE_MAX_DEPTH or not folder.is_dir() or folder.name in SKIPPED_DIRS:
            return
        try:  # (is a folder, path), links followed; a stable sort keeps listing order among equal keys
            listed = [(child.is_dir(), child) for child in folder.iterdir()]
        except OSError:
            return
        children = sorted(
            ((is_dir, child) for is_dir, child in listed if not (is_dir and child.name in SKIPPED_DIRS)),
            key=lambda entry: (not entry[0], entry[1].name.lower()),
        )
        if len(children) > TREE_MAX_CHILDREN:
            lines.append({"depth": depth, "kind": "crowded", "name": "", "suffix": "", "count": len(children)})
            return
        for is_dir, child in children:
            if budget <= 0:
                truncated = True
                return
            budget -= 1
            if is_dir:
                lines.append({"depth": depth, "kind": "dir", "name": child.name, "suffix": "", "count": 0})
                walk(child, depth + 1)
            else:
                suffix = _suffix(child.name).lower()
                binary = suffix if suffix in BINARY_SUFFIXES else ""
                lines.append({"depth": depth, "kind": "file", "name": child.name, "suffix": binary, "count": 0})

    walk(root, 1)
    label = name or root.name or str(root)
    runs = longest_backtick_run(label, *(line["name"] for line in lines))
    return {"root": label, "lines": lines, "truncated": truncated, "child_limit": TREE_MAX_CHILDREN, "backticks": runs}


# -- preflight -----------------------------------------------------------------------------------------------------


def task_plot_paths(task_text: str) -> list[str]:
    """PNG paths the task names, sorted: every ``…deliverables/plots/X.png`` as written (any prefix kept), and every
    ``X.png`` name (bare or after ``deliverables/plots/``) as ``deliverables/plots/X.png``."""
    paths = {match.group(1) for match in _PLOT_PATH.finditer(task_text)}
    paths.update(f"deliverables/plots/{match.group(1)}" for match in _PLOT_NAME.finditer(task_text))
    return sorted(paths)


def preflight(root: Path, task_text: str) -> dict[str, Any]:
    """FOUND/MISSING of the required files (sorted by path) and of every plot the task names (the first 40 listed)."""
    core = [{"path": path, "found": (root / path).is_file()} for path in sorted(PREFLIGHT_FILES)]
    plots = [{"path": path, "found": (root / path).is_file()} for path in task_plot_paths(task_text)]
    return {
        "core": core,
        "plots": plots[:PREFLIGHT_MAX_PLOTS],
        "plot_count": len(plots),
        "plots_found": sum(1 for plot in plots if plot["found"]),
    }


# -- excerpts ------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Excerpt:
    """One capped file excerpt: template parts (`cap_excerpt`) and whether anything was cut."""

    path: str
    parts: tuple[dict[str, Any], ...]
    truncated: bool
    backticks: int = 0

    def variables(self) -> dict[str, Any]:
        return {"path": self.path, "parts": list(self.parts), "truncated": self.truncated, "backticks": self.backticks}


def excerpt_targets(root: Path, caps: EvidenceCaps) -> list[tuple[str, int, int | None]]:
    """(relative path, character cap, token cap) of every file to excerpt, in the reference's order: the five key
    files, up to 4 entry scripts at the root (sorted), then the first ``tests/test_*.py`` if it is a file (a first
    match that is a folder means no test excerpt)."""
    targets: list[tuple[str, int, int | None]] = [
        (path, caps.json_chars, caps.json_tokens)
        if category == "json"
        else (path, caps.report_chars, caps.report_tokens)
        for path, category in EXCERPT_FILES
    ]
    try:
        names = os.listdir(root)
    except OSError:
        names = []
    scripts = sorted({n for n in names if ENTRY_SCRIPT_PATTERN.fullmatch(n) and (root / n).is_file()})
    targets += [(name, caps.code_chars, caps.code_tokens) for name in scripts[:MAX_ENTRY_SCRIPTS]]
    tests = root / "tests"
    if tests.is_dir():
        try:
            matches = sorted(n for n in os.listdir(tests) if TEST_FILE_PATTERN.fullmatch(n))
        except OSError:
            matches = []
        if matches:
            tokens = None if caps.code_tokens is None else min(TEST_FILE_CAP, caps.code_tokens)
            targets.append((f"tests/{matches[0]}", min(TEST_FILE_CAP, caps.code_chars), tokens))
    return targets


def file_excerpts(root: Path, caps: EvidenceCaps, markers: CutMarkers | None = None) -> list[Excerpt]:
    """Capped excerpts of the files `excerpt_targets` names that exist as regular files."""
    token_marker = (markers or CutMarkers.of()).token
    count = token_counter(caps.token_model)
    excerpts = []
    for relative, max_chars, max_tokens in excerpt_targets(root, caps):
        path = root / relative
        if not path.is_file():
            continue
        text = read_text(path, max_chars)
        if text is None:
            continue
        parts, cut = cap_excerpt(text, max_chars, max_tokens, count, token_marker)
        excerpts.append(Excerpt(relative, tuple(parts), cut, longest_backtick_run(_shown(parts, token_marker))))
    return excerpts


def _shown(parts: Sequence[dict[str, Any]], token_marker: str) -> str:
    """The excerpt's text as far as Python knows it (a character cut's marker, the template's alone, as a newline)."""
    pieces = []
    for part in parts:
        if part["kind"] == "text":
            pieces.append(part["text"])
        elif part["kind"] == "token_cut":
            pieces.append(token_marker[part["start"] : part["stop"]])
        else:
            pieces.append("\n")
    return "".join(pieces)


# -- bundles -------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class EvidenceBundle:
    """The evidence of one workspace for one task, as raw data for ``evidence.j2`` (`variables`).

    `refused` says why the workspace could not be unpacked within the platform's archive limits (None: it was); a
    judge never sees such a bundle, the pair's outcome follows from the refusal (`PairwiseJudge.judge`)."""

    task_id: int
    query_id: str
    location: str
    tree: dict[str, Any] = field(default_factory=dict)
    preflight: dict[str, Any] = field(default_factory=dict)
    excerpts: tuple[Excerpt, ...] = ()
    refused: str | None = None

    def variables(self) -> dict[str, Any]:
        """The bundle as the ``evidence`` macro receives it (plain dicts, lists, strings, numbers)."""
        return {
            "task_id": self.task_id,
            "query_id": self.query_id,
            "location": self.location,
            "refused": self.refused,
            "tree": self.tree,
            "preflight": self.preflight,
            "excerpts": [excerpt.variables() for excerpt in self.excerpts],
        }

    def render(self, heading: str, *, prompts: PromptSet | None = None) -> str:
        """The ``evidence`` macro of ``evidence.j2`` over this bundle under `heading` (a convenience: prompt
        templates call the macro themselves)."""
        from mass_ops.prompts import shipped_prompts

        return (prompts or shipped_prompts()).macro(EVIDENCE_TEMPLATE, "evidence")(self.variables(), heading)


def build_bundle(
    root: Path,
    *,
    task_id: int,
    task_text: str,
    location: str,
    caps: EvidenceCaps,
    name: str | None = None,
    prompts: PromptSet | None = None,
) -> EvidenceBundle:
    """Bundle the workspace at `root`; `location` is how the prompt names it (e.g. the workspace artifact URI),
    `name` the root of its tree (default: the folder name), `prompts` the templates whose cut markers apply."""
    if not root.is_dir():
        raise EvidenceError(f"task {task_id}: workspace {root} is not a folder")
    return EvidenceBundle(
        task_id=task_id,
        query_id=f"query_{task_id}",
        location=location,
        tree=directory_tree(root, name),
        preflight=preflight(root, task_text),
        excerpts=tuple(file_excerpts(root, caps, CutMarkers.of(prompts))),
    )


def refused_bundle(bundle: EvidenceBundle, reason: str) -> EvidenceBundle:
    """`bundle` (built from an empty folder, so it names the task and location) marked as refused for `reason`."""
    return replace(bundle, refused=reason)


# -- the optimizer's results/ appendix ------------------------------------------------------------------------------


@dataclass(frozen=True)
class AppendixFile:
    """One JSON file of the appendix: its text, or head and tail around the per-file cut."""

    path: str
    head: str
    tail: str
    truncated: bool
    unreadable: bool = False

    def variables(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "head": self.head,
            "tail": self.tail,
            "truncated": self.truncated,
            "unreadable": self.unreadable,
            "backticks": longest_backtick_run(self.head, self.tail),
        }


@dataclass(frozen=True)
class ResultsAppendix:
    """The ``results/**/*.json`` files shown to the optimizer, those omitted by the total cap, and the caps."""

    results_dir: bool
    files: tuple[AppendixFile, ...]
    omitted: tuple[tuple[str, int], ...]  # (path, characters it would have taken)
    per_file_chars: int
    total_chars: int

    def variables(self) -> dict[str, Any]:
        """The appendix as the ``results_appendix`` macro receives it."""
        return {
            "results_dir": self.results_dir,
            "files": [file.variables() for file in self.files],
            "omitted": [{"path": path, "chars": chars} for path, chars in self.omitted],
            "per_file_chars": self.per_file_chars,
            "total_chars": self.total_chars,
        }

    def render(self, *, prompts: PromptSet | None = None) -> str:
        """The ``results_appendix`` macro of ``evidence.j2`` over this appendix (a convenience)."""
        from mass_ops.prompts import shipped_prompts

        return (prompts or shipped_prompts()).macro(EVIDENCE_TEMPLATE, "results_appendix")(self.variables())


def appendix_excluded(task_id: int, name: str) -> bool:
    """Whether the appendix of task `task_id` leaves out files named `name` (globally or for that task)."""
    return name in APPENDIX_EXCLUDED_NAMES or name in APPENDIX_EXCLUDED_BY_TASK.get(task_id, frozenset())


def _appendix_file(root: Path, path: Path, per_file_chars: int, marker: str) -> tuple[AppendixFile, int]:
    """The file as the appendix shows it and the characters it takes (the marker's included): whole when it has at
    most `per_file_chars` characters, else per_file_chars // 2 from the head and the rest from the tail. Read only
    as far as that needs: beyond 4 bytes a character the file is longer than the cap whatever it holds."""
    relative = path.relative_to(root).as_posix()
    window = 4 * per_file_chars + _SYNC_BYTES
    read = read_capped(path, head=window, tail=window)
    if read is None:
        return AppendixFile(relative, "", "", truncated=False, unreadable=True), 0
    half = per_file_chars // 2
    if not read.tail:  # the whole file
        text = _decode(read.head)
        if len(text) <= per_file_chars:
            return AppendixFile(relative, text, "", truncated=False), len(text)
        head, tail = text[:half], text[len(text) - (per_file_chars - half) :]
    else:
        tail_text = _decode(read.tail)
        head, tail = _decode(read.head)[:half], tail_text[len(tail_text) - (per_file_chars - half) :]
    return AppendixFile(relative, head, tail, truncated=True), len(head) + len(marker) + len(tail)


def results_json_appendix(
    root: Path,
    task_id: int,
    *,
    per_file_chars: int = 24000,
    total_chars: int = 120000,
    prompts: PromptSet | None = None,
) -> ResultsAppendix:
    """Every ``results/**/*.json`` file (sorted by path components, excluded names left out), each capped at
    `per_file_chars`, in order until `total_chars`: a file that would overflow the total is omitted (and listed)
    while later smaller files may still fit. `prompts`: the templates whose appendix marker counts."""
    results = root / "results"
    if not results.is_dir():
        return ResultsAppendix(False, (), (), per_file_chars, total_chars)
    marker = CutMarkers.of(prompts).appendix
    paths = sorted(p for p in results.rglob("*.json") if p.is_file())
    files: list[AppendixFile] = []
    omitted: list[tuple[str, int]] = []
    used = 0
    for path in paths:
        if appendix_excluded(task_id, path.name):
            continue
        shown, size = _appendix_file(root, path, per_file_chars, marker)
        if used + size > total_chars:
            omitted.append((shown.path, size))
            continue
        used += size
        files.append(shown)
    return ResultsAppendix(True, tuple(files), tuple(omitted), per_file_chars, total_chars)
