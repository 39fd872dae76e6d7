"""The Ascend backend's packaging and start-up, on a machine without torch_npu or CANN: import-light
detection, the listing, environment defaults, one-line start-up errors (the import of torch_npu is
simulated by monkeypatching), the SoC check, batch invariance refused."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path
from types import SimpleNamespace

import pytest

from deepinfer_core.plugin_context import Platform
from deepinfer_core.plugins import PlatformError, PluginManager

REPO = Path(__file__).resolve().parents[2]
BACKEND = REPO / "backends" / "ascend950"


@pytest.fixture
def ascend(monkeypatch):
    """The backend's modules from the source tree, with a fresh runtime."""
    monkeypatch.syspath_prepend(str(BACKEND))
    from deepinfer_ascend import plugin, runtime
    runtime.reset()
    yield SimpleNamespace(plugin=plugin, runtime=runtime)
    runtime.reset()


def ctx_for(device="npu", batch_invariant=False):
    return SimpleNamespace(platform=Platform("ascend", "npu", plugin="ascend"), device=device,
                           batch_invariant=batch_invariant)


# ---- packaging -----------------------------------------------------------------------------------
def test_torch_npu_is_an_optional_extra_pinned_to_the_documented_pairing():
    project = tomllib.loads((BACKEND / "pyproject.toml").read_text())["project"]
    assert not [d for d in project["dependencies"] if "torch" in d.lower()], project["dependencies"]
    assert project["optional-dependencies"]["npu"] == ["torch-npu==2.13.0"]
    assert project["entry-points"]["deepinfer.backends"] == {"ascend": "deepinfer_ascend.plugin"}


def test_detection_and_listing_never_import_torch_npu(tmp_path):
    """A fresh process: import the plugin, detect, read the listing's info -- torch_npu (and torch)
    stay unimported."""
    code = ("import sys; import deepinfer_ascend.plugin as p; p.PROBE_PATHS = ('/nonexistent',); "
            "assert p.deepinfer_detect_platform(None) is None; info = p.DEEPINFER_PLUGIN_INFO; "
            "print(sorted(m for m in ('torch_npu', 'torch') if m in sys.modules))")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(BACKEND), str(REPO)]))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def _listing(site: Path, **env: str) -> dict:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("DEEPINFER_")}
    environ.update(env)
    environ["PYTHONPATH"] = os.pathsep.join([str(site), str(BACKEND), str(REPO)])
    proc = subprocess.run([sys.executable, "-m", "deepinfer_core.plugins", "--json"], cwd=REPO,
                          env=environ, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


@pytest.fixture
def ascend_site(tmp_path):
    """A site folder in which the backend is an installed distribution (as `pip install` makes it);
    empty when deepinfer-ascend is installed already."""
    site = tmp_path / "site"
    site.mkdir()
    try:
        metadata.distribution("deepinfer-ascend")
    except metadata.PackageNotFoundError:
        info = site / "deepinfer_ascend-0.1.0.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(
            "Metadata-Version: 2.1\nName: deepinfer-ascend\nVersion: 0.1.0\n")
        (info / "entry_points.txt").write_text(
            "[deepinfer.backends]\nascend = deepinfer_ascend.plugin\n")
    return site


@pytest.mark.skipif(os.path.exists("/dev/davinci0"), reason="an Ascend NPU is present")
def test_listing_shows_the_backend_installed_not_active_with_the_reason(ascend_site):
    listing = _listing(ascend_site)
    row = next(p for p in listing["plugins"] if p["name"] == "ascend")
    assert (row["kind"], row["status"]) == ("backend", "loaded"), row
    assert "not usable here: no Ascend NPU (/dev/davinci0 absent)" in row["note"], row
    assert listing["active"]["name"] != "ascend"
    asked = _listing(ascend_site, DEEPINFER_ACCELERATOR="ascend")["active"]
    assert asked["name"] == ""
    assert "DEEPINFER_ACCELERATOR=ascend but no Ascend NPU" in asked["error"]
    assert "\n" not in asked["error"]


