"""Plugin discovery through real entry points, allow/deny lists, failures, platform choice."""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
import uuid
from importlib import metadata
from pathlib import Path
from types import SimpleNamespace

import pytest

from deepinfer_core import envs, plugins
from deepinfer_core.plugin_context import Platform
from deepinfer_core.plugins import PlatformError, PluginError, PluginManager

REPO = Path(__file__).resolve().parents[2]
NO_NVIDIA = not (os.path.exists("/proc/driver/nvidia/version") or os.path.exists("/dev/nvidia0"))
NO_ASCEND = not os.path.exists("/dev/davinci0")

FEATURE = "deepinfer.features"
BACKEND = "deepinfer.backends"


def make_dist(site: Path, ep_name: str, body: str, group: str = FEATURE) -> str:
    """Write a throwaway installed distribution (dist-info + one module) into `site`.

    Returns the module name, unique per call so that sys.modules never serves a stale copy.
    """
    module = f"fakeplug_{ep_name}_{uuid.uuid4().hex[:8]}"
    dist = f"fake-{ep_name.replace('_', '-')}"
    info = site / f"{dist.replace('-', '_')}-0.3.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.3\n")
    (info / "entry_points.txt").write_text(f"[{group}]\n{ep_name} = {module}\n")
    header = "from deepinfer_core.hookspecs import hookimpl\n" \
             "from deepinfer_core.plugin_context import Platform\n"
    (site / f"{module}.py").write_text(header + textwrap.dedent(body))
    return module


@pytest.fixture
def site(tmp_path, monkeypatch):
    path = tmp_path / "site"
    path.mkdir()
    monkeypatch.syspath_prepend(str(path))  # importlib.metadata scans sys.path per call
    return path


SKELETON = """
DEEPINFER_PLUGIN_INFO = {"status": "skeleton", "note": "filled later"}
CALLS = []

@hookimpl
def deepinfer_configure(ctx):
    CALLS.append(ctx)

@hookimpl
def deepinfer_logits_processors(ctx):
    return ["proc-from-fake"]
"""


def test_entry_point_plugin_is_discovered(site):
    module = make_dist(site, "fakefeat", SKELETON)
    mgr = PluginManager({})
    rec = mgr.record("fakefeat")
    assert rec is not None and rec.status == "loaded", rec
    assert (rec.dist, rec.version, rec.kind) == ("fake-fakefeat", "0.3", "feature")
    assert (rec.info_status, rec.note) == ("skeleton", "filled later")
    assert mgr.pm.has_plugin("fakefeat") and mgr.pm.has_plugin("core")
    assert mgr.records[0].name == "core"            # the core is registered first
    ctx = SimpleNamespace(platform=Platform("cpu", "cpu"))
    assert mgr.configure(ctx) is ctx and sys.modules[module].CALLS == [ctx]
    assert "proc-from-fake" in mgr.logits_processors(ctx)


def test_disable_plugins_blocks_without_importing(site):
    module = make_dist(site, "fakefeat", SKELETON)
    mgr = PluginManager({"DEEPINFER_DISABLE_PLUGINS": "fakefeat"})
    rec = mgr.record("fakefeat")
    assert rec.status == "blocked" and "DEEPINFER_DISABLE_PLUGINS" in rec.error
    assert not mgr.pm.has_plugin("fakefeat") and mgr.pm.is_blocked("fakefeat")
    assert module not in sys.modules


def test_allow_list_excludes_others_but_keeps_core(site):
    make_dist(site, "fake_a", SKELETON)
    make_dist(site, "fake_b", SKELETON)
    mgr = PluginManager({"DEEPINFER_PLUGINS": "fake_a"})
    assert mgr.record("fake_a").status == "loaded"
    rec_b = mgr.record("fake_b")
    assert rec_b.status == "blocked" and "DEEPINFER_PLUGINS" in rec_b.error
    assert mgr.pm.has_plugin("core")
    # Installed skeletons (if any) are excluded too.
    assert all(r.status == "blocked" for r in mgr.records if r.name not in ("core", "fake_a"))


