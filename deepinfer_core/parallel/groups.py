"""Rank layout and process groups for DP attention + MoE expert parallelism.

Invariants:
* One process per rank. Every rank runs attention on its own sequences (data parallel); when
  `expert_parallel` is on, the routed experts are sharded over the EP group, which spans all ranks
  (ep == world), so EP rank == global rank. Tensor parallelism is not used for V4: size 1 only (with
  one K=V head, every TP rank would hold the whole KV cache).
* All ranks create the same groups in the same order (torch.distributed requires it), and every device
  group is warmed with one tiny all-reduce right after creation: NCCL communicators of subgroups are
  created lazily, and a first collective inside a CUDA graph or a DeepEP buffer must not be the one that
  builds them.
* A world of one needs no torch.distributed at all: the groups are None and the EP layer runs its local
  path (`ep_comm.dispatch(..., group=None)`).
* Nothing here reads the environment except `ParallelLayout.from_env` and the rendezvous address in
  `init_process_groups` (torchrun's variables), both meant for the entry point.
"""
from __future__ import annotations

import datetime
import os
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..device_module import device_module, device_type

DEFAULT_TIMEOUT_S = 14400.0      # DEEPINFER_GLOO_TIMEOUT default; tests pass 60 s so hangs fail fast
DEFAULT_MASTER_ADDR = "localhost"
DEFAULT_MASTER_PORT = 23333      # DS-DeepInfer's default rendezvous port


def _check_int(name: str, value: object, minimum: int) -> int:
    # bool is an int subclass; True as a size is always a caller bug
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}={value!r}: must be an int >= {minimum}")
    return value


@dataclass(frozen=True)
class ParallelLayout:
    """Where this process sits: `world_size` ranks = `data_parallel_size` × `tensor_parallel_size`."""

    world_size: int
    rank: int
    data_parallel_size: int
    expert_parallel: bool
    tensor_parallel_size: int = 1

    def __post_init__(self) -> None:
        _check_int("world_size", self.world_size, 1)
        _check_int("rank", self.rank, 0)
        if self.rank >= self.world_size:
            raise ValueError(f"rank={self.rank}: must be in [0, {self.world_size}) for world_size={self.world_size}")
        _check_int("tensor_parallel_size", self.tensor_parallel_size, 1)
        if self.tensor_parallel_size != 1:
            raise ValueError(f"tensor_parallel_size={self.tensor_parallel_size}: allowed values: 1 (V4 attention "
                             "has a single KV head, so ranks split sequences (DP attention), not heads)")
        _check_int("data_parallel_size", self.data_parallel_size, 1)
        if self.data_parallel_size * self.tensor_parallel_size != self.world_size:
            allowed = self.world_size // self.tensor_parallel_size
            raise ValueError(f"data_parallel_size={self.data_parallel_size}: data_parallel_size × "
                             f"tensor_parallel_size must equal world_size={self.world_size}; allowed "
                             f"value: {allowed}")
        if not isinstance(self.expert_parallel, bool):
            raise ValueError(f"expert_parallel={self.expert_parallel!r}: allowed values: True, False")

    @property
    def ep_size(self) -> int:
        """Ranks that share the routed experts; the EP group is all ranks when EP is on."""
        return self.world_size if self.expert_parallel else 1

    @property
    def ep_rank(self) -> int:
        return self.rank if self.expert_parallel else 0

    @property
    def dp_rank(self) -> int:
        return self.rank // self.tensor_parallel_size

    @classmethod
    def from_env(cls, expert_parallel: bool = True, data_parallel_size: int | None = None,
                 env: Mapping[str, str] | None = None) -> ParallelLayout:
        """The layout torchrun describes (RANK, WORLD_SIZE; a single process when unset).
        `data_parallel_size` defaults to the world size (no TP)."""
        env = os.environ if env is None else env
        world = _env_int(env, "WORLD_SIZE", 1)
        rank = _env_int(env, "RANK", 0)
        dp = world if data_parallel_size is None else data_parallel_size
        return cls(world_size=world, rank=rank, data_parallel_size=dp, expert_parallel=expert_parallel)


def _env_int(env: Mapping[str, str], name: str, default: int) -> int:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r}: must be an integer") from None


@dataclass(frozen=True)
class ProcessGroups:
    """The groups of one rank. None everywhere for a world of one (local path, no torch.distributed).

    `world`: all ranks on the device backend (DP votes, all-reduces of counts). `cpu`: gloo twin of
    `world` for CPU control traffic (the same group when the backend is gloo). `ep`: the EP group on the
    device backend, or None when experts are replicated (expert_parallel off) or the world is one rank.
    `ep_graph`: the EP ranks again, on a communicator only decode CUDA graphs use (`graph_ep`), else None.
    """

    layout: ParallelLayout
    backend: str | None
    world: dist.ProcessGroup | None
    cpu: dist.ProcessGroup | None
    ep: dist.ProcessGroup | None
    ep_graph: dist.ProcessGroup | None = None


def _backend_map() -> dict[str, str]:
    """torch.distributed's device type -> backend (torch 2.13: cpu gloo, cuda nccl, xpu xccl, mps gloo;
    torch_npu adds npu hccl on import: `Backend.register_backend("hccl", ..., devices=["npu"])`)."""
    return dict(dist.Backend.default_device_backend_map)


def _known_backends() -> str:
    return ", ".join(f"{kind} -> {name}" for kind, name in _backend_map().items())


