"""The DEEPINFER_* table: typed parsing, validation errors, unknown-name warning, README sync."""
from __future__ import annotations

import dataclasses
import logging
import subprocess
import sys
from pathlib import Path

import pytest

from deepinfer_core import envs, readme_tables

REPO = Path(__file__).resolve().parents[2]

# One invalid value per declared variable (the path one is filled in per test: it needs tmp_path).
INVALID = {
    "DEEPINFER_ACCELERATOR": "bogus",
    "DEEPINFER_HF_MODEL_DIR": None,
    "DEEPINFER_ENABLE_MTP_VARLEN": "maybe",
    "DEEPINFER_USE_NEXTN_DECODE": "-1",
    "DEEPINFER_DFLASH_CONFIDENCE_HEAD_TEMPERATURE": "1.0,hot",
    "DEEPINFER_MAX_BACKTRACKING_TOKENS": "six",
    "DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE": "foo",
    "DEEPINFER_YOCO_PREFILL_KEEP_TOKENS": "1.5",
    "DEEPINFER_ENGRAM_FORCE_GPU_STORAGE": "gpu",
    "DEEPINFER_BATCH_INVARIANT": "2",
    "DEEPINFER_ZERO_OVERHEAD_SCHEDULING": "on-ish",
    "DEEPINFER_CPU_KV_CACHE_BYTES": "0",
    "DEEPINFER_ENFORCE_EAGER": "nope",
    "DEEPINFER_PDL": "fast",
    "DEEPINFER_XGRAMMAR_TIMEOUT": "0",
    "DEEPINFER_XGRAMMAR_CACHE_LIMIT_BYTES": "-1",
    "DEEPINFER_XGRAMMAR_DISABLE_CACHE": "sometimes",
    "DEEPINFER_SO_BUILDER_CPUS": "four",
    "DEEPINFER_SO_JSON_MAX_WHITESPACE": "-2",
    "DEEPINFER_PLUGINS": "nvidia;ascend",
    "DEEPINFER_DISABLE_PLUGINS": "a b",
    "DEEPINFER_TRACE_PLUGINS": "10",
    "DEEPINFER_DP_AUTHKEY": "too-short",
}


def test_every_declared_variable_has_an_invalid_case():
    assert set(INVALID) == set(envs.ENV_VARS)


@pytest.mark.parametrize("name", sorted(INVALID))
def test_invalid_value_names_variable_value_and_allowed(name, tmp_path):
    bad = INVALID[name] if INVALID[name] is not None else str(tmp_path / "missing")
    with pytest.raises(envs.EnvError) as err:
        envs.read_settings({name: bad})
    msg = str(err.value)
    secret = envs.ENV_VARS[name].kind == "secret"
    assert name in msg and (bad not in msg if secret else repr(bad) in msg)     # a secret is never printed
    assert "allowed: " + envs.ENV_VARS[name].allowed() in msg
    with pytest.raises(ValueError):  # EnvError is a ValueError; get() validates the same way
        envs.get(name, {name: bad})


def test_a_secret_is_never_printed(monkeypatch, capsys):
    secret = "a-secret-of-24-chars-xyz"
    monkeypatch.setenv("DEEPINFER_DP_AUTHKEY", secret)
    assert envs.get("DEEPINFER_DP_AUTHKEY") == secret and secret not in repr(envs.read_settings())
    assert envs.main([]) == 0
    out = capsys.readouterr().out
    assert "DEEPINFER_DP_AUTHKEY='<set>'" in out and secret not in out


def test_error_message_format():
    with pytest.raises(envs.EnvError, match=r"^DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE='foo' is "
                                            r"invalid; allowed: off, mask, compact$"):
        envs.get("DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE", {"DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE": "foo"})


def test_defaults():
    s = envs.read_settings({})
    assert s == envs.Settings()
    assert s.accelerator is None and s.hf_model_dir is None
    assert s.use_nextn_decode == 5 and s.max_backtracking_tokens == 0
    assert s.zero_overhead_scheduling is True and s.batch_invariant is False
    assert s.yoco_prefill_truncation_mode == "off"
    assert s.plugins is None and s.disable_plugins == ()
    assert dataclasses.is_dataclass(s)
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.use_nextn_decode = 3  # type: ignore[misc]


@pytest.mark.parametrize("raw,value", [("1", True), ("0", False), ("true", True), ("FALSE", False),
                                       ("Yes", True), ("no", False), (" 1 ", True), ("", False)])
