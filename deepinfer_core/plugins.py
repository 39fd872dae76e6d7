"""The plugin manager: entry-point discovery, allow/deny lists, a typed facade, and a listing.

The core's portable implementations (`deepinfer_core.ops.portable_plugin`, name "core") are
registered first, exactly like any other plugin; backends (`deepinfer.backends`) and features
(`deepinfer.features`) come from installed distributions' entry points. A plugin that fails to
import is recorded and logged, never fatal by itself: only an explicit request it would have
served (e.g. DEEPINFER_ACCELERATOR=nvidia) turns its failure into an error.

Core code calls the typed facade methods (`detect_platform`, `attention_backend`, ...) once at
start-up and keeps the returned objects; it never spells `pm.hook.*` and never calls a hook on
the hot path. `python -m deepinfer_core.plugins` prints what was discovered.
"""
from __future__ import annotations

import importlib
import importlib.metadata as metadata
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import pluggy

from . import envs, hookspecs
from .hookspecs import PROJECT_NAME
from .plugin_context import Platform, PlatformError, PluginError  # noqa: F401  (re-exported)

logger = logging.getLogger("deepinfer.plugins")

CORE_NAME = "core"
CORE_MODULE = "deepinfer_core.ops.portable_plugin"
BACKENDS_GROUP = "deepinfer.backends"
FEATURES_GROUP = "deepinfer.features"
GROUPS = (BACKENDS_GROUP, FEATURES_GROUP)
INFO_ATTR = "DEEPINFER_PLUGIN_INFO"   # optional module-level {"status": ..., "note": ...}
FROM_ENV = object()                   # detect_platform(): "use DEEPINFER_ACCELERATOR"


@dataclass
class PluginRecord:
    """What discovery found for one plugin; `status` is loaded | blocked | failed."""

    name: str
    group: str                      # entry-point group, or "builtin" for the core
    dist: str = ""
    version: str = ""
    status: str = "loaded"
    error: str = ""                 # why it failed or was blocked
    info_status: str = ""           # from DEEPINFER_PLUGIN_INFO, e.g. "skeleton"
    note: str = ""

    @property
    def kind(self) -> str:
        return {BACKENDS_GROUP: "backend", FEATURES_GROUP: "feature"}.get(self.group, "core")


def _plugin_info(plugin: Any) -> dict[str, str]:
    info = getattr(plugin, INFO_ATTR, None)
    if info is None:  # allow the declaration on the plugin's top-level package too
        top = getattr(plugin, "__name__", "").split(".")[0]
        info = getattr(importlib.import_module(top), INFO_ATTR, None) if top else None
    return dict(info) if isinstance(info, Mapping) else {}


def _error_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


