"""The optimizer message's computations against an independent transcription of the reference's code.

The `ref_*` functions below restate, from the semantics of the reference release's
``harness_improvement/iterate_multi_agent_prompt.py`` (and the run_status.json its ``runtime/run_episode.sh``
writes), what the reference computes for each part of the optimizer's user message. They import nothing from
mass-ops. Each test draws 1,000 seeded random inputs and compares mass-ops' data (rendered through the shipped
macros where a text ending is involved) with the transcription: history rows, takeaways, checklist buckets, design
diffs, the scoreboard, the previous-best and v0 sections, and the run-status JSON.
"""

from __future__ import annotations

import difflib
import json
import random
import re
from typing import Any

from mass_ops.prompts import shipped_prompts
from mass_ops.search.champion import derive_champion
from mass_ops.search.prompt import (
    HistoryEntry,
    best_variables,
    delta_rows,
    history_rows,
    prior_failures,
    run_failed,
    scoreboard_entries,
    select_best,
    show_v0,
    status_json,
    takeaways,
    version_diff,
)

CASES = 1000

# -- the transcription ---------------------------------------------------------------------------------------------

REF_CUES = [
    "fail", "fails", "failed", "missing", "inconsistent", "mismatch", "not ", "lack", "weak", "nan", "null", "error",
    "defect", "reproducibility",
]  # fmt: skip
# Bucket order and alternatives of the reference's checklist (plain regex alternations over the lower-cased text).
REF_BUCKETS = [
    r"(inconsistent|mismatch|contradict|does not match|conflict)",
    r"(missing|absent|not found|not present)",
    r"(stability|robustness|subperiod|pre_2020|post_2020)",
    r"(nan|null|none|non-standard json)",
    r"(reproducibility|not reproducible|cannot reproduce|requirements|pin)",
    r"(validation|test|insufficient evidence|not proven|unclear)",
]
# mass-ops' bucket ids, in the same order.
BUCKET_IDS = ["inconsistency", "missing", "robustness", "null_values", "reproducibility", "validation"]


def ref_shorten(text: str, cap: int) -> str:
    words = " ".join(text.split())
    if len(words) > cap:
        return words[: cap - 3].rstrip() + "..."
    return words


def ref_items(rationale: str, most: int = 6) -> list[str]:
    flat = " ".join(rationale.split())
    chosen: list[str] = []
    for piece in re.split(r"(?<=[.!?])\s+", flat):
        piece = piece.strip()
        if not piece or not any(cue in piece.lower() for cue in REF_CUES) or piece in chosen:
            continue
        chosen.append(piece)
        if len(chosen) == most:
            break
    return chosen


def ref_read(files: dict[str, str], name: str) -> str | None:
    """A versions/ file as ``Path.read_text`` returns it (universal newlines), None when it does not exist."""
    if name not in files:
        return None
    return files[name].replace("\r\n", "\n").replace("\r", "\n")


def ref_diffs(rows: list[dict[str, Any]], files: dict[str, str]) -> dict[str, str]:
    """Baseline mode: v{k}_vs_no_harness rows with k ≥ 1, newest first; the 3 newest get 1500 characters."""
    found = set()
    for row in rows:
        match = re.fullmatch(r"v(\d+)_vs_no_harness", str(row.get("key") or ""))
        if match and int(match.group(1)) >= 1:
            found.add((int(match.group(1)), row["key"]))
    out: dict[str, str] = {}
    for position, (newer, key) in enumerate(sorted(found, reverse=True)):
        old_text = ref_read(files, f"multi_agent_design_v{newer - 1}.txt")
        new_text = ref_read(files, f"multi_agent_design_v{newer}.txt")
        if old_text is None or new_text is None:
            continue
        lines = difflib.unified_diff(
            old_text.splitlines(),
            new_text.splitlines(),
            fromfile=f"multi_agent_design_v{newer - 1}",
            tofile=f"multi_agent_design_v{newer}",
            lineterm="",
            n=1,
        )
        body = "\n".join(lines).strip() or "(designs are identical)"
        out[key] = ref_shorten(body, 1500 if position < 3 else 400)
    return out


def ref_history(rows: list[dict[str, Any]], diffs: dict[str, str]) -> list[dict[str, Any]]:
    """Per row: the rationale excerpt (None when the rationale is blank), the takeaways and the diff (or None)."""
    out = []
    for row in rows:
        rationale = str(row.get("rationale", "")).strip()
        out.append(
            {
                "rationale": ref_shorten(rationale, 2400) if rationale else None,
                "items": ref_items(rationale),
                "diff": diffs.get(str(row.get("key", ""))),
            }
        )
    return out


