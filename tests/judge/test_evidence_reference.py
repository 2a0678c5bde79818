"""Evidence and the results/ appendix against an independent transcription of the reference's computations.

The transcription below is written from MASS_SPEC §5 / §3.3 step B and the reference release's evaluation/artifacts.py,
evaluation/bundle.py and the appendix builder of iterate_multi_agent_prompt.py; it imports nothing of
`mass_ops.judge.evidence` but its public entry points, and reads files the reference's way (``Path.read_text``). It
renders its results in the layout of the shipped ``evidence.j2``, so each case compares the whole rendered text.
Seeded random workspaces (trees, names, binaries, deep and crowded folders, CRLF and invalid UTF-8, backtick runs,
task texts naming plots) and random results/ trees run with small caps so that every cut triggers.
"""

from __future__ import annotations

import math
import os
import random
import re
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from mass_ops.judge import evidence
from mass_ops.judge.evidence import EvidenceCaps, build_bundle, results_json_appendix
from mass_ops.prompts import PromptSet, PromptTemplate, shipped_prompts

WORKSPACES, VARIANTS = 250, 4  # 1,000 random inputs per comparison
SKIP = {".git", "__pycache__", ".pytest_cache", ".mypy_cache", "node_modules", ".venv", "venv"}
BINARY = (".parquet", ".pq", ".npy", ".npz", ".pkl", ".pickle", ".pt", ".pth", ".onnx", ".bin", ".h5", ".hdf5",
          ".feather", ".arrow", ".png", ".jpg", ".jpeg", ".gif", ".webp", ".pdf", ".zip", ".tar", ".gz")  # fmt: skip
TOKEN_MARK = "\n\n[... cut here to fit the token cap ...]\n\n"  # the shipped template's markers
APPENDIX_MARK = "\n[truncated: middle omitted]\n"


def char_mark(omitted: int) -> str:
    return f"\n\n[... {omitted} characters omitted ...]\n\n"


def fake_bpe(text: str) -> int:
    """A stand-in for o200k (unavailable offline): words, digit pairs and single symbols are tokens."""
    return len(re.findall(r"[A-Za-z]+|\d{1,2}|\s+|[^\sA-Za-z\d]", text))


# -- the transcription -------------------------------------------------------------------------------------------


def ref_counter(model: str) -> Callable[[str], int]:
    if model.strip().lower().startswith("gpt-"):
        return fake_bpe
    return lambda s: max(1, math.ceil(len(s) / 4))


