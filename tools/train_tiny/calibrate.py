"""Calibrate the trained tiny DSpark drafter and store its temperatures in its artifact.

    python -m tools.train_tiny.calibrate [DRAFTER.safetensors] [--tokens 128] [--device cpu]

Builds the DSpark checkpoint from the bundled target and DRAFTER (default: the bundled drafter),
runs the dspark plugin's calibration (deepinfer_dspark.calibrate: sequential temperature scaling on
the engine's logged acceptances, float32, T=1) over benchmarks/data/calibration_prompts.json (held-out
text, none of the acceptance benchmark's prompts), and rewrites DRAFTER with
`dspark_confidence_temperatures` among its config keys and the calibration report in its metadata,
so the bundled DSpark model's checkpoint carries its calibration.
"""
from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from deepinfer_dspark.calibrate import calibrate, load_prompts

from deepinfer_core.tools.trained_model import (
    ARTIFACT,
    DSPARK_ARTIFACT,
    make_trained_checkpoint,
    read_drafter,
)

PROMPTS = Path(__file__).resolve().parents[2] / "benchmarks" / "data" / "calibration_prompts.json"


def store(drafter: Path, result: dict) -> None:
    from safetensors import safe_open
    from safetensors.torch import save_file
    keys, tensors, _ = read_drafter(drafter)
    with safe_open(str(drafter), "pt") as f:
        meta = f.metadata()
    keys["dspark_confidence_temperatures"] = result["temperatures"]
    meta = {**meta, "drafter_config": json.dumps(keys), "calibration": json.dumps(result)}
    save_file(tensors, str(drafter), metadata=meta)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m tools.train_tiny.calibrate", description=__doc__.split("\n\n")[0])
    ap.add_argument("drafter", type=Path, nargs="?", default=DSPARK_ARTIFACT)
    ap.add_argument("--prompts", type=Path, default=PROMPTS)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--device", default="cpu")
    a = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = make_trained_checkpoint(Path(tmp) / "dspark", ARTIFACT, drafter=a.drafter)
        result = calibrate(str(ckpt), load_prompts(a.prompts), a.tokens, 1.0, dtype="float32", device=a.device,
                           max_model_len=512)
    print(json.dumps(result, indent=1))
    store(a.drafter, result)
    print(f"wrote dspark_confidence_temperatures={result['temperatures']} into {a.drafter}")
    return result


if __name__ == "__main__":
    main()
