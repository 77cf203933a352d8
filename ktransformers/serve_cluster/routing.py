"""Prefix-affine routing: which replica a request goes to.

A replica's prefix cache holds the KV pages of the prompts it served; a request whose prompt
starts the way an earlier one did prefills only the rest *on that replica*.  So the router keeps
a table from the keys a request carries to the replica that last served them:

* **sticky ids** — state a server keeps under an id (``previous_response_id``, ``conversation``,
  an Assistants thread in the path): the replica that answered holds that conversation's pages;
* **the prompt chain** — chained hashes of the prompt's leading blocks (one block per chat
  message / Responses input item, or per :data:`BLOCK_CHARS` characters of a plain prompt), so
  turn *n + 1* of a conversation, which repeats turn *n*'s messages, matches turn *n*'s keys.

:meth:`AffinityPolicy.choose` takes the replica owning a sticky id, else the one owning the
longest chain prefix, unless it already runs ``spill_at`` requests and another live replica runs
fewer: then, as for a request no replica holds, the least-loaded live replica.  The keys are the
router's view only; the replica's own prefix cache decides, by token ids, what is reused.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections import OrderedDict
from dataclasses import dataclass
from typing import Iterable, Sequence

#: characters per block of a plain-text prompt (a few KV pages of a typical tokenizer)
BLOCK_CHARS = 256
#: blocks of a prompt hashed at most (a longer prompt routes by its first ones)
MAX_BLOCKS = 512
#: keys the table remembers; the least recently used are forgotten first
MAX_KEYS = 1 << 16
#: requests a replica may run before new ones spill to a less-loaded replica
DEFAULT_SPILL_AT = 4
#: how much of a response the router reads for the ids it creates (``resp_…``, ``conv_…``)
ID_SCAN_BYTES = 8192

#: ids under which a server keeps a conversation's state (the server's ``new_id`` prefixes)
_ID_IN_BODY = re.compile(rb'"id"\s*:\s*"((?:resp|conv|thread)_[A-Za-z0-9]{1,64})"')
_ID_IN_PATH = re.compile(r"^/v1/(threads|conversations|responses)/((?:thread|conv|resp)_[A-Za-z0-9]{1,64})(?:/|$)")


class NoLiveReplica(Exception):
    """Every replica is marked down."""


@dataclass(frozen=True)
class RouteKeys:
    """What a request offers the router: ``sticky`` ids, then ``chain`` keys (shortest prefix first)."""

    sticky: tuple[str, ...] = ()
    chain: tuple[str, ...] = ()

    def all(self) -> tuple[str, ...]:
        return self.sticky + self.chain


def _block(value) -> str:
    """One canonical text per message / input item (key order and spacing do not matter)."""
    if isinstance(value, str):
        return value
    return json.dumps(value, sort_keys=True, ensure_ascii=False, default=str, separators=(",", ":"))


def _text_blocks(text: str) -> list[str]:
    return [text[i:i + BLOCK_CHARS] for i in range(0, min(len(text), BLOCK_CHARS * MAX_BLOCKS), BLOCK_CHARS)]


def _prompt_blocks(body: dict) -> list[str]:
    """The prompt's blocks in the order the server renders them: system / instructions first."""
    blocks: list[str] = []
    for field in ("system", "instructions"):
        if isinstance(body.get(field), str):
            blocks.append(f"{field}\x00{body[field]}")
    for field in ("messages", "input", "prompt"):
        value = body.get(field)
        if isinstance(value, str):
            blocks += _text_blocks(value)
        elif isinstance(value, list) and value:
            if field == "prompt":  # completions: a batch of prompts routes by its first
                first = value[0]
                blocks += _text_blocks(first) if isinstance(first, str) else [_block(first)]
            else:
                blocks += [_block(m) for m in value[:MAX_BLOCKS]]
    return blocks[:MAX_BLOCKS]


def chain_keys(blocks: Iterable[str]) -> tuple[str, ...]:
    """``key(i) = H(key(i-1), block i)``: a key names its block and every block before it."""
    keys, parent = [], b"kt-route"
    for b in blocks:
        parent = hashlib.blake2b(parent + b.encode("utf-8", "surrogatepass"), digest_size=12).digest()
        keys.append(parent.hex())
    return tuple(keys)


