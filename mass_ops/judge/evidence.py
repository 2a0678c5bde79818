"""Evidence bundles: what a judge or the optimizer sees of one workspace (MASS_SPEC §5, §3.3 step B).

A bundle is text: a representative directory tree, a programmatic preflight of the required deliverables and of the
plots the task names, and size-capped excerpts of the key files. Caps apply optionally in tokens, then in characters
(head and tail kept, the middle replaced by a marker); requirements.txt takes the report's caps. The optimizer
additionally gets an appendix with the JSON files under ``results/``.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from mass_ops.errors import InputError
from mass_ops.store.untrusted import read_capped

logger = logging.getLogger(__name__)

SKIPPED_DIRS = frozenset({".git", "__pycache__", ".pytest_cache", ".mypy_cache", "node_modules", ".venv", "venv"})
BINARY_SUFFIXES = frozenset(
    {
        "parquet", "pq", "npy", "npz", "pkl", "pickle", "pt", "pth", "onnx", "bin", "h5", "hdf5", "feather",
        "arrow", "png", "jpg", "jpeg", "gif", "webp", "pdf", "zip", "tar", "gz",
    }
)  # fmt: skip
TREE_MAX_ENTRIES = 400
TREE_MAX_DEPTH = 6
TREE_MAX_CHILDREN = 100
PREFLIGHT_FILES = ("research_report.md", "deliverables/index.json", "results/metrics.json", "requirements.txt")
PREFLIGHT_MAX_PLOTS = 40
ENTRY_SCRIPT_NAMES = ("main.py", "pipeline.py")
MAX_ENTRY_SCRIPTS = 4
TEST_FILE_CHAR_CAP = 8000
# Token caps shrink the kept characters by this factor until the excerpt fits, at most this many times.
_TOKEN_SHRINK = 0.7
_TOKEN_SHRINK_ROUNDS = 24

# Files the optimizer's results/ appendix never includes: raw dumps, and per-task files known to be huge.
APPENDIX_EXCLUDED_NAMES = frozenset({"raw_records.json", "pilot_raw_records.json"})
APPENDIX_EXCLUDED_BY_TASK: dict[int, tuple[str, ...]] = {
    202: (
        "curve_data.json",
        "distances_angles_predictions.json",
        "distances_only_predictions.json",
        *(f"run_{family}_family_s{seed}.json" for family in ("B0", "B1", "M1", "M2", "M3") for seed in range(3)),
    ),
    207: ("esmfold_plddts.json",),
}
_APPENDIX_EXCLUDED_PATTERNS: dict[int, re.Pattern[str]] = {202: re.compile(r"^run_.*_random_s0\.json$")}
APPENDIX_TRUNCATION_MARKER = "[truncated: middle omitted]"

_PNG_PATH = re.compile(r"(?:[\w.-]+/)*[\w.-]+\.png", re.IGNORECASE)


class EvidenceError(InputError):
    """A workspace cannot be turned into evidence (missing folder, bundles of different tasks)."""


# -- token counting ------------------------------------------------------------------------------------------------


def _chars_over_four(text: str) -> int:
    return math.ceil(len(text) / 4)


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
    return lambda text: len(encoding.encode(text, disallowed_special=()))


def token_counter(model: str) -> Callable[[str], int]:
    """Token counter of the reference: tiktoken o200k_base for models named ``gpt-…``, else ceil(chars / 4).

    Where the o200k tables cannot be loaded (offline machines) the character estimate is used instead.
    """
    if model.startswith("gpt-"):
        counter = _o200k_counter()
        if counter is not None:
            return counter
    return _chars_over_four


# -- caps ----------------------------------------------------------------------------------------------------------


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


def cap_chars(text: str, max_chars: int) -> tuple[str, bool]:
    """Keep half of `max_chars` from the head and half from the tail, with a marker naming what was omitted."""
    if len(text) <= max_chars:
        return text, False
    head = max_chars // 2
    tail = max_chars - head
    omitted = len(text) - head - tail
    return f"{text[:head]}\n\n[... {omitted} characters omitted ...]\n\n{text[len(text) - tail :]}", True


def cap_tokens(text: str, max_tokens: int, count: Callable[[str], int]) -> tuple[str, bool]:
    """Shrink head+tail excerpts by ×0.7 (at most 24 times), starting at 4 characters per token, until they fit."""
    if count(text) <= max_tokens:
        return text, False
    keep = max_tokens * 4
    candidate = text
    for _ in range(_TOKEN_SHRINK_ROUNDS):
        candidate, _ = cap_chars(text, keep)
        if count(candidate) <= max_tokens:
            break
        keep = int(keep * _TOKEN_SHRINK)
    return candidate, True


def cap_excerpt(text: str, max_chars: int, max_tokens: int | None, token_model: str) -> tuple[str, bool]:
    """The optional token cap first, then the character cap (the reference's order, MASS_SPEC §5); returns the
    excerpt and whether anything was cut."""
    capped, cut = text, False
    if max_tokens is not None:
        capped, cut = cap_tokens(capped, max_tokens, token_counter(token_model))
    capped, char_cut = cap_chars(capped, max_chars)
    return capped, cut or char_cut


# -- directory tree ------------------------------------------------------------------------------------------------


def _suffix(name: str) -> str:
    return name.rsplit(".", 1)[-1].lower() if "." in name else ""


def directory_tree(root: Path, name: str | None = None) -> str:
    """Representative tree: root name (`name` when given), then entries indented two spaces per level, folders first,
    names sorted case-insensitively. Skips tool folders, tags binaries, elides crowded folders, stops at 400
    entries or depth 6."""
    lines = [name or root.name or str(root)]
    truncated = False

    def walk(folder: Path, depth: int) -> None:
        nonlocal truncated
        try:
            entries = [entry for entry in os.scandir(folder) if entry.name not in SKIPPED_DIRS]
        except OSError:
            return
        indent = "  " * depth
        if len(entries) > TREE_MAX_CHILDREN:
            lines.append(f"{indent}... ({len(entries)} entries omitted)")
            return
        entries.sort(key=lambda e: (not e.is_dir(follow_symlinks=False), e.name.lower(), e.name))
        for entry in entries:
            if len(lines) - 1 >= TREE_MAX_ENTRIES:
                truncated = True
                return
            is_dir = entry.is_dir(follow_symlinks=False)
            if is_dir:
                lines.append(f"{indent}{entry.name}/")
                if depth < TREE_MAX_DEPTH:
                    walk(Path(entry.path), depth + 1)
                else:
                    truncated = True
            elif _suffix(entry.name) in BINARY_SUFFIXES:
                lines.append(f"{indent}{entry.name} [.{_suffix(entry.name)} binary/large]")
            else:
                lines.append(f"{indent}{entry.name}")

    walk(root, 1)
    if truncated:
        lines.append("... (tree truncated)")
    return "\n".join(lines)


# -- preflight -----------------------------------------------------------------------------------------------------


def task_plot_paths(task_text: str) -> list[str]:
    """PNG deliverables named by the task: ``…deliverables/plots/X.png`` as such, a bare ``X.png`` mapped into
    ``deliverables/plots/``; other relative paths kept. First mention first, at most 40."""
    found: list[str] = []
    for match in _PNG_PATH.finditer(task_text):
        path = match.group(0)
        marker = path.find("deliverables/plots/")
        if marker >= 0:
            path = path[marker:]
        elif "/" not in path:
            path = f"deliverables/plots/{path}"
        if path not in found:
            found.append(path)
        if len(found) == PREFLIGHT_MAX_PLOTS:
            break
    return found


def preflight(root: Path, task_text: str) -> str:
    """FOUND/MISSING for the required deliverables and ok/missing for each plot the task names."""
    lines = ["## Programmatic preflight"]
    for relative in PREFLIGHT_FILES:
        state = "FOUND" if (root / relative).is_file() else "MISSING"
        lines.append(f"- {relative}: {state}")
    plots = task_plot_paths(task_text)
    if plots:
        present = sum(1 for plot in plots if (root / plot).is_file())
        lines.append(f"- plots named by the task: {present}/{len(plots)} present")
        lines.extend(f"  - {plot}: {'ok' if (root / plot).is_file() else 'missing'}" for plot in plots)
    return "\n".join(lines)


# -- excerpts ------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Excerpt:
    """One size-capped file excerpt."""

    path: str
    text: str
    truncated: bool
    language: str


def _excerpt_targets(root: Path) -> list[tuple[str, str]]:
    """(relative path, category) of the files excerpted, in the reference order."""
    targets = [
        ("research_report.md", "report"),
        ("deliverables/index.json", "json"),
        ("results/metrics.json", "json"),
        ("results/model_comparison.json", "json"),
        # The reference caps requirements.txt like the report (28000 characters), not like code.
        ("requirements.txt", "requirements"),
    ]
    try:
        root_files = sorted(entry.name for entry in os.scandir(root) if entry.is_file(follow_symlinks=False))
    except OSError:
        root_files = []
    scripts = [n for n in root_files if (n.startswith("run_") and n.endswith(".py")) or n in ENTRY_SCRIPT_NAMES]
    targets += [(name, "code") for name in scripts[:MAX_ENTRY_SCRIPTS]]
    tests_dir = root / "tests"
    if tests_dir.is_dir():
        tests = sorted(p.name for p in tests_dir.iterdir() if p.is_file() and re.fullmatch(r"test_.*\.py", p.name))
        if tests:
            targets.append((f"tests/{tests[0]}", "test"))
    return targets


def _read_text(path: Path, max_chars: int) -> str | None:
    """The text of `path` as far as an excerpt of `max_chars` characters can show it, read within a bounded number
    of bytes whatever the file's size (None when it cannot be opened as a regular file).

    A file of at most `excerpt_read_bytes(max_chars)` bytes is read whole; a larger one only its head and its tail,
    each as many bytes as half the excerpt can hold in UTF-8 (4 bytes a character), joined by a marker naming the
    bytes not read — so the head-and-tail excerpt cut from it is the one the whole file would give."""
    side = excerpt_read_bytes(max_chars) // 2
    read = read_capped(path, head=side, tail=side)
    if read is None:
        return None
    head = read.head.decode("utf-8", errors="replace")
    if not read.omitted:
        return head + read.tail.decode("utf-8", errors="replace")
    tail = read.tail.decode("utf-8", errors="replace")
    return f"{head}\n\n[... {read.omitted} bytes not read ...]\n\n{tail}"


def excerpt_read_bytes(max_chars: int) -> int:
    """The most bytes read of one file for an excerpt of `max_chars` characters: 4 bytes per character (UTF-8's
    widest) on each of the head and the tail, so the excerpt never lacks text it would have shown."""
    return 8 * max(max_chars, 1)


def file_excerpts(root: Path, caps: EvidenceCaps) -> list[Excerpt]:
    """Capped excerpts of the report, the JSON deliverables, requirements, entry scripts and the first test file."""
    excerpts = []
    for relative, category in _excerpt_targets(root):
        path = root / relative
        if not path.is_file():
            continue
        if category == "report":
            limits = (caps.report_chars, caps.report_tokens, "markdown")
        elif category == "requirements":
            limits = (caps.report_chars, caps.report_tokens, "text")
        elif category == "json":
            limits = (caps.json_chars, caps.json_tokens, "json")
        elif category == "test":
            limits = (min(TEST_FILE_CHAR_CAP, caps.code_chars), caps.code_tokens, "python")
        else:
            limits = (caps.code_chars, caps.code_tokens, "python" if relative.endswith(".py") else "text")
        max_chars, max_tokens, language = limits
        text = _read_text(path, max_chars)  # read within a bound, whatever the file's size
        if text is None:
            continue
        capped, cut = cap_excerpt(text, max_chars, max_tokens, caps.token_model)
        excerpts.append(Excerpt(path=relative, text=capped, truncated=cut, language=language))
    return excerpts


def _fence(text: str, language: str = "") -> str:
    # A fence longer than any backtick run inside keeps excerpts of Markdown files from closing it early.
    longest = max((len(run) for run in re.findall(r"`+", text)), default=0)
    ticks = "`" * max(3, longest + 1)
    return f"{ticks}{language}\n{text.rstrip()}\n{ticks}"


# -- bundles -------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class EvidenceBundle:
    """The evidence of one workspace for one task; `body` is rendered under a heading chosen by the prompt.

    `refused` says why the workspace could not be unpacked within the platform's archive limits (None: it was); a
    judge never sees such a bundle, the pair's outcome follows from the refusal (`PairwiseJudge.judge`)."""

    task_id: int
    query_id: str
    location: str
    body: str
    refused: str | None = None

    def render(self, heading: str) -> str:
        return f"# {heading} (evidence only)\nPath: `{self.location}`\n\n{self.body}"


def build_bundle(
    root: Path,
    *,
    task_id: int,
    task_text: str,
    location: str,
    caps: EvidenceCaps,
    name: str | None = None,
) -> EvidenceBundle:
    """Bundle the workspace at `root`; `location` is how the prompt names it (e.g. the workspace artifact URI) and
    `name` the root of its tree (default: the folder name)."""
    if not root.is_dir():
        raise EvidenceError(f"task {task_id}: workspace {root} is not a folder")
    parts = [
        "## Directory tree (representative)",
        _fence(directory_tree(root, name), "text"),
        "",
        preflight(root, task_text),
        "",
        "# File excerpts (size-capped; binaries omitted)",
    ]
    excerpts = file_excerpts(root, caps)
    if not excerpts:
        parts.append("(none of the key files exist)")
    for excerpt in excerpts:
        marker = " [truncated]" if excerpt.truncated else ""
        parts += [f"### File: `{excerpt.path}`{marker}", _fence(excerpt.text, excerpt.language), ""]
    return EvidenceBundle(task_id=task_id, query_id=f"query_{task_id}", location=location, body="\n".join(parts))


def refused_bundle(bundle: EvidenceBundle, reason: str) -> EvidenceBundle:
    """`bundle` (built from an empty folder, so it names the task and location) marked as refused for `reason`."""
    body = f"The workspace was not unpacked: {reason}"
    return EvidenceBundle(bundle.task_id, bundle.query_id, bundle.location, body, refused=reason)


# -- the optimizer's results/ appendix ------------------------------------------------------------------------------


def _appendix_excluded(task_id: int, name: str) -> bool:
    if name in APPENDIX_EXCLUDED_NAMES or name in APPENDIX_EXCLUDED_BY_TASK.get(task_id, ()):
        return True
    pattern = _APPENDIX_EXCLUDED_PATTERNS.get(task_id)
    return bool(pattern and pattern.match(name))


def results_json_appendix(root: Path, task_id: int, *, per_file_chars: int = 24000, total_chars: int = 120000) -> str:
    """Every ``results/**/*.json`` (sorted, known huge files excluded), each capped at `per_file_chars` (head half +
    marker + tail half), until `total_chars`; files that would overflow the total are listed as omitted, while later
    smaller files may still fit."""
    results = root / "results"
    files = (
        sorted(p.relative_to(root).as_posix() for p in results.rglob("*.json") if p.is_file())
        if results.is_dir()
        else []
    )
    files = [f for f in files if not _appendix_excluded(task_id, f.rsplit("/", 1)[-1])]
    lines = ["# Full JSON artifacts under results/"]
    if not files:
        lines.append("(no JSON files under results/)")
        return "\n".join(lines)
    used = 0
    omitted: list[str] = []
    for relative in files:
        text = _read_text(root / relative, per_file_chars) or ""
        if len(text) > per_file_chars:
            half = per_file_chars // 2
            text = f"{text[:half]}\n{APPENDIX_TRUNCATION_MARKER}\n{text[len(text) - half :]}"
        if used + len(text) > total_chars:
            omitted.append(f"{relative} ({len(text)} chars)")
            continue
        used += len(text)
        lines += [f"## `{relative}`", _fence(text, "json")]
    if omitted:
        lines.append(f"Omitted (total cap of {total_chars} characters reached): " + ", ".join(omitted))
    return "\n".join(lines)
