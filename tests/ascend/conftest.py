"""Fixtures of the Ascend tests: the simulated `torch_npu` (see fake_npu/__init__.py's docstring
for the contract: what is faked, alias mode, the call recorder, choosing the SoC)."""
from __future__ import annotations

from pathlib import Path

import pytest
from fake_npu import SOC_A5, FakeNpu

BACKEND = Path(__file__).resolve().parents[2] / "backends" / "ascend950"


@pytest.fixture
def make_fake_npu():
    """Factory: `make_fake_npu(soc_version=260, device_count=1, mem_info=(free, total))` installs
    a fake torch_npu (one at a time) and returns its `FakeNpu`; removed at teardown."""
    made: list[FakeNpu] = []

    def make(soc_version: int = SOC_A5, device_count: int = 1,
             mem_info=(48 << 30, 64 << 30)) -> FakeNpu:
        fake = FakeNpu(soc_version, device_count, mem_info).install()
        made.append(fake)
        return fake

    yield make
    for fake in reversed(made):
        fake.uninstall()


@pytest.fixture
def fake_npu(request, make_fake_npu) -> FakeNpu:
    """A fake torch_npu for this test; SoC 260 (A5) unless parametrised indirectly
    (`@pytest.mark.parametrize("fake_npu", [223, 260], indirect=True)`)."""
    return make_fake_npu(getattr(request, "param", SOC_A5))


@pytest.fixture
def npu(fake_npu, monkeypatch):
    """The backend on the fake torch_npu in alias mode (its ops run on the CPU)."""
    monkeypatch.syspath_prepend(str(BACKEND))
    from deepinfer_ascend import plugin, runtime
    runtime.reset()
    monkeypatch.setattr(runtime, "DEVICE_TYPE", "cpu")
    yield plugin
    runtime.reset()
