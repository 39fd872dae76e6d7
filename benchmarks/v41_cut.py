"""The benchmarks' DeepSeek-V4.1 cut: a V4.1 `config.json` (V4.1-Flash width in
tests/data/deepseek-v4.1-flash, or any config of the same layout) cut to fewer layers with a valid
topology, for dummy-weight runs (`sweep.py`, `throughput.py`, `bounded_replay.py`).

The cut keeps the base's leading window-only layers and splits the rest evenly between C2 producer
layers and C1 consumer layers (the producer half takes an odd one), so both YOCO halves are present:

* KV sources (= index-key sources) recur in each half with the base's spacing (V4.1-Flash: a C2
  source every 6 layers from the first C2 layer; the first C1 layer is the consumers' only source);
* index sources likewise (V4.1-Flash: the C2 KV sources, then every 4th C1 layer from the first);
* the candidate source keeps its place relative to its half (V4.1-Flash: the first C1 layer);
* Engram layers stay in the producer half: each base id clipped to the last producer layer.

At the base's own depth the base's topology is kept as it is. The DSpark drafter stages
(`num_nextn_predict_layers`, `dspark_*`) are dropped: their target layers name the uncut stack.
Engram tables hold hundreds of millions of rows per layer at the real `engram_vocab_size` (16M per
head and order): `engram_rows` caps it (default `DEFAULT_ENGRAM_ROWS`, ~2.4M rows and ~0.6 GB
per Engram layer at V4.1-Flash width). A token gathers the same number of rows either way, so
only the table's memory changes, not the work of a step.
"""

from __future__ import annotations

import copy
import math
from typing import Any

from deepinfer_core.config_v41 import is_v41

DEFAULT_ENGRAM_ROWS = 100003       # engram_vocab_size per n-gram order (a prime per head above it)
_DRAFTER_KEYS = ("dspark_",)


def family(cfg: dict[str, Any]) -> str:
    """"v41" for a DeepSeek-V4.1 config (`model_type: deepseek_v41`), else "v4"."""
    return "v41" if is_v41(cfg) else "v4"


def text_keys(cfg: dict[str, Any]) -> dict[str, Any]:
    """The dict holding the text model's keys: `text_config` for V4.1, the config itself for V4."""
    return cfg["text_config"] if family(cfg) == "v41" else cfg


def _halves(t: dict[str, Any]) -> tuple[int, int, int]:
    """(window-only, C2, C1) layer counts of a base laid out as 0..0 2..2 1..1."""
    n = int(t["num_hidden_layers"])
    ratios = [int(r) for r in t["compress_ratios"][:n]]
    w = next((i for i, r in enumerate(ratios) if r), n)
    p = next((i for i, r in enumerate(ratios[w:], w) if r != 2), n) - w
    c = n - w - p
    if ratios != [0] * w + [2] * p + [1] * c or not p or not c:
        raise ValueError(
            f"--config: text_config.compress_ratios={ratios}; a V4.1 cut needs window-only "
            "layers, then C2 layers, then C1 layers (both halves present)"
        )
    return w, p, c


def min_layers(base: dict[str, Any]) -> int:
    """The fewest layers a cut may have: the window-only ones, one C2 and one C1 layer."""
    return _halves(text_keys(base))[0] + 2


def _recur(ids: list[int], start: int, base_len: int, new_start: int, new_len: int) -> list[int]:
    """Ids of one half of the base (starting at `start`, `base_len` long) laid on a half starting at
    `new_start`, `new_len` long: the base's first offset, then its spacing (first gap), repeated."""
    offs = [i - start for i in ids if start <= i < start + base_len]
    if not offs:
        return []
    step = offs[1] - offs[0] if len(offs) > 1 else base_len
    return list(range(new_start + offs[0], new_start + new_len, step))


