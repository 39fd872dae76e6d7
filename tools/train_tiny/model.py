"""The model being trained: the engine's own DeepSeek-V4 module graph (deepinfer_core.model), bound to
the portable ops, with its float runtime weights turned into trainable leaves.

What differs from serving, and why:
- Vocabulary: the corpus uses ~20k of the 129,280 tokens. The model is built with `vocab_size =
  K + 1` rows: the K most frequent training tokens (BOS and EOS always among them) and one shared row
  for every other token. `VocabMap` maps token ids to rows. Exported, every other token gets a copy of
  the shared embedding and head row (and hash-routing row), so the served model's softmax over 129,280
  logits holds the shared logit V - K times; `loss` counts that (log(V - K) on the shared logit), so
  the training loss is exactly the served model's negative log-likelihood.
- Weights: float32 masters, quantised in every forward to what the checkpoint stores (FP8 128x128
  blocks, FP4 experts, bf16) with straight-through gradients (`QATLinear`), so the exported FP8/FP4
  model computes what was trained.
- Activations (`qat=True`, the default): the served model's QAT simulation (FP8 activations before the
  quantised linears, FP8 KV no-RoPE dims, Hadamard + FP4 indexer keys and queries) in the forward, with
  straight-through gradients (`QATLinear._quant_input`, `QATPointwise`), so the model learns under the
  numerics it is served with (simulate_qat=True is the engine's default). `qat=False` trains the clean
  function.
- Not trained by gradient: the indexer (its top-k choice has no gradient; DeepSeek trains it with a
  separate KL objective), the routing bias (DeepSeek's bias update balances load; it stays at its
  initial value) and the hash-routing table (random, fixed).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from deepinfer_core.cache.state_cache import new_sequence_state
from deepinfer_core.config import ModelConfig
from deepinfer_core.contracts import ModelOps
from deepinfer_core.model import ForwardBatch, bind_ops, build_model, process_weights
from deepinfer_core.model.attention import Numerics
from deepinfer_core.model.deepseek_v4 import DeepseekV4Model
from deepinfer_core.model.dummy_weights import fill_dummy_weights
from deepinfer_core.model.layers import Linear
from deepinfer_core.ops.portable_attention import PortableAttentionBackend
from deepinfer_core.ops.portable_linear import PortableLinearMethod
from deepinfer_core.ops.portable_mhc import PortableMHC
from deepinfer_core.ops.portable_moe import PortableMoE
from deepinfer_core.ops.portable_pointwise import PortablePointwise
from deepinfer_core.ops.quant import (
    dequant_fp4,
    dequant_fp8_block,
    fake_quant_fp8,
    hadamard_transform,
    quantize_fp4,
    quantize_fp8_block,
)
from deepinfer_core.tools.tiny_config import tiny_config_dict

FULL_VOCAB = 129280
BOS, EOS = 0, 1


@dataclass
class VocabMap:
    """The K kept token ids (row i = kept[i]); every other id maps to row K."""

    kept: np.ndarray              # int64 [K], sorted

    @classmethod
    def most_frequent(cls, tokens: np.ndarray, k: int) -> VocabMap:
        ids, counts = np.unique(tokens, return_counts=True)
        order = np.lexsort((ids, -counts))                  # by count, then by id: deterministic
        ranked = [i for i in ids[order].tolist() if i not in (BOS, EOS)]
        return cls(np.asarray(sorted(ranked[:k - 2] + [BOS, EOS]), dtype=np.int64))

    @property
    def rows(self) -> int:
        return len(self.kept) + 1

    @property
    def shared(self) -> int:
        return len(self.kept)

    def row_of_token(self) -> np.ndarray:
        """int64 [FULL_VOCAB]: each token id's row."""
        table = np.full(FULL_VOCAB, self.shared, dtype=np.int64)
        table[self.kept] = np.arange(len(self.kept))
        return table


class QATLinear(PortableLinearMethod):
    """The portable linear method over a float master weight, rounded to the checkpoint's storage
    format (`round_weights`, once per forward) with a straight-through gradient."""

    def _weight(self, layer) -> torch.Tensor:
        w = layer.weight
        return w + (layer.rounded - w).detach()

    input_noise = 0.0     # see build(act_noise=...)

    def _quant_input(self, layer, x: torch.Tensor) -> torch.Tensor:
        if layer.act_quant and self.simulate_qat:
            seen = x.detach()
            if self.input_noise and torch.is_grad_enabled():      # training forwards only
                seen = seen * (1 + self.input_noise * (2 * torch.rand_like(seen) - 1))
            x = x + (fake_quant_fp8(seen, 128) - x).detach()
        return x.to(layer.weight.dtype)

    def apply(self, layer, x: torch.Tensor) -> torch.Tensor:
        return F.linear(self._quant_input(layer, x), self._weight(layer))

    def apply_grouped(self, layer, x: torch.Tensor) -> torch.Tensor:
        G = x.shape[1]
        return torch.einsum("tgi,goi->tgo", self._quant_input(layer, x), self._weight(layer).view(G, -1, x.shape[-1]))