def test_bool_spellings(raw, value):
    assert envs.get("DEEPINFER_BATCH_INVARIANT", {"DEEPINFER_BATCH_INVARIANT": raw}) is value


def test_typed_values(tmp_path):
    env = {
        "DEEPINFER_ACCELERATOR": "NVIDIA",
        "DEEPINFER_HF_MODEL_DIR": str(tmp_path),
        "DEEPINFER_USE_NEXTN_DECODE": "3",
        "DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE": "compact",
        "DEEPINFER_YOCO_PREFILL_KEEP_TOKENS": "140",
        "DEEPINFER_ZERO_OVERHEAD_SCHEDULING": "0",
        "DEEPINFER_PLUGINS": "nvidia, dspark ,",
        "DEEPINFER_DISABLE_PLUGINS": "swa_replay",
    }
    s = envs.read_settings(env)
    assert s.accelerator == "nvidia"          # choices are case-insensitive, normalised
    assert s.hf_model_dir == str(tmp_path)
    assert s.use_nextn_decode == 3 and s.yoco_prefill_keep_tokens == 140
    assert s.yoco_prefill_truncation_mode == "compact"
    assert s.zero_overhead_scheduling is False
    assert s.plugins == ("nvidia", "dspark") and s.disable_plugins == ("swa_replay",)


def test_effective_max_backtracking_tokens():
    assert envs.effective_max_backtracking_tokens(0, 5) == 6
    assert envs.effective_max_backtracking_tokens(10, 5) == 10
    assert envs.read_settings({}).effective_max_backtracking_tokens == 6
    s = envs.read_settings({"DEEPINFER_USE_NEXTN_DECODE": "0", "DEEPINFER_MAX_BACKTRACKING_TOKENS": "4"})
    assert s.effective_max_backtracking_tokens == 4


def test_get_unknown_name_is_a_programming_error():
    with pytest.raises(KeyError, match="not declared"):
        envs.get("DEEPINFER_NOT_A_THING", {})


def test_unknown_variables_warn_once(caplog):
    env = {"DEEPINFER_TYPO_ONE": "1", "DEEPINFER_TYPO_TWO": "x", "OTHER": "1"}
    with caplog.at_level(logging.WARNING, logger="deepinfer.envs"):
        envs.read_settings(env)
        envs.read_settings(env)
    warnings = [r for r in caplog.records if "DEEPINFER_TYPO_ONE" in r.getMessage()]
    assert len(warnings) == 1
    assert "DEEPINFER_TYPO_TWO" in warnings[0].getMessage()
    assert "OTHER" not in warnings[0].getMessage()


def test_settings_fields_follow_the_table():
    assert [f.name for f in dataclasses.fields(envs.Settings)] == \
        [envs.field_name(n) for n in envs.ENV_VARS]
    for var in envs.ENV_VARS.values():
        assert var.doc and var.name.startswith("DEEPINFER_")
        assert getattr(envs.Settings(), envs.field_name(var.name)) == var.default


def test_readme_table_matches_generated():
    """The table in docs/configuration.md is the generated one."""
    page = readme_tables.DOCS_PAGE
    section = envs.readme_section((REPO / page).read_text(encoding="utf-8"))
    assert section is not None, f"{page} lacks the <!-- envs:begin/end --> markers"
    assert section.strip() == envs.markdown_table().strip(), \
        f"{page}'s env table is stale: run python -m deepinfer_core.envs --update {page}"


def test_cli_markdown_and_update_readme(tmp_path):
    out = subprocess.run([sys.executable, "-m", "deepinfer_core.envs", "--markdown"], cwd=REPO,
                         capture_output=True, text=True, check=True).stdout
    assert out.strip() == envs.markdown_table()
    readme = tmp_path / "README.md"
    readme.write_text(f"# X\n{envs.README_BEGIN}\nold\n{envs.README_END}\ntail\n")
    assert envs.update_readme(readme) is True
    assert envs.readme_section(readme.read_text()).strip() == envs.markdown_table()
    assert readme.read_text().endswith("tail\n")
    assert envs.update_readme(readme) is False
    readme.write_text(f"# X\n{envs.README_BEGIN}\nold\n{envs.README_END}\n")
    for flag, said in (("--update", "updated"), ("--update-readme", "already up to date")):
        out = subprocess.run([sys.executable, "-m", "deepinfer_core.envs", flag, str(readme)],
                             cwd=REPO, capture_output=True, text=True, check=True).stdout
        assert out.strip() == f"{readme}: {said}"
    assert envs.readme_section(readme.read_text()).strip() == envs.markdown_table()
