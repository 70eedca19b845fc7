"""Prefix-aware routing (cache affinity): send a request to the node most likely to hold its prompt's longest
prefix in its KV cache.

Multi-turn chats and agents resend the same long prefix every turn. The node that served the previous turn
still holds it: llama-server keeps each slot's prompt and saves idle slots to its host-memory prompt cache
(`--cache-prompt`, `--cache-ram`); vLLM's automatic prefix caching keeps KV blocks by their prefix hash. A
request sent there skips re-processing the prefix, which dominates time to first token for long prompts.

How a request's prefix is known without a second JSON parse: `prefix_hashes` reads the body the parse step
already decoded and chains a hash over its leading blocks: one block per message of a chat (role and
content), or fixed-size character (or token) blocks of a completion's prompt. Block `i`'s hash covers blocks
`0..i`, so turn N+1 (whose messages begin with turn N's) shares the hashes of all of turn N's blocks.
After a request is routed, its longest `RECORDED_BLOCKS` prefix hashes are recorded with the chosen node
(`PrefixAffinity.record`); the next request looks its hashes up longest first (`PrefixAffinity.choose`).

Bounds: the map holds at most `max_entries` hashes (least recently used evicted first) and forgets one
`ttl_s` seconds after it was last recorded or used (KV caches are evicted too); a request hashes at most
`MAX_BLOCKS` blocks and records at most `RECORDED_BLOCKS`. Entries of a node that left are never chosen
(only eligible candidates are) and age out.

Load still counts: the affinity node is chosen only while its requests in flight exceed the least-loaded
candidate's by at most `max(imbalance_requests, floor(imbalance_ratio × least))`; otherwise (and when no
prefix is known) the table falls back to least-connections. The hash is Python's `hash` of tuples of
strings: fast, and randomised per process (`PYTHONHASHSEED`), which is fine for a map that lives in one.
"""

from __future__ import annotations

import logging
import math
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from enum import StrEnum
from typing import Any, Protocol, TypeVar

__all__ = [
    "MAX_BLOCKS",
    "PROMPT_BLOCK_CHARS",
    "PROMPT_BLOCK_TOKENS",
    "RECORDED_BLOCKS",
    "SAMPLED_MESSAGE_CHARS",
    "AffinityResult",
    "PrefixAffinity",
    "RoutingPolicy",
    "prefix_hashes",
]

logger = logging.getLogger("qiip.routing")

MAX_BLOCKS = 64
"""The most leading blocks hashed per request (messages, or prompt blocks), so hashing stays bounded
(bench/prefix_routing.py measures it). A longer conversation is still known by its first 64 messages, which
every later turn repeats, so it keeps its node; only branches after them are not told apart."""

RECORDED_BLOCKS = 8
"""Prefix hashes recorded per routed request: its longest ones. Turn N+1 looks up turn N's whole prompt, its
longest prefix; shorter ones serve a client that cut or edited its history."""

SAMPLED_MESSAGE_CHARS = 256
"""Messages longer than this (characters) are hashed by their length, first 96 and last 96 characters, so
hashing costs the same for every message: a client would have to change a long message only in between,
keeping its length, for the change to go unnoticed, and then the request only goes to a node that holds less
of its prefix than the map believes."""

PROMPT_BLOCK_CHARS = 512
"""Characters per block of a completion's text prompt (about 128 tokens): only whole blocks are hashed, so
turn N's prompt matches turn N+1's to within one block."""

PROMPT_BLOCK_TOKENS = 128
"""Tokens per block of a completion's prompt given as token ids."""


class RoutingPolicy(StrEnum):
    """How a model's requests choose among its eligible nodes (`routing.policy`, `[routing.model_policy]`)."""

    LEAST_CONNECTIONS = "least_connections"
    """The node with the fewest requests in flight; ties at random."""
    PREFIX_AFFINITY = "prefix_affinity"
    """The node that served the request's longest known prefix, within the imbalance bound; else least
    connections."""


class AffinityResult(StrEnum):
    """What prefix-aware routing did for one request (the `result` label of `qiip_prefix_affinity_total`)."""

    HIT = "hit"
    """Sent to the node that served its longest known prefix."""
    MISS = "miss"
    """No prefix of it is known on an eligible node (a first turn, an expired entry, a node gone or tried):
    least-connections."""
    OVERLOADED = "overloaded"
    """Its prefix is known, but every node holding one is loaded beyond the imbalance bound: least-connections."""


