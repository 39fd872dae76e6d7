"""The bundled tiny DeepSeek-V4 model: the trained tiny model (tools/train_tiny; its compact weights ship
in this package, deepinfer_core/tools/data) expanded once into an official checkpoint in the user cache.

`bundled_tiny_model_dir()` returns `$XDG_CACHE_HOME/deepinfer/tiny-v4` (or `~/.cache/deepinfer/tiny-v4`),
building it first when it is missing or stale. The build writes into a temporary sibling directory
and renames it into place only once complete, so an interrupted build never leaves a half-written
model behind, and concurrent builders cannot see each other's partial output.

A stamp file records a fingerprint of what was built (the trained weights and the builders' source),
so an upgrade that changes the model or its format rebuilds it instead of loading a stale one. The
random tiny model (`make_tiny_checkpoint`) stays what the tests build.

`variant="dspark"` (`tiny-v4-dspark`): the same target with its trained DSpark drafter in place of the
MTP block, as DeepSeek ships V4-Flash-DSpark beside V4-Flash.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

STAMP_FILE = ".deepinfer-bundled.json"
_TMP_PREFIX = ".tmp-"
_STALE_TMP_SECONDS = 3600   # a build takes well under a minute; older temp dirs are crash leftovers
VARIANTS = {"mtp": "tiny-v4", "dspark": "tiny-v4-dspark"}     # variant -> directory name


def _variant_name(variant: str) -> str:
    if variant not in VARIANTS:
        raise ValueError(f"bundled model variant={variant!r}; allowed: {', '.join(map(repr, VARIANTS))}")
    return VARIANTS[variant]


def default_cache_dir(variant: str = "mtp") -> Path:
    """`$XDG_CACHE_HOME/deepinfer/tiny-v4` (`tiny-v4-dspark`), else under `~/.cache/deepinfer/`."""
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    # The XDG spec says a relative value is invalid and must be ignored.
    base = Path(xdg) if xdg and os.path.isabs(xdg) else Path.home() / ".cache"
    return base / "deepinfer" / _variant_name(variant)


def fingerprint(variant: str = "mtp") -> str:
    """Identifies the bundled model's content: the trained weights and the builders' source."""
    from . import make_tiny_checkpoint, trained_model
    h = hashlib.sha256()
    drafter = (trained_model.DSPARK_ARTIFACT,) if variant == "dspark" else ()
    for path in (trained_model.ARTIFACT, *drafter, Path(make_tiny_checkpoint.__file__), Path(trained_model.__file__)):
        try:
            h.update(path.read_bytes())
        except (OSError, TypeError):   # no source on disk (frozen/zipped install): the rest only
            pass
    return h.hexdigest()[:16]


def is_complete(model_dir: Path, expected: str | None = None) -> bool:
    """True when `model_dir` holds a finished build (with fingerprint `expected`, when given)."""
    try:
        stamp = json.loads((Path(model_dir) / STAMP_FILE).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(stamp, dict) and (expected is None or stamp.get("fingerprint") == expected)


def bundled_tiny_model_dir(cache_dir: str | Path | None = None, variant: str = "mtp") -> Path:
    """The bundled tiny model's directory, built (~150 MiB, a few seconds) on first use; `variant`:
    "mtp" (the target with its MTP block) or "dspark" (with its DSpark drafter)."""
    final = Path(cache_dir) if cache_dir is not None else default_cache_dir(variant)
    expected = fingerprint(variant)
    if is_complete(final, expected):
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_temp_dirs(final)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}{_TMP_PREFIX}", dir=final.parent))
    try:
        # Looked up at call time so that tests can replace the builder.
        from . import trained_model as builder
        builder.make_trained_checkpoint(tmp, **({"drafter": builder.DSPARK_ARTIFACT} if variant == "dspark" else {}))
        # The stamp goes in last: its presence means every other file is complete.
        (tmp / STAMP_FILE).write_text(json.dumps({"fingerprint": expected}) + "\n")
        _install(tmp, final, expected)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)   # gone already after a successful rename
    return final


def _install(tmp: Path, final: Path, expected: str) -> None:
    """Atomically rename the finished build `tmp` to `final`, replacing a stale or partial one."""
    for _ in range(3):
        try:
            os.rename(tmp, final)        # atomic; fails when `final` exists and is not empty
            return
        except OSError:
            if is_complete(final, expected):
                return                   # another process finished the same build first
        # `final` is stale (older fingerprint) or foreign: move it aside, then retry the rename.
        aside = Path(tempfile.mkdtemp(prefix=f".{final.name}{_TMP_PREFIX}old-", dir=final.parent))
        try:
            os.rename(final, aside / final.name)
        except FileNotFoundError:
            pass                         # someone else moved it already
        shutil.rmtree(aside, ignore_errors=True)
    raise OSError(f"could not install the bundled tiny model at {final}")


def _remove_stale_temp_dirs(final: Path) -> None:
    # Leftovers of builds that were killed (a normal failure cleans up after itself).
    cutoff = time.time() - _STALE_TMP_SECONDS
    for path in final.parent.glob(f".{final.name}{_TMP_PREFIX}*"):
        try:
            if path.is_dir() and path.stat().st_mtime < cutoff:
                shutil.rmtree(path, ignore_errors=True)
        except OSError:
            pass


if __name__ == "__main__":
    import argparse
    ap = argparse.ArgumentParser(prog="python -m deepinfer_core.tools.bundled_model",
                                 description="Build (once) and print the bundled tiny model's directory.")
    ap.add_argument("--variant", default="mtp", choices=sorted(VARIANTS))
    print(bundled_tiny_model_dir(variant=ap.parse_args().variant))
