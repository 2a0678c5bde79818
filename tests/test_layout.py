"""Names and keys: reference conditions, unit identity across attempts, artifact keys."""

from __future__ import annotations

from mass_ops import layout


def test_conditions_match_the_reference_names():
    assert layout.bare_condition(51) == "t51_bare"
    assert layout.version_condition(51, 3) == "t51_v3"
    assert layout.teacher_condition(202, 1) == "t202_L1"
    assert layout.episode_name("t202_L1", 1730217) == "t202_L1_s1730217"


def test_unit_slug_is_stable_across_attempts_and_key_is_not():
    first = layout.EpisodeUnit("paper-L0", 51, "search", 453051, version=3)
    retry = layout.EpisodeUnit("paper-L0", 51, "search", 453051, version=3, attempt=2)
    assert first.slug == retry.slug == "search-t51-v3-s453051"
    assert first.key != retry.key
    assert first.artifact_key("workspace") == "cycles/paper-L0/episodes/search-t51-v3-s453051/a1/workspace.tar.gz"


def test_collection_units_differ_by_candidate():
    a = layout.EpisodeUnit("c", 51, "collection", 715100, candidate=0)
    b = layout.EpisodeUnit("c", 51, "collection", 715101, candidate=1)
    assert a.slug != b.slug