@torch.no_grad()
def round_weights(model: DeepseekV4Model) -> None:
    """Every linear's weight rounded to its checkpoint storage (FP8 128x128 blocks, FP4 per 32, bf16)
    into `layer.rounded`: the linears of one format and shape in one batched call, so a training step
    launches a few hundred rounding kernels instead of tens of thousands (the step is launch-bound)."""
    block = tuple(model.cfg.weight_block_size or (128, 128))
    groups: dict[tuple, list[Linear]] = {}
    for m in model.modules():
        if isinstance(m, Linear):
            groups.setdefault((m.fmt, tuple(m.weight.shape)), []).append(m)
    for (fmt, (rows, cols)), mods in groups.items():
        stacked = fmt != "fp8" or rows % block[0] == 0          # FP8 blocks must not straddle two weights
        for part in ([mods] if stacked else [[m] for m in mods]):
            w = torch.cat([m.weight.detach() for m in part])
            q = stored_value(w, fmt, block)
            for m, r in zip(part, q.split(rows)):
                m.rounded = r


def storage(w: torch.Tensor, fmt: str, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A linear's weight as the checkpoint stores it: (FP8 + UE8M0 128x128 scales | packed FP4 + per-32
    scales | bf16, None)."""
    if fmt == "fp8":
        return quantize_fp8_block(w, block)
    if fmt == "fp4":
        return quantize_fp4(w, 32)
    return w.to(torch.bfloat16), None


def stored_value(w: torch.Tensor, fmt: str, block: tuple[int, int]) -> torch.Tensor:
    """What the checkpoint's copy of `w` holds, in w's dtype."""
    weight, scale = storage(w, fmt, block)
    if fmt == "fp8":
        return dequant_fp8_block(weight, scale, block, w.dtype)
    if fmt == "fp4":
        return dequant_fp4(weight, scale, 32, w.dtype)
    return weight.to(w.dtype)


class QATPointwise(PortablePointwise):
    """The portable norm/RoPE/fake-quant glue with a straight-through gradient past the rounding (the
    Hadamard transform of the indexer path stays in the gradient)."""

    def norm_rope_quant(self, x: torch.Tensor, positions: torch.Tensor, rope, *, quant: str = "none", **kw):
        y = super().norm_rope_quant(x, positions, rope, quant="none", **kw)
        if quant == "none":
            return y
        if quant == "hadamard_fp4":
            y = hadamard_transform(y)
        with torch.no_grad():
            q = super().norm_rope_quant(x, positions, rope, quant=quant, **kw)
        return y + (q - y).detach()


def training_config(rows: int, **overrides) -> dict:
    """The bundled tiny architecture (every V4 part) with `rows` vocabulary rows."""
    return tiny_config_dict(vocab_size=rows, **overrides)


def build(cfg_dict: dict, device: str, seed: int, qat: bool = True, act_noise: float = 0.0) -> DeepseekV4Model:
    """The engine's model with seeded initial weights (the dummy loader's trained-model magnitudes)
    and every float weight a float32 leaf that requires grad; `qat`: the served QAT numerics.

    `act_noise` (training forwards only; evaluation computes the served numerics exactly): each FP8
    activation is rounded from x * (1 + u), u uniform in +-act_noise. Why: served in bf16, the first
    FP8 activation rounding already sends ~3% of the elements to the neighbouring FP8 value (the bf16
    rounding crossed a midpoint), and the jumps compound layer by layer: by the last layers about half
    of the FP8 values differ from a float32 run's (`benchmarks/qat_divergence.py`; `backend_agreement.py
    --greedy` says how often greedy tokens then differ). At act_noise 2^-4 (half an e4m3 step) the training forward sees
    a fresh rounding pattern every step, so the model is trained not to depend on one."""
    cfg = ModelConfig.from_dict(cfg_dict)
    model = build_model(cfg, device=device)
    fill_dummy_weights(model, cfg, seed=seed)
    block = cfg.weight_block_size or (128, 128)
    linear = QATLinear(torch.float32, simulate_qat=qat, block=block)
    linear.input_noise = act_noise
    # with the QAT numerics, the official rounding order the engine serves them in
    ops = ModelOps(linear={f: linear for f in ("bf16", "fp8", "fp4")},
                   attention=PortableAttentionBackend(official=qat), moe=PortableMoE(),
                   mhc=PortableMHC(cfg.hc_mult, cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.rms_norm_eps, qat),
                   pointwise=QATPointwise(official=qat))
    bind_ops(model, ops, Numerics(dtype=torch.float32, simulate_qat=qat))
    process_weights(model)
    for module in model.modules():
        for name, t in list(module._buffers.items()):
            if t is not None and t.is_floating_point():
                persistent = name not in module._non_persistent_buffers_set
                module.register_buffer(name, t.detach().float().requires_grad_(name != "bias"), persistent=persistent)
    return model


def parameters(model: DeepseekV4Model) -> list[torch.Tensor]:
    return [t for t in model.buffers() if t.requires_grad]


def fresh_states(model: DeepseekV4Model, batch: int, length: int, device: str) -> list:
    """One state per sequence, each in a one-slot cache of its own for this step: a training forward
    starts from nothing, and autograd flows through the rows and tails written into the cache. (In
    one shared cache, a slot's view taken before another slot's write made the pool require grad
    trips autograd's in-place check.)"""
    return [new_sequence_state(model.cfg, torch.float32, device, with_mtp=len(model.mtp) > 0, max_tokens=length)
            for _ in range(batch)]


def shared_log_count(rows: int) -> float:
    """log of how many token ids share the last row in the served model."""
    return math.log(FULL_VOCAB - (rows - 1))


def nll(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Per-row negative log-likelihood of the served model: the shared row's logit counts once per
    token id it stands for."""
    extra = torch.zeros(logits.shape[-1], device=logits.device, dtype=logits.dtype)
    extra[-1] = shared_log_count(logits.shape[-1])
    lse = torch.logsumexp(logits + extra, dim=-1)
    return lse - logits.gather(1, targets[:, None]).squeeze(1)


def forward_losses(model: DeepseekV4Model, windows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, dict]:
    """windows: int64 [B, L] rows (vocabulary rows, not token ids). Main loss: predict row t+1 at t
    (rows 0..L-2); MTP loss (DeepSeek's objective): from the main streams at t and the embedding of
    token t+1, predict token t+2 (rows 0..L-3). Returns (main mean NLL, MTP mean NLL, stats)."""
    B, L = windows.shape
    dev = windows.device
    round_weights(model)
    states = fresh_states(model, B, L, str(dev))
    ids = windows.reshape(-1)
    positions = torch.arange(L, device=dev).repeat(B)
    main_rows = (torch.arange(B, device=dev)[:, None] * L + torch.arange(L - 1, device=dev)[None, :]).reshape(-1)
    batch = ForwardBatch(ids, positions, [0] * B, [L] * B, states, main_rows)
    out = model(batch)
    main = nll(out.logits, ids[main_rows + 1])
    stats = {"main_nll": main.mean().item()}
    mtp = None
    if len(model.mtp):
        next_ids = torch.cat([ids[1:], ids[:1]])               # row t: token t+1 (the last row's is unused)
        mtp_rows = (torch.arange(B, device=dev)[:, None] * L + torch.arange(L - 2, device=dev)[None, :]).reshape(-1)
        batch.logits_rows = mtp_rows
        mtp_logits = model.forward_mtp(out.streams, next_ids, batch)
        mtp_nll = nll(mtp_logits, ids[mtp_rows + 2])
        mtp = mtp_nll.mean()
        stats["mtp_nll"] = mtp.item()
        stats["mtp_top1"] = (mtp_logits.argmax(-1) == ids[mtp_rows + 2]).float().mean().item()
    return main.mean(), mtp, stats


@torch.no_grad()
def round_to_checkpoint(model: DeepseekV4Model) -> None:
    """Set every trained tensor to the value its checkpoint storage holds (FP8/FP4/bf16 linears as
    the forward already rounds them; bf16-stored norms, embedding and router exactly), so what is
    evaluated after this is what the exported checkpoint computes."""
    from deepinfer_core.tools.make_tiny_checkpoint import model_tensor_spec
    spec = model_tensor_spec(dict(model.cfg.raw))
    round_weights(model)
    linears = {name for name, m in model.named_modules() if isinstance(m, Linear)}
    for name, t in model.named_buffers():
        stem = name.rpartition(".")[0]
        if stem in linears and name.endswith(".weight"):
            t.copy_(model.get_submodule(stem).rounded)
        elif t.is_floating_point() and name in spec and spec[name][1] == torch.bfloat16:
            t.copy_(t.to(torch.bfloat16))
