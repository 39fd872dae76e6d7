"""Engram's table gather kernel (`deepinfer_kernels.engram`) against the core's portable gather:
every E4M3 code (subnormals, both signs) and a spread of UE8M0 scales, bit for bit."""
from __future__ import annotations

import pytest
import torch
from deepinfer_kernels.engram import engram_gather

from deepinfer_core.ops.portable_pointwise import gather_rows


def _table(rows: int, dim: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, (rows, dim), generator=gen, dtype=torch.int32)
    codes[(codes & 0x7F) == 0x7F] = 0x12           # no NaN codes in a table
    codes.view(-1)[:256] = torch.arange(256)       # then every code once (0x7F/0xFF excepted)
    codes[(codes & 0x7F) == 0x7F] = 0x33
    weight = codes.to(torch.uint8).view(torch.float8_e4m3fn)
    scale = torch.randint(100, 150, (rows, dim // 32), generator=gen).to(torch.uint8)
    return weight, scale.view(torch.float8_e8m0fnu)


@pytest.mark.parametrize("dim", [32, 96, 256])
def test_gather_matches_the_portable_gather_bitwise(kdev, dim):
    weight, scale = _table(41, dim)
    rows = torch.randint(0, 41, (7, 5), generator=torch.Generator().manual_seed(1))
    want = gather_rows(weight, scale, rows)
    got = engram_gather(weight.to(kdev), scale.to(kdev), rows.to(kdev))
    assert got.shape == (7, 5 * dim) and got.dtype == torch.float32
    assert torch.equal(got.cpu(), want)


def test_no_rows_and_bad_tables(kdev):
    weight, scale = _table(8, 64)
    none = torch.zeros((0, 3), dtype=torch.long, device=kdev)
    empty = engram_gather(weight.to(kdev), scale.to(kdev), none)
    assert empty.shape == (0, 192)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        engram_gather(weight.float(), scale, torch.zeros((1, 1), dtype=torch.long))
    with pytest.raises(ValueError, match="dim/32"):
        engram_gather(weight, scale[:, :1], torch.zeros((1, 1), dtype=torch.long))
