"""Evidence caps (MASS_SPEC §5): token caps before character caps, requirements.txt under the report's caps."""

from __future__ import annotations

from pathlib import Path

from mass_ops.judge.evidence import EvidenceCaps, cap_excerpt, file_excerpts

MARKER = "\n\n[... {} characters omitted ...]\n\n"


def distinct_text(n: int) -> str:
    """n characters in which every 8-character window is unique, so any head/tail cut is visible."""
    return "".join(f"{i:07d}\n" for i in range(n // 8 + 1))[:n]


def head_tail(text: str, keep: int) -> str:
    """The reference's character cut written out: half of `keep` from the head, the rest from the tail."""
    head = keep // 2
    return text[:head] + MARKER.format(len(text) - keep) + text[len(text) - (keep - head) :]


def test_token_cap_applies_before_the_character_cap():
    # 30000 characters, 6000 tokens (chars/4), 24000 characters: the JSON caps of remote ranking.
    text = distinct_text(30000)
    capped, cut = cap_excerpt(text, max_chars=24000, max_tokens=6000, token_model="qwen")
    # Token cap on the original text: 24000 characters plus the marker is 6010 tokens > 6000, so 24000 × 0.7 = 16800
    # characters are kept; that already fits the character cap, which then leaves it alone: one marker, not two.
    assert capped == head_tail(text, 16800)
    assert cut and capped.count("characters omitted") == 1


def test_character_cap_still_applies_after_the_token_cap():
    text = distinct_text(100000)
    capped, cut = cap_excerpt(text, max_chars=28000, max_tokens=12000, token_model="qwen")
    token_capped = head_tail(text, 33600)  # 48000 chars (+marker) is over 12000 tokens; 48000 × 0.7 fits
    assert cut and capped == head_tail(token_capped, 28000)
    assert capped.startswith(text[:14000]) and capped.endswith(text[-14000:])


def test_without_a_token_cap_only_characters_count():
    text = distinct_text(50000)
    assert cap_excerpt(text, 28000, None, "qwen") == (head_tail(text, 28000), True)
    assert cap_excerpt("short", 28000, 10, "qwen") == ("short", False)


def test_requirements_take_the_report_character_cap(tmp_path: Path):
    requirements = "".join(f"package-{i:05d}==1.0.{i}\n" for i in range(1500))  # ~33000 characters
    (tmp_path / "requirements.txt").write_text(requirements)
    (tmp_path / "run_all.py").write_text(requirements)
    caps = EvidenceCaps(report_chars=28000, code_chars=12000, report_tokens=None, code_tokens=None)
    excerpts = {e.path: e for e in file_excerpts(tmp_path, caps)}
    assert excerpts["requirements.txt"].text == head_tail(requirements, 28000)
    assert excerpts["requirements.txt"].truncated
    assert excerpts["run_all.py"].text == head_tail(requirements, 12000)  # code keeps the code cap


def test_a_500mb_report_is_read_only_as_far_as_its_excerpt_shows(tmp_path: Path) -> None:
    import tracemalloc

    from mass_ops.judge.evidence import build_bundle, excerpt_read_bytes, results_json_appendix

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
    assert peak < 4 * excerpt_read_bytes(28000) + (4 << 20), f"peak {peak:,} bytes"
    assert "### File: `research_report.md` [truncated]" in bundle.body
    assert "HEAD-OF-THE-REPORT" in bundle.body and "TAIL-OF-THE-REPORT" in bundle.body
    assert "HEAD-OF-THE-REPORT" in appendix and "TAIL-OF-THE-REPORT" in appendix
