"""Prefix-aware placement for the data-parallel front end: SGLang's cache-aware router, small.

Each rank has a prefix cache of its own (cache/prefix_cache.py), so a prompt that starts as an
earlier one did (a shared system prompt, the next turn of a conversation that resends its history)
hits only on the rank that ran the earlier one. With prefix caching on and more than one rank, the
front end remembers, per rank, the block keys of the prompts it sent there, and a request goes to
the rank with the longest remembered match of its own keys, as long as that rank's load is at most
the least-loaded rank's plus ROUTE_SLACK_TOKENS; otherwise, and when no rank matches, to the least
loaded rank (lowest rank on ties), as without prefix caching.

Keys: the ranks' own (`prefix_index.root_key` / `block_keys` over the salt and block size each rank
reports when it is ready, `PrefixKeying`, and the request's `cache_salt`), for the whole blocks
before a prompt's last token: those a rank looks up and caches for it.

The memory is approximate, as SGLang's: it does not see a rank evict blocks (a request sent on a
stale match computes its prompt, as anywhere else); it holds at most MAX_ROUTED_BLOCKS (rank, block)
entries, the least recently routed out first (a prompt's blocks are refreshed leaf first, so a
prefix never leaves before its extensions); a prefix-cache reset clears it.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from ..cache.prefix_index import block_keys, root_key
from .dp_messages import PrefixKeying, RankRequest

# How much more load (waiting + running tokens) than the least-loaded rank a rank may have and still
# get a request for its cached prefix: 32 blocks, a long shared prefix's prefill saved against a
# few steps of queueing on a busier rank.
ROUTE_SLACK_TOKENS = 4096
# (rank, block key) entries remembered: 8M prompt tokens of 128-token blocks, a few MB.
MAX_ROUTED_BLOCKS = 1 << 16


def route(matches: Sequence[int], loads: Sequence[int], slack: int = ROUTE_SLACK_TOKENS) -> int:
    """The rank for one request: of the ranks whose load is at most min(loads) + `slack`, the one
    with the most matched blocks, then the least load, then the lowest rank. With no match anywhere
    this is the least-loaded rank."""
    if len(matches) != len(loads) or not loads:
        raise ValueError(f"route: {len(matches)} matches and {len(loads)} loads; need one of each "
                         "per rank")
    floor = min(loads)
    return min(range(len(loads)),
               key=lambda r: (loads[r] > floor + slack, -matches[r], loads[r], r))


class PrefixRouter:
    """What the front end sent where, and `place`, its choice for the next request."""

    def __init__(self, keying: PrefixKeying, world: int, slack: int = ROUTE_SLACK_TOKENS,
                 capacity: int = MAX_ROUTED_BLOCKS):
        if capacity < 1 or slack < 0:
            raise ValueError(f"PrefixRouter: capacity={capacity} (>= 1), slack={slack} (>= 0)")
        self.keying, self.world, self.slack, self.capacity = keying, world, slack, capacity
        self._seen: OrderedDict[tuple[int, bytes], None] = OrderedDict()   # oldest first

    def __len__(self) -> int:
        return len(self._seen)

    def keys(self, request: RankRequest) -> list[bytes]:
        """The keys a rank's prefix cache looks `request` up by: its whole blocks before its last
        prompt token (none for ids that are not int64s: the rank's engine refuses the request)."""
        ids, k = request.prompt_token_ids, self.keying
        try:
            return block_keys(root_key(*k.salt, request.cache_salt), ids[:len(ids) - 1],
                              k.block_size)
        except (OverflowError, TypeError, ValueError):
            return []

    def matches(self, keys: Sequence[bytes]) -> list[int]:
        """Per rank, how many of `keys` (from the first on) were sent there."""
        out = []
        for rank in range(self.world):
            n = 0
            while n < len(keys) and (rank, keys[n]) in self._seen:
                n += 1
            out.append(n)
        return out

    def place(self, request: RankRequest, loads: Sequence[int]) -> int:
        """The rank for `request` (`route`), remembered as holding its blocks from now on."""
        keys = self.keys(request)
        rank = route(self.matches(keys), loads, self.slack)
        seen = self._seen
        for key in reversed(keys):          # leaf first: the root side ends up the most recent
            seen[(rank, key)] = None
            seen.move_to_end((rank, key))
        while len(seen) > self.capacity:
            seen.popitem(last=False)
        return rank

    def clear(self) -> None:
        self._seen.clear()