class PluginManager:
    """pluggy manager for project "deepinfer" plus discovery records and a typed facade."""

    def __init__(self, environ: Mapping[str, str] | None = None, *, load: bool = True) -> None:
        # Only the plugin variables are read here, so a bad unrelated variable (say a model dir)
        # does not stop discovery or `python -m deepinfer_core.plugins`.
        self.requested: str | None = envs.get("DEEPINFER_ACCELERATOR", environ)
        self.allow: tuple[str, ...] | None = envs.get("DEEPINFER_PLUGINS", environ)
        self.deny: tuple[str, ...] = envs.get("DEEPINFER_DISABLE_PLUGINS", environ)
        self.trace: bool = envs.get("DEEPINFER_TRACE_PLUGINS", environ)
        self.pm = pluggy.PluginManager(PROJECT_NAME)
        self.pm.add_hookspecs(hookspecs)
        self.records: list[PluginRecord] = []
        if self.trace:
            self._enable_tracing()
        if load:
            self.load()

    # ---- discovery -----------------------------------------------------------------------------
    def load(self) -> None:
        """Register the core, then every allowed entry point; then check for unknown hooks."""
        core = importlib.import_module(CORE_MODULE)
        self.pm.register(core, name=CORE_NAME)
        from . import __version__
        version = _dist_version("deepinfer-core") or f"{__version__} (source tree)"
        self.records.append(PluginRecord(CORE_NAME, "builtin", "deepinfer-core", version, "loaded",
                                         note="portable PyTorch reference implementations"))
        for name in self.deny:
            if name == CORE_NAME:
                logger.warning("DEEPINFER_DISABLE_PLUGINS names 'core'; the core cannot be disabled")
            else:
                self.pm.set_blocked(name)
        for group in GROUPS:
            # Sorted so registration (and so firstresult order) does not depend on sys.path order.
            for ep in sorted(metadata.entry_points(group=group), key=lambda e: e.name):
                self._load_entry_point(ep, group)
        if self.allow is not None:
            found = {r.name for r in self.records}
            for name in sorted(set(self.allow) - found - {CORE_NAME}):
                logger.warning("DEEPINFER_PLUGINS names %r but no such plugin is installed", name)
        self._check_pending()

    def _load_entry_point(self, ep: metadata.EntryPoint, group: str) -> None:
        dist = getattr(ep, "dist", None)
        rec = PluginRecord(ep.name, group, dist.metadata["Name"] if dist else "",
                           dist.version if dist else "")
        self.records.append(rec)
        if ep.name == CORE_NAME or self.pm.has_plugin(ep.name) or any(
                r.name == ep.name and r is not rec for r in self.records):
            rec.status, rec.error = "failed", f"duplicate plugin name {ep.name!r} (ignored)"
        elif self.pm.is_blocked(ep.name):
            rec.status, rec.error = "blocked", "DEEPINFER_DISABLE_PLUGINS"
        elif self.allow is not None and ep.name not in self.allow:
            rec.status, rec.error = "blocked", "not in DEEPINFER_PLUGINS"
        else:
            try:
                plugin = ep.load()
                info = _plugin_info(plugin)
                self._warn_unmarked(ep.name, plugin)
                self.pm.register(plugin, name=ep.name)
            except Exception as exc:  # a broken plugin must not take the engine down
                if self.pm.has_plugin(ep.name):  # pluggy may have registered part of it
                    self.pm.unregister(name=ep.name)
                rec.status, rec.error = "failed", _error_text(exc)
                logger.warning("plugin %r (%s, %s) failed to load: %s", ep.name, group,
                               rec.dist or "?", rec.error)
                return
            rec.info_status, rec.note = info.get("status", ""), info.get("note", "")
            if self.trace:
                logger.info("registered plugin %r from %s %s", ep.name, rec.dist, rec.version)
        if rec.status == "blocked":
            logger.info("plugin %r (%s) blocked: %s", ep.name, group, rec.error)

    def _warn_unmarked(self, name: str, plugin: Any) -> None:
        # pluggy silently ignores unmarked functions: a forgotten @hookimpl is a silent no-op.
        for attr in dir(plugin):
            if attr.startswith("deepinfer_") and callable(getattr(plugin, attr, None)):
                if self.pm.parse_hookimpl_opts(plugin, attr) is None:
                    logger.warning("plugin %r: %s is not marked with @hookimpl and is ignored",
                                   name, attr)

    def _check_pending(self) -> None:
        """Implementations of unknown hooks: unregister that plugin (recorded as failed)."""
        try:
            self.pm.check_pending()
            return
        except pluggy.PluginValidationError:
            pass
        known = {name for name, caller in vars(self.pm.hook).items()
                 if isinstance(caller, pluggy.HookCaller) and caller.has_spec()}
        for hook_name, caller in list(vars(self.pm.hook).items()):
            if hook_name in known or not isinstance(caller, pluggy.HookCaller):
                continue
            for impl in caller.get_hookimpls():
                if impl.optionalhook:
                    continue
                msg = (f"implements unknown hook {hook_name!r} (not in deepinfer_core/hookspecs.py;"
                       " typo or plugin newer than the core?)")
                if impl.plugin_name == CORE_NAME:
                    raise PluginError(f"core plugin {msg}")
                if self.pm.is_registered(impl.plugin):
                    self.pm.unregister(impl.plugin)
                for rec in self.records:
                    if rec.name == impl.plugin_name:
                        rec.status, rec.error = "failed", f"PluginValidationError: {msg}"
                logger.warning("plugin %r %s; it was unloaded", impl.plugin_name, msg)

    def _enable_tracing(self) -> None:
        def before(hook_name: str, impls: list, kwargs: Mapping[str, Any]) -> None:
            logger.info("hook %s(%s) -> impls [%s]", hook_name,
                        ", ".join(f"{k}={v!r}" for k, v in kwargs.items()),
                        ", ".join(i.plugin_name for i in impls))

        def after(outcome: Any, hook_name: str, impls: list, kwargs: Mapping[str, Any]) -> None:
            exc = outcome.exception
            logger.info("hook %s returned %s", hook_name,
                        _error_text(exc) if exc else repr(outcome.get_result()))

        self.pm.add_hookcall_monitoring(before, after)

    # ---- queries ---------------------------------------------------------------------------
    def record(self, name: str) -> PluginRecord | None:
        return next((r for r in self.records if r.name == name), None)

    def failed(self) -> list[PluginRecord]:
        return [r for r in self.records if r.status == "failed"]

    # ---- platform ----------------------------------------------------------------------------
    def detect_platform(self, requested: str | None | object = FROM_ENV) -> Platform:
        """The platform to run on. `requested` defaults to DEEPINFER_ACCELERATOR.

        Precedence: an explicit request > exactly one out-of-tree platform whose hardware is
        present > the core's CPU platform; two out-of-tree answers are an error.
        """
        if requested is FROM_ENV:
            requested = self.requested
        elif requested is not None:
            requested = envs.ENV_VARS["DEEPINFER_ACCELERATOR"].parse(str(requested))
        hook = self.pm.hook.deepinfer_detect_platform
        if requested is not None:
            platform = hook(requested=requested)
            if platform is None or platform.name != requested:
                raise PlatformError(self._missing_platform_message(requested, platform))
            return platform
        answers: list[Platform] = []
        # Called one by one (not firstresult) so that an ambiguity is an error, not a coin toss.
        for impl in reversed(hook.get_hookimpls()):
            if impl.hookwrapper or impl.wrapper:
                continue
            try:
                result = impl.function(*[{"requested": None}[a] for a in impl.argnames])
            except Exception as exc:  # a broken probe must not hide the other platforms
                logger.warning("plugin %r: platform detection failed: %s", impl.plugin_name,
                               _error_text(exc))
                continue
            if self.trace:  # direct calls bypass pluggy's monitoring, so log them here
                logger.info("hook deepinfer_detect_platform(requested=None) [%s] returned %r",
                            impl.plugin_name, result)
            if result is not None:
                answers.append(result)
        outside = [p for p in answers if p.plugin != CORE_NAME]
        if len(outside) > 1:
            names = ", ".join(f"{p.name} (plugin {p.plugin})" for p in outside)
            raise PlatformError(f"several platforms detected: {names}; set DEEPINFER_ACCELERATOR "
                                "to choose one")
        if outside:
            return outside[0]
        if answers:
            return answers[0]
        raise PlatformError("no platform detected and the core provided none; is "
                            f"{CORE_MODULE} intact?" + self._failures_text())

    def _missing_platform_message(self, requested: str, got: Platform | None) -> str:
        head = f"DEEPINFER_ACCELERATOR={requested}: no installed plugin provides platform " \
               f"{requested!r}"
        if got is not None:
            head += f" (plugin {got.plugin!r} answered with {got.name!r})"
        rec = self.record(requested)
        if rec is None:
            head += (f"; the {requested!r} backend is not installed (run "
                     f"DEEPINFER_ACCELERATOR={requested} ./build.sh)")
        elif rec.status == "blocked":
            head += f"; plugin {requested!r} is blocked ({rec.error})"
        return head + self._failures_text()

    def _failures_text(self) -> str:
        failed = self.failed()
        if not failed:
            return ""
        return "; failed plugins: " + "; ".join(f"{r.name} ({r.group}): {r.error}" for r in failed)

    # ---- typed facade: called once at start-up, results kept by the caller --------------------
    def _first(self, hook_name: str, what: str, required: bool = True, **kwargs: Any) -> Any:
        result = getattr(self.pm.hook, hook_name)(**kwargs)
        if result is None and required:
            ctx = kwargs.get("ctx")
            where = f" on platform {ctx.platform.name!r}" if ctx is not None else ""
            impls = [i.plugin_name for i in getattr(self.pm.hook, hook_name).get_hookimpls()]
            raise PluginError(f"no plugin provided {what}{where} (hook {hook_name}; "
                              f"implemented by: {', '.join(impls) or 'none'})"
                              + self._failures_text())
        return result

    def configure(self, ctx: Any) -> Any:
        """Let every plugin validate/adjust the build context; returns `ctx`."""
        self.pm.hook.deepinfer_configure(ctx=ctx)
        return ctx

    def linear_method(self, ctx: Any, fmt: str) -> Any:
        return self._first("deepinfer_linear_method", f"a linear method for {fmt!r} weights",
                           ctx=ctx, weight_format=fmt)

    def attention_backend(self, ctx: Any) -> Any:
        return self._first("deepinfer_attention_backend", "an attention backend", ctx=ctx)

    def moe_method(self, ctx: Any) -> Any:
        return self._first("deepinfer_moe_method", "a MoE method", ctx=ctx)

    def pointwise_method(self, ctx: Any) -> Any:
        return self._first("deepinfer_pointwise_method", "a pointwise method", ctx=ctx)

    def mhc_method(self, ctx: Any) -> Any:
        return self._first("deepinfer_mhc_method", "an mHC method", ctx=ctx)

    def sampler(self, ctx: Any) -> Any:
        return self._first("deepinfer_sampler", "a sampler", ctx=ctx)

    def logits_processors(self, ctx: Any) -> list:
        """All plugins' processors, concatenated (an implementation returns a list or None)."""
        out: list = []
        for result in self.pm.hook.deepinfer_logits_processors(ctx=ctx):
            if result is not None:
                out.extend(result if isinstance(result, (list, tuple)) else [result])
        return out

    def scheduler_policy(self, ctx: Any) -> Any:
        return self._first("deepinfer_scheduler_policy", "a scheduler policy", ctx=ctx)

    def proposer(self, ctx: Any) -> Any | None:
        """The draft proposer, or None: speculation is off (not an error)."""
        return self._first("deepinfer_proposer", "a proposer", required=False, ctx=ctx)

    def prefill_truncation(self, ctx: Any) -> Any | None:
        return self._first("deepinfer_prefill_truncation", "a prefill truncation", required=False, ctx=ctx)

    def verifier(self, ctx: Any) -> Any:
        return self._first("deepinfer_verifier", "a verifier", ctx=ctx)

    # ---- listing ----------------------------------------------------------------------------
    def listing(self) -> dict[str, Any]:
        """Discovered plugins plus the active platform (or why none could be chosen)."""
        try:
            platform = self.detect_platform()
            active = {"name": platform.name, "plugin": platform.plugin,
                      "device_type": platform.device_type, "error": ""}
        except Exception as exc:  # the listing must still print when detection fails
            active = {"name": "", "plugin": "", "device_type": "", "error": _error_text(exc)}
        return {"plugins": [dict(vars(r), kind=r.kind) for r in self.records], "active": active}


