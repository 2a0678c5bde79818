"""Critical-path priority: one order of a cycle's work, for the episode pool (higher first) and the server (lower
first)."""

from __future__ import annotations

from mass_ops.config import CycleConfig, read_config_source, validate_config
from mass_ops.critical_path import chain_priority, episode_phase, episode_server_priority, server_priority


def paper(policy: str) -> CycleConfig:
    data = read_config_source("paper")
    data["tasks"]["catalogue"] = "builtin"
    data["inference"]["server"]["scheduling_policy"] = policy
    return validate_config(data)


def test_chain_priority_orders_search_versions_before_collection_before_the_rest() -> None:
    iterations = 11
    ranks = [
        chain_priority("search", None, iterations),
        chain_priority("search", 0, iterations),
        chain_priority("search", 5, iterations),
        chain_priority("search", 11, iterations),
        chain_priority("collection", None, iterations),
        chain_priority("ranking", None, iterations),
        chain_priority("other", None, iterations),
    ]
    assert ranks == [13, 13, 8, 2, 1, 0, 0]


def test_a_reference_episode_is_search_work_and_rollouts_are_not_on_the_chain() -> None:
    phases = [episode_phase(kind) for kind in ("reference", "search", "collection", "rollout", "benchmark")]
    assert phases == ["search", "search", "collection", "other", "other"]


def test_a_first_come_first_served_server_gets_no_priority_field() -> None:
    config = paper("fcfs")
    assert {server_priority(config, phase, 3) for phase in ("search", "collection", "ranking", "other")} == {None}


def test_server_priority_is_the_chain_order_turned_the_way_vllm_sorts() -> None:
    config = paper("priority")
    assert config.search.iterations == 11
    values = [
        server_priority(config, "search", 0),
        server_priority(config, "search", 5),
        server_priority(config, "search", 11),
        server_priority(config, "collection"),
        server_priority(config, "ranking"),
        server_priority(config, "other"),
    ]
    assert values == [0, 5, 11, 12, 12, 13]  # ranking shares collection's level (see `server_priority`)


def test_an_episode_s_server_priority_is_its_phase_s() -> None:
    config = paper("priority")
    kinds = [("reference", None), ("search", 4), ("collection", None), ("rollout", None), ("benchmark", None)]
    assert [episode_server_priority(config, kind, version) for kind, version in kinds] == [0, 4, 12, 13, 13]
    assert episode_server_priority(paper("fcfs"), "search", 4) is None
