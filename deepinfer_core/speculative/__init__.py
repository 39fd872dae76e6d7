"""Speculative decoding: the MTP drafter (`mtp`, its CUDA graphs `mtp_graphs`), the engine's
speculative step (`engine_step`), a replay drafter for benchmarks (`replay`) and a reference loop
(`reference_loop`). Verification itself is `deepinfer_core.ops.verify`."""
