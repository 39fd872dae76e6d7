"""The structured-outputs plugin below the engine, on the real V4 tokenizer (129,280 ids): grammar
errors at submission, trigger / bound phases, rollback and draft masks, the device mask, the
compiled-grammar cache and the compile timeout."""
from __future__ import annotations

import time

import pytest
import torch

from deepinfer_core import SamplingParams
from deepinfer_core.api.tokenizer import Tokenizer
from deepinfer_core.tools.make_tiny_checkpoint import tokenizer_dir
from deepinfer_structured_outputs.grammar_service import ServiceSettings
from deepinfer_structured_outputs.processor import StructuredOutputProcessor

V, EOS = 129280, 1
A, B, C, X = 100, 200, 300, 400            # arbitrary ordinary token ids for triggers and bounds


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_path(tokenizer_dir())


@pytest.fixture(scope="module")
def proc():
    return StructuredOutputProcessor(ServiceSettings(timeout_s=30.0, builder_threads=2))


def prepare(proc, tok, **so):
    params = SamplingParams(so_args=so)
    cons = proc.prepare(params, tokenizer=tok, vocab_size=V, eos_token_id=EOS)
    cons.wait(30)
    assert cons.ready(), cons.error()
    return cons, params


def state_for(proc, tok, **so):
    cons, params = prepare(proc, tok, **so)
    return cons.new_state(params, EOS)


