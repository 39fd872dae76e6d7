"""Every package of the repository builds a wheel with correct metadata, and the wheels alone make
a working install.

The packages: the core (the repository root), the kernels, each backend and each feature, plus the
third-party example plugin (examples/plugins/deepinfer-example-plugin). They are built with
`pip wheel` from a copy of the tree (so no build output lands in the repository and no earlier build
leaks into a wheel). Each wheel's metadata is checked against its pyproject.toml and the release
rules: one version for every DeepInfer package (deepinfer_core.__version__), the Apache-2.0 licence,
a Python floor, a lower bound on every dependency, the plugin entry points, and every file of the
package's source folders (code and data, such as the bundled tiny model's weights) inside the wheel.

Then, as a user would: a fresh virtualenv (no system site-packages), torch, and every wheel in one
`pip install` that takes the deepinfer-* distributions from the built wheels only (pinned versions
from a --find-links folder) and their other dependencies from the package index (PyPI in CI; pip's
cache holds what build.sh already fetched). From a directory outside the repository, with a fresh
HOME: every DeepInfer module must come from the virtualenv (no editable install, nothing from the
repository), `deepinfer plugins` lists every plugin as loaded, and a copy of
examples/offline_inference.py runs on the bundled tiny model. The virtualenv (about 2 GB) and the
model it builds are deleted at the end.
"""
from __future__ import annotations

import email.parser
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import NamedTuple

import pytest
import tomllib
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

import deepinfer_core

REPO = Path(__file__).resolve().parents[2]
VERSION = deepinfer_core.__version__
EXAMPLE_PLUGIN = "examples/plugins/deepinfer-example-plugin"
# The package folders, relative to the repository root; the example plugin is third-party code with
# a release of its own (its version and lower bounds are not held to the core's).
OURS = [".", "kernels", *(p.parent.relative_to(REPO).as_posix() for pattern in ("backends", "features")
                          for p in sorted(REPO.glob(f"{pattern}/*/pyproject.toml")))]
PACKAGES = OURS + ([EXAMPLE_PLUGIN] if (REPO / EXAMPLE_PLUGIN / "pyproject.toml").is_file() else [])
PLUGIN_GROUPS = ("deepinfer.backends", "deepinfer.features")
# Never copied into the build tree: VCS data, build outputs, caches, local environments.
NOT_SOURCE = shutil.ignore_patterns(".git", "build", "dist", "*.egg-info", "__pycache__", "*.pyc",
                                    ".pytest_cache", ".venv", ".whl", "tmp", ".devscratch")
# pip: give up on an unreachable package index after 15 s and one retry per page, with its own message
PIP_NETWORK = ["--timeout", "15", "--retries", "1"]


def pyproject(package: str, root: Path) -> dict:
    return tomllib.loads((root / package / "pyproject.toml").read_text(encoding="utf-8"))["project"]


def run(cmd: list[str], what: str, timeout: float, **kwargs) -> subprocess.CompletedProcess:
    """Run `cmd`; on a non-zero exit or a timeout, fail naming `what` with the end of its output."""
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False,
                              **kwargs)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{what}: no result after {timeout:.0f} s\n$ {' '.join(cmd)}\n{exc.stdout or ''}"
                    f"{exc.stderr or ''}"[-4000:])
    if proc.returncode != 0:
        pytest.fail(f"{what}: exit status {proc.returncode}\n$ {' '.join(cmd)}\n--- stdout\n"
                    f"{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-3000:]}")
    return proc


# ---- building -----------------------------------------------------------------------------------
class Built(NamedTuple):
    src: Path                  # the copy of the tree the wheels were built from
    wheels: dict[str, Path]    # package folder -> its wheel


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Built:
    """Every package's wheel, built from a copy of the tree (both removed afterwards)."""
    import setuptools

    if int(setuptools.__version__.split(".")[0]) < 77:     # the packages' build-system requirement
        pytest.fail(f"building the wheels needs setuptools>=77 here (./build.sh installs it); found "
                    f"{setuptools.__version__}")
    root = tmp_path_factory.mktemp("wheels")
    src, out = root / "src", root / "wheels"
    shutil.copytree(REPO, src, ignore=NOT_SOURCE)
    # One pip run for all, in this environment (no build isolation: nothing to fetch)
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-cache-dir",
         "--disable-pip-version-check", "-q", "-w", str(out), *(str(src / p) for p in PACKAGES)],
        "pip wheel of every package", timeout=600)
    wheels = {}
    for package in PACKAGES:
        stem = canonicalize_name(pyproject(package, src)["name"]).replace("-", "_")
        found = sorted(out.glob(f"{stem}-*.whl"))
        assert len(found) == 1, f"{package}: expected one wheel {stem}-*.whl in {sorted(out.iterdir())}"
        wheels[package] = found[0]
    yield Built(src, wheels)
    shutil.rmtree(root, ignore_errors=True)