def test_import_failure_is_recorded_and_not_fatal(site, caplog):
    make_dist(site, "fakebroken", "raise ImportError('boom: libfoo.so missing')\n")
    with caplog.at_level(logging.WARNING, logger="deepinfer.plugins"):
        mgr = PluginManager({})
    rec = mgr.record("fakebroken")
    assert rec.status == "failed" and "ImportError: boom: libfoo.so missing" in rec.error
    assert any("fakebroken" in r.getMessage() and "boom" in r.getMessage() for r in caplog.records)
    assert mgr.detect_platform(None).name == "cpu"   # the engine still starts


def test_required_backend_failure_names_the_import_error(site):
    make_dist(site, "nvidia", "raise ImportError('no module named deep_gemm')\n", group=BACKEND)
    mgr = PluginManager({"DEEPINFER_ACCELERATOR": "nvidia"})
    with pytest.raises(PlatformError) as err:
        mgr.detect_platform()
    assert "nvidia" in str(err.value) and "deep_gemm" in str(err.value)


def test_blocked_or_missing_required_backend_says_so(site):
    make_dist(site, "ascend", "raise RuntimeError('must not be imported')\n", group=BACKEND)
    mgr = PluginManager({"DEEPINFER_ACCELERATOR": "ascend", "DEEPINFER_DISABLE_PLUGINS": "ascend"})
    with pytest.raises(PlatformError, match=r"plugin 'ascend' is blocked \(DEEPINFER_DISABLE_PLUGINS\)"):
        mgr.detect_platform()
    mgr = PluginManager({"DEEPINFER_ACCELERATOR": "ascend", "DEEPINFER_PLUGINS": "fake_none"})
    with pytest.raises(PlatformError, match=r"blocked \(not in DEEPINFER_PLUGINS\)"):
        mgr.detect_platform()


def test_unknown_hook_implementation_is_reported(site, caplog):
    make_dist(site, "faketypo", "@hookimpl\ndef deepinfer_sampelr(ctx):\n    return 1\n")
    with caplog.at_level(logging.WARNING, logger="deepinfer.plugins"):
        mgr = PluginManager({})
    rec = mgr.record("faketypo")
    assert rec.status == "failed" and "deepinfer_sampelr" in rec.error
    assert not mgr.pm.has_plugin("faketypo")
    mgr.pm.check_pending()   # nothing unknown is left registered


def test_bad_signature_leaves_nothing_registered(site):
    make_dist(site, "fakesig", """
@hookimpl
def deepinfer_configure(ctx):
    pass

@hookimpl
def deepinfer_sampler(ctx, not_a_spec_arg):
    return 1
""")
    mgr = PluginManager({})
    assert mgr.record("fakesig").status == "failed"
    assert not mgr.pm.has_plugin("fakesig")
    assert all(i.plugin_name != "fakesig" for i in mgr.pm.hook.deepinfer_configure.get_hookimpls())


@pytest.mark.skipif(not NO_NVIDIA or not NO_ASCEND, reason="an accelerator is present")
@pytest.mark.parametrize("environ", [{}, {"DEEPINFER_ACCELERATOR": "cpu"}])
def test_core_cpu_platform_selected(environ):
    platform = PluginManager(environ).detect_platform()
    assert (platform.name, platform.device_type, platform.plugin) == ("cpu", "cpu", "core")


def test_bogus_accelerator_is_a_clear_error():
    with pytest.raises(envs.EnvError, match=r"DEEPINFER_ACCELERATOR='bogus' is invalid; "
                                            r"allowed: nvidia, ascend, cpu"):
        PluginManager({"DEEPINFER_ACCELERATOR": "bogus"})
    with pytest.raises(envs.EnvError, match="allowed: nvidia, ascend, cpu"):
        PluginManager({}).detect_platform("bogus")


BACKEND_PRESENT = """
@hookimpl
def deepinfer_detect_platform(requested):
    if requested in (None, "{name}"):
        return Platform(name="{name}", device_type="cuda", plugin="{name}")
"""