def allowed(state) -> set[int]:
    bm = torch.zeros(1, (V + 31) // 32, dtype=torch.int32)
    state.fill(bm, 0)
    bits = (bm[0].unsqueeze(1) >> torch.arange(32, dtype=torch.int32)) & 1
    return set(bits.flatten()[:V].nonzero().flatten().tolist())


def ids(tok, text):
    out = tok.encode(text)
    assert tok.decode(out) == text
    return out


# ---- submission errors ---------------------------------------------------------------------------
@pytest.mark.parametrize("so, match", [
    ({"schema_type": "json", "schema": {"type": "foo"}}, "invalid JSON schema: Unsupported type \"foo\""),
    ({"schema_type": "json", "schema": {"$ref": "#/$defs/missing"}}, "invalid JSON schema"),
    ({"schema_type": "regex", "schema": "[a-"}, r"invalid regex: Regex parsing error at position 4: Unclosed '\['"),
    ({"schema_type": "ebnf", "schema": "root ::= item"}, 'invalid EBNF grammar: .*Rule "item" is not defined'),
    ({"schema_type": "ebnf", "schema": 'start ::= "a"'}, 'root rule with name "root" is not found'),
    ({"schema_type": "regex", "schema": "a", "trigger_token_ids": [V]}, "trigger_token_ids has id"),
    ({"schema_type": "regex", "schema": "a", "trigger_token_ids": [1], "bound_token_id": V + 5},
     "bound_token_id has id"),
])
def test_invalid_grammar_is_a_value_error_at_submission(proc, tok, so, match):
    with pytest.raises(ValueError, match=match):
        proc.prepare(SamplingParams(so_args=so), tokenizer=tok, vocab_size=V, eos_token_id=EOS)


def test_no_tokenizer_is_refused(proc):
    with pytest.raises(ValueError, match="needs the model's tokenizer"):
        proc.prepare(SamplingParams(so_args={"schema_type": "regex", "schema": "a"}), tokenizer=None,
                     vocab_size=V, eos_token_id=EOS)


def test_control_tokens_never_enter_a_grammar(proc, tok):
    """Added tokens (chat / tool-call markers) are not text: a free JSON string cannot contain them."""
    st = state_for(proc, tok, schema_type="json", schema={"type": "string"})
    assert st.accept(ids(tok, '"')[0])
    ok = allowed(st)
    assert len(ok) > 100_000
    assert not ok & set(tok.backend.get_added_tokens_decoder())


def test_length_bounded_json_strings_never_allow_control_characters(proc, tok):
    """xgrammar 0.2.9 lets TAB & co. into {"type": "string", "maxLength": n}; the plugin rewrites such
    strings to an equivalent pattern, so the output stays valid JSON (grammar_service.py)."""
    def inside(text):                 # the part of a token that would still be in the string
        return text.split('"')[0]
    control = {i for i in range(128000) if any(ord(ch) < 32 for ch in inside(tok.decode([i])))}
    assert len(control) > 100
    for schema in ({"type": "string", "maxLength": 6}, {"type": "string", "minLength": 2, "maxLength": 40},
                   {"type": "object", "properties": {"s": {"type": "string", "maxLength": 9}}, "required": ["s"]}):
        st = state_for(proc, tok, schema_type="json", schema=schema)
        for t in ids(tok, '{"s": "' if "properties" in schema else '"'):
            assert st.accept(t)
        ok = allowed(st)
        assert len(ok) > 10_000 and not ok & control, schema


# ---- phases --------------------------------------------------------------------------------------
def test_trigger_starts_the_grammar_and_falls_back_on_partial_matches(proc, tok):
    st = state_for(proc, tok, schema_type="regex", schema="[0-9]{2}", trigger_token_ids=[A, A, B])
    for t in (C, A, C, A, A, A):                  # a broken partial match, then A A A (suffix A A kept)
        assert not st.constrains and st.accept(t)
    assert st.phase == "free" and st.matched == 2
    assert st.accept(B) and st.phase == "grammar"
    digits = allowed(st)
    assert all(tok.decode([t]).isdigit() for t in digits) and ids(tok, "4")[0] in digits


@pytest.mark.parametrize("trigger, bound", [([A, B], X), ([X, B], X)])
def test_bound_token_forces_the_trigger(proc, tok, trigger, bound):
    st = state_for(proc, tok, schema_type="regex", schema="[0-9]", trigger_token_ids=trigger,
                   bound_token_id=bound)
    assert st.accept(C) and st.phase == "free"
    assert st.accept(bound) and st.phase == "forcing"
    for t in trigger[1 if bound == trigger[0] else 0:]:
        assert allowed(st) == {t} and st.forced_token == t
        assert not st.accept(C)                   # a wrong token is refused, nothing changes
        assert st.accept(t)
    assert st.phase == "grammar"


def test_grammar_end_is_done_with_the_stop_token(proc, tok):
    st = state_for(proc, tok, schema_type="regex", schema="(ab|cd)")
    assert st.accept(ids(tok, "ab")[0])
    assert allowed(st) == {EOS}
    assert proc.advance([st], [EOS]) == [True] and st.done
    with pytest.raises(RuntimeError, match="mask forbids it"):
        proc.advance([state_for(proc, tok, schema_type="regex", schema="(ab|cd)")], [ids(tok, "x")[0]])


# ---- rollback and drafts -------------------------------------------------------------------------
def test_rollback_restores_every_earlier_state(proc, tok):
    st = state_for(proc, tok, schema_type="json", schema={"type": "object", "properties": {
        "n": {"type": "integer", "minimum": 0, "maximum": 999}}, "required": ["n"]},
        trigger_token_ids=[A, B], bound_token_id=X)
    seq = [C, X, A, B] + ids(tok, '{"n": 42}') + [EOS]
    masks = [allowed(st)]
    for t in seq:
        assert st.accept(t), (t, st.describe())
        masks.append(allowed(st) if not st.done else None)
    assert st.done
    for k in (1, 3, len(seq) - 4, len(seq)):     # back inside the grammar, to forcing, to free
        st.rollback(k)
        assert allowed(st) == masks[len(seq) - k], k
        for t in seq[len(seq) - k:]:
            assert st.accept(t)
    with pytest.raises(ValueError, match="rollback"):
        st.rollback(len(seq) + 1)


def test_draft_masks_equal_step_by_step_masks(proc, tok):
    st = state_for(proc, tok, schema_type="regex", schema="[a-z]{1,3}-[0-9]{1,2}")
    drafts = ids(tok, "ab-7")
    W = (V + 31) // 32
    bm = torch.zeros(len(drafts) + 1, W, dtype=torch.int32)
    assert st.fill_draft_masks(drafts, bm) == len(drafts)
    ref = torch.zeros_like(bm)
    for i, t in enumerate(drafts + [None]):
        st.fill(ref, i)
        if t is not None:
            st.accept(t)
    assert torch.equal(bm, ref)
    st.rollback(len(drafts))
    bad = drafts[:1] + ids(tok, "9") + drafts[2:]            # the second draft breaks the grammar
    bm.zero_()
    assert st.fill_draft_masks(bad, bm) == 1
    assert torch.equal(bm[:2], ref[:2]) and bool((bm[2:] == -1).all())
    assert allowed(st) == allowed(state_for(proc, tok, schema_type="regex", schema="[a-z]{1,3}-[0-9]{1,2}"))


# ---- the batch mask ------------------------------------------------------------------------------
def test_mask_edits_only_constrained_rows(proc, tok):
    free = state_for(proc, tok, schema_type="regex", schema="[0-9]", trigger_token_ids=[A])
    forced = state_for(proc, tok, schema_type="regex", schema="[0-9]", trigger_token_ids=[A, B], bound_token_id=A)
    forced.accept(A)
    gram = state_for(proc, tok, schema_type="regex", schema="[0-9]")
    logits = torch.randn(4, V)
    before = logits.clone()
    proc.mask(logits, [0, 1, 3], [free, forced, gram])          # row 2: an unconstrained request
    assert torch.equal(logits[0], before[0]) and torch.equal(logits[2], before[2])
    assert (logits[1] > -torch.inf).nonzero().flatten().tolist() == [B]
    kept = set((logits[3] > -torch.inf).nonzero().flatten().tolist())
    assert kept == allowed(gram) and torch.equal(logits[3][list(kept)], before[3][list(kept)])


def test_mask_drafts_masks_each_verify_row_by_the_grammar_after_its_drafts(proc, tok):
    """Speculative verification: two constrained requests' verify rows in one logits batch, beside an
    unconstrained row; each row kept exactly the tokens its grammar allows after the drafts before
    it; a draft the grammar refuses caps what that request may accept; the states are unchanged."""
    regex = "[a-z]{1,3}-[0-9]{1,2}"
    good, bad = state_for(proc, tok, schema_type="regex", schema=regex), state_for(proc, tok, schema_type="regex",
                                                                                    schema=regex)
    drafts = ids(tok, "ab-7")
    refused = drafts[:1] + ids(tok, "9") + drafts[2:]
    logits = torch.randn(2 * len(drafts) + 3, V)
    before = logits.clone()
    free_row = len(drafts) + 1
    assert proc.mask_drafts(logits, [0, free_row + 1], [good, bad], [drafts, refused]) == [len(drafts), 1]
    assert torch.equal(logits[free_row], before[free_row])
    step = state_for(proc, tok, schema_type="regex", schema=regex)
    for j in range(len(drafts) + 1):
        assert set((logits[j] > -torch.inf).nonzero().flatten().tolist()) == allowed(step), j
        if j < len(drafts):
            step.accept(drafts[j])
    first = state_for(proc, tok, schema_type="regex", schema=regex)
    assert set((logits[free_row + 1] > -torch.inf).nonzero().flatten().tolist()) == allowed(first)
    assert allowed(good) == allowed(bad) == allowed(first)          # both rolled back


# ---- cache and timeout ---------------------------------------------------------------------------
def test_compiled_grammars_are_cached_per_schema(tok):
    on = StructuredOutputProcessor(ServiceSettings())
    for _ in range(3):
        prepare(on, tok, schema_type="regex", schema="[xy]{4}")
    prepare(on, tok, schema_type="regex", schema="[xy]{5}")
    assert on.service.num_compiles == 2 and on.service.cache_size == 2
    off = StructuredOutputProcessor(ServiceSettings(cache_enabled=False))
    for _ in range(2):
        prepare(off, tok, schema_type="regex", schema="[xy]{4}")
    assert off.service.num_compiles == 2 and off.service.cache_size == 0
    tiny = StructuredOutputProcessor(ServiceSettings(cache_limit_bytes=1))
    for n in (4, 5, 6):
        prepare(tiny, tok, schema_type="regex", schema=f"[xy]{{{n}}}")
    assert tiny.service.cache_size == 0                     # every entry is over the limit: evicted


def test_compile_timeout_and_failure_are_reported(tok, monkeypatch):
    slow = StructuredOutputProcessor(ServiceSettings(timeout_s=0.3))
    real = slow.service._compile
    monkeypatch.setattr(slow.service, "_compile", lambda *a: (time.sleep(2), real(*a))[1])
    cons = slow.prepare(SamplingParams(so_args={"schema_type": "regex", "schema": "a"}), tokenizer=tok,
                        vocab_size=V, eos_token_id=EOS)
    assert not cons.ready() and cons.error() is None
    cons.wait(5)
    assert not cons.ready() and "did not compile within 0.3 s (DEEPINFER_XGRAMMAR_TIMEOUT)" in cons.error()
    broken = StructuredOutputProcessor(ServiceSettings())

    def boom(*a):
        raise RuntimeError("out of memory")
    monkeypatch.setattr(broken.service, "_compile", boom)
    cons = broken.prepare(SamplingParams(so_args={"schema_type": "regex", "schema": "a"}), tokenizer=tok,
                          vocab_size=V, eos_token_id=EOS)
    cons.wait(5)
    assert cons.error() == "so_args: grammar compilation failed: out of memory"
    assert broken.service.cache_size == 0                   # a failure is not cached


def test_a_stuck_compilation_does_not_hold_the_interpreter(tmp_path):
    """Compilations cannot be interrupted: one still running past its timeout must not block exit."""
    import subprocess
    import sys
    script = tmp_path / "stuck.py"
    script.write_text(
        "import time\n"
        "from deepinfer_core import SamplingParams\n"
        "from deepinfer_core.api.tokenizer import Tokenizer\n"
        "from deepinfer_core.tools.make_tiny_checkpoint import tokenizer_dir\n"
        "from deepinfer_structured_outputs.grammar_service import ServiceSettings\n"
        "from deepinfer_structured_outputs.processor import StructuredOutputProcessor\n"
        "p = StructuredOutputProcessor(ServiceSettings(timeout_s=0.2))\n"
        "p.service._compile = lambda *a: time.sleep(600)\n"
        "c = p.prepare(SamplingParams(so_args={'schema_type': 'regex', 'schema': 'a'}),\n"
        "              tokenizer=Tokenizer.from_path(tokenizer_dir()), vocab_size=129280, eos_token_id=1)\n"
        "c.wait(5)\n"
        "print(c.error())\n")
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "did not compile within 0.2 s" in out.stdout, out.stderr
    assert time.monotonic() - t0 < 60
