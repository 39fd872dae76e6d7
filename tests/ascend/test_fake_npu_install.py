"""The fake torch_npu's install/uninstall contract (tests/ascend/fake_npu/__init__.py)."""
from __future__ import annotations

import importlib
import sys

import pytest
import torch
import torch.distributed as dist
from fake_npu import FakeNpu


def test_install_exposes_the_device_api_and_uninstall_removes_everything():
    assert "torch_npu" not in sys.modules and not hasattr(torch, "npu")
    had_hccl_check = hasattr(dist, "is_hccl_available")
    fake = FakeNpu(soc_version=253, device_count=2, mem_info=(5, 9)).install()
    try:
        import torch_npu
        from torch_npu._C._distributed_c10d import ProcessGroupHCCL

        assert torch.npu is torch_npu.npu and sys.modules["torch.npu"] is torch_npu.npu
        assert torch_npu.npu.is_available() and torch_npu.npu.device_count() == 2
        assert torch_npu.npu.get_soc_version() == 253
        assert torch.npu.mem_get_info() == (5, 9)
        torch.npu.set_device(1)
        assert torch.npu.current_device() == 1
        with pytest.raises(RuntimeError, match="ordinal 2"):
            torch.npu.set_device(2)
        assert (torch_npu.float4_e2m1fn_x2, torch_npu.hifloat8, torch_npu.float8_e8m0fnu) == (
            296, 290, 293)
        assert ProcessGroupHCCL.Options().hccl_config == {}
        assert dist.is_hccl_available()
        s = torch.npu.Stream()
        with torch.npu.stream(s):
            assert torch.npu.current_stream() is s
        assert torch.npu.current_stream() is not s
        torch_npu.npu.config.allow_internal_format = True
        torch_npu.npu.set_compile_mode(jit_compile=False)
        assert fake.state.compile_mode == {"jit_compile": False}
        assert not fake.state.transfer_to_npu_imported
        importlib.import_module("torch_npu.contrib.transfer_to_npu")
        assert fake.state.transfer_to_npu_imported
    finally:
        fake.uninstall()
    for name in ("torch_npu", "torch_npu.npu", "torch_npu.contrib", "torch_npu._C",
                 "torch_npu._C._distributed_c10d", "torch_npu.contrib.transfer_to_npu",
                 "torch.npu"):
        assert name not in sys.modules, name
    assert not hasattr(torch, "npu")
    assert hasattr(dist, "is_hccl_available") == had_hccl_check
    with pytest.raises(ImportError):
        importlib.import_module("torch_npu")


def test_fixture_default_soc_is_a5_and_records_calls(fake_npu):
    import torch_npu
    assert torch_npu.npu.get_soc_version() == 260 and fake_npu.soc_version == 260
    x = torch.ones(2, 4)
    torch_npu.npu_rms_norm(x, torch.ones(4), epsilon=1e-5)
    gamma = torch.ones(4)
    torch_npu.npu_rms_norm(x, gamma)
    assert [(name, sorted(args)) for name, args in torch_npu._calls] == [
        ("npu_rms_norm", ["epsilon", "gamma", "input"])] * 2
    assert torch_npu._calls[0][1]["epsilon"] == 1e-5 and torch_npu._calls[0][1]["input"] is x
    assert torch_npu._calls[1][1]["epsilon"] == 1e-6 and torch_npu._calls[1][1]["gamma"] is gamma
    assert torch_npu._calls is fake_npu.calls


@pytest.mark.parametrize("fake_npu", [223, 253], indirect=True)
def test_fixture_soc_is_parametrisable(fake_npu):
    import torch_npu
    assert torch_npu.npu.get_soc_version() in (223, 253)


def test_second_install_is_refused(fake_npu):
    with pytest.raises(RuntimeError, match="already installed"):
        FakeNpu().install()


def test_ops_refuse_to_run_without_an_installed_fake():
    from fake_npu import OPS
    with pytest.raises(RuntimeError, match="no fake NPU is installed"):
        OPS["npu_rms_norm"](torch.ones(2, 4), torch.ones(4))
