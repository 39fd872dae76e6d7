"""The `hccl` backend stand-in: init_process_group("hccl") + all_reduce over gloo; hccl as the alias
device's (the CPU's) default backend in an NPU rank."""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist


def _all_reduce_worker(rank: int, world: int, init_file: str, result_dir: str):
    import fake_npu
    fake = fake_npu.install()
    try:
        from torch_npu._C._distributed_c10d import ProcessGroupHCCL
        dist.init_process_group("hccl", init_method=f"file://{init_file}", rank=rank,
                                world_size=world, pg_options=ProcessGroupHCCL.Options())
        t = torch.tensor([float(rank + 1)])
        dist.all_reduce(t)
        assert dist.get_backend() == "hccl"
        torch.save(t, os.path.join(result_dir, f"rank{rank}.pt"))
        dist.destroy_process_group()
    finally:
        fake.uninstall()


def test_hccl_single_process(tmp_path):
    _all_reduce_worker(0, 1, str(tmp_path / "init"), str(tmp_path))
    assert torch.load(tmp_path / "rank0.pt").item() == 1.0


def test_hccl_registration_is_undone(make_fake_npu):
    fake = make_fake_npu()
    assert dist.Backend.backend_capability["hccl"] == ["cpu"]
    fake.uninstall()
    assert "hccl" not in dist.Backend.backend_list and not hasattr(dist.Backend, "HCCL")


def test_hccl_rejects_foreign_pg_options(fake_npu, tmp_path):
    with pytest.raises(Exception, match="pg_options must be ProcessGroupHCCL.Options"):
        dist.init_process_group("hccl", init_method=f"file://{tmp_path / 'init'}", rank=0,
                                world_size=1, pg_options=dist.ProcessGroupGloo._Options())
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.mark.slow
def test_hccl_all_reduce_two_processes(tmp_path):
    import torch.multiprocessing as mp
    mp.spawn(_all_reduce_worker, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2)
    assert [torch.load(tmp_path / f"rank{r}.pt").item() for r in range(2)] == [3.0, 3.0]


def test_hccl_for_cpu_makes_hccl_the_alias_devices_backend(make_fake_npu):
    """An alias-mode NPU rank: the core's `device_backend("cpu")` answers hccl until undone."""
    from fake_npu.hccl import hccl_for_cpu

    from deepinfer_core.parallel.groups import device_backend
    fake = make_fake_npu()
    undo = hccl_for_cpu()
    assert device_backend("cpu") == "hccl"
    undo()
    assert device_backend("cpu") == "gloo"
    fake.uninstall()
    with pytest.raises(RuntimeError, match="hccl is not registered"):
        hccl_for_cpu()