def test_auto_detect_prefers_one_out_of_tree_and_rejects_two(site):
    make_dist(site, "fakegpu", BACKEND_PRESENT.format(name="fakegpu"), group=BACKEND)
    assert PluginManager({}).detect_platform().plugin == "fakegpu"
    make_dist(site, "fakegpu2", BACKEND_PRESENT.format(name="fakegpu2"), group=BACKEND)
    with pytest.raises(PlatformError, match="several platforms"):
        PluginManager({}).detect_platform()
    # An explicit request still resolves to the core's CPU platform.
    assert PluginManager({"DEEPINFER_ACCELERATOR": "cpu"}).detect_platform().plugin == "core"


def test_required_hook_returning_none_is_a_clear_error():
    mgr = PluginManager({}, load=False)   # nothing registered: every hook returns None
    ctx = SimpleNamespace(platform=Platform("cpu", "cpu"))
    for call in (mgr.attention_backend, mgr.moe_method, mgr.mhc_method, mgr.sampler,
                 mgr.scheduler_policy, mgr.verifier):
        with pytest.raises(PluginError, match="no plugin provided .* on platform 'cpu'"):
            call(ctx)
    with pytest.raises(PluginError, match="'fp8'"):
        mgr.linear_method(ctx, "fp8")
    assert mgr.proposer(ctx) is None                  # speculation off is not an error
    assert mgr.logits_processors(ctx) == []


def test_trace_logs_hook_calls(caplog):
    with caplog.at_level(logging.INFO, logger="deepinfer.plugins"):
        PluginManager({"DEEPINFER_TRACE_PLUGINS": "1"}).detect_platform("cpu")
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "hook deepinfer_detect_platform" in text and "Platform(name='cpu'" in text


def test_get_plugin_manager_caches(monkeypatch):
    monkeypatch.delenv("DEEPINFER_ACCELERATOR", raising=False)
    first = plugins.get_plugin_manager(refresh=True)
    assert plugins.get_plugin_manager() is first
    assert plugins.get_plugin_manager(refresh=True) is not first


@pytest.mark.parametrize("pkg,src,name", [("deepinfer_nvidia", "backends/nvidia_sm100", "nvidia"),
                                          ("deepinfer_ascend", "backends/ascend950", "ascend")])
def test_backend_detection(pkg, src, name, monkeypatch, tmp_path):
    monkeypatch.syspath_prepend(str(REPO / src))
    mod = __import__(f"{pkg}.plugin", fromlist=["plugin"])
    assert mod.DEEPINFER_PLUGIN_INFO["status"] == "partial"
    monkeypatch.setattr(mod, "PROBE_PATHS", (str(tmp_path / "absent"),))
    assert mod.deepinfer_detect_platform(None) is None
    assert mod.deepinfer_detect_platform("cpu") is None
    with pytest.raises(RuntimeError, match=f"DEEPINFER_ACCELERATOR={name} but no"):
        mod.deepinfer_detect_platform(name)
    (tmp_path / "dev").write_text("")
    monkeypatch.setattr(mod, "PROBE_PATHS", (str(tmp_path / "dev"),))
    platform = mod.deepinfer_detect_platform(None)
    assert (platform.name, platform.plugin) == (name, name)
    assert platform.device_type == {"nvidia": "cuda", "ascend": "npu"}[name]