def ref_token_budget(text: str, max_tokens: int, count: Callable[[str], int], mark: str) -> tuple[str, bool]:
    if max_tokens <= 0 or count(text) <= max_tokens:
        return text, False
    if count(mark) >= max_tokens:
        return mark, True
    head = tail = max(1, len(text) // 4)
    for _ in range(24):
        candidate = text[:head] + mark + text[-tail:]
        if count(candidate) <= max_tokens:
            return candidate, True
        head, tail = max(1, int(head * 0.7)), max(1, int(tail * 0.7))
    return text[:256] + mark + text[-256:], True


def ref_read(root: Path, rel: str, chars: int, tokens: int | None, count: Callable[[str], int], mark: str):
    path = root / rel
    if not path.is_file():
        return None
    text = path.read_text(encoding="utf-8", errors="replace")
    cut = False
    if tokens is not None:
        text, cut = ref_token_budget(text, tokens, count, mark)
    if len(text) > chars:
        half = chars // 2
        head, tail = text[:half], text[-half:]
        text, cut = head + char_mark(len(text) - len(head) - len(tail)) + tail, True
    return rel, cut, text


def ref_tree(root: Path, label: str) -> str:
    lines: list[str] = []
    left, cut = [400], [False]

    def walk(cur: Path, depth: int) -> None:
        if left[0] <= 0:
            cut[0] = True
            return
        if depth > 6 or not cur.is_dir() or cur.name in SKIP:
            return
        subs = sorted(
            (p for p in cur.iterdir() if not (p.is_dir() and p.name in SKIP)),
            key=lambda p: (not p.is_dir(), p.name.lower()),
        )
        if len(subs) > 100:
            lines.append("  " * depth + f"... ({len(subs)} entries omitted)")
            return
        for p in subs:
            if left[0] <= 0:
                cut[0] = True
                return
            if p.is_dir():
                lines.append("  " * depth + p.name + "/")
                left[0] -= 1
                walk(p, depth + 1)
            else:
                suffix = p.suffix.lower()
                lines.append("  " * depth + p.name + (f"  [{suffix} binary/large]" if suffix in BINARY else ""))
                left[0] -= 1

    walk(root, 1)
    return "\n".join([label, *lines, *(["... (tree truncated)"] if cut[0] else [])])


def ref_plots(query: str) -> list[str]:
    paths = {m.group(1) for m in re.finditer(r"([\w./\\-]+deliverables/plots/[\w.-]+\.png)", query, re.IGNORECASE)}
    for m in re.finditer(r"(?:deliverables/plots/|\b)([a-z0-9_-]+\.png)\b", query, re.IGNORECASE):
        paths.add(f"deliverables/plots/{m.group(1)}")
    return sorted(paths)


def ref_reads(root: Path, caps: EvidenceCaps, mark: str) -> list[tuple[str, bool, str]]:
    count = ref_counter(caps.token_model)
    out = []
    for rel in (
        "research_report.md",
        "deliverables/index.json",
        "results/metrics.json",
        "results/model_comparison.json",
    ):
        js = rel.endswith(".json")
        out.append(
            ref_read(
                root,
                rel,
                caps.json_chars if js else caps.report_chars,
                caps.json_tokens if js else caps.report_tokens,
                count,
                mark,
            )
        )
    out.append(ref_read(root, "requirements.txt", caps.report_chars, caps.report_tokens, count, mark))
    scripts = sorted(
        {str(p.relative_to(root)) for g in ("run_*.py", "main.py", "pipeline.py") for p in root.glob(g) if p.is_file()}
    )
    out += [ref_read(root, rel, caps.code_chars, caps.code_tokens, count, mark) for rel in scripts[:4]]
    if (root / "tests").is_dir():
        for p in sorted((root / "tests").glob("test_*.py")):
            tokens = None if caps.code_tokens is None else min(8000, caps.code_tokens)
            out.append(ref_read(root, str(p.relative_to(root)), min(8000, caps.code_chars), tokens, count, mark))
            break
    return [read for read in out if read]


def fence(text: str) -> str:
    return "`" * max(3, max((len(r) for r in re.findall(r"`+", text)), default=0) + 1)


def ref_evidence(root: Path, label: str, query: str, caps: EvidenceCaps, mark: str = TOKEN_MARK) -> str:
    """The reference's computation in the shipped template's layout and wording."""
    tree = ref_tree(root, label)
    out = ["# Workspace A (evidence only)", "Path: `loc`", "", "## Directory tree (representative)", fence(tree), tree]
    out += [fence(tree), "", "## Programmatic preflight"]
    core = ("research_report.md", "deliverables/index.json", "results/metrics.json", "requirements.txt")
    out += [f"- {k}: {'FOUND' if (root / k).is_file() else 'MISSING'}" for k in sorted(core)]
    plots = ref_plots(query)
    if plots:
        found = [p for p in plots if (root / p).is_file()]
        out.append(f"- plots named by the task: {len(found)}/{len(plots)} present")
        out += [f"  - {p}: {'ok' if p in found else 'missing'}" for p in plots[:40]]
        if len(plots) > 40:
            out.append(f"  - ({len(plots) - 40} more not listed)")
    out += ["", "# File excerpts (size-capped; binaries omitted)"]
    reads = ref_reads(root, caps, mark)
    if not reads:
        return "\n".join([*out, "(none of the key files exist)"])
    blocks = [
        f"### File: `{rel}`{' [truncated]' if cut else ''}\n{fence(t)}\n{t.rstrip()}\n{fence(t)}\n"
        for rel, cut, t in reads
    ]
    return "\n".join(out) + "\n" + "\n".join(blocks)


def ref_appendix(root: Path, task: int, per_file: int, total: int, mark: str = APPENDIX_MARK) -> str:
    excluded = {"raw_records.json", "pilot_raw_records.json"} | {
        57: {"data_quality_issues.json"},
        202: {"curve_data.json", "distances_angles_predictions.json", "distances_only_predictions.json"}
        | {
            f"run_{f}_{k}.json"
            for f in ("B0", "B1", "M1", "M2", "M3")
            for k in ("family_s0", "family_s1", "family_s2", "random_s0")
        },
        207: {"esmfold_plddts.json"},
        220: {"invariant_baseline_test_results.json", "se3_gvp_small_test_results.json", "se3_gvp_test_results.json"},
    }.get(task, set())
    out = ["# Full JSON artifacts under results/"]
    results = root / "results"
    paths = (
        [p for p in sorted(q for q in results.rglob("*.json") if q.is_file()) if p.name not in excluded]
        if results.is_dir()
        else []
    )
    used, omitted = 0, []
    for path in paths:
        body = path.read_text(encoding="utf-8", errors="replace")
        if len(body) > per_file:
            half = per_file // 2
            body = body[:half] + mark + body[len(body) - (per_file - half) :]
        if used + len(body) > total:
            omitted.append(f"{path.relative_to(root)} ({len(body)} chars)")
            continue
        used += len(body)
        out += [f"## `{path.relative_to(root)}`", fence(body), body.rstrip(), fence(body)]
    if not paths:
        out.append("(no JSON files under results/)")
    if omitted:
        out.append(f"Omitted (total cap of {total} characters reached): " + ", ".join(omitted))
    return "\n".join(out)


# -- random inputs ------------------------------------------------------------------------------------------------


def _pool() -> str:
    rng = random.Random(0)
    pieces = ["word ", "```", "`", "\r\n", "\r", "\n", "é", "€", "𝄞", '{"k": 1}', "12345", "  "]
    return "".join(rng.choice(pieces) if rng.random() < 0.3 else chr(rng.randint(32, 126)) for _ in range(20000))


POOL = _pool()


def random_text(rng: random.Random, size: int) -> bytes:
    start = rng.randrange(len(POOL) - size)
    raw = POOL[start : start + size].encode()
    if rng.random() < 0.2:  # invalid UTF-8 somewhere
        at = rng.randint(0, len(raw))
        raw = raw[:at] + bytes(rng.choice([[0xFF], [0xE2, 0x82], [0x80, 0x80], [0xC3]])) + raw[at:]
    return raw


NAMES = ["a", "B", "data", "Data", "x-y", "x.y", "r e", "z_9", "run_all.py", "main.py", ".png", "foo.", "m.tar.gz",
         "p.PNG", "w.npy", "notes.md", "venv", ".git", "node_modules", "a.b.c", "Ω", "`tick`"]  # fmt: skip


def random_workspace(rng: random.Random, root: Path) -> None:
    """A random workspace under `root`."""
    root.mkdir(parents=True)

    def fill(folder: Path, depth: int) -> None:
        for _ in range(rng.randint(0, 4 if depth < 2 else 2)):
            name = rng.choice(NAMES) + (str(rng.randint(0, 3)) if rng.random() < 0.5 else "")
            target = folder / name
            if target.exists():
                continue
            if rng.random() < 0.3 and depth < 4:
                target.mkdir()
                fill(target, depth + 1)
            else:
                target.write_bytes(random_text(rng, rng.randint(0, 40)))

    fill(root, 1)
    if rng.random() < 0.15:  # deeper than the tree shows
        (root / "/".join(f"d{i}" for i in range(rng.randint(5, 8)))).mkdir(parents=True)
    if rng.random() < 0.05:
        (root / "wide").mkdir()
        for i in range(rng.choice([100, 101, 130])):
            (root / "wide" / f"f{i}.txt").write_bytes(b"")
    if rng.random() < 0.03:  # past 400 entries, with a crowded folder among them (its line is not counted)
        (root / "crowded").mkdir()
        for i in range(101):
            (root / "crowded" / f"c{i}").write_bytes(b"")
        for group in range(5):
            (root / f"g{group}").mkdir()
            for i in range(rng.randint(75, 95)):
                (root / f"g{group}" / f"z{i:02d}.bin").write_bytes(b"")
    keys = ["research_report.md", "deliverables/index.json", "results/metrics.json", "results/model_comparison.json",
            "requirements.txt", "run_a.py", "run_b.py", "run_.py", "RUN_c.py", "pipeline.py", "main.py", "run_z.py",
            "run_y.py", "tests/test_b.py", "tests/test_a.py", "tests/helper.py"]  # fmt: skip
    for key in keys:
        if rng.random() < 0.45:
            path = root / key
            path.parent.mkdir(parents=True, exist_ok=True)
            if not path.exists():
                path.write_bytes(random_text(rng, rng.choice([0, 5, 50, 300, 1500, 4000])))
    if rng.random() < 0.1:
        (root / "tests" / "test_0.py").mkdir(parents=True, exist_ok=True)  # a folder sorting first: no test excerpt
    elif rng.random() < 0.1:  # a test file over 8000 tokens: its token cap is min(8000, the code cap)
        (root / "tests").mkdir(exist_ok=True)
        (root / "tests" / "test_00.py").write_text(POOL * 5, encoding="utf-8")
    for plot in ("deliverables/plots/eq.png", "deliverables/plots/drawdown.png", "deliverables/plots/p3.png"):
        if rng.random() < 0.5:
            (root / plot).parent.mkdir(parents=True, exist_ok=True)
            (root / plot).write_bytes(b"\x89PNG")


def random_query(rng: random.Random) -> str:
    """A task text naming plots in the ways the reference's two patterns see (and some they do not)."""
    words = ["study", "deliverables/plots/eq.png", "drawdown.png", "out/deliverables/plots/A.PNG", "x.pngs",
             "foo.bar.png", "deliverables/plots/", "figures/extra.png", "a-b.png", "\\n", "Ünï.png"]  # fmt: skip
    query = " ".join(rng.choice(words) for _ in range(rng.randint(0, 12)))
    if rng.random() < 0.05:
        query += " " + " ".join(f"p{i}.png" for i in range(rng.randint(38, 45)))
    return query


def random_caps(rng: random.Random) -> EvidenceCaps:
    def tokens() -> int | None:
        return None if rng.random() < 0.3 else rng.choice([0, 1, 5, 12, 40, 150, 400, 9000])

    return EvidenceCaps(
        report_chars=rng.choice([1, 2, 3, 20, 57, 200, 900, 28000]),
        json_chars=rng.choice([1, 7, 64, 301, 24000]),
        code_chars=rng.choice([2, 9, 100, 777, 12000]),
        report_tokens=tokens(),
        json_tokens=tokens(),
        code_tokens=tokens(),
        token_model=rng.choice(["qwen", "Qwen/Qwen3.6", " GPT-5.5", "gpt-5.5"]),
    )


@pytest.fixture
def scratch(tmp_path: Path) -> Iterator[Path]:
    """A folder in memory where there is one (thousands of small files and folders), else the test's tmp folder."""
    shm = Path("/dev/shm")
    if not (shm.is_dir() and os.access(shm, os.W_OK)):
        yield tmp_path
        return
    with tempfile.TemporaryDirectory(dir=shm, prefix="mass-evidence-test-") as folder:
        yield Path(folder)


@pytest.fixture
def bpe(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(evidence, "_o200k_counter", lambda: fake_bpe)


def test_bundles_match_the_transcription_on_random_workspaces(scratch: Path, bpe: None) -> None:
    prompts = shipped_prompts()
    for seed in range(WORKSPACES):
        rng = random.Random(seed)
        root = scratch / f"w{seed}" / rng.choice(["query51_ourTeam", "venv", "ws"])
        random_workspace(rng, root)
        for variant in range(VARIANTS):  # several task texts and caps per workspace
            query, caps = random_query(rng), random_caps(rng)
            bundle = build_bundle(root, task_id=51, task_text=query, location="loc", caps=caps, name=root.name)
            expected = ref_evidence(root, root.name, query, caps)
            assert bundle.render("Workspace A", prompts=prompts) == expected, f"seed {seed} variant {variant}"


def test_results_appendix_matches_the_transcription_on_random_results_trees(scratch: Path) -> None:
    names = ["a.json", "a-b.json", "a", "b.JSON", "raw_records.json", "curve_data.json", "run_B0_random_s0.json",
             "run_X_random_s0.json", "data_quality_issues.json", "se3_gvp_test_results.json", "x.json",
             "z.txt"]  # fmt: skip
    for seed in range(WORKSPACES):
        rng = random.Random(seed)
        root = scratch / f"r{seed}"
        root.mkdir()
        if rng.random() < 0.95:
            for _ in range(rng.randint(0, 9)):
                parts = [rng.choice(names) for _ in range(rng.randint(1, 3))]
                path = root.joinpath("results", *parts)
                if any(p.is_file() for p in [path, *path.parents]) or path.is_dir():
                    continue
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_bytes(random_text(rng, rng.choice([0, 3, 30, 300, 2500])))
        for variant in range(VARIANTS):
            task = rng.choice([51, 57, 202, 207, 220])
            per_file, total = rng.choice([1, 2, 5, 40, 333, 24000]), rng.choice([0, 10, 90, 700, 5000, 120000])
            appendix = results_json_appendix(root, task, per_file_chars=per_file, total_chars=total)
            assert appendix.render() == ref_appendix(root, task, per_file, total), f"seed {seed} variant {variant}"


def test_the_template_markers_drive_the_cuts(scratch: Path, bpe: None) -> None:
    """With other marker texts in ``prompts.dir`` the cuts are the reference's for those texts: the token cap counts
    the template's token marker, the appendix's total counts the template's appendix marker."""
    shipped = shipped_prompts()
    source = shipped.templates["evidence.j2"].source
    token_mark, appendix_mark = "\n<<a much longer marker of the token cut, as a user might write it>>\n", "\n<<A>>\n"
    source = source.replace(TOKEN_MARK.replace("\n", "\\n"), token_mark.replace("\n", "\\n"))
    source = source.replace(APPENDIX_MARK.replace("\n", "\\n"), appendix_mark.replace("\n", "\\n"))
    assert source != shipped.templates["evidence.j2"].source
    custom = PromptSet({**shipped.templates, "evidence.j2": PromptTemplate("evidence.j2", source, scratch)})
    differs = 0
    for seed in range(40):
        rng = random.Random(seed)
        root = scratch / f"w{seed}" / "ws"
        random_workspace(rng, root)
        for _ in range(VARIANTS):
            query, caps = random_query(rng), random_caps(rng)
            bundle = build_bundle(root, task_id=51, task_text=query, location="loc", caps=caps, prompts=custom)
            expected = ref_evidence(root, "ws", query, caps, mark=token_mark)
            assert bundle.render("Workspace A", prompts=custom) == expected, f"seed {seed}"
            differs += expected != ref_evidence(root, "ws", query, caps)
        appendix = results_json_appendix(root, 51, per_file_chars=20, total_chars=75, prompts=custom)
        assert appendix.render(prompts=custom) == ref_appendix(root, 51, 20, 75, mark=appendix_mark)
    assert differs > 10  # the marker's length changed where the token cap cut


def test_files_beyond_the_whole_read_bound_keep_their_character_cuts(
    scratch: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file over `WHOLE_READ_BYTES` is read only at its ends: without a token cap its excerpt is cut at the same
    places (the count our marker shows is of the characters read, so it is left out of the comparison)."""
    monkeypatch.setattr(evidence, "WHOLE_READ_BYTES", 64)
    count = re.compile(r"\[\.\.\. \d+ characters omitted")
    for seed in range(60):
        rng = random.Random(seed)
        root = scratch / f"w{seed}" / "ws"
        random_workspace(rng, root)
        query = random_query(rng)
        caps = EvidenceCaps(
            report_chars=rng.choice([2, 20, 57]), json_chars=rng.choice([3, 64]), code_chars=rng.choice([9, 100]),
            report_tokens=None, json_tokens=None, code_tokens=None,
        )  # fmt: skip
        rendered = build_bundle(root, task_id=51, task_text=query, location="loc", caps=caps).render("Workspace A")
        expected = ref_evidence(root, "ws", query, caps)
        assert count.sub("[... N characters omitted", rendered) == count.sub("[... N characters omitted", expected)