def wheel_metadata(wheel: Path) -> tuple[email.message.Message, dict[str, dict[str, str]], list[str]]:
    """(METADATA, entry points by group, every file name) of a wheel."""
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        info = next(n.split("/")[0] for n in names if n.endswith(".dist-info/METADATA"))
        meta = email.parser.Parser().parsestr(z.read(f"{info}/METADATA").decode())
        groups: dict[str, dict[str, str]] = {}
        if f"{info}/entry_points.txt" in names:
            group = None
            for line in z.read(f"{info}/entry_points.txt").decode().splitlines():
                if line.startswith("["):
                    group = line.strip("[]")
                    groups[group] = {}
                elif "=" in line:
                    name, value = (s.strip() for s in line.split("=", 1))
                    groups[group][name] = value
    return meta, groups, names


def source_files(root: Path) -> set[str]:
    """Every file of the import folders of the package at `root`, as wheel paths (code and data)."""
    find = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    files = set()
    for name in (p.rstrip("*") for p in find["include"]):
        for path in (root / name).rglob("*"):
            if path.is_file():
                files.add(path.relative_to(root).as_posix())
    return files


@pytest.mark.parametrize("package", PACKAGES)
def test_wheel_metadata(built, package):
    project = pyproject(package, built.src)     # what the wheel was built from
    meta, entry_points, names = wheel_metadata(built.wheels[package])
    ours = package in OURS
    assert meta["Name"] == project["name"]
    assert meta["Version"] == (VERSION if ours else project["version"]), \
        f"{package}: every DeepInfer package carries the release version {VERSION}"
    assert meta["Summary"] and meta["Summary"] == project["description"]
    assert meta["Description-Content-Type"] == "text/markdown" and len(meta.get_payload()) > 200, \
        f"{package}: the wheel's long description (its README.md) is missing"
    assert meta["License-Expression"] == "Apache-2.0"
    assert meta["Requires-Python"] == ">=3.10"
    for text in meta.get_all("Requires-Dist") or []:
        req = Requirement(text)
        if req.marker is not None and "extra" in str(req.marker):
            continue                                  # optional extras (test, server)
        bounds = [s.version for s in req.specifier if s.operator in (">=", "==", "~=")]
        assert bounds, f"{package}: dependency {text!r} has no lower bound"
        if req.name.startswith("deepinfer-"):
            assert req.specifier.contains(VERSION), f"{package}: {text!r} excludes release {VERSION}"
            if ours:
                assert bounds == [VERSION], f"{package}: {text!r}: the packages move in lockstep ({VERSION})"
    declared = {g: dict(eps) for g, eps in project.get("entry-points", {}).items()}
    if "scripts" in project:
        declared["console_scripts"] = dict(project["scripts"])
    assert entry_points == declared
    if ours and package not in (".", "kernels"):
        assert set(entry_points) & set(PLUGIN_GROUPS), f"{package}: registers no plugin"
    missing = source_files(built.src / package) - set(names)
    assert not missing, f"{package}: files of the package missing from its wheel: {sorted(missing)}"
    if package == ".":
        assert "deepinfer_core/tools/data/tiny_v4_shakespeare.safetensors" in names
        assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)


