"""Multi-rank execution (DP attention + MoE expert parallelism). `expert_map` (physical slots, the
logical<->physical maps, replica choice) and `eplb` (load statistics, rearrangement schedule,
placement policies) are pure PyTorch and need no process group.

Import the submodules directly: this package imports nothing on its own.
"""