def _dist_version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return ""


_cached: PluginManager | None = None


def get_plugin_manager(refresh: bool = False) -> PluginManager:
    """The process-wide manager built from os.environ (rebuilt when `refresh`)."""
    global _cached
    if _cached is None or refresh:
        _cached = PluginManager()
    return _cached


def list_plugins(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Fresh discovery (not the cached manager) and its listing; see `PluginManager.listing`."""
    return PluginManager(environ).listing()


def format_listing(listing: Mapping[str, Any]) -> str:
    header = ("name", "kind", "distribution", "version", "status", "note")
    rows = [header]
    for p in listing["plugins"]:
        status = p["status"] + (f" ({p['info_status']})" if p["info_status"] else "")
        note = p["error"] if p["status"] != "loaded" else p["note"]
        rows.append((p["name"], p["kind"], p["dist"], p["version"], status, note))
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(header) - 1)]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(r, widths)) + "  " + str(r[-1])
             for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths) + "  ----")
    active = listing["active"]
    if active["error"]:
        lines.append(f"\nactive backend: none ({active['error']})")
    else:
        lines.append(f"\nactive backend: {active['name']} (plugin {active['plugin']}, "
                     f"device {active['device_type']})")
    return "\n".join(line.rstrip() for line in lines)


def main(argv: list[str] | None = None, prog: str = "python -m deepinfer_core.plugins") -> int:
    import argparse
    import json

    parser = argparse.ArgumentParser(prog=prog,
                                     description="List DeepInfer plugins and the active backend.")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        listing = list_plugins()
    except envs.EnvError as exc:
        print(f"error: {exc}")
        return 2
    print(json.dumps(listing, indent=2) if args.json else format_listing(listing))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
