"""Evidence caps (MASS_SPEC §5): token caps before character caps, requirements.txt under the report's caps, and
reading that stays bounded however large a file is."""

from __future__ import annotations

from pathlib import Path

from mass_ops.judge.evidence import EvidenceCaps, build_bundle, cap_excerpt, file_excerpts, results_json_appendix

MARK = "<cut>"


def chars_over_four(text: str) -> int:
    return max(1, -(-len(text) // 4))


def distinct_text(n: int) -> str:
    """n characters in which every 8-character window is unique, so any head/tail cut is visible."""
    return "".join(f"{i:07d}\n" for i in range(n // 8 + 1))[:n]


def shown(parts: list[dict[str, object]]) -> str:
    """The parts as text, markers written as <cut> (token cap) and <N omitted> (character cap)."""
    out = []
    for part in parts:
        if part["kind"] == "text":
            out.append(str(part["text"]))
        elif part["kind"] == "token_cut":
            out.append(MARK[int(part["start"]) : int(part["stop"])])  # type: ignore[call-overload]
        else:
            out.append(f"<{part['omitted']} omitted>")
    return "".join(out)


def test_token_cap_keeps_a_quarter_at_each_end_shrunk_until_it_fits_then_the_character_cap():
    text = distinct_text(30000)  # 7500 tokens at chars/4
    parts, cut = cap_excerpt(text, 24000, 6000, chars_over_four, MARK)
    # 7500 characters at each end (len/4) plus the marker: 3752 tokens, within 6000; 15005 characters fit 24000.
    assert cut and shown(parts) == text[:7500] + MARK + text[-7500:]
    parts, cut = cap_excerpt(text, 24000, 3000, chars_over_four, MARK)
    # 7500 → 5250 (2627 tokens): the first window that fits 3000.
    assert cut and shown(parts) == text[:5250] + MARK + text[-5250:]
    parts, cut = cap_excerpt(text, 1000, 3000, chars_over_four, MARK)
    # Then the character cap cuts the token-capped text (10505 characters) to 500 + 500 around its own marker.
    assert shown(parts) == text[:500] + "<9505 omitted>" + text[-500:]


def test_the_token_marker_counts_and_a_cut_may_fall_inside_it():
    text = distinct_text(400)
    parts, cut = cap_excerpt(text, 10_000, 1, chars_over_four, MARK)
    assert cut and shown(parts) == MARK  # the marker alone takes the whole cap
    long_mark = "<" + "m" * 38 + ">"  # 40 characters: 10 tokens
    parts, _ = cap_excerpt(text, 10_000, 30, chars_over_four, long_mark)
    assert [p["kind"] for p in parts] == ["text", "token_cut", "text"]
    head, tail = parts[0]["text"], parts[2]["text"]
    assert len(head) == len(tail) and chars_over_four(head + long_mark + tail) <= 30
    # A character cap 20 short of the token-capped text keeps 10 marker characters on each side of its own cut.
    parts, _ = cap_excerpt(text, 2 * len(head) + 20, 30, chars_over_four, long_mark)
    assert parts == [
        {"kind": "text", "text": head},
        {"kind": "token_cut", "start": 0, "stop": 10},
        {"kind": "char_cut", "omitted": 20},
        {"kind": "token_cut", "start": 30, "stop": 40},
        {"kind": "text", "text": tail},
    ]


def test_without_a_token_cap_only_characters_count_and_short_text_stays_whole():
    text = distinct_text(50000)
    parts, cut = cap_excerpt(text, 28000, None, chars_over_four, MARK)
    assert cut and shown(parts) == text[:14000] + "<22000 omitted>" + text[-14000:]
    assert cap_excerpt("short", 28000, 10, chars_over_four, MARK) == ([{"kind": "text", "text": "short"}], False)


def test_requirements_take_the_report_character_cap(tmp_path: Path):
    requirements = "".join(f"package-{i:05d}==1.0.{i}\n" for i in range(1500))  # ~33000 characters
    (tmp_path / "requirements.txt").write_text(requirements)
    (tmp_path / "run_all.py").write_text(requirements)
    caps = EvidenceCaps(report_chars=28000, code_chars=12000, report_tokens=None, code_tokens=None)
    excerpts = {e.path: e for e in file_excerpts(tmp_path, caps)}
    cut = len(requirements) - 28000
    assert shown(list(excerpts["requirements.txt"].parts)) == (
        requirements[:14000] + f"<{cut} omitted>" + requirements[-14000:]
    )
    assert excerpts["requirements.txt"].truncated
    assert shown(list(excerpts["run_all.py"].parts)).startswith(requirements[:6000] + "<")  # code keeps the code cap


def test_a_500mb_report_is_read_only_as_far_as_its_excerpt_shows(tmp_path: Path) -> None:
    import tracemalloc

    root = tmp_path / "ws"
    (root / "results").mkdir(parents=True)
    for path in (root / "research_report.md", root / "results" / "dump.json"):
        with path.open("wb") as out:  # sparse: 500 MB that cost nothing to write, head and tail text around zeros
            out.write(b"HEAD-OF-THE-REPORT " * 10)
            out.truncate(500_000_000)
            out.seek(500_000_000 - 190)
            out.write(b"TAIL-OF-THE-REPORT " * 10)
    caps = EvidenceCaps(report_chars=28000)
    tracemalloc.start()
    try:
        bundle = build_bundle(root, task_id=51, task_text="t", location="ws", caps=caps)
        appendix = results_json_appendix(root, 51, per_file_chars=24000, total_chars=120000)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # At most the head and tail the caps can show are read: a few hundred KB, never the file.
    assert peak < 4 * 8 * 28000 + (4 << 20), f"peak {peak:,} bytes"
    text, appendix_text = bundle.render("Workspace A"), appendix.render()
    assert "### File: `research_report.md` [truncated]" in text
    assert "HEAD-OF-THE-REPORT" in text and "TAIL-OF-THE-REPORT" in text
    assert "HEAD-OF-THE-REPORT" in appendix_text and "TAIL-OF-THE-REPORT" in appendix_text