def cut_v41(
    base: dict[str, Any],
    layers: int,
    experts: int | None = None,
    engram_rows: int | None = DEFAULT_ENGRAM_ROWS,
    flag: str = "--layers",
) -> dict[str, Any]:
    """`base` (a V4.1 config) cut to `layers` main layers (module docstring). `experts`: routed
    experts per layer (None: the base's); `engram_rows`: each order's `engram_vocab_size` at most
    (None: the base's). `flag` names the option in errors."""
    if family(base) != "v41":
        raise ValueError("cut_v41: the config is not DeepSeek-V4.1 (model_type deepseek_v41)")
    cfg = copy.deepcopy(base)
    t = cfg["text_config"]
    n_base = int(t["num_hidden_layers"])
    lo = min_layers(base)
    if not lo <= layers <= n_base:
        raise ValueError(
            f"{flag}: {layers} layers; allowed for a DeepSeek-V4.1 cut of this config: "
            f"{lo}..{n_base} ({lo - 2} window-only, at least one C2 producer and one C1 consumer)"
        )
    for key in [k for k in t if k.startswith(_DRAFTER_KEYS)]:
        del t[key]
    t["num_nextn_predict_layers"] = 0
    t["compress_ratios"] = list(t["compress_ratios"][:n_base])
    if layers < n_base:
        _cut_topology(t, layers)
    if experts is not None:
        if not int(t["num_experts_per_tok"]) <= experts:
            raise ValueError(
                f"--experts {experts}: allowed: >= num_experts_per_tok ({t['num_experts_per_tok']})"
            )
        t["n_routed_experts"] = experts
    if engram_rows is not None and t.get("engram_layer_ids"):
        if engram_rows < 2:
            raise ValueError(f"--engram-rows {engram_rows}: allowed: an int >= 2")
        orders = int(t["engram_max_ngram_size"]) - 1
        sizes = t["engram_vocab_size"]
        sizes = [sizes] * orders if isinstance(sizes, int) else list(sizes)
        t["engram_vocab_size"] = [min(int(v), engram_rows) for v in sizes]
    return cfg


def _cut_topology(t: dict[str, Any], layers: int) -> None:
    """Rewrite the layer keys of text config `t` for `layers` layers (fewer than its own)."""
    w, p, c = _halves(t)
    n = layers - w
    p_new = math.ceil(n / 2)
    c_new = n - p_new
    first_c1, new_c1 = w + p, w + p_new

    def both(key: str) -> list[int]:
        ids = list(t.get(key) or [])
        return _recur(ids, w, p, w, p_new) + _recur(ids, first_c1, c, new_c1, c_new)

    kv = both("kv_source_layer_ids")
    if new_c1 not in kv:          # YOCO: the first consumer layer is always a KV source
        kv = sorted(set(kv) | {new_c1})
    index = sorted(set(both("index_source_layer_ids")) | set(kv))
    t.update(
        num_hidden_layers=layers,
        compress_ratios=[0] * w + [2] * p_new + [1] * c_new,
        kv_source_layer_ids=kv,
        index_source_layer_ids=index,
        index_k_source_layer_ids=kv,
    )
    cand = t.get("candidate_source_layer_id")
    if cand is not None:
        start, new = (w, w) if cand < first_c1 else (first_c1, new_c1)
        t["candidate_source_layer_id"] = new + (cand - start)
        if t["candidate_source_layer_id"] not in index:
            t["candidate_source_layer_id"] = new
    if t.get("engram_layer_ids"):
        t["engram_layer_ids"] = sorted({min(int(i), new_c1 - 1) for i in t["engram_layer_ids"]})


def cut_notes(base: dict[str, Any], cut: dict[str, Any]) -> dict[str, Any]:
    """What the cut changed, for a benchmark's JSON."""
    b, t = base["text_config"], cut["text_config"]
    out: dict[str, Any] = {
        "layers": t["num_hidden_layers"],
        "base_layers": b["num_hidden_layers"],
        "compress_ratios": t["compress_ratios"],
        "kv_source_layer_ids": t.get("kv_source_layer_ids"),
        "index_source_layer_ids": t.get("index_source_layer_ids"),
        "candidate_source_layer_id": t.get("candidate_source_layer_id"),
        "n_routed_experts": t["n_routed_experts"],
        "base_n_routed_experts": b["n_routed_experts"],
        "drafter": "dropped (num_nextn_predict_layers 0)",
    }
    if t.get("engram_layer_ids"):
        out.update(
            engram_layer_ids=t["engram_layer_ids"],
            engram_vocab_size=t["engram_vocab_size"],
            base_engram_vocab_size=b["engram_vocab_size"],
            engram_note=(
                "Engram tables shrunk to engram_vocab_size rows per head and order (the real ones "
                "hold base_engram_vocab_size): a token gathers the same rows either way, so the "
                "step's work is the real one; only the tables' memory is smaller"
                if t["engram_vocab_size"] != b["engram_vocab_size"]
                else "Engram tables at the base config's size"
            ),
        )
    return out
