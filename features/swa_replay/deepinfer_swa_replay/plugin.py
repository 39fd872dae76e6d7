"""Feature plugin `swa_replay`: DeepSeek-V4.1's SWA bounded replay (YOCO prefill truncation).

The core does the mechanics (model/yoco.py compacts the consumer half's rows; the attention
backends clip consumer windows to the rectangle); this plugin decides the rectangle and checks
that the options suit the model:

* the model has a YOCO consumer half (a ratio-1 layer);
* KEEP >= sliding_window + the backtracking room, so every row a decode or verification step can
  see through a consumer window lies inside the rectangle;
* DSpark target layers all on one side of the boundary (the drafter reads target features of
  every prompt row).
"""

from __future__ import annotations

from dataclasses import dataclass

from deepinfer_core.hookspecs import hookimpl

NAME = "swa_replay"
DEEPINFER_PLUGIN_INFO = {
    "status": "partial",
    "note": "V4.1 SWA bounded replay: yoco_prefill_truncation_mode 'mask' and 'compact' on the "
    "portable attention backends (CPU and CUDA); no fused GPU kernels",
}


@dataclass(frozen=True)
class BoundedReplay:
    """The consumer half sees a prompt through its windows from position prompt_len - KEEP on."""

    mode: str
    keep_tokens: int

    def rectangle(self, prompt_len: int) -> int:
        return max(0, prompt_len - self.keep_tokens)


@hookimpl
def deepinfer_prefill_truncation(ctx):
    opts, cfg = ctx.options, ctx.model_config
    mode, keep = opts.model.yoco_prefill_truncation_mode, opts.model.yoco_prefill_keep_tokens
    backtrack = opts.cache.max_backtracking_tokens
    if keep < cfg.sliding_window + backtrack:
        raise ValueError(
            f"yoco_prefill_keep_tokens={keep}; allowed: >= sliding_window + "
            f"max_backtracking_tokens = {cfg.sliding_window} + {backtrack} = "
            f"{cfg.sliding_window + backtrack} (a decode or verification step must "
            "find its whole window inside the replayed suffix)"
        )
    if cfg.dspark is not None:
        boundary = cfg.n_prefill_layer
        sides = {layer >= boundary for layer in cfg.dspark.target_layer_ids}
        if len(sides) > 1 or (mode == "compact" and True in sides):
            raise ValueError(
                f"yoco_prefill_truncation_mode={mode!r}: dspark_target_layer_ids="
                f"{list(cfg.dspark.target_layer_ids)} straddle the YOCO boundary or, for 'compact', "
                f"lie behind it (layer "
                f"{boundary}); allowed: 'off' for this checkpoint"
            )
    return BoundedReplay(mode, keep)