def device_backend(device: torch.device | str) -> str:
    """The process-group backend of a device: torch.distributed's default for its type (gloo for the
    CPU, nccl for CUDA, hccl for an NPU once torch_npu is imported)."""
    kind = device_type(device)
    backend = _backend_map().get(kind)
    if backend is None:
        raise ValueError(f"device={str(device)!r}: torch.distributed has no backend for device type {kind!r}; "
                         f"registered: {_known_backends()} (torch_npu registers npu -> hccl when imported)")
    return backend


def rendezvous_address(env: Mapping[str, str] | None = None) -> str:
    """tcp://MASTER_ADDR:MASTER_PORT as torchrun sets them (defaults localhost:23333)."""
    env = os.environ if env is None else env
    addr = env.get("MASTER_ADDR") or DEFAULT_MASTER_ADDR
    port = _env_int(env, "MASTER_PORT", DEFAULT_MASTER_PORT)
    if not 0 < port < 65536:
        raise ValueError(f"environment variable MASTER_PORT={port}: must be in [1, 65535]")
    return f"tcp://{addr}:{port}"


def init_process_groups(layout: ParallelLayout, backend: str = "gloo", init_method: str | None = None,
                        timeout_s: float = DEFAULT_TIMEOUT_S, device: torch.device | None = None,
                        env: Mapping[str, str] | None = None, graph_ep: bool = False) -> ProcessGroups:
    """Join the world (once per process) and build the EP group; every rank must call this.

    `init_method`: a torch.distributed URL; None = tcp://MASTER_ADDR:MASTER_PORT from `env` (default
    os.environ). If RANK / WORLD_SIZE are set there (torchrun) they must agree with `layout`.
    `backend`: one of torch.distributed's device backends (`device_backend(device)` chooses it).
    `device`: where the warm-up tensors live (default: the CPU for gloo, else the current device of the
    type the backend serves: the rank's GPU for nccl, its NPU for hccl).
    `graph_ep`: also an EP group for the exchanges decode CUDA graphs hold. torch's NCCL process group
    keeps per-collective host state that a graph's capture advances and its replays do not, so the
    collectives replayed from graphs get a communicator that eager collectives never use.
    """
    allowed = sorted(set(_backend_map().values()))
    if backend not in allowed:
        raise ValueError(f"backend={backend!r}: allowed values: {', '.join(allowed)} (the device backends "
                         f"torch.distributed has registered: {_known_backends()})")
    if not timeout_s > 0:
        raise ValueError(f"timeout_s={timeout_s!r}: must be > 0 seconds")
    if layout.world_size == 1 and not dist.is_initialized():
        return ProcessGroups(layout, None, None, None, None)
    env = os.environ if env is None else env
    for name, want in (("RANK", layout.rank), ("WORLD_SIZE", layout.world_size)):
        got = _env_int(env, name, want)
        if got != want:       # a launcher that disagrees with the config would pair the wrong ranks
            raise ValueError(f"environment variable {name}={got} disagrees with the layout ({name.lower()}={want})")
    timeout = datetime.timedelta(seconds=timeout_s)
    if dist.is_initialized():
        if (dist.get_rank(), dist.get_world_size()) != (layout.rank, layout.world_size):
            raise ValueError(f"torch.distributed is already initialised as rank {dist.get_rank()} of "
                             f"{dist.get_world_size()}, not rank {layout.rank} of {layout.world_size}")
    else:
        dist.init_process_group(backend, init_method=init_method or rendezvous_address(env),
                                rank=layout.rank, world_size=layout.world_size, timeout=timeout)
    world = dist.group.WORLD
    # control traffic (votes, small CPU tensors) must not need a device: a gloo twin when world is nccl
    cpu = world if backend == "gloo" else dist.new_group(backend="gloo", timeout=timeout)
    ep = ep_graph = None
    if layout.expert_parallel:
        # its own communicator even though it spans the world: dispatch/combine never queue behind
        # (or interleave with) other collectives on `world`
        ep = dist.new_group(ranks=list(range(layout.world_size)), backend=backend, timeout=timeout)
        if graph_ep:
            ep_graph = dist.new_group(ranks=list(range(layout.world_size)), backend=backend, timeout=timeout)
    warm_device = device if device is not None else _default_device(backend)
    for group in (world, ep, ep_graph):
        if group is not None:
            dist.all_reduce(torch.zeros(1, device=warm_device), group=group)
    return ProcessGroups(layout, backend, world, cpu, ep, ep_graph)


def _default_device(backend: str) -> torch.device:
    kinds = [kind for kind, name in _backend_map().items() if name == backend]
    if "cpu" in kinds or not kinds:
        return torch.device("cpu")
    return torch.device(kinds[0], device_module(kinds[0]).current_device())


def destroy_process_groups(groups: ProcessGroups) -> None:
    """Leave torch.distributed (all groups); a no-op for the local world of one."""
    if groups.world is not None and dist.is_initialized():
        dist.destroy_process_group()


def group_size_rank(group: dist.ProcessGroup | None) -> tuple[int, int]:
    """(size, rank) in `group`; None is the local world of one."""
    if group is None:
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def all_gather_rows(out: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """out = concatenation over the ranks of `group` (in rank order) of each rank's `inp` along dim 0.

    Every rank passes the same `inp` shape; `out` has `inp`'s shape with dim 0 × group size (a flat
    output for a 2-D input is refused by gloo). torch 2.13 deprecates `all_gather_into_tensor` in favour
    of `all_gather_single`; this picks whichever the installed torch has, so callers never see the warning.
    """
    size, _ = group_size_rank(group)
    want = (inp.shape[0] * size, *inp.shape[1:])
    if tuple(out.shape) != want:
        raise ValueError(f"out.shape={tuple(out.shape)}: must be {want} (input shape with dim 0 × group size {size})")
    if group is None:
        out.copy_(inp)
        return out
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, inp.contiguous(), group=group)
    return out
