"""Sequential temperature scaling (STS, DSpark paper) for a DSpark checkpoint's confidence head.

    python -m deepinfer_dspark.calibrate --model DIR --prompts PROMPTS.json [--tokens 128]
                                         [--temperature 1.0] [--json OUT.json] [--write-config]

The checkpoint runs through `LLM.generate` with every draft verified (VARLEN off, temperatures 1), and
each verification logs the confidences of the drafts it could accept and how many it accepted
(`Engine.record_acceptance`). From the cumulative confidences C_k the tool recovers each position's
logit z_k = logit(C_k / C_{k-1}), then fits T_1..T_gamma in order: T_k minimises the expected
calibration error (ECE, 20 equal-width bins) of the cumulative confidence prod_{i<=k} sigmoid(z_i / T_i)
against "the first k drafts were accepted", T_1..T_{k-1} held fixed (temperature scaling keeps each
position's order, so what the head ranks well stays ranked). Even-numbered prompts fit, odd-numbered
prompts report the ECE before and after.

It prints the value for DEEPINFER_DFLASH_CONFIDENCE_HEAD_TEMPERATURE; --write-config stores the
temperatures in the checkpoint's config.json as `dspark_confidence_temperatures`, which the engine uses
when that variable is unset.
"""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np

GRID = np.exp(np.linspace(math.log(0.05), math.log(20.0), 241))      # candidate temperatures
BINS = 20


def position_logits(records: list[tuple[list[float], int]], gamma: int) -> tuple[np.ndarray, np.ndarray]:
    """(z [n, gamma] with NaN past what a record verified, accepted [n]) from the engine's log of
    (cumulative confidences at temperature 1, drafts accepted)."""
    z = np.full((len(records), gamma), np.nan)
    accepted = np.zeros(len(records), dtype=np.int64)
    for r, (cum, j) in enumerate(records):
        cum = np.asarray(cum[:gamma], dtype=np.float64)
        prev = np.concatenate([[1.0], cum[:-1]])
        c = np.clip(cum / np.maximum(prev, 1e-300), 1e-12, 1 - 1e-12)
        z[r, :len(c)] = np.log(c) - np.log1p(-c)
        accepted[r] = j
    return z, accepted


def ece(pred: np.ndarray, label: np.ndarray, bins: int = BINS) -> float:
    """Expected calibration error: sum over equal-width bins of (share of samples) x |mean pred - mean label|."""
    if len(pred) == 0:
        return 0.0
    which = np.minimum((pred * bins).astype(np.int64), bins - 1)
    gap = np.abs(np.bincount(which, pred, bins) - np.bincount(which, label, bins))
    return float(gap.sum() / len(pred))


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1 / (1 + np.exp(-np.clip(x, -60, 60)))


def cumulative(z: np.ndarray, temps: list[float]) -> np.ndarray:
    """prod_{i<=k} sigmoid(z_i / T_i) for k = 1..len(temps) (NaN where z is)."""
    return np.cumprod(_sigmoid(z[:, :len(temps)] / np.asarray(temps)), axis=1)


def cumulative_ece(z: np.ndarray, accepted: np.ndarray, temps: list[float]) -> list[float]:
    """Per position k, the ECE of the cumulative confidence against "the first k accepted", over the
    records that verified position k."""
    cum = cumulative(z, temps)
    out = []
    for k in range(len(temps)):
        seen = ~np.isnan(z[:, k])
        out.append(ece(cum[seen, k], (accepted[seen] > k).astype(np.float64)))
    return out


def fit_temperatures(z: np.ndarray, accepted: np.ndarray, grid: np.ndarray = GRID) -> list[float]:
    """STS: T_k on `grid` minimising position k's cumulative ECE, T_1..T_{k-1} fixed; ties (and
    positions no record verified) keep the temperature closest to 1."""
    temps: list[float] = []
    order = np.argsort(np.abs(np.log(grid)))          # try 1 first, then outwards: ties keep the nearest
    for k in range(z.shape[1]):
        seen = ~np.isnan(z[:, k])
        if not seen.any():
            temps.append(1.0)
            continue
        label = (accepted[seen] > k).astype(np.float64)
        prefix = cumulative(z[seen], temps)[:, -1] if temps else np.ones(int(seen.sum()))
        errors = [ece(prefix * _sigmoid(z[seen, k] / grid[i]), label) for i in order]
        temps.append(float(grid[order[int(np.argmin(errors))]]))
    return temps