class _Loaded(Protocol):
    """What affinity needs of a candidate node: its id and its requests in flight (`NodeState`)."""

    @property
    def id(self) -> str: ...

    @property
    def in_flight(self) -> int: ...


_Node = TypeVar("_Node", bound=_Loaded)


def prefix_hashes(model: str, api: str | None, payload: Mapping[str, Any]) -> tuple[int, ...]:
    """The chained hashes of a request's leading blocks, shortest prefix first.

    A chat's blocks are its `messages` (role with content, or with `tool_calls` when content is null; the
    OpenAI chat message shape; a long content sampled, `SAMPLED_MESSAGE_CHARS`); a completion's are
    `PROMPT_BLOCK_CHARS`-character blocks of a text `prompt`, or `PROMPT_BLOCK_TOKENS`-token blocks of a
    token-id prompt (whole blocks only). At most `MAX_BLOCKS`.

    Args:
        model: the requested model (part of every hash, so models never share entries).
        api: `chat` or `completions`; any other API (embeddings hold no KV cache) has no prefix.
        payload: the request body, as the parse step decoded it.

    Returns:
        The hashes (empty when the request has no usable prefix: a malformed `messages`, a batch of prompts).
    """
    seed = hash((model, api))
    if api == "chat":
        messages = payload.get("messages")
        return _message_hashes(seed, messages) if type(messages) is list else ()
    if api == "completions":
        prompt = payload.get("prompt")
        if type(prompt) is str:
            size = PROMPT_BLOCK_CHARS
            count = min(len(prompt) // size, MAX_BLOCKS)
            return _chained(seed, [prompt[i * size : (i + 1) * size] for i in range(count)])
        if type(prompt) is list and prompt and all(type(t) is int for t in prompt[: PROMPT_BLOCK_TOKENS * 4]):
            size = PROMPT_BLOCK_TOKENS
            count = min(len(prompt) // size, MAX_BLOCKS)
            return _chained(seed, [tuple(prompt[i * size : (i + 1) * size]) for i in range(count)])
    return ()


def _message_hashes(seed: int, messages: list[Any]) -> tuple[int, ...]:
    # One plain loop: this runs on every chat request, at a few hundred nanoseconds a message.
    hashes = []
    current = seed
    for message in messages[:MAX_BLOCKS]:
        if type(message) is not dict:
            break
        role, content = message.get("role"), message.get("content")
        if type(content) is not str:
            # Parts (text, images) or tool calls: their text form, deterministic for the same JSON.
            try:
                content = repr(content if content is not None else message.get("tool_calls"))
            except RecursionError:
                break  # nested as deep as the parser allowed, deeper than repr can follow here: no prefix past it
        size = len(content)
        if size > SAMPLED_MESSAGE_CHARS:
            # A long message is known by its length and three samples: hashing all of a fresh string costs
            # about 1 µs per KB, as much again as parsing it.
            content = (size, content[:96], content[-96:])
        current = hash((current, role if type(role) is str else None, content))
        hashes.append(current)
    return tuple(hashes)


def _chained(seed: int, blocks: list[object]) -> tuple[int, ...]:
    hashes = []
    current = seed
    for block in blocks:
        current = hash((current, block))
        hashes.append(current)
    return tuple(hashes)


class PrefixAffinity:
    """The map from prefix hashes to the node that last served them, with the routing policy per model.

    Args:
        policy: the default policy.
        model_policy: per-model overrides, by model id.
        max_entries: the most prefix hashes held; the least recently used go first.
        ttl_s: seconds a hash is kept after it was last recorded or used.
        imbalance_requests: the affinity node may have this many more requests in flight than the least-loaded
            candidate ...
        imbalance_ratio: ... or, when larger, `floor(imbalance_ratio × least)` more.
        clock: monotonic seconds (tests inject one).

    Raises:
        ValueError: `max_entries` < 1, `ttl_s` <= 0, or a negative imbalance.
    """

    def __init__(
        self,
        *,
        policy: RoutingPolicy = RoutingPolicy.PREFIX_AFFINITY,
        model_policy: Mapping[str, RoutingPolicy] | None = None,
        max_entries: int = 50_000,
        ttl_s: float = 600.0,
        imbalance_requests: int = 2,
        imbalance_ratio: float = 0.25,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_entries < 1 or ttl_s <= 0 or imbalance_requests < 0 or imbalance_ratio < 0:
            raise ValueError("max_entries and ttl_s must be positive, the imbalance bounds not negative")
        self.policy = policy
        self.model_policy = dict(model_policy or {})
        self.max_entries = max_entries
        self.ttl_s = ttl_s
        self.imbalance_requests = imbalance_requests
        self.imbalance_ratio = imbalance_ratio
        self._clock = clock
        # hash -> (node id, expiry in `clock` seconds), least recently used first.
        self._entries: OrderedDict[int, tuple[str, float]] = OrderedDict()
        self.results: dict[tuple[str, AffinityResult], int] = {}
        """Requests routed with a prefix, by model and result, since start (read by `/metrics`)."""
        self.recorded: list[tuple[str, tuple[int, ...]]] | None = None
        """With several serving processes (`server.workers`): what `record` recorded since the last
        `take_recorded`, as (node id, hashes), for the other processes to `learn`; None (the default): not kept."""

    def __len__(self) -> int:
        return len(self._entries)

    def prefix_of(self, model: str, api: str | None, payload: Mapping[str, Any]) -> tuple[int, ...]:
        """`prefix_hashes` of a request whose model routes by prefix affinity; () for any other."""
        if self.model_policy.get(model, self.policy) is not RoutingPolicy.PREFIX_AFFINITY:
            return ()
        return prefix_hashes(model, api, payload)

    def allowed_extra(self, least: int) -> int:
        """How many more requests in flight than `least` (the least-loaded candidate's) the affinity node may
        have: `max(imbalance_requests, floor(imbalance_ratio × least))`."""
        return max(self.imbalance_requests, math.floor(self.imbalance_ratio * least))

    def choose(self, model: str, candidates: Sequence[_Node], prefix: Sequence[int]) -> _Node | None:
        """The candidate holding the longest known prefix of the request, within the imbalance bound.

        Args:
            model: the model (for the result counts).
            candidates: the eligible nodes not yet tried by this request; not empty.
            prefix: the request's `prefix_hashes`, shortest first.

        Returns:
            The affinity node, or None: the caller falls back to least-connections (and the result is counted
            as `miss` or `overloaded`).
        """
        entries, now = self._entries, self._clock()
        least = min(c.in_flight for c in candidates)
        limit = least + self.allowed_extra(least)
        overloaded = False
        for key in reversed(prefix):
            entry = entries.get(key)
            if entry is None:
                continue
            node_id, expires = entry
            if expires <= now:
                del entries[key]
                continue
            for candidate in candidates:
                if candidate.id == node_id:
                    if candidate.in_flight <= limit:
                        self._count(model, AffinityResult.HIT)
                        return candidate
                    overloaded = True
                    break
        self._count(model, AffinityResult.OVERLOADED if overloaded else AffinityResult.MISS)
        return None

    def record(self, prefix: Sequence[int], node_id: str) -> None:
        """Remember that `node_id` now holds the request's prefixes: its longest `RECORDED_BLOCKS` hashes."""
        if self.recorded is not None:
            self.recorded.append((node_id, tuple(prefix[-RECORDED_BLOCKS:])))
        self.learn(node_id, prefix)

    def learn(self, node_id: str, prefix: Sequence[int]) -> None:
        """Remember that `node_id` holds these prefixes, as another serving process routed them (`record`
        without keeping it for the others)."""
        entries = self._entries
        expires = self._clock() + self.ttl_s
        for key in prefix[-RECORDED_BLOCKS:]:
            entries[key] = (node_id, expires)
            entries.move_to_end(key)
        while len(entries) > self.max_entries:
            entries.popitem(last=False)

    def known(self) -> list[tuple[str, tuple[int, ...]]]:
        """Every prefix in the map, least recently used first, as (node id, hashes) runs of one node each: what a
        process starting beside this one (`server.workers`) `learn`s to begin with the same map."""
        now = self._clock()
        runs: list[tuple[str, list[int]]] = []
        for key, (node_id, expires) in self._entries.items():
            if expires <= now:
                continue
            if runs and runs[-1][0] == node_id:
                runs[-1][1].append(key)
            else:
                runs.append((node_id, [key]))
        return [(node_id, tuple(keys)) for node_id, keys in runs]

    def take_recorded(self) -> list[tuple[str, tuple[int, ...]]]:
        """What `record` recorded since the last call (empty when not kept)."""
        recorded = self.recorded
        if not recorded:
            return []
        self.recorded = []
        return recorded

    def _count(self, model: str, result: AffinityResult) -> None:
        key = (model, result)
        self.results[key] = self.results.get(key, 0) + 1
