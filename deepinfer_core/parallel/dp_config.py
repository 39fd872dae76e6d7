"""What the data-parallel ranks run with, resolved and checked by the front end before any rank
starts: their device (unset: the detected platform's), the accelerators they need (one each, through
the device type's torch module: `RankDevices`), their drafts (unset = 0), the CUDA-graph refusals,
and the collective timeout."""

from __future__ import annotations

from ..device_module import RankDevices, device_type, rank_devices
from ..engine_config import EngineConfig

DEFAULT_TIMEOUT_S = 60.0  # collective timeout of CPU ranks (a hung peer fails after this)
# of accelerator ranks (GPU, NPU): a rank may compile kernels for minutes while its peers wait
GPU_TIMEOUT_S = 900.0


def collective_timeout(device: str | None) -> float:
    """How long a rank's collectives wait for a hung peer (a rank that dies is seen at once by the
    front end either way)."""
    return DEFAULT_TIMEOUT_S if device is None or device_type(device) == "cpu" else GPU_TIMEOUT_S


def rank_config(config: EngineConfig, node_ranks: int | None = None) -> EngineConfig:
    """The ranks' device and drafts resolved. One engine process (engine_process=True,
    data_parallel_size 1) keeps the options as they are: it is the in-process engine moved to a
    child. Several ranks run where the options say (unset: the detected platform's device): an
    accelerator type ('cuda', 'npu') puts rank r on device r of this host, which must have that many
    (`node_ranks`: under torchrun, the ranks of this node); 'cpu' runs them all on the host's cores.
    Unset drafts are 0 (speculation under DP is asked for by number)."""
    dp = config.parallel.data_parallel_size
    if dp == 1:
        return config
    device = config.model.device
    if device is None:
        platform = detect_platform()
        device = platform.device_type
        try:
            ranks = rank_devices(device)
        except ValueError as exc:
            raise ValueError(
                f"data_parallel_size={dp}: the detected platform is {platform.name!r} (device "
                f"{device!r}), which has no data-parallel ranks yet; allowed: device='cuda' or "
                f"'cpu', or an accelerator whose torch module is there ({exc})"
            ) from None
    else:
        ranks = rank_devices(device)
    if ranks is not None:
        check_device_count(dp, ranks, node_ranks=node_ranks)
    drafts = config.speculative.num_speculative_tokens or 0
    if config.parallel.enable_ep_cuda_graphs:
        if device_type(device) != "cuda":
            raise ValueError(
                f"enable_ep_cuda_graphs=True with device={device!r}: CUDA graphs need GPU ranks; "
                "allowed: device='cuda', or enable_ep_cuda_graphs=False"
            )
        if config.model.enforce_eager:
            raise ValueError(
                "enable_ep_cuda_graphs=True with enforce_eager=True: one asks for CUDA graphs, the "
                "other forbids them; set one of them False"
            )
        if drafts:
            raise ValueError(
                f"enable_ep_cuda_graphs=True with num_speculative_tokens={drafts}: the graphs "
                "cover decode steps only (verify steps would run eagerly, and the ranks must agree "
                "on every step's kind); allowed: num_speculative_tokens=0"
            )
    return config.replace(device=device, num_speculative_tokens=drafts)


def check_device_count(dp: int, ranks: RankDevices, available: int | None = None,
                       node_ranks: int | None = None) -> None:
    """Rank r runs on device r: a host with fewer devices of the type (as its visibility variable,
    e.g. CUDA_VISIBLE_DEVICES, shows them) is refused at once, before any rank starts. Under
    torchrun (`node_ranks`: LOCAL_WORLD_SIZE) local rank r runs on device r of its node, and this
    node must have `node_ranks`."""
    if available is None:
        available = ranks.count()
    kind, units = ranks.type, f"{ranks.unit}s"
    if node_ranks is not None and available < node_ranks:
        raise ValueError(
            f"data_parallel_size={dp} with device={kind!r} and launcher='torchrun' needs "
            f"{node_ranks} {units} on this node (LOCAL_WORLD_SIZE={node_ranks}, local rank r on "
            f"{ranks.unit} r); this process sees {available} ({ranks.visible}); allowed: torchrun "
            f"--nproc-per-node <= {available}, or device='cpu'"
        )
    if node_ranks is None and available < dp:
        raise ValueError(
            f"data_parallel_size={dp} with device={kind!r} needs {dp} {units} (rank r on "
            f"{ranks.unit} r); this process sees {available} ({ranks.visible}); allowed: "
            f"data_parallel_size <= {available}, or device='cpu'"
        )


def detect_platform():
    from ..plugins import get_plugin_manager

    return get_plugin_manager().detect_platform()
