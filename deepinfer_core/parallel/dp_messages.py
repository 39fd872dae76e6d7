"""What the data-parallel front end (dp_engine.py, dp_online.py) and its ranks (dp_worker.py) send
each other: the rank's start-up spec and how its prefix cache keys blocks, the requests, the reports
after an iteration or a run, and the answers to a prefix-cache reset.

All of it is pickled: over the spawned ranks' queues and pipes, or over the socket connections of
ranks in other torchrun processes (torchrun.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..api.sampling_params import SamplingParams
from ..engine_config import EngineConfig


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a rank needs (pickled to the spawned child, or sent to a torchrun rank)."""

    rank: int
    world_size: int
    init_method: str  # tcp://host:port of the rendezvous, or env:// (torchrun's agent store)
    model_dir: str
    config: EngineConfig  # resolved once by the front end (device cpu, cuda, npu; drafts unset = 0)
    expert_parallel: bool
    num_redundant_experts: int
    timeout_s: float  # collective timeout: a hung peer becomes an error after this
    num_threads: int  # torch intra-op threads of this rank (ranks share the host's cores)
    # its index on its node (its GPU, its NPU); None = rank (all ranks on one host)
    local_rank: int | None = None

    def __post_init__(self) -> None:
        if self.local_rank is None:
            object.__setattr__(self, "local_rank", self.rank)


@dataclass(frozen=True)
class RankRequest:
    """One request as the front end resolved it (ids tokenized, seed derived), for one rank's
    engine."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int
    stream: bool = True  # per-step deltas (the server); False: only the finished output (generate)
    cache_salt: str | None = None   # prefix caching: shared only by requests with the same salt


@dataclass(frozen=True)
class PrefixKeying:
    """How a rank's prefix cache keys its blocks (cache/prefix_cache.py `PrefixCache.salt` and
    `block_size`), sent with its "ready" (None there: prefix caching off), so that the front end's
    router (dp_router.py) computes the keys the rank's cache computes."""

    salt: tuple  # what besides the tokens decides the cached state (model, dtype, QAT, ...)
    block_size: int  # tokens per cached block


@dataclass
class RankStats:
    """What one rank did in the last generate call (tests, logs)."""

    rank: int
    num_requests: int = 0
    iterations: int = 0  # lockstep iterations (equal on every rank by construction)
    forwards: int = 0  # engine steps that launched a model forward
    idle_forwards: int = 0  # placeholder MoE passes (iterations without a forward of its own)
    ep_graph_steps: int = 0  # iterations all ranks replayed a decode graph (enable_ep_cuda_graphs)
    num_preemptions: int = 0  # the scheduler's count over this rank's lifetime
    seconds: float = 0.0
    # speculative decoding (num_speculative_tokens > 0): the engine's SpecMetrics deltas this call
    spec_verify_steps: int = 0  # verifications (one per verify chunk)
    spec_drafted_tokens: int = 0
    spec_verified_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_proposer: str = ""  # the drafter's class (MTP: "" = the speculator's own MTP drafting)
    # VARLEN (enable_mtp_varlen): the ranks' shared step-time table, the lengths chosen this call
    varlen_ms: list[list[float]] = field(default_factory=list)
    varlen_chosen: list[int] = field(default_factory=list)
    # EPLB (enable_eplb), during this call: rearrangements and what they moved on this rank
    eplb_rearrangements: int = 0
    eplb_layers_changed: int = 0  # summed over rearrangements
    eplb_experts_received: int = 0  # expert copies received from other ranks
    eplb_experts_sent: int = 0
    eplb_bytes_received: int = 0
    eplb_bytes_sent: int = 0
    eplb_local_copies: int = 0  # slots filled from another slot of this rank
    eplb_seconds: float = 0.0  # time spent in rearrangements (plan + moves)
    # phys_to_log after each rearrangement
    eplb_placements: list[list[list[int]]] = field(default_factory=list)
    # (token, expert) pairs received per layer
    eplb_layer_pairs: list[int] = field(default_factory=list)
    # balance readings (eplb_stat_interval) this call
    eplb_moe_lb: list[float] = field(default_factory=list)

    def add_rearrangement(self, r) -> None:
        """Counts one `eplb_runtime.Rearrangement` of this rank."""
        m = r.moves
        self.eplb_rearrangements += 1
        self.eplb_layers_changed += m.layers_changed
        self.eplb_experts_received += m.experts_received
        self.eplb_experts_sent += m.experts_sent
        self.eplb_bytes_received += m.bytes_received
        self.eplb_bytes_sent += m.bytes_sent
        self.eplb_local_copies += m.local_copies
        self.eplb_seconds += r.seconds


@dataclass
class StepReport:
    """What a rank sends after a lockstep iteration with news: its finished step's outputs and its
    state."""

    rank: int
    outputs: list[Any]  # RequestOutputs of the step (deltas of streamed requests)
    # request id -> why its constraint never became ready (finished, "abort")
    refused: dict[str, str]
    invalid: dict[str, str]  # request id -> why add_request refused it (nothing runs)
    load: int  # waiting + running tokens of its unfinished sequences
    gauges: dict[str, float]  # serve/metrics.py scheduler_gauges of its engine
    consumed: int  # counted commands it has applied so far


@dataclass
class IdleReport:
    """Sent by every rank when the lockstep vote found no work anywhere: the run (wake .. idle)
    ended."""

    rank: int
    run: int  # runs so far (the same on every rank: they leave at the same vote)
    consumed: int
    load: int
    gauges: dict[str, float]
    stats: RankStats


@dataclass
class ResetReport:
    """A rank's answer to the ("reset_prefix_cache",) command, which it applies between two engine
    steps (or at once while idle) without starting a run: its `Engine.reset_prefix_cache()`."""

    rank: int
    reset: bool  # True: no cached prefix is left on it (False also when prefix caching is off)
    gauges: dict[str, float]  # scheduler_gauges after the reset (an idle rank sends no others)


EXIT_TEST_HOOK = 17
RESET_PREFIX_CACHE = "reset_prefix_cache"
# Commands that never start a run (nor count as consumed): the front end's wake bookkeeping ignores
# them.
UNCOUNTED = ("stop", "exit_at", RESET_PREFIX_CACHE)