def collect(llm, prompts: list[str], tokens: int, temperature: float, first_seed: int) -> list:
    """Generate and return the engine's acceptance log of these prompts."""
    from deepinfer_core import SamplingParams
    log: list = []
    llm.engine.record_acceptance(log)
    params = [SamplingParams(temperature=temperature, max_tokens=tokens, ignore_eos=True, seed=first_seed + i)
              for i in range(len(prompts))]
    llm.generate(prompts, params, use_tqdm=False)
    llm.engine.record_acceptance(None)
    return log


def calibrate(model: str, prompts: list[str], tokens: int = 128, temperature: float = 1.0, **engine_options) -> dict:
    """Fit on the even-numbered prompts' verifications, report ECE on the odd-numbered ones."""
    from deepinfer_core import LLM
    llm = LLM(model=model, enable_mtp_varlen=False, confidence_head_temperature=(1.0,), **engine_options)
    gamma = llm.runner.num_drafts
    if llm.runner.loaded.proposer is None or not gamma:
        raise ValueError(f"{model}: no DSpark drafter to calibrate (needs dspark_* config keys, the dspark plugin "
                         f"and DEEPINFER_USE_NEXTN_DECODE > 0)")
    fit_log = collect(llm, prompts[0::2], tokens, temperature, 0)
    check_log = collect(llm, prompts[1::2], tokens, temperature, len(prompts))
    z_fit, acc_fit = position_logits(fit_log, gamma)
    z_check, acc_check = position_logits(check_log, gamma)
    temps = fit_temperatures(z_fit, acc_fit)
    return {"temperatures": [round(t, 4) for t in temps], "gamma": gamma, "sampling_temperature": temperature,
            "fit_verifications": len(fit_log), "check_verifications": len(check_log),
            "check_ece_before": [round(e, 4) for e in cumulative_ece(z_check, acc_check, [1.0] * gamma)],
            "check_ece_after": [round(e, 4) for e in cumulative_ece(z_check, acc_check, temps)],
            "check_acceptance": [round(float((acc_check[~np.isnan(z_check[:, k])] > k).mean()), 4)
                                 if (~np.isnan(z_check[:, k])).any() else None for k in range(gamma)]}


def load_prompts(path: Path) -> list[str]:
    """A JSON list of strings, a JSON object with a "prompts" list, or a text file (one per line)."""
    text = path.read_text()
    if path.suffix == ".json":
        data = json.loads(text)
        prompts = data["prompts"] if isinstance(data, dict) else data
    else:
        prompts = [line for line in text.splitlines() if line.strip()]
    if len(prompts) < 2 or not all(isinstance(p, str) for p in prompts):
        raise ValueError(f"--prompts {path}: allowed: at least 2 prompt strings (half fit, half check)")
    return prompts


def write_config(model: str, temps: list[float]) -> Path:
    path = Path(model) / "config.json"
    cfg = json.loads(path.read_text())
    cfg["dspark_confidence_temperatures"] = temps
    path.write_text(json.dumps(cfg, indent=2) + "\n")
    return path


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m deepinfer_dspark.calibrate", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="a DSpark checkpoint directory")
    ap.add_argument("--prompts", type=Path, required=True, help="JSON list / {'prompts': [...]} / one per line")
    ap.add_argument("--tokens", type=int, default=128, help="tokens generated per prompt")
    ap.add_argument("--temperature", type=float, default=1.0, help="the requests' sampling temperature")
    ap.add_argument("--device", default=None)
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--json", type=Path, help="write the result here")
    ap.add_argument("--write-config", action="store_true", help="store the temperatures in the checkpoint's config.json")
    a = ap.parse_args(argv)
    options = {k: v for k, v in (("device", a.device), ("dtype", a.dtype)) if v is not None}
    result = calibrate(a.model, load_prompts(a.prompts), a.tokens, a.temperature, **options)
    value = ",".join(f"{t:g}" for t in result["temperatures"])
    print(json.dumps(result, indent=1))
    print(f"DEEPINFER_DFLASH_CONFIDENCE_HEAD_TEMPERATURE={value}")
    if a.json:
        a.json.write_text(json.dumps(result, indent=1) + "\n")
    if a.write_config:
        print(f"wrote dspark_confidence_temperatures to {write_config(a.model, result['temperatures'])}")
    return result


if __name__ == "__main__":
    main()
