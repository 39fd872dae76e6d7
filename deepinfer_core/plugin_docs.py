"""The reference section of docs/plugins.md, generated from the code a plugin must satisfy: every
hook spec of hookspecs.py (its signature, whether it is firstresult, its docstring) and every
`typing.Protocol` of contracts.py, engine/constraints.py and engine/scheduler.py (each member
with its docstring, or the comment beside an attribute, and the optional members their comments
describe).

`python -m deepinfer_core.plugin_docs --markdown` prints the section; `--update docs/plugins.md`
rewrites it between the marker comments. A test keeps the page current and fails when a hook spec
or a Protocol member has no entry there (`missing_entries`).
"""
from __future__ import annotations

import importlib
import inspect
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any, Protocol

from .hookspecs import PROJECT_NAME
from .readme_tables import cli, section

DOCS_PAGE = "docs/plugins.md"
BEGIN = "<!-- plugin-reference:begin -->"
END = "<!-- plugin-reference:end -->"
HOOK_MODULES = ("deepinfer_core.hookspecs",)
PROTOCOL_MODULES = ("deepinfer_core.contracts", "deepinfer_core.engine.constraints",
                    "deepinfer_core.engine.scheduler")
_SPEC_ATTR = f"{PROJECT_NAME}_spec"          # where pluggy's HookspecMarker keeps a spec's options


# ---- what the code declares --------------------------------------------------------------------
def hook_specs(module: ModuleType) -> list[tuple[str, Callable, dict]]:
    """(name, function, pluggy options) of each hook spec of `module`, in definition order."""
    return [(name, fn, getattr(fn, _SPEC_ATTR)) for name, fn in vars(module).items()
            if callable(fn) and isinstance(getattr(fn, _SPEC_ATTR, None), dict)]


def protocols(module: ModuleType) -> list[type]:
    """The typing.Protocol classes defined in `module`, in definition order."""
    return [obj for obj in vars(module).values()
            if isinstance(obj, type) and obj is not Protocol and getattr(obj, "_is_protocol", False)
            and obj.__module__ == module.__name__]


def protocol_members(contract: type) -> list[tuple[str, str, str]]:
    """(name, signature or annotation, doc) of each member `contract` itself declares: attributes
    (doc: the comment beside them) first, then methods (doc: the docstring)."""
    comments = _attribute_comments(contract)
    annotations = vars(contract).get("__annotations__", {})
    out = [(name, f": {_annotation(ann)}", comments.get(name, ""))
           for name, ann in annotations.items() if not name.startswith("_")]
    out += [(name, _signature(fn, drop_self=True), inspect.cleandoc(fn.__doc__ or ""))
            for name, fn in vars(contract).items() if callable(fn) and not name.startswith("_")]
    return out


def optional_members(contract: type) -> list[str]:
    """The comments in the class body that start with `# Optional`, each as one paragraph (a
    commented-out `def name(self, ...) -> T:` shown as `name(...) -> T`)."""
    try:
        lines = inspect.getsource(contract).splitlines()
    except (OSError, TypeError):      # a class without source (made at run time)
        return []
    found: list[list[str]] = []
    for line in lines:
        text = line.strip()
        if text.startswith("# Optional"):
            found.append([text[len("# Optional"):].lstrip(",: ")])
        elif found and found[-1] and text.startswith("#"):
            found[-1].append(text[1:].strip())
        elif found and found[-1]:
            found.append([])                 # the comment block ended
    paragraphs = [" ".join(block) for block in found if block]
    method = re.compile(r"def (\w+)\(self,? ?([^)]*)\)( -> [^:]+)?:")
    return [method.sub(r"`\1(\2)\3`:", p).replace('"""', "") for p in paragraphs]


def _attribute_comments(contract: type) -> dict[str, str]:
    """attribute -> the comment beside its annotation (and on the comment-only lines below it)."""
    try:
        lines = inspect.getsource(contract).splitlines()
    except (OSError, TypeError):
        return {}
    out: dict[str, str] = {}
    current = None
    for line in lines:
        m = re.match(r"\s+(\w+): [^#]*#(.*)$", line)
        if m:
            current, out[m.group(1)] = m.group(1), m.group(2).strip()
        elif current and line.strip().startswith("#"):
            out[current] += " " + line.strip()[1:].strip()
        else:
            current = None
    return out


def _annotation(ann: Any) -> str:
    return ann if isinstance(ann, str) else inspect.formatannotation(ann)