def ref_checklist(rows: list[dict[str, Any]]) -> tuple[str, list[tuple[int, int, str | None]]]:
    """("empty", []) without rows, ("none", []) when no bucket matches, else ("ranked", [(bucket, count, example)])."""
    if not rows:
        return "empty", []
    tally = [0] * len(REF_BUCKETS)
    example: dict[int, str] = {}
    for row in rows:
        rationale = str(row.get("rationale", "")).strip()
        if not rationale:
            continue
        lowered = rationale.lower()
        for index, pattern in enumerate(REF_BUCKETS):
            if re.search(pattern, lowered):
                tally[index] += 1
                if index not in example:
                    first = ref_items(rationale, most=1)
                    if first:
                        example[index] = first[0]
    ranked = sorted([(i, c) for i, c in enumerate(tally) if c > 0], key=lambda pair: pair[1], reverse=True)
    if not ranked:
        return "none", []
    return "ranked", [(i, c, example.get(i)) for i, c in ranked]


def ref_champion(
    rows: list[dict[str, Any]], arbitrations: list[dict[str, Any]], current: int
) -> tuple[int, bool, bool]:
    verdict = {}
    for row in rows:
        match = re.fullmatch(r"v(\d+)_vs_no_harness", str(row.get("key") or ""))
        if match:
            verdict[int(match.group(1))] = row.get("winner")
    decided = {}
    for row in arbitrations:
        match = re.fullmatch(r"champion_v(\d+)_vs_v(\d+)", str(row.get("key") or ""))
        if match:
            decided[(int(match.group(1)), int(match.group(2)))] = row.get("winner")
    champion, proven, needed = 0, verdict.get(0) == "B", False
    for k in range(1, current + 1):
        if verdict.get(k) != "B":
            continue
        if not proven:
            champion, proven = k, True
        elif (champion, k) in decided:
            if decided[(champion, k)] == "B":
                champion = k
        elif k == current:
            needed = True
    return champion, proven, needed


def ref_scoreboard(rows: list[dict[str, Any]], current: int, starred: int | None) -> list[tuple[int, Any, bool]]:
    verdict = {}
    for row in rows:
        match = re.fullmatch(r"v(\d+)_vs_no_harness", str(row.get("key") or ""))
        if match:
            verdict[int(match.group(1))] = row.get("winner")
    return [(k, verdict.get(k), starred == k) for k in range(current + 1)]


def ref_sections(
    rows: list[dict[str, Any]], arbitrations: list[dict[str, Any]], current: int, champion: int, proven: bool
) -> tuple[int | None, str | None, str | None, bool]:
    """(best version or None, its case, the rationale text as shown (None when omitted), v0 shown)."""
    best = None
    case = None
    text = None
    if champion != current and proven:
        best = champion
        source = next(
            (r for r in reversed(arbitrations) if r.get("key") == f"champion_v{champion}_vs_v{current}"), None
        )
        case = "both_win_arbitration" if source is not None else "champion_only_win"
        if source is None:
            source = next((r for r in reversed(rows) if r.get("key") == f"v{current}_vs_no_harness"), None)
        raw = str(source["rationale"]) if source is not None and source.get("rationale") else None
        if raw:
            text = ref_shorten(raw.strip(), 2000)
            if text and text[-1] not in ".!?\"'":
                text += "."
            text = text or None  # an empty excerpt: the reference leaves the rationale sentence out
    v0_shown = current >= 1 and best != 0
    return best, case, text, v0_shown


def ref_status_file(facts: dict[str, Any]) -> dict[str, Any]:
    """The run_status.json the reference's runner writes (its jq object, in its field order)."""
    failure = facts["failure"]
    if failure is not None:
        failure = {
            "subtype": failure["subtype"],
            "message": failure["message"],
            "last_tool_calls_most_recent_first": [
                {"tool": call["tool"], "args": call["args"]} for call in failure["calls"]
            ],
        }
    document = {
        "started_at": facts["started_at"],
        "finished_at": facts["finished_at"],
        "model": facts["model"],
        "endpoint": facts["endpoint"],
        "seed": facts["seed"],
        "qwen_code_version": facts["qwen"],
        "exit_code": facts["exit_code"],
        "trace_has_success_result": facts["success"],
        "failure": failure,
        "execution_mode": "headless_host_visible_yolo",
        "operational_limits": {
            "http_response_timeout_ms": 1800000,
            "foreground_shell_timeout_ms": 600000,
            "context_window_tokens": facts["context"],
            "max_tokens_per_model_response": facts["output"],
        },
        "hiw": {
            "condition": facts["condition"],
            "prompt_source": facts["prompt_source"],
            "client_endpoint": facts["client_endpoint"],
            "api_log": facts["api_log"],
            "api_requests": facts["api_requests"],
            "mass": True,
            "env_policy": facts["env_policy"],
        },
    }
    if "prior" in facts:
        document["prior_failures"] = facts["prior"]
    return document


