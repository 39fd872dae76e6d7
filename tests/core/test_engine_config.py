"""`EngineConfig`: one validated, env-resolved config for every engine option; the CLI flags and the
README table generated from it; options the engine does not implement refused, never ignored."""
from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from deepinfer_core import engine_config as ec
from deepinfer_core import envs, generate, readme_tables
from deepinfer_core.engine_config import COMPAT_OPTIONS, EngineConfig, option_fields

REPO = Path(__file__).resolve().parents[2]
OPTIONS = [name for name, *_ in option_fields()]


@pytest.fixture
def clean_env(monkeypatch):
    for name in envs.ENV_VARS:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_defaults_are_the_engine_defaults(clean_env):
    c = EngineConfig.from_options()
    assert c == EngineConfig()                     # the dataclass defaults are the env table's
    assert (c.scheduler.max_num_seqs, c.scheduler.max_num_batched_tokens, c.scheduler.async_scheduling) == \
        (256, 8192, True)
    assert (c.cache.num_cache_blocks, c.cache.kv_cache_memory_bytes, c.cache.gpu_memory_utilization,
            c.cache.cpu_kv_cache_bytes, c.cache.kv_cache_dtype, c.cache.max_backtracking_tokens) == \
        (None, None, 0.9, 1 << 30, "auto", 6)
    m = c.model
    assert (m.model, m.dtype, m.simulate_qat, m.seed, m.max_model_len, m.device, m.load_format,
            m.batch_invariant, m.enforce_eager) == \
        (None, "float32", True, 0, None, None, "auto", False, False)
    assert c.decode_sequence is False and c.parallel.tensor_parallel_size == 1
    assert c.speculative.speculative_config is None and not c.speculative.enable_mtp_varlen


@pytest.mark.parametrize("name", OPTIONS)
def test_every_field_refuses_a_bad_value_naming_the_field(clean_env, name):
    bad = object()          # of no accepted type for any field
    with pytest.raises(ValueError, match=rf"^{name}=<object object .*; allowed: ") as err:
        EngineConfig.from_options(**{name: bad})
    assert "allowed" in str(err.value)