def _signature(fn: Callable, drop_self: bool = False) -> str:
    sig = inspect.signature(fn)
    parts, star_done = [], False
    params = list(sig.parameters.values())[1 if drop_self else 0:]
    for p in params:
        if p.kind is p.KEYWORD_ONLY and not star_done:
            parts.append("*")
        star_done = star_done or p.kind in (p.KEYWORD_ONLY, p.VAR_POSITIONAL)
        text = {p.VAR_POSITIONAL: "*", p.VAR_KEYWORD: "**"}.get(p.kind, "") + p.name
        if p.annotation is not p.empty:
            text += f": {_annotation(p.annotation)}"
        if p.default is not p.empty:
            text += f" = {p.default!r}"
        parts.append(text)
    ret = "" if sig.return_annotation is sig.empty else f" -> {_annotation(sig.return_annotation)}"
    return f"({', '.join(parts)}){ret}"


# ---- the entries a page must have ---------------------------------------------------------------
def hook_entry(name: str) -> str:
    return f"#### `{name}("


def member_entry(contract: type, member: str) -> str:
    return f"- `{contract.__name__}.{member}"


def missing_entries(page: str, hook_modules: Sequence[ModuleType] | None = None,
                    protocol_modules: Sequence[ModuleType] | None = None) -> list[str]:
    """The hook specs and Protocol members that have no entry in the text `page`."""
    hook_modules, protocol_modules = _modules(hook_modules, protocol_modules)
    missing = [f"hook spec {name} ({m.__name__})" for m in hook_modules
               for name, _, _ in hook_specs(m) if hook_entry(name) not in page]
    missing += [f"{c.__name__}.{name} ({m.__name__})" for m in protocol_modules
                for c in protocols(m) for name, _, _ in protocol_members(c)
                if member_entry(c, name) not in page]
    return missing


def _modules(hook_modules, protocol_modules) -> tuple[list[ModuleType], list[ModuleType]]:
    def load(given, default):
        return [importlib.import_module(n) for n in default] if given is None else list(given)
    return load(hook_modules, HOOK_MODULES), load(protocol_modules, PROTOCOL_MODULES)


# ---- Markdown ----------------------------------------------------------------------------------
def _path(module: ModuleType) -> str:
    return module.__name__.replace(".", "/") + ".py"


def _indented(doc: str) -> str:
    """A docstring as the continuation of a list item (paragraph breaks kept)."""
    return "\n".join(f"  {line}" if line.strip() else "" for line in doc.splitlines()).lstrip()


def markdown(hook_modules: Sequence[ModuleType] | None = None,
             protocol_modules: Sequence[ModuleType] | None = None) -> str:
    """The reference section: the hook specs, then the Protocols."""
    hook_modules, protocol_modules = _modules(hook_modules, protocol_modules)
    out = ["### Hook specs", ""]
    for module in hook_modules:
        for name, fn, opts in hook_specs(module):
            out += [f"{hook_entry(name)}{_signature(fn)[1:]}`", "",
                    f"Declared in `{_path(module)}`. " + (
                        "**firstresult**: the implementations are asked in turn (`tryfirst` first, "
                        "`trylast` last) and the first answer that is not None wins."
                        if opts.get("firstresult") else
                        "**Every implementation is called**; their answers are collected."), ""]
            out += [inspect.cleandoc(fn.__doc__ or "(no docstring)"), ""]
    out += ["### Protocols", ""]
    for module in protocol_modules:
        for contract in protocols(module):
            bases = [b.__name__ for b in contract.__bases__ if getattr(b, "_is_protocol", False)
                     and b is not Protocol]
            extends = f"; extends {', '.join(f'`{b}`' for b in bases)}" if bases else ""
            out += [f"#### `{contract.__name__}`", "",
                    f"Declared in `{_path(module)}`{extends}.", ""]
            if contract.__doc__:
                out += [inspect.cleandoc(contract.__doc__), ""]
            for name, sig, doc in protocol_members(contract):
                doc = f": {_indented(doc)}" if doc else ""
                out.append(f"{member_entry(contract, name)}{sig}`{doc}")
            out += [f"- optional (not checked at start-up): {text}"
                    for text in optional_members(contract)]
            out.append("")
    return "\n".join(out).rstrip() + "\n"


def page_section(path: str | Path = DOCS_PAGE) -> str | None:
    """The section as the page carries it (None without the markers)."""
    return section(Path(path).read_text(encoding="utf-8"), BEGIN, END)


def main(argv: list[str] | None = None) -> int:
    return cli("python -m deepinfer_core.plugin_docs",
               "The hook and Protocol reference of docs/plugins.md.", markdown, BEGIN, END, argv,
               page=DOCS_PAGE)


if __name__ == "__main__":
    raise SystemExit(main())
