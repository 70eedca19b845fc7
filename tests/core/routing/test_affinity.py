"""The prefix map and its policy, pure: hashes of chat and completion prefixes, bounds, expiry (an injected
clock), the imbalance bound, and the table's use of it. Against real llama-server nodes:
tests/proxy/test_prefix_routing.py."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest

from qiip_core.nodes import Node, NodeStatus
from qiip_core.routing import (
    MAX_BLOCKS,
    PROMPT_BLOCK_CHARS,
    RECORDED_BLOCKS,
    SAMPLED_MESSAGE_CHARS,
    AffinityResult,
    PrefixAffinity,
    RoutingPolicy,
    RoutingTable,
    prefix_hashes,
)


@dataclass
class Candidate:
    id: str
    in_flight: int = 0


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def chat(*contents: str) -> dict[str, object]:
    roles = ["system", "user", "assistant"]
    return {"messages": [{"role": roles[min(i, 1 + (i + 1) % 2)], "content": c} for i, c in enumerate(contents)]}


def test_turn_n_plus_1_shares_every_hash_of_turn_n() -> None:
    turn1 = prefix_hashes("m", "chat", chat("sys", "q1"))
    turn2 = prefix_hashes("m", "chat", chat("sys", "q1", "a1", "q2"))
    assert len(turn1) == 2 and len(turn2) == 4
    assert turn2[:2] == turn1
    # Another model, another API, another role or content: other hashes.
    assert prefix_hashes("other", "chat", chat("sys", "q1"))[1] != turn1[1]
    assert prefix_hashes("m", "chat", chat("sys", "q1!"))[1] != turn1[1]
    other_role = {"messages": [{"role": "system", "content": "sys"}, {"role": "assistant", "content": "q1"}]}
    assert prefix_hashes("m", "chat", other_role)[1] != turn1[1]


def test_parts_and_tool_calls_hash_and_malformed_messages_stop_the_prefix() -> None:
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}
    tools = {"messages": [{"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]}]}
    assert len(prefix_hashes("m", "chat", parts)) == 1
    assert prefix_hashes("m", "chat", tools) != prefix_hashes("m", "chat", {"messages": [{"role": "assistant"}]})
    assert prefix_hashes("m", "chat", {"messages": [{"role": "user", "content": "x"}, "junk", {}]}) != ()
    assert len(prefix_hashes("m", "chat", {"messages": [{"role": "user", "content": "x"}, "junk", {}]})) == 1
    assert prefix_hashes("m", "chat", {"messages": "not a list"}) == ()
    assert prefix_hashes("m", "chat", {"messages": [{"role": ["unhashable"], "content": "x"}]}) != ()
    assert prefix_hashes("m", "embeddings", {"input": "x"}) == ()
    many = {"messages": [{"role": "user", "content": str(i)} for i in range(MAX_BLOCKS + 50)]}
    assert len(prefix_hashes("m", "chat", many)) == MAX_BLOCKS


def test_completion_prompts_hash_in_whole_blocks() -> None:
    prompt = "x" * (PROMPT_BLOCK_CHARS * 3 + 10)
    first = prefix_hashes("m", "completions", {"prompt": prompt})
    longer = prefix_hashes("m", "completions", {"prompt": prompt + "y" * PROMPT_BLOCK_CHARS})
    assert len(first) == 3 and longer[:3] == first
    assert prefix_hashes("m", "completions", {"prompt": "short"}) == ()
    tokens = prefix_hashes("m", "completions", {"prompt": list(range(300))})
    assert len(tokens) == 2
    assert prefix_hashes("m", "completions", {"prompt": ["a", "b"]}) == ()


def test_choose_the_longest_known_prefix_on_an_eligible_node() -> None:
    affinity = PrefixAffinity()
    a, b = Candidate("a"), Candidate("b")
    turn1 = prefix_hashes("m", "chat", chat("sys", "q1"))
    assert affinity.choose("m", [a, b], turn1) is None
    affinity.record(turn1, "b")
    turn2 = prefix_hashes("m", "chat", chat("sys", "q1", "a1", "q2"))
    assert affinity.choose("m", [a, b], turn2) is b
    # The longest prefix wins over a shorter one held elsewhere.
    affinity.record(turn1[:1], "a")
    assert affinity.choose("m", [a, b], turn2) is b
    # A node not among the candidates (tried, drained, gone) is skipped: the next known prefix, else None.
    assert affinity.choose("m", [a], turn2) is a
    assert affinity.choose("m", [Candidate("c")], turn2) is None
    assert affinity.results == {
        ("m", AffinityResult.MISS): 2,
        ("m", AffinityResult.HIT): 3,
    }


def test_imbalance_bound() -> None:
    affinity = PrefixAffinity(imbalance_requests=2, imbalance_ratio=0.5)
    assert [affinity.allowed_extra(least) for least in (0, 3, 4, 10)] == [2, 2, 2, 5]
    prefix = prefix_hashes("m", "chat", chat("sys", "q1"))
    affinity.record(prefix, "b")
    a, b = Candidate("a", in_flight=0), Candidate("b", in_flight=2)
    assert affinity.choose("m", [a, b], prefix) is b
    b.in_flight = 3
    assert affinity.choose("m", [a, b], prefix) is None
    assert affinity.results[("m", AffinityResult.OVERLOADED)] == 1
    a.in_flight, b.in_flight = 10, 15
    assert affinity.choose("m", [a, b], prefix) is b
    b.in_flight = 16
    assert affinity.choose("m", [a, b], prefix) is None


def test_entries_expire_and_the_map_stays_bounded() -> None:
    clock = Clock()
    affinity = PrefixAffinity(max_entries=3, ttl_s=10.0, clock=clock)
    long_chat = prefix_hashes("m", "chat", chat(*(str(i) for i in range(20))))
    affinity.record(long_chat, "a")
    # Only the longest RECORDED_BLOCKS hashes are recorded, and at most max_entries kept.
    assert RECORDED_BLOCKS > 3 and len(affinity) == 3
    a = Candidate("a")
    assert affinity.choose("m", [a], long_chat) is a
    assert affinity.choose("m", [a], long_chat[:-3]) is None
    clock.now = 9.9
    affinity.record(long_chat[-1:], "a")
    clock.now = 10.0
    # The refreshed entry lives on; the others expired (and are dropped when met).
    assert affinity.choose("m", [a], long_chat[-2:-1]) is None
    assert affinity.choose("m", [a], long_chat) is a
    assert len(affinity) < 3


def test_policy_per_model() -> None:
    affinity = PrefixAffinity(
        policy=RoutingPolicy.LEAST_CONNECTIONS, model_policy={"sticky": RoutingPolicy.PREFIX_AFFINITY}
    )
    body = chat("sys", "q1")
    assert affinity.prefix_of("plain", "chat", body) == ()
    assert affinity.prefix_of("sticky", "chat", body) == prefix_hashes("sticky", "chat", body)
    with pytest.raises(ValueError):
        PrefixAffinity(max_entries=0)


def _table(affinity: PrefixAffinity | None) -> RoutingTable:
    table = RoutingTable(rng=random.Random(0), affinity=affinity)
    for node_id in ("a", "b"):
        table.apply_put(
            Node(id=node_id, endpoint=f"http://127.0.0.1:{9000 + ord(node_id)}", model="m"), source="config"
        )
        table.set_liveness(node_id, NodeStatus.HEALTHY)
    return table


def test_the_table_follows_the_prefix_and_falls_back() -> None:
    table = _table(PrefixAffinity())
    turn1 = prefix_hashes("m", "chat", chat("sys", "q1"))
    first = table.reserve("m", prefix=turn1)
    first.release()
    turn2 = prefix_hashes("m", "chat", chat("sys", "q1", "a1", "q2"))
    for _ in range(5):
        with table.reserve("m", prefix=turn2) as again:
            assert again.state.id == first.state.id
    # Failover: the affinity node excluded, the other one serves, and now holds the prefix.
    with table.reserve("m", prefix=turn2, exclude=[first.state.id]) as other:
        assert other.state.id != first.state.id
    with table.reserve("m", prefix=turn2) as after:
        assert after.state.id == other.state.id
    # Drained: never chosen.
    table.set_lifecycle(other.state.id, NodeStatus.DRAINING)
    with table.reserve("m", prefix=turn2) as drained:
        assert drained.state.id == first.state.id


def test_without_affinity_the_table_is_least_connections() -> None:
    table = _table(None)
    turn = prefix_hashes("m", "chat", chat("sys", "q1"))
    held = table.reserve("m", prefix=turn)
    with table.reserve("m", prefix=turn) as second:
        assert second.state.id != held.state.id
    held.release()


def test_a_long_message_is_known_by_its_length_and_ends() -> None:
    long = "x" * (SAMPLED_MESSAGE_CHARS * 4)
    base = prefix_hashes("m", "chat", chat(long))
    assert prefix_hashes("m", "chat", chat(long[:-1] + "y")) != base
    assert prefix_hashes("m", "chat", chat(long + "x")) != base
    # A change in between, keeping the length, goes unnoticed (by design: hashing stays O(1) per message).
    middle = len(long) // 2
    assert prefix_hashes("m", "chat", chat(long[:middle] + "y" + long[middle + 1 :])) == base


def test_what_one_process_records_another_learns() -> None:
    routing, other = PrefixAffinity(), PrefixAffinity()
    turn1 = prefix_hashes("m", "chat", chat("sys", "q1"))
    routing.record(turn1, "a")
    assert routing.take_recorded() == []  # not kept unless asked for (one process)
    routing.recorded = []
    routing.record(turn1, "b")
    shared = routing.take_recorded()
    assert shared == [("b", turn1[-RECORDED_BLOCKS:])] and routing.take_recorded() == []
    for node_id, hashes in shared:
        other.learn(node_id, hashes)
    # Learning is not recording: nothing is passed on again.
    assert other.take_recorded() == []
    turn2 = prefix_hashes("m", "chat", chat("sys", "q1", "a1", "q2"))
    assert other.choose("m", [Candidate("a"), Candidate("b")], turn2) == Candidate("b")


def test_a_starting_process_learns_the_whole_map_in_its_order() -> None:
    clock = Clock()
    routing, starting = PrefixAffinity(clock=clock, ttl_s=10), PrefixAffinity(clock=clock, ttl_s=10)
    turns = [prefix_hashes("m", "chat", chat("sys", f"q{n}")) for n in range(3)]
    routing.record(turns[0], "a")
    routing.record(turns[1], "a")
    clock.now = 5.0
    routing.record(turns[2], "b")
    clock.now = 12.0  # the first two have expired
    assert routing.known() == [("b", turns[2][-RECORDED_BLOCKS:])]
    clock.now = 0.0
    for node_id, hashes in routing.known():
        starting.learn(node_id, hashes)
    # "sys" is every turn's first block: last routed with the third turn, to b.
    assert starting.known() == routing.known() == [("a", (turns[0][1], turns[1][1])), ("b", turns[2])]
