"""docs/plugins.md carries the generated reference of every hook spec and Protocol member, current;
the check that finds an undocumented one does find it (a fake hook spec and a fake member)."""
from __future__ import annotations

import types
from typing import Protocol

import pytest
from plugin_cases import PLUGINS_PAGE

from deepinfer_core import hookspecs, plugin_docs
from deepinfer_core.engine import constraints
from deepinfer_core.hookspecs import hookspec


def page() -> str:
    return PLUGINS_PAGE.read_text(encoding="utf-8")


def test_the_generated_reference_is_current():
    section = plugin_docs.page_section(PLUGINS_PAGE)
    assert section is not None, f"{PLUGINS_PAGE} lacks {plugin_docs.BEGIN} ... {plugin_docs.END}"
    assert section.strip() == plugin_docs.markdown().strip(), (
        "docs/plugins.md is stale: python -m deepinfer_core.plugin_docs --update docs/plugins.md")


def test_every_hook_spec_and_protocol_member_has_an_entry():
    assert plugin_docs.missing_entries(page()) == []
    names = [name for name, _, _ in plugin_docs.hook_specs(hookspecs)]
    assert "deepinfer_logits_processors" in names and len(names) >= 12


def _fake_modules():
    hooks = types.ModuleType("fake_hookspecs")

    @hookspec(firstresult=True)
    def deepinfer_undocumented_hook(ctx):
        """A hook no page documents."""

    hooks.deepinfer_undocumented_hook = deepinfer_undocumented_hook
    contracts = types.ModuleType("fake_constraints")

    class LogitsProcessor(constraints.LogitsProcessor, Protocol):    # the real one, one member more
        def undocumented(self) -> None:
            """A member no page documents."""

    LogitsProcessor.__module__ = contracts.__name__
    contracts.LogitsProcessor = LogitsProcessor
    return hooks, contracts


def test_the_check_finds_an_undocumented_hook_spec_and_member():
    hooks, contracts = _fake_modules()
    missing = plugin_docs.missing_entries(page(), [hooks], [contracts])
    assert missing == ["hook spec deepinfer_undocumented_hook (fake_hookspecs)",
                       "LogitsProcessor.undocumented (fake_constraints)"]
    # ...and the generator writes the entries that would satisfy it
    text = plugin_docs.markdown([hooks], [contracts])
    assert plugin_docs.missing_entries(text, [hooks], [contracts]) == []
    assert "#### `deepinfer_undocumented_hook(ctx)`" in text and "**firstresult**" in text
    assert "- `LogitsProcessor.undocumented() -> None`: A member no page documents." in text


def test_a_page_without_an_entry_fails_the_check():
    entry = plugin_docs.member_entry(constraints.LogitsProcessor, "advance")
    cut = "\n".join(line for line in page().splitlines() if not line.startswith(entry))
    assert plugin_docs.missing_entries(cut) == [
        "LogitsProcessor.advance (deepinfer_core.engine.constraints)"]


def test_the_cli_prints_and_updates(tmp_path, capsys):
    assert plugin_docs.main(["--markdown"]) == 0
    assert capsys.readouterr().out.strip() == plugin_docs.markdown().strip()
    doc = tmp_path / "plugins.md"
    doc.write_text(f"# X\n{plugin_docs.BEGIN}\nold\n{plugin_docs.END}\ntail\n", encoding="utf-8")
    assert plugin_docs.main(["--update", str(doc)]) == 0
    assert plugin_docs.page_section(doc).strip() == plugin_docs.markdown().strip()
    assert doc.read_text(encoding="utf-8").endswith(f"{plugin_docs.END}\ntail\n")
    assert plugin_docs.main(["--update", str(doc)]) == 0
    assert capsys.readouterr().out.endswith("already up to date\n")
    doc.write_text("# no markers\n", encoding="utf-8")
    with pytest.raises(ValueError, match="lacks the markers"):
        plugin_docs.main(["--update", str(doc)])