# ---- environment defaults ------------------------------------------------------------------------
def test_env_defaults_never_overwrite_the_users_values(ascend):
    rt = ascend.runtime
    env = {"HCCL_CONNECT_TIMEOUT": "600", "PYTORCH_NPU_ALLOC_CONF": "expandable_segments:True"}
    lines = rt.apply_env_defaults(env)
    assert env["HCCL_CONNECT_TIMEOUT"] == "600"
    assert env["HCCL_EXEC_TIMEOUT"] == rt.ENV_DEFAULTS["HCCL_EXEC_TIMEOUT"][0]
    assert set(env) == set(rt.ENV_DEFAULTS)
    kept = "HCCL_CONNECT_TIMEOUT=600 kept from the environment (the backend's default would be 240)"
    assert kept in lines, lines
    assert any(line.startswith("HCCL_EXEC_TIMEOUT=200 set by default") for line in lines), lines


def test_env_defaults_are_set_before_torch_npu_is_imported(ascend, monkeypatch):
    for name in ascend.runtime.ENV_DEFAULTS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HCCL_EXEC_TIMEOUT", "999")
    seen = {}

    def importer(name):
        seen.update({k: os.environ.get(k) for k in ascend.runtime.ENV_DEFAULTS})
        raise ModuleNotFoundError("No module named 'torch_npu'", name="torch_npu")
    monkeypatch.setattr(ascend.runtime, "_import", importer)
    with pytest.raises(PlatformError):
        ascend.runtime.start()
    assert seen == {"PYTORCH_NPU_ALLOC_CONF": "expandable_segments:True",
                    "HCCL_CONNECT_TIMEOUT": "240", "HCCL_EXEC_TIMEOUT": "999"}


# ---- one-line start-up errors --------------------------------------------------------------------
def _start_error(ascend, monkeypatch, exc: BaseException | None = None) -> str:
    if exc is not None:
        def importer(name):
            raise exc
        monkeypatch.setattr(ascend.runtime, "_import", importer)
    with pytest.raises(PlatformError) as info:
        ascend.plugin.deepinfer_configure(ctx_for())
    message = str(info.value)
    exc = info.value            # no chained traceback: neither a cause nor a shown context
    assert "\n" not in message and exc.__cause__ is None
    assert exc.__context__ is None or exc.__suppress_context__
    assert message.startswith("Ascend backend start-up: ")
    return message


def test_torch_npu_not_installed(ascend, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch_npu", None)     # the real import machinery refuses it
    message = _start_error(ascend, monkeypatch)
    assert "torch_npu is not installed: pip install 'deepinfer-ascend[npu]'" in message


@pytest.mark.parametrize("text,lib", [
    ("libhccl.so: cannot open shared object file: No such file or directory", "libhccl.so"),
    ("libascend_hal.so: cannot open shared object file", "libascend_hal.so"),
])
def test_cann_missing_names_the_library(ascend, monkeypatch, text, lib):
    message = _start_error(ascend, monkeypatch, ImportError(text))
    assert f"CANN not found: torch_npu could not load {lib} (install CANN 9.2" in message


def test_autoload_failure_points_at_cann(ascend, monkeypatch):
    exc = RuntimeError("Failed to load the backend extension: torch_npu. You can disable extension "
                       "auto-loading with TORCH_DEVICE_BACKEND_AUTOLOAD=0.")
    assert "most likely because CANN is missing" in _start_error(ascend, monkeypatch, exc)


def test_cuda_torch_is_refused_before_the_import(ascend, monkeypatch):
    import torch
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(ascend.runtime, "_import", lambda name: pytest.fail("imported torch_npu"))
    message = _start_error(ascend, monkeypatch)
    assert "is a CUDA build (CUDA 12.8); torch_npu needs the CPU build of torch" in message


def test_torch_minor_version_must_match_torch_npu(ascend, monkeypatch):
    monkeypatch.setattr(ascend.runtime.detect, "torch_npu_version", lambda: "2.14.0")
    monkeypatch.setattr(ascend.runtime, "_import", lambda name: pytest.fail("imported torch_npu"))
    import torch
    message = _start_error(ascend, monkeypatch)
    assert (f"torch {torch.__version__} does not pair with torch_npu 2.14.0 (torch_npu needs "
            "torch 2.14.*)") in message


def test_unknown_import_error_is_still_one_line(ascend, monkeypatch):
    message = _start_error(ascend, monkeypatch, OSError("disk on fire\nsecond line"))
    assert message.endswith("import torch_npu failed: OSError: disk on fire")


# ---- SoC -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("version,family", [(260, "A5"), (220, "A2"), (225, "A2"), (250, "A3"),
                                            (255, "A3")])