# ---- installing from the wheels alone and running --------------------------------------------------
def clean_env(**extra: str) -> dict[str, str]:
    """This environment less what would point Python at the repository or another environment, and
    less DeepInfer's and Hugging Face's settings; pip's own configuration (its cache, find-links
    folders) stays, as on a user's machine."""
    drop = ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "PYTHONUSERBASE", "VIRTUAL_ENV", "PIP_USER",
            "PIP_TARGET", "PIP_PREFIX", "PIP_EDITABLE")
    env = {k: v for k, v in os.environ.items()
           if k not in drop and not k.startswith(("DEEPINFER_", "HF_", "PYTEST_"))}
    env["PYTHONNOUSERSITE"] = "1"
    env.update(extra)
    return env


# Run inside the virtualenv: where every installed DeepInfer distribution and module comes from.
PROBE = """
import importlib, importlib.metadata as md, json, pathlib, site, sys
dists = {}
for dist in md.distributions():
    name = dist.metadata["Name"]
    if name.lower().startswith("deepinfer"):
        tops = (dist.read_text("top_level.txt") or "").split()
        dists[name] = {"version": dist.version, "location": str(dist.locate_file("")),
                       "direct_url": dist.read_text("direct_url.json"),
                       "modules": {t: importlib.import_module(t).__file__ for t in tops}}
pth = {}
for d in site.getsitepackages():
    for p in pathlib.Path(d).glob("*.pth"):
        pth[str(p)] = p.read_text()
print(json.dumps({"prefix": sys.prefix, "path": sys.path, "dists": dists, "pth": pth}))
"""


def inside(path: str | Path, root: Path) -> bool:
    return Path(os.path.realpath(path)).is_relative_to(os.path.realpath(root))


def test_wheels_install_alone_into_a_fresh_virtualenv_and_run(built, tmp_path):
    import torch

    work = tmp_path / "wheel-install"
    venv, home, outside = work / "venv", work / "home", work / "user-project"
    home.mkdir(parents=True)
    outside.mkdir()
    dists = {(pp := pyproject(p, built.src))["name"]: VERSION if p in OURS else pp["version"]
             for p in PACKAGES}
    try:
        run([sys.executable, "-m", "venv", str(venv)], "python -m venv", timeout=180, env=clean_env())
        python = venv / "bin" / "python"
        pip = [str(python), "-m", "pip", "install", "--no-compile", "--disable-pip-version-check",
               "--progress-bar", "off", *PIP_NETWORK]
        # The torch the tests run with (CI: 2.13.0, the CPU build build.sh installed); a plain
        # `torch` would resolve to a CUDA build of several GB
        run([*pip, f"torch=={torch.__version__}"], "pip install torch into the virtualenv",
            timeout=600, env=clean_env(), cwd=outside)
        folder = next(iter(built.wheels.values())).parent
        wheels_alone = [*pip, "--find-links", str(folder), *(f"{d}=={v}" for d, v in dists.items())]
        try:
            run(wheels_alone, "pip install of the wheels", timeout=600, env=clean_env(), cwd=outside)
        except pytest.fail.Exception as exc:
            pytest.fail("the wheels did not install. The deepinfer-* distributions come from the built "
                        f"wheels ({folder}); their other dependencies from the package index, which "
                        "must be reachable (PyPI, or pip's configured index).\n" + str(exc))
        run([str(python), "-m", "pip", "check"], "pip check in the virtualenv", timeout=120,
            env=clean_env(), cwd=outside)

        env = clean_env(HOME=str(home), XDG_CACHE_HOME=str(home / ".cache"), DEEPINFER_ACCELERATOR="cpu")
        probe = json.loads(run([str(python), "-c", PROBE], "the import probe", timeout=300, env=env,
                               cwd=outside).stdout)
        assert inside(probe["prefix"], venv)
        assert not [p for p in probe["path"] if p and inside(p, REPO)], probe["path"]
        assert {d: info["version"] for d, info in probe["dists"].items()} == dists
        for name, info in probe["dists"].items():
            assert inside(info["location"], venv), f"{name} installed at {info['location']}"
            assert not (info["direct_url"] and '"editable": true' in info["direct_url"]), name
            assert info["modules"], f"{name}: no importable top-level module"
            for module, file in info["modules"].items():
                assert inside(file, venv) and not inside(file, REPO), f"{module} imported from {file}"
        for path, text in probe["pth"].items():
            assert str(REPO) not in text and "__editable__" not in Path(path).name, (path, text)

        check_plugins(venv, built, env, outside)
        check_commands(venv, env, outside)
        check_offline_example(python, env, outside, home)
    finally:
        shutil.rmtree(work, ignore_errors=True)    # ~2 GB of virtualenv and the tiny model


