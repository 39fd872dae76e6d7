"""Shared fixtures: one tiny DeepSeek-V4 and one tiny V4.1 checkpoint (real tokenizer, official
tensor format) per test session, built once and reused read-only by every test that needs a model on disk; and the
real V4-Flash data files kept in tests/data (see the README there)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

V4_FLASH_DATA = Path(__file__).resolve().parent / "data" / "deepseek-v4-flash"


@pytest.fixture(scope="session")
def tiny_ckpt_dir(tmp_path_factory) -> Path:
    from deepinfer_core.tools.make_tiny_checkpoint import make_tiny_checkpoint
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny_v4_ckpt"), seed=0)


@pytest.fixture(scope="session")
def tiny_v41_dir(tmp_path_factory) -> Path:
    """A tiny DeepSeek-V4.1 (tools/tiny_config_v41.py: C2 + C1 sources and their sharers, the
    YOCO boundary, candidate blocks, Engram on two producer layers), official format."""
    from deepinfer_core.tools.make_tiny_checkpoint import make_tiny_checkpoint
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny_v41_ckpt"), seed=0, family="v41")


@pytest.fixture(scope="session")
def v4_flash_dir() -> Path:
    """tests/data/deepseek-v4-flash: the real config.json and the chat renderer's golden cases."""
    return V4_FLASH_DATA


@pytest.fixture(scope="session")
def v4_flash_config(v4_flash_dir) -> dict:
    """The real DeepSeek-V4-Flash config.json, as published."""
    return json.loads((v4_flash_dir / "config.json").read_text())


# ---- no test reads outside the repository -------------------------------------------------------
# A user's clone has no ../shared beside it and none of this machine's files: every file a test reads
# must come from the repository, a temporary directory the tests made, the Python installation (the
# packages under test and their data) or the operating system. An audit hook sees every Python-level
# open() and directory listing; reads elsewhere fail the session, listed in its summary.
import os  # noqa: E402
import site  # noqa: E402
import sys  # noqa: E402
import sysconfig  # noqa: E402
import tempfile  # noqa: E402

REPO = V4_FLASH_DATA.parents[2]
_SYSTEM = ("/proc", "/sys", "/dev", "/etc", "/usr", "/lib", "/lib64", "/bin", "/sbin", "/run")
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND


def _allowed_roots() -> tuple[str, ...]:
    roots = {str(REPO), tempfile.gettempdir(), sys.prefix, sys.base_prefix, sys.exec_prefix,
             *site.getsitepackages(), site.getusersitepackages(), *_SYSTEM}
    roots |= {p for p in sysconfig.get_paths().values() if p}
    # Triton's compile cache (GPU runs): kernels this code compiled, read back, no input of a test
    roots.add(os.environ.get("TRITON_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".triton"))
    return tuple(sorted(os.path.realpath(r) for r in roots))


_ROOTS = _allowed_roots()
_OUTSIDE_READS: dict[str, str] = {}      # path -> the test that read it


def _audit_reads(event: str, args: tuple) -> None:
    if event == "open":
        path, mode, flags = args
        if (mode and any(c in mode for c in "wax+")) or (mode is None and flags & _WRITE_FLAGS):
            return
    elif event not in ("os.listdir", "os.scandir"):
        return
    else:
        path = args[0]
    if not isinstance(path, (str, bytes, os.PathLike)):
        return                            # a file descriptor
    real = os.path.realpath(os.fsdecode(path))
    if not any(real == r or real.startswith(r + os.sep) for r in _ROOTS):
        _OUTSIDE_READS.setdefault(real, os.environ.get("PYTEST_CURRENT_TEST", "(collection)"))


def pytest_configure(config) -> None:
    sys.addaudithook(_audit_reads)
    if os.environ.get("PYTEST_XDIST_WORKER"):
        # CI runs two pytest workers on two cores: one thread each keeps them from contending (the
        # suite's shapes are too small for intra-op threads to pay); subprocesses inherit it
        os.environ["OMP_NUM_THREADS"] = "1"
        import torch

        torch.set_num_threads(1)
    # Speculation is on by default for checkpoints that carry an MTP block (DS-DeepInfer's gamma = 5).
    # The suite's tiny random models accept no draft, so MTP-5 would only multiply every decode
    # step's work: tests decode without it unless they ask for it (tests/speculative) or set the
    # variable themselves; tests/speculative/test_engine_speculation.py checks the default.
    os.environ.setdefault("DEEPINFER_USE_NEXTN_DECODE", "0")


def pytest_sessionfinish(session, exitstatus) -> None:
    worker_output = getattr(session.config, "workeroutput", None)
    if worker_output is not None:                       # a pytest-xdist worker: tell the controller
        worker_output["outside_reads"] = json.dumps(_OUTSIDE_READS)
    elif _OUTSIDE_READS:
        session.exitstatus = 1


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error) -> None:
    """pytest-xdist controller: gather the reads each worker saw."""
    _OUTSIDE_READS.update(json.loads(getattr(node, "workeroutput", {}).get("outside_reads", "{}")))


def pytest_terminal_summary(terminalreporter) -> None:
    if _OUTSIDE_READS:
        terminalreporter.section("files read outside the repository", sep="=", red=True)
        for path, test in sorted(_OUTSIDE_READS.items()):
            terminalreporter.write_line(f"{path}  (by {test})")
        terminalreporter.write_line("tests may read only the repository, their temporary directories, the "
                                    "Python installation and the operating system (tests/conftest.py)")