def test_soc_families(ascend, version, family):
    from deepinfer_ascend.soc import classify_soc
    assert classify_soc(version).family == family
    assert classify_soc(version).has_mx == (family == "A5")


@pytest.mark.parametrize("version", [100, 226, 240, 261, None, "260"])
def test_unknown_soc_is_refused(ascend, monkeypatch, version):
    fake = SimpleNamespace(npu=SimpleNamespace(get_soc_version=lambda: version),
                           __version__="2.13.0")
    monkeypatch.setattr(ascend.runtime, "_import", lambda name: fake)
    message = _start_error(ascend, monkeypatch)
    assert "supported: 260 (Ascend 950, A5), 250-255 (Atlas A3), 220-225 (Atlas A2)" in message
    assert repr(version) in message or str(version) in message


def test_start_runs_once_and_checks_the_device(ascend, monkeypatch):
    calls = []
    fake = SimpleNamespace(npu=SimpleNamespace(get_soc_version=lambda: 260), __version__="2.13.0")
    monkeypatch.setattr(ascend.runtime, "_import", lambda name: calls.append(name) or fake)
    ascend.plugin.deepinfer_configure(ctx_for("cpu"))      # the portable ops on the host: allowed
    ascend.plugin.deepinfer_configure(ctx_for("cpu"))
    assert calls == ["torch_npu"]
    rt = ascend.runtime.started()
    assert (rt.soc.family, rt.device_type, rt.torch_npu) == ("A5", "npu", fake)
    with pytest.raises(ValueError, match=r"device='cuda' on the ascend platform; allowed: 'npu'"):
        ascend.plugin.deepinfer_configure(ctx_for("cuda"))


def test_other_platforms_and_batch_invariance(ascend, monkeypatch):
    monkeypatch.setattr(ascend.runtime, "_import", lambda name: pytest.fail("imported torch_npu"))
    cpu = SimpleNamespace(platform=Platform("cpu", "cpu"), batch_invariant=True)
    ascend.plugin.deepinfer_configure(cpu)
    with pytest.raises(ValueError, match="not supported on the Ascend backend"):
        ascend.plugin.deepinfer_configure(ctx_for(batch_invariant=True))


def test_explicit_request_through_the_plugin_manager(ascend, ascend_site, monkeypatch, tmp_path):
    """DEEPINFER_ACCELERATOR=ascend with an NPU node but no CANN: the platform is chosen, start-up
    (the configure hook) fails in one line naming the missing library."""
    monkeypatch.syspath_prepend(str(ascend_site))
    (tmp_path / "davinci0").write_text("")
    monkeypatch.setattr(ascend.plugin, "PROBE_PATHS", (str(tmp_path / "davinci0"),))
    monkeypatch.setattr(ascend.runtime, "_import", lambda name: (_ for _ in ()).throw(
        ImportError("libascendcl.so: cannot open shared object file: No such file or directory")))
    pm = PluginManager({"DEEPINFER_ACCELERATOR": "ascend"})
    platform = pm.detect_platform()
    assert (platform.name, platform.device_type) == ("ascend", "npu")
    with pytest.raises(PlatformError, match=r"^Ascend backend start-up: CANN not found: torch_npu "
                                            r"could not load libascendcl.so \("):
        pm.configure(SimpleNamespace(platform=platform, device="npu", batch_invariant=False))