def check_plugins(venv: Path, built: Built, env: dict[str, str], cwd: Path) -> None:
    """`deepinfer plugins` (the console script of the core's wheel) lists every plugin of every
    wheel, loaded from its distribution at the release version, and the cpu backend active."""
    expected = {}
    for wheel in built.wheels.values():
        meta, groups, _ = wheel_metadata(wheel)
        for group in PLUGIN_GROUPS:
            for name in groups.get(group, {}):
                expected[name] = (group.split(".")[1][:-1], meta["Name"], meta["Version"])
    deepinfer = str(venv / "bin" / "deepinfer")
    listing = json.loads(run([deepinfer, "plugins", "--json"], "deepinfer plugins --json",
                             timeout=300, env=env, cwd=cwd).stdout)
    found = {p["name"]: p for p in listing["plugins"]}
    assert found["core"]["status"] == "loaded" and found["core"]["version"] == VERSION, found["core"]
    for name, (kind, dist, version) in expected.items():
        assert name in found, f"plugin {name!r} of {dist} not discovered: {sorted(found)}"
        p = found[name]
        assert (p["kind"], p["dist"], p["version"], p["status"]) == (kind, dist, version, "loaded"), p
    assert listing["active"]["name"] == "cpu" and not listing["active"]["error"], listing["active"]
    table = run([deepinfer, "plugins"], "deepinfer plugins", timeout=300, env=env, cwd=cwd).stdout
    for name, (kind, dist, version) in expected.items():
        row = rf"^{name} +{kind} +{re.escape(dist)} +{re.escape(version)} +loaded\b"
        assert re.search(row, table, re.MULTILINE), f"no row for {name}:\n{table}"
    assert "\nactive backend: cpu " in table, table


def check_commands(venv: Path, env: dict[str, str], cwd: Path) -> None:
    """From a wheel install: `deepinfer env` reports the venv's packages; the benchmarks that are
    scripts of the source tree say in one line that they need a checkout (exit 2), while
    `deepinfer bench latency` ships in the wheel."""
    deepinfer = str(venv / "bin" / "deepinfer")
    report = run([deepinfer, "env"], "deepinfer env", timeout=300, env=env, cwd=cwd).stdout
    assert re.search(rf"^deepinfer-core +{re.escape(VERSION)} ", report, re.MULTILINE), report
    assert "editable" not in report and "source checkout" not in report, report
    proc = subprocess.run([deepinfer, "bench", "throughput"], capture_output=True, text=True,
                          timeout=300, env=env, cwd=cwd, check=False)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and "source" in lines[0], proc.stderr
    run([deepinfer, "bench", "latency", "--help"], "deepinfer bench latency --help", timeout=300,
        env=env, cwd=cwd)


def check_offline_example(python: Path, env: dict[str, str], cwd: Path, home: Path) -> None:
    """The offline example, copied out of the repository, builds the bundled tiny model into the
    fresh user cache from the weights inside the core's wheel and prints three completions."""
    script = cwd / "offline_inference.py"
    shutil.copyfile(REPO / "examples" / "offline_inference.py", script)
    out = run([str(python), script.name], "python offline_inference.py (outside the repository)",
              timeout=600, env=env, cwd=cwd).stdout
    bundled = home / ".cache" / "deepinfer" / "tiny-v4"
    assert f"using the bundled tiny model at {bundled} (trained on Shakespeare)" in out, out
    assert (bundled / "config.json").is_file() and (bundled / "tokenizer.json").is_file()
    completions = re.findall(r"^prompt .* \(\d+ tokens\) -> (['\"].*)$", out, re.MULTILINE)
    assert len(completions) == 3 and all(c.strip("'\"") for c in completions), out
    # the two greedy requests have ignore_eos: exactly max_tokens=8 tokens each
    greedy = re.findall(r"^  token ids \[(?:\d+, ){7}\d+\], finish_reason=length$", out, re.MULTILINE)
    assert len(greedy) >= 2, out