def ref_metadata(document: dict[str, Any]) -> tuple[str, bool, bool]:
    """The metadata JSON and the two notice conditions as the reference derives them from the file."""
    text = json.dumps(document, indent=2, ensure_ascii=False)
    failed = document.get("exit_code") not in (0, None) or document.get("trace_has_success_result") is False
    return text, failed, bool(document.get("prior_failures"))


# -- random inputs -------------------------------------------------------------------------------------------------

WORDS = [
    "The", "report", "is", "missing", "Missing", "absent", "not found", "not present", "inconsistent", "MISMATCH",
    "contradicts", "does not match", "conflicts", "stability", "Robustness", "subperiod", "pre_2020", "post_2020",
    "NaN", "financial", "null", "None", "nonetheless", "non-standard JSON", "reproducibility", "not reproducible",
    "cannot reproduce", "requirements", "pinned", "spinning", "validation", "tests", "latest", "insufficient evidence",
    "not proven", "unclear", "fails", "failed", "lack", "weak", "error", "defect", "not", "B", "A", "workspace",
    "plots", "ünïcödé", "İstanbul", "\u212aelvin", "ratio", "Sharpe", "…", "“quoted”", "{braces}", "{{ x }}",
    "cr\rlf", "crlf\r\nend",
]  # fmt: skip
ENDS = [".", "!", "?", "", '."', "'", ";", ":", "..."]
SPACES = [" ", "  ", "\n", "\t", " \n ", "\u00a0", "\u2003"]


def random_rationale(rng: random.Random) -> str:
    if rng.random() < 0.08:
        return rng.choice(["", "   ", "\n\t "])
    sentences = []
    pool: list[str] = []
    for _ in range(rng.choice([1, 2, 3, 5, 8, 20, 45])):
        if pool and rng.random() < 0.15:
            sentences.append(rng.choice(pool))  # a repeated sentence
            continue
        words = [rng.choice(WORDS) for _ in range(rng.randint(1, 14))]
        sentence = " ".join(words) + rng.choice(ENDS)
        pool.append(sentence)
        sentences.append(sentence)
    text = ""
    for sentence in sentences:
        text += sentence + rng.choice(SPACES)
    return rng.choice(["", " ", "\n"]) + text


def random_design(rng: random.Random, base: list[str] | None) -> list[str]:
    if base is None or rng.random() < 0.1:
        return [
            f"line {rng.randint(0, 30)} {rng.choice(WORDS)}" + rng.choice(["", "  "]) for _ in range(rng.randint(1, 40))
        ]
    lines = list(base)
    for _ in range(rng.choice([0, 0, 1, 2, 5, 20])):
        action = rng.random()
        if action < 0.4 and lines:
            lines[rng.randrange(len(lines))] = f"changed {rng.choice(WORDS)} {rng.randint(0, 99)}"
        elif action < 0.7:
            lines.insert(rng.randint(0, len(lines)), f"added {rng.choice(WORDS)}")
        elif lines:
            del lines[rng.randrange(len(lines))]
    return lines


def random_history(rng: random.Random, current: int) -> list[dict[str, Any]]:
    """Baseline rows of versions 0..current in judging order (some versions unjudged)."""
    rows = []
    for version in range(current + 1):
        if version not in (0, current) and rng.random() < 0.15:
            continue
        rows.append(
            {
                "key": f"v{version}_vs_no_harness",
                "winner": rng.choice(["A", "B", "B", "tie"]),
                "rationale": random_rationale(rng),
            }
        )
    return rows


def entries_of(rows: list[dict[str, Any]], diffs: dict[int, str | None]) -> list[HistoryEntry]:
    out = []
    for row in rows:
        version = int(row["key"][1:].split("_", 1)[0])
        out.append(
            HistoryEntry(
                key=row["key"],
                version=version,
                winner=row["winner"],
                judge_model="m",
                judged_at=None,
                side_a="reference",
                side_b=f"v{version}",
                rationale=row["rationale"],
                diff=diffs.get(version),
            )
        )
    return out