@pytest.mark.parametrize("options, message", [
    ({"max_num_seqs": 0}, "max_num_seqs=0; allowed: an int >= 1"),
    ({"max_num_batched_tokens": True}, "max_num_batched_tokens=True; allowed: an int >= 1"),
    ({"gpu_memory_utilization": 1.5}, r"gpu_memory_utilization=1.5; allowed: a number in \(0, 1\]"),
    ({"dtype": "float16"}, "dtype='float16' is not supported; allowed: 'float32', 'bfloat16'"),
    ({"kv_cache_dtype": "fp16"}, "kv_cache_dtype='fp16'; allowed: 'auto', 'bfloat16', 'fp8'"),
    ({"kv_cache_dtype": "fp8"}, "kv_cache_dtype='fp8' needs dtype='bfloat16'"),
    ({"load_format": "pt"}, "load_format='pt'; allowed: 'auto', 'dummy'"),
    ({"async_scheduling": "yes"}, r"async_scheduling='yes'; allowed: True, False, None \(= "
                                  "DEEPINFER_ZERO_OVERHEAD_SCHEDULING\\)"),
    ({"tensor_parallel_size": 8}, r"tensor_parallel_size=8; allowed: 1 \(not implemented; data and expert parallelism are"),
    ({"data_parallel_size": 0}, "data_parallel_size=0; allowed: an int >= 1"),
    ({"data_parallel_size": 2, "device": "cuda:1"},
     r"data_parallel_size=2 with device='cuda:1': rank r runs on GPU r \(or NPU r\) .* allowed with "
     "data_parallel_size > 1: device='cpu', 'cuda', 'npu' or None"),
    ({"data_parallel_size": 2, "num_speculative_tokens": 0, "enable_mtp_varlen": True},
     "enable_mtp_varlen=True .*num_speculative_tokens=0"),
    ({"enable_expert_parallel": True}, "enable_expert_parallel=True with data_parallel_size=1"),
    ({"enable_expert_parallel": "yes"}, "enable_expert_parallel='yes'; allowed: True, False"),
    ({"data_parallel_size": 2, "enable_eplb": True}, "enable_eplb=True needs enable_expert_parallel=True"),
    ({"data_parallel_size": 2, "num_redundant_experts": 2}, "num_redundant_experts=2 needs enable_expert_parallel"),
    ({"num_redundant_experts": -1}, "num_redundant_experts=-1; allowed: an int >= 0"),
    ({"data_parallel_size": 2, "enable_expert_parallel": True, "eplb_step_interval": 10},
     "eplb_step_interval=10 needs enable_eplb=True; allowed without it: 3000"),
    ({"data_parallel_size": 2, "enable_expert_parallel": True, "eplb_stat_interval": 16},
     "eplb_stat_interval=16 needs enable_eplb=True; allowed without it: 128"),
    ({"eplb_window_size": 0}, "eplb_window_size=0; allowed: an int >= 1"),
    ({"expert_parallel_size": 2}, r"expert_parallel_size=2; allowed: 1 \(set enable_expert_parallel instead"),
    ({"speculative_config": {"num_speculative_tokens": 3}}, "speculative_config=.*use num_speculative_tokens"),
    ({"num_speculative_tokens": 4, "max_backtracking_tokens": 2},
     "num_speculative_tokens=4 .*needs max_backtracking_tokens >= 5 .*DEEPINFER_MAX_BACKTRACKING_TOKENS"),
    ({"max_backtracking_tokens": -1}, "max_backtracking_tokens=-1; allowed: an int >= 0"),
])
def test_validation_messages(clean_env, options, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig.from_options(**options)


def test_data_parallel_options(clean_env):
    c = EngineConfig.from_options(data_parallel_size=4, enable_expert_parallel=True, enable_eplb=True,
                                  num_redundant_experts=4, eplb_window_size=8, eplb_step_interval=16)
    p = c.parallel
    assert (p.data_parallel_size, p.enable_expert_parallel, p.enable_eplb) == (4, True, True)
    assert (p.num_redundant_experts, p.eplb_window_size, p.eplb_step_interval) == (4, 8, 16)
    assert c.replace(enable_eplb=False, eplb_window_size=1000, eplb_step_interval=3000).parallel.enable_eplb is False
    assert EngineConfig.from_options(data_parallel_size=2, device="cpu").parallel.enable_expert_parallel is False


def test_aliases_are_normalised(clean_env):
    import torch
    assert EngineConfig.from_options(dtype="auto").model.dtype == "bfloat16"
    assert EngineConfig.from_options(dtype=torch.bfloat16).model.dtype == "bfloat16"
    assert EngineConfig.from_options(gpu_memory_utilization=1).cache.gpu_memory_utilization == 1.0
    assert EngineConfig.from_options(model=Path("/x")).model.model == "/x"


def test_unknown_option_is_a_type_error_listing_the_accepted(clean_env):
    with pytest.raises(TypeError, match=r"argument\(s\) \['bogus'\]; accepted: .*max_num_seqs"):
        EngineConfig.from_options(bogus=1)


def test_env_defaults_are_resolved_once(clean_env, tmp_path):
    env = {"DEEPINFER_ZERO_OVERHEAD_SCHEDULING": "0", "DEEPINFER_ENFORCE_EAGER": "1",
           "DEEPINFER_BATCH_INVARIANT": "yes", "DEEPINFER_CPU_KV_CACHE_BYTES": "12345",
           "DEEPINFER_MAX_BACKTRACKING_TOKENS": "9", "DEEPINFER_HF_MODEL_DIR": str(tmp_path)}
    for name, value in env.items():
        clean_env.setenv(name, value)
    c = EngineConfig.from_options()
    assert c.scheduler.async_scheduling is False and c.model.enforce_eager is True
    assert c.model.batch_invariant is True and c.cache.cpu_kv_cache_bytes == 12345
    assert c.cache.max_backtracking_tokens == 9 and c.model.model == str(tmp_path)
    clean_env.setenv("DEEPINFER_ZERO_OVERHEAD_SCHEDULING", "1")          # later changes do not reach it
    assert c.scheduler.async_scheduling is False
    # An explicit value wins; None means "the environment's".
    c = EngineConfig.from_options(async_scheduling=False, enforce_eager=False, model="m",
                                  batch_invariant=None)
    assert (c.scheduler.async_scheduling, c.model.enforce_eager, c.model.model) == (False, False, "m")
    assert c.model.batch_invariant is True


def test_backtracking_default_follows_the_draft_length(clean_env):
    clean_env.setenv("DEEPINFER_USE_NEXTN_DECODE", "2")
    assert EngineConfig.from_options().cache.max_backtracking_tokens == 3        # max(0, 2 + 1)
    assert EngineConfig.from_options(num_speculative_tokens=4).cache.max_backtracking_tokens == 5   # the option's
    with pytest.raises(ValueError, match="needs max_backtracking_tokens >= 3"):     # less room than gamma needs
        EngineConfig.from_options(max_backtracking_tokens=1)
    no_drafts = EngineConfig.from_options(num_speculative_tokens=0, max_backtracking_tokens=1)
    assert no_drafts.cache.max_backtracking_tokens == 1


def test_the_environment_is_read_once_per_config(clean_env, monkeypatch):
    calls = []
    monkeypatch.setattr(ec, "read_settings", lambda: calls.append(1) or envs.read_settings())
    EngineConfig.from_options(max_num_seqs=3)
    assert len(calls) == 1


def test_mtp_varlen_is_read_from_the_env_and_needs_speculation(clean_env):
    clean_env.setenv("DEEPINFER_ENABLE_MTP_VARLEN", "1")
    assert EngineConfig.from_options().speculative.enable_mtp_varlen
    with pytest.raises(ValueError, match="enable_mtp_varlen=True .* num_speculative_tokens=0 "
                                         r"\(DEEPINFER_USE_NEXTN_DECODE=0\)"):
        EngineConfig.from_options(num_speculative_tokens=0)


@pytest.mark.parametrize("name", sorted(COMPAT_OPTIONS))
def test_vllm_spellings_accept_what_the_engine_does_and_refuse_the_rest(clean_env, name):
    accepted, what = COMPAT_OPTIONS[name]
    for value in accepted:
        assert EngineConfig.from_options(**{name: value}) == EngineConfig.from_options()
    for value in ("refused-value", 12345):
        with pytest.raises(ValueError, match=rf"^{name}={value!r} is not supported: .*; allowed: "):
            EngineConfig.from_options(**{name: value})


def test_compat_values_are_type_strict(clean_env):
    with pytest.raises(ValueError, match="enable_chunked_prefill=False is not supported: prefill is always"):
        EngineConfig.from_options(enable_chunked_prefill=False)
    with pytest.raises(ValueError, match="enable_prefix_caching.*True, False"):
        EngineConfig.from_options(enable_prefix_caching=1)
    with pytest.raises(ValueError, match="swap_space=False"):       # False is not 0
        EngineConfig.from_options(swap_space=False)


def test_replace_and_model_limit(clean_env):
    c = EngineConfig.from_options(max_num_seqs=4)
    d = c.replace(max_num_batched_tokens=2)
    assert d.scheduler == dataclasses.replace(c.scheduler, max_num_batched_tokens=2) and d.model == c.model
    assert c.as_options()["max_num_seqs"] == 4 and set(c.as_options()) == set(OPTIONS)
    with pytest.raises(ValueError, match="max_num_batched_tokens=0"):
        c.replace(max_num_batched_tokens=0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.scheduler.max_num_seqs = 5
    assert c.with_model_limit(4096).model.max_model_len == 4096
    assert c.replace(max_model_len=100).with_model_limit(4096).model.max_model_len == 100
    with pytest.raises(ValueError, match=r"max_model_len=5000; allowed: 1..4096"):
        c.replace(max_model_len=5000).with_model_limit(4096)


def test_build_context_holds_the_config():
    from deepinfer_core.cache import budget
    from deepinfer_core.plugin_context import BuildContext
    assert isinstance(BuildContext(model_config=None, platform=None).options, EngineConfig)
    from deepinfer_core import config_fields
    # the cache budget validates with the very rule the option's field declares
    rule = {f.name: f for f in dataclasses.fields(ec.CacheOptions)}["gpu_memory_utilization"].metadata["rule"]
    assert budget.validate_utilization is config_fields.validate_utilization and rule is config_fields.UTILIZATION


# ---- CLI and README ---------------------------------------------------------------------------------
def test_every_option_is_a_cli_flag():
    """A new config field fails here until it has a flag (or a reason in NO_ENGINE_FLAG)."""
    dests = {a.dest for a in generate.build_parser()._actions}
    missing = [name for name in OPTIONS if name not in dests and name not in generate.NO_ENGINE_FLAG]
    assert not missing, f"config fields without a CLI flag: {missing}"
    assert set(generate.NO_ENGINE_FLAG) <= set(OPTIONS)


def test_cli_flags_reach_the_config(clean_env):
    args = generate.build_parser().parse_args([
        "--max-num-seqs", "3", "--no-async-scheduling", "--load-format", "dummy", "--dtype", "bf16",
        "--gpu-memory-utilization", "0.5", "--num-cache-blocks", "none", "--tokenizer", "/t",
        "--speculative-config", "null", "--seed", "7"])
    options = generate.engine_options_from_args(args)
    assert "seed" not in options                                   # --seed is the sampling seed
    c = EngineConfig.from_options(**options)
    assert (c.scheduler.max_num_seqs, c.scheduler.async_scheduling) == (3, False)
    assert c.model.load_format == "dummy" and c.cache.num_cache_blocks is None
    assert (c.model.dtype, c.cache.gpu_memory_utilization, c.model.tokenizer) == ("bfloat16", 0.5, "/t")


@pytest.mark.parametrize("argv, needle", [
    (["--tensor-parallel-size", "8"], "not implemented; data and expert parallelism are"),
    (["--max-num-seqs", "x"], "'x' is not int"),
    (["--kv-cache-dtype", "fp16"], "allowed: 'auto', 'bfloat16', 'fp8'"),
])
def test_cli_refuses_bad_engine_values_naming_the_flag(capsys, argv, needle):
    assert generate.main(["--prompt", "a", *argv]) == 2
    err = capsys.readouterr().err
    assert f"argument {argv[0]}" in err and needle in err and len(err.strip().splitlines()) == 1


def test_cli_checks_the_whole_config_before_loading_a_model(capsys, monkeypatch):
    monkeypatch.setattr(generate, "choose_model", lambda m: pytest.fail("the model was chosen first"))
    assert generate.main(["--prompt", "a", "--kv-cache-dtype", "fp8"]) == 2
    assert "kv_cache_dtype='fp8' needs dtype='bfloat16'" in capsys.readouterr().err


def test_help_and_config_need_no_torch():
    code = ("import sys; from deepinfer_core import generate, engine_config; generate.build_parser();"
            "engine_config.EngineConfig.from_options(dtype='bf16'); print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_readme_option_table_is_current():
    """The tables in docs/configuration.md are the generated ones, and name every option."""
    page = readme_tables.DOCS_PAGE
    text = (REPO / page).read_text(encoding="utf-8")
    start, end = text.find(ec.README_BEGIN), text.find(ec.README_END)
    assert 0 <= start < end, f"{page} lacks the <!-- options:begin/end --> markers"
    assert text[start + len(ec.README_BEGIN):end].strip() == ec.markdown_table().strip(), \
        f"{page}'s option table is stale: python -m deepinfer_core.engine_config --update {page}"
    for name in OPTIONS + sorted(COMPAT_OPTIONS):
        assert f"| `{name}` |" in text


def test_update_readme(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text(f"# X\n{ec.README_BEGIN}\nold\n{ec.README_END}\ntail\n")
    assert ec.update_readme(readme) and not ec.update_readme(readme)
    text = readme.read_text()
    assert ec.markdown_table() in text and text.endswith(f"{ec.README_END}\ntail\n")


# ---- load_format="dummy" ----------------------------------------------------------------------------
def test_dummy_load_format_needs_only_config_json(tiny_ckpt_dir, tmp_path, clean_env):
    from deepinfer_core import LLM, SamplingParams
    shutil.copy(Path(tiny_ckpt_dir) / "config.json", tmp_path / "config.json")
    llm = LLM(str(tmp_path), load_format="dummy", max_model_len=64, max_num_seqs=2, seed=1)
    assert llm.get_tokenizer() is None and llm.runner.loaded.ctx.options.model.load_format == "dummy"
    assert json.loads((tmp_path / "config.json").read_text())["vocab_size"] == llm.vocab_size
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    out = llm.generate(prompt_token_ids=[[0, 5, 6]], sampling_params=params, use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3