def route_keys(path: str, body: bytes | None) -> RouteKeys:
    """The keys of a request (any body: one that is not a JSON object has none)."""
    sticky: list[str] = []
    m = _ID_IN_PATH.match(path)
    if m:
        sticky.append(m.group(2))
    obj = None
    if body:
        try:
            obj = json.loads(body)
        except (ValueError, RecursionError):
            obj = None
    if not isinstance(obj, dict):
        return RouteKeys(tuple(sticky))
    prev = obj.get("previous_response_id")
    if isinstance(prev, str) and prev:
        sticky.append(prev)
    conv = obj.get("conversation")
    conv = conv.get("id") if isinstance(conv, dict) else conv
    if isinstance(conv, str) and conv:
        sticky.append(conv)
    thread = obj.get("thread_id")
    if isinstance(thread, str) and thread:
        sticky.append(thread)
    return RouteKeys(tuple(sticky), chain_keys(_prompt_blocks(obj)))


def ids_in_response(head: bytes) -> list[str]:
    """Conversation-state ids a response creates (read from its first :data:`ID_SCAN_BYTES`)."""
    return [m.decode() for m in _ID_IN_BODY.findall(head[:ID_SCAN_BYTES])]


class AffinityPolicy:
    """The routing table and the replicas' in-flight counts (one router's view; not thread-safe:
    the router calls it from its event loop)."""

    def __init__(self, replicas: Sequence[str], *, spill_at: int = DEFAULT_SPILL_AT, max_keys: int = MAX_KEYS):
        if not replicas:
            raise ValueError("at least one replica is needed")
        if spill_at < 1:
            raise ValueError(f"spill_at must be at least 1, not {spill_at}")
        self.replicas = list(replicas)
        self.spill_at = spill_at
        self.max_keys = max_keys
        self.ids: OrderedDict[str, str] = OrderedDict()       # sticky id -> replica (its state: database)
        self.prefixes: OrderedDict[str, str] = OrderedDict()  # chain key -> replica (its prefix cache)
        self.in_flight = {r: 0 for r in self.replicas}
        self.down: set[str] = set()
        self._next = 0  # rotates ties between equally loaded replicas

    def live(self) -> list[str]:
        return [r for r in self.replicas if r not in self.down]

    def owner(self, keys: RouteKeys) -> str | None:
        """The live replica holding a sticky id, else the longest chain prefix; None if none."""
        for k in keys.sticky:
            r = self.ids.get(k)
            if r is not None and r not in self.down:
                return r
        for k in reversed(keys.chain):
            r = self.prefixes.get(k)
            if r is not None and r not in self.down:
                return r
        return None

    def least_loaded(self) -> str:
        live = self.live()
        if not live:
            raise NoLiveReplica("no replica is up")
        low = min(self.in_flight[r] for r in live)
        tied = [r for r in live if self.in_flight[r] == low]
        self._next += 1
        return tied[self._next % len(tied)]

    def choose(self, keys: RouteKeys) -> str:
        owner = self.owner(keys)
        if owner is None:
            return self.least_loaded()
        if self.in_flight[owner] < self.spill_at:
            return owner
        least = self.least_loaded()
        return least if self.in_flight[least] < self.in_flight[owner] else owner

    def record(self, keys: RouteKeys, replica: str) -> None:
        """``replica`` served a request with these keys: it holds its ids and its prompt's pages."""
        self._put(self.ids, keys.sticky, replica)
        self._put(self.prefixes, keys.chain, replica)

    def learn_ids(self, ids: Iterable[str], replica: str) -> None:
        """``replica`` created these ids (a response, a conversation): later requests naming them go there."""
        self._put(self.ids, ids, replica)

    def _put(self, table: OrderedDict, keys: Iterable[str], replica: str) -> None:
        for k in keys:
            table[k] = replica
            table.move_to_end(k)
        while len(table) > self.max_keys:
            table.popitem(last=False)

    def started(self, replica: str) -> None:
        self.in_flight[replica] += 1

    def finished(self, replica: str) -> None:
        self.in_flight[replica] = max(0, self.in_flight[replica] - 1)

    def mark_down(self, replica: str) -> None:
        """A replica that failed: no new request goes there until :meth:`mark_up`.  Its prefix
        cache died with it, so its prompt keys are forgotten; the ids stay (their rows are in
        the database, which outlives the process)."""
        self.down.add(replica)
        for k in [k for k, r in self.prefixes.items() if r == replica]:
            del self.prefixes[k]

    def mark_up(self, replica: str) -> None:
        self.down.discard(replica)