CUT = shipped_prompts().macro("optimizer_parts.j2", "cut")

# -- the comparisons -----------------------------------------------------------------------------------------------


def test_takeaways_match_the_transcription() -> None:
    rng = random.Random(2601)
    for _ in range(CASES):
        rationale = random_rationale(rng)
        assert takeaways(rationale) == ref_items(rationale), rationale


def test_history_rows_and_design_diffs_match_the_transcription() -> None:
    rng = random.Random(2602)
    for case in range(CASES):
        current = rng.randint(1, 11)
        rows = random_history(rng, current)
        files: dict[str, str] = {}  # the reference's versions/ folder: design.strip() + "\n" per version
        designs: dict[int, str] = {}
        lines = None
        for version in range(current + 1):
            lines = random_design(rng, lines)
            if version and rng.random() < 0.05:
                continue  # a version whose design is not recorded
            designs[version] = "\n".join(lines)
            files[f"multi_agent_design_v{version}.txt"] = designs[version].strip() + "\n"
        diffs = {
            v: version_diff(designs[v - 1], designs[v], v - 1, v)
            for v in range(1, current + 1)
            if v in designs and v - 1 in designs
        }
        ours = history_rows(entries_of(rows, diffs))
        expected = ref_history(rows, ref_diffs(rows, files))
        for mine, theirs in zip(ours, expected, strict=True):
            rationale = CUT(mine["rationale"])
            assert (rationale or None) == theirs["rationale"]
            assert mine["takeaways"] == theirs["items"]
            diff = mine["diff"]
            shown = None if diff is None else "(designs are identical)" if diff["identical"] else CUT(diff)
            assert shown == theirs["diff"], (case, mine["key"])


def test_checklist_buckets_match_the_transcription() -> None:
    rng = random.Random(2603)
    for _ in range(CASES):
        rationales = [random_rationale(rng) for _ in range(rng.choice([0, 1, 2, 4, 12]))]
        state, expected = ref_checklist([{"rationale": r} for r in rationales])
        ours = delta_rows(rationales)
        assert [(BUCKET_IDS.index(r["bucket"]), r["count"], r["example"]) for r in ours] == expected
        assert (state == "empty") == (not rationales)


def test_scoreboard_and_sections_match_the_transcription() -> None:
    rng = random.Random(2604)
    for _ in range(CASES):
        current = rng.randint(1, 12)
        rows = random_history(rng, current)
        arbitrations: list[dict[str, Any]] = []
        for _round in range(rng.randint(0, current)):
            champion, challenger = sorted(rng.sample(range(current + 1), 2))
            key = f"champion_v{champion}_vs_v{challenger}"
            if all(r["key"] != key for r in arbitrations):
                arbitrations.append(
                    {"key": key, "winner": rng.choice(["A", "B", "tie"]), "rationale": random_rationale(rng)}
                )
        champion, proven, needed = ref_champion(rows, arbitrations, current)
        if needed:  # the step's arbitration call, then the champion as the reference updates it
            arbitrations.append(
                {
                    "key": f"champion_v{champion}_vs_v{current}",
                    "winner": rng.choice(["A", "B", "tie"]),
                    "rationale": random_rationale(rng),
                }
            )
            if arbitrations[-1]["winner"] == "B":
                champion = current
        baseline = {int(r["key"][1:].split("_", 1)[0]): r["winner"] for r in rows}
        decided = {tuple(int(x) for x in re.findall(r"\d+", r["key"])): r["winner"] for r in arbitrations}
        state = derive_champion(baseline, decided, current)
        assert (state.champion, state.has_win) == (champion, proven)
        assert [
            (e["version"], e["verdict"], e["retained"])
            for e in scoreboard_entries([(v, baseline.get(v)) for v in range(current + 1)], state.retained)
        ] == ref_scoreboard(rows, current, champion if proven else None)

        arbitration = next((r for r in arbitrations if r["key"] == f"champion_v{champion}_vs_v{current}"), None)
        own = next((r for r in rows if r["key"] == f"v{current}_vs_no_harness"), None)
        best = select_best(
            state.champion,
            state.has_win,
            current,
            "design",
            None if arbitration is None else arbitration["rationale"] or "",
            None if own is None else own["rationale"],
        )
        shown = best_variables(best)
        text = None
        if shown is not None and shown["rationale"]["text"]:
            text = CUT(shown["rationale"]) + ("." if shown["rationale"]["needs_period"] else "")
        mine = (
            None if best is None else best.version,
            None if best is None else best.case,
            text,
            show_v0(current, best),
        )
        assert mine == ref_sections(rows, arbitrations, current, champion, proven)


