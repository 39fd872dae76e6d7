"""Ascend SoC families by `torch_npu.npu.get_soc_version()` (the integers vllm-ascend's
`device/hardware.py` maps; read, not verified on hardware): 260 = Ascend 950 (A5, this backend's
target), 220-225 = Atlas A2 (910B), 250-255 = Atlas A3 (910C / 910_93). Anything else is refused."""
from __future__ import annotations

from dataclasses import dataclass

A5, A3, A2 = "A5", "A3", "A2"
_RANGES = ((260, 260, A5, "Ascend 950 (A5)"), (250, 255, A3, "Atlas A3 (910C)"),
           (220, 225, A2, "Atlas A2 (910B)"))
SUPPORTED = "260 (Ascend 950, A5), 250-255 (Atlas A3), 220-225 (Atlas A2)"


@dataclass(frozen=True)
class Soc:
    version: int        # get_soc_version()
    family: str         # "A5" | "A3" | "A2"
    name: str

    @property
    def has_mx(self) -> bool:
        """MX (32-element E8M0-scaled) FP8/FP4 formats: Ascend 950 only."""
        return self.family == A5


def classify_soc(version: object) -> Soc:
    """The Soc of `version`, or ValueError naming the value and the supported ones."""
    if isinstance(version, bool) or not isinstance(version, int):
        raise ValueError(f"torch_npu.npu.get_soc_version() returned {version!r}; expected an int, "
                         f"supported: {SUPPORTED}")
    for lo, hi, family, name in _RANGES:
        if lo <= version <= hi:
            return Soc(version, family, name)
    raise ValueError(f"Ascend SoC version {version} (torch_npu.npu.get_soc_version()) is not "
                     f"supported by deepinfer-ascend; supported: {SUPPORTED}")