def _run_listing(site: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("DEEPINFER_")}
    environ.update(env)
    environ["PYTHONPATH"] = os.pathsep.join([str(site), str(REPO), environ.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-m", "deepinfer_core.plugins", *args], cwd=REPO,
                          env=environ, capture_output=True, text=True, timeout=120)


def test_cli_listing_in_a_fresh_process(site):
    make_dist(site, "fakefeat", SKELETON)
    make_dist(site, "fakebroken", "raise ImportError('boom')\n")
    proc = _run_listing(site, "--json")
    assert proc.returncode == 0, proc.stderr
    listing = json.loads(proc.stdout)
    by_name = {p["name"]: p for p in listing["plugins"]}
    assert by_name["core"]["status"] == "loaded"
    assert by_name["fakefeat"]["status"] == "loaded" and by_name["fakefeat"]["info_status"] == "skeleton"
    assert by_name["fakebroken"]["status"] == "failed" and "boom" in by_name["fakebroken"]["error"]
    assert listing["active"]["plugin"] == "core" or not (NO_NVIDIA and NO_ASCEND)


def test_cli_table_lists_installed_skeletons(site):
    proc = _run_listing(site)
    assert proc.returncode == 0, proc.stderr
    assert "core" in proc.stdout and "active backend:" in proc.stdout
    if NO_NVIDIA and NO_ASCEND:
        assert "active backend: cpu (plugin core" in proc.stdout
    try:
        metadata.distribution("deepinfer-dspark")
    except metadata.PackageNotFoundError:
        if os.environ.get("CI"):
            pytest.fail("build.sh should have installed the feature skeletons")
        pytest.skip("feature skeletons not installed (run ./build.sh)")
    for name, state in (("dspark", "partial"), ("swa_replay", "partial"), ("batch_invariant", "ready"),
                        ("structured_outputs", "ready")):
        line = next(line for line in proc.stdout.splitlines() if line.startswith(name + " "))
        assert f"loaded ({state})" in line, line
    proc = _run_listing(site, DEEPINFER_ACCELERATOR="nvidia")
    if NO_NVIDIA:
        assert proc.returncode == 0 and "active backend: none" in proc.stdout
        assert "nvidia" in proc.stdout.split("active backend:")[1]


def test_nvidia_fp4_experts_default_follows_the_gpu(monkeypatch):
    """fp4_experts=None keeps FP4 experts FP4 only on the architectures listed as verified (none
    yet: the default is off everywhere); an explicit True or False wins on any GPU."""
    import torch
    monkeypatch.syspath_prepend(str(REPO / "backends/nvidia_sm100"))
    mod = __import__("deepinfer_nvidia.plugin", fromlist=["plugin"])

    def ctx(asked):
        return SimpleNamespace(device="cuda", options=SimpleNamespace(model=SimpleNamespace(fp4_experts=asked)))
    for verified in (mod.FP4_EXPERTS_BY_DEFAULT, (9,)):
        monkeypatch.setattr(mod, "FP4_EXPERTS_BY_DEFAULT", verified)
        for major in (8, 9, 10):
            monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device, m=major: (m, 0))
            assert mod.fp4_experts(ctx(None)) is (major in verified)
            assert mod.fp4_experts(ctx(True)) is True and mod.fp4_experts(ctx(False)) is False


def test_nvidia_linear_method_declines_off_gpu(monkeypatch):
    """The nvidia linear methods are chosen only for the nvidia platform on an SM90+ CUDA device (FP8 for
    fp8/fp4 weights, fp32-accumulating bf16 GEMMs for bf16 weights); everything else falls through."""
    from types import SimpleNamespace

    import torch
    monkeypatch.syspath_prepend(str(REPO / "backends/nvidia_sm100"))
    mod = __import__("deepinfer_nvidia.plugin", fromlist=["plugin"])
    nvidia = SimpleNamespace(name="nvidia")
    ctx = SimpleNamespace(platform=nvidia, simulate_qat=True, device="cpu")
    assert mod.deepinfer_linear_method(ctx, "fp8") is None                   # not a CUDA device
    monkeypatch.setattr(mod, "_fp8_capable", lambda device: True)
    assert mod.deepinfer_linear_method(SimpleNamespace(platform=SimpleNamespace(name="cpu"),
                                                       simulate_qat=True, device="cuda"), "fp8") is None
    qat_off = SimpleNamespace(platform=nvidia, simulate_qat=False, device="cuda", torch_dtype=torch.bfloat16,
                              model_config=SimpleNamespace(weight_block_size=(128, 128), family="v4"))
    assert type(mod.deepinfer_linear_method(qat_off, "fp8")).__name__ == "Fp8LinearMethod"
    assert type(mod.deepinfer_linear_method(qat_off, "bf16")).__name__ == "Bf16LinearMethod"
    assert mod.deepinfer_linear_method(qat_off, "int4") is None
    # V4.1: the linear, MoE, mHC and pointwise methods serve it (each falls back per layer where it
    # has no kernel, e.g. 32x32-block FP8 weights); its attention stays the core's portable one
    qat_off.model_config.family = "v41"
    assert type(mod.deepinfer_linear_method(qat_off, "fp8")).__name__ == "Fp8LinearMethod"
    assert mod.deepinfer_attention_backend(qat_off) is None