def random_facts(rng: random.Random) -> dict[str, Any]:
    failed = rng.random() < 0.4
    facts: dict[str, Any] = {
        "started_at": f"2026-12-0{rng.randint(1, 9)}T0{rng.randint(0, 9)}:00:00Z",
        "finished_at": "2026-12-05T10:00:00Z",
        "model": rng.choice(["Qwen/Qwen3.6-27B-FP8", "modèle-ü"]),
        "endpoint": "http://127.0.0.1:8000/v1",
        "seed": rng.randint(0, 10**6),
        "qwen": rng.choice(["0.1.2", "0.2.0 ★"]),
        "exit_code": rng.choice([0, 0, 1, 137, None, 2]),
        "success": rng.choice([True, True, False, None]),
        "failure": None,
        "context": 262144,
        "output": rng.choice([32768, 8192]),
        "condition": f"t{rng.randint(1, 400)}_v{rng.randint(0, 11)}",
        "prompt_source": "/runs/prompt.txt",
        "client_endpoint": "http://127.0.0.1:9000/v1",
        "api_log": rng.choice(["", "/logs/api_requests.jsonl.gz"]),
        "api_requests": rng.randint(0, 500),
        "env_policy": "OMP=2,MKL=2",
    }
    if failed:
        calls = [
            {"tool": rng.choice(["shell", "read_file", "ü"]), "args": json.dumps({"p": rng.random()})}
            for _ in range(rng.randint(0, 5))
        ]
        facts["failure"] = {
            "subtype": rng.choice(["error_max_turns", "no_result"]),
            "message": rng.choice(["halt — “loop”", None]),
            "calls": calls,
        }
    if rng.random() < 0.3:
        facts["prior"] = rng.choice([[], [1], [{"version": 2, "exit_code": 137}], None, 0, "x"])
    return facts


def ours_record(facts: dict[str, Any], rng: random.Random) -> dict[str, Any]:
    """The same facts as mass-ops' runtime records them: extra fields, "name" for a tool, any key order."""
    failure = None
    if facts["failure"] is not None:
        failure = {
            "subtype": facts["failure"]["subtype"],
            "message": facts["failure"]["message"],
            "last_tool_calls_most_recent_first": [
                {"name": c["tool"], "args": c["args"]} for c in facts["failure"]["calls"]
            ],
        }
        if rng.random() < 0.3:
            failure["budget"] = {"name": "tokens"}
    record: dict[str, Any] = {
        "started_at": facts["started_at"],
        "finished_at": facts["finished_at"],
        "model": facts["model"],
        "endpoint": facts["endpoint"],
        "seed": facts["seed"],
        "qwen_code_version": facts["qwen"],
        "exit_code": facts["exit_code"],
        "trace_has_success_result": facts["success"],
        "failure": failure,
        "execution_mode": "headless_host_visible_yolo",
        "operational_limits": {
            "max_tokens_per_model_response": facts["output"],
            "context_window_tokens": facts["context"],
            "foreground_shell_timeout_ms": 600000,
            "http_response_timeout_ms": 1800000,
        },
        "hiw": {
            "mass": True,
            "env_policy": facts["env_policy"],
            "condition": facts["condition"],
            "prompt_source": facts["prompt_source"],
            "client_endpoint": facts["client_endpoint"],
            "api_log": facts["api_log"],
            "api_requests": facts["api_requests"],
        },
        "status": "succeeded",
        "unit": "search-t51-v0-s1",
        "attempt": 1,
        "usage": {"prompt_tokens": 1},
        "durations": {"wall": 1.5},
        "terminated_by": None,
        "proxy_failures": [],
    }
    if "prior" in facts:
        record["prior_failures"] = facts["prior"]
    keys = list(record)
    rng.shuffle(keys)  # a record read back from the store comes with sorted keys; order must not matter
    return {key: record[key] for key in keys}


def test_run_status_json_and_notice_conditions_match_the_transcription() -> None:
    rng = random.Random(2605)
    for _ in range(CASES):
        facts = random_facts(rng)
        record = ours_record(facts, rng)
        expected = ref_metadata(ref_status_file(facts))
        assert (status_json(record), run_failed(record), prior_failures(record)) == expected
