"""The example plugin's matching logic, in this process (imported from its source directory, not
installed): settings and their errors, the token sequences of a word, the per-completion state
against a brute-force reading of the rule, the masks of sampled and speculative verify rows, and
the engine's contracts."""
from __future__ import annotations

import importlib
import random
import sys

import pytest
import torch
from plugin_cases import EXAMPLE

from deepinfer_core import SamplingParams
from deepinfer_core.contracts import missing_members
from deepinfer_core.engine.constraints import LogitsProcessor, RequestConstraint, drafts_under


@pytest.fixture(scope="module")
def bw():
    sys.path.insert(0, str(EXAMPLE))
    try:   # only for the import: the source directory must not stay on this process's path
        return importlib.import_module("deepinfer_example_plugin.banned_words")
    finally:
        sys.path.remove(str(EXAMPLE))


@pytest.fixture(scope="module")
def proc_mod(bw):
    sys.path.insert(0, str(EXAMPLE))
    try:
        return importlib.import_module("deepinfer_example_plugin.processor")
    finally:
        sys.path.remove(str(EXAMPLE))


FAKE_VOCAB = {"thee": [5, 6], " thee": [7], "my lord": [8, 9], " my lord": [10, 9], "Thee": [11, 6],
              " Thee": [12], "THEE": [99], " THEE": [13, 200]}


class FakeTokenizer:
    """Words to ids from a table: "thee" is two tokens, " thee" one, "my lord" two."""

    def encode(self, text, add_special_tokens=True):
        assert add_special_tokens is False
        return FAKE_VOCAB[text]


# ---- settings ----------------------------------------------------------------------------------
def test_settings_and_what_is_claimed(bw):
    parsed = bw.parse({"banned_words": ["thee", "my lord"], "other": 1})
    assert parsed == bw.BannedWords(("thee", "my lord"))
    assert bw.parse({"banned_words": [], "banned_words_ignore_case": True}).ignore_case
    assert bw.requested({"banned_words": ["x"]}) and bw.requested({"banned_typo": 1})
    assert not any(bw.requested(x) for x in ({"words": ["x"]}, None, {1: 2}))
    assert bw.BannedWords(("thee", "My Lord"), True).forms() == [
        "thee", "THEE", "Thee", "My Lord", "my lord", "MY LORD", "My lord"]


@pytest.mark.parametrize("extra, message", [
    ({"banned_words": "thee"},
     "extra_args.banned_words: must be a list of non-blank strings, got 'thee'"),
    ({"banned_words": ["thee", 3]}, "extra_args.banned_words: must be a list of non-blank strings"),
    ({"banned_words": ["thee", " "]},
     "extra_args.banned_words: must be a list of non-blank strings"),
    ({"banned_words": ["x"], "banned_word": ["y"]},
     ("extra_args.banned_word: unknown key of the banned_words plugin; allowed: banned_words, "
      "banned_words_ignore_case")),
    ({"banned_words_ignore_case": True}, "extra_args.banned_words: missing"),
    ({"banned_words": ["x"], "banned_words_ignore_case": "yes"},
     "extra_args.banned_words_ignore_case: must be true or false, got 'yes'"),
])
def test_bad_settings_name_the_field_and_what_it_allows(bw, extra, message):
    with pytest.raises(ValueError) as e:
        bw.parse(extra)
    assert str(e.value).startswith(message)


def test_token_sequences_of_a_word_with_and_without_a_space(bw):
    tok = FakeTokenizer()
    seqs = bw.token_sequences(bw.BannedWords(("thee", "my lord")),
                              lambda t: tok.encode(t, False), 100)
    assert seqs == {(5, 6), (7,), (8, 9), (10, 9)}
    # ignore_case adds the case forms; a sequence with an id past the vocabulary can never be made
    seqs = bw.token_sequences(bw.BannedWords(("thee",), True), lambda t: tok.encode(t, False), 100)
    assert seqs == {(5, 6), (7,), (11, 6), (12,), (99,)}


# ---- the state ---------------------------------------------------------------------------------
def brute_force(sequences, history):
    """The rule as the docs state it: the last token of every sequence whose other tokens end the
    completion so far."""
    return {s[-1] for s in sequences
            if len(history) >= len(s) - 1 and tuple(history[len(history) - len(s) + 1:]) == s[:-1]}


def test_the_state_follows_the_rule_over_random_walks(bw):
    rng = random.Random(0)
    for _ in range(200):
        seqs = {tuple(rng.randrange(6) for _ in range(rng.randint(1, 4)))
                for _ in range(rng.randint(1, 4))}
        state = bw.BannedState(bw.BannedTable(seqs))
        history = []
        for _ in range(30):
            assert state.banned() == brute_force(seqs, history)
            allowed = [t for t in range(6) if t not in state.banned()]
            if not allowed:
                break
            token = rng.choice(allowed)
            state.accept(token)
            history.append(token)
            assert len(state.history) <= max(len(s) for s in seqs) - 1


def test_draft_masks_stop_at_the_first_banned_draft_and_keep_the_state(bw):
    state = bw.BannedState(bw.BannedTable({(8, 9), (7,)}))
    state.accept(3)
    rows, allowed = state.draft_masks([1, 8, 2])        # nothing banned among the drafts
    assert allowed == 3 and rows == [{7}, {7}, {7, 9}, {7}]
    rows, allowed = state.draft_masks([8, 9, 1])         # "my" then "lord": the second is refused
    assert allowed == 1 and rows == [{7}, {7, 9}]
    assert state.draft_masks([7]) == ([{7}], 0)
    assert state.history == [3] and state.banned() == {7}   # no draft was accepted


# ---- the processor -----------------------------------------------------------------------------
def test_the_processor_satisfies_the_engines_contracts(proc_mod):
    processor = proc_mod.BannedWordsProcessor()
    constraint = processor.prepare(SamplingParams(extra_args={"banned_words": ["thee"]}),
                                   tokenizer=FakeTokenizer(), vocab_size=100, eos_token_id=1)
    assert missing_members(processor, LogitsProcessor) == [] and drafts_under(processor)
    assert missing_members(constraint, RequestConstraint) == []
    assert constraint.ready() and constraint.error() is None and constraint.processor is processor


def test_claims_refuses_structured_outputs_beside_it(proc_mod):
    processor = proc_mod.BannedWordsProcessor()
    assert processor.claims(SamplingParams(extra_args={"banned_words": ["thee"]}))
    assert not processor.claims(SamplingParams(extra_args={"seed_note": 1}))
    assert not processor.claims(SamplingParams(so_args={"schema_type": "regex", "schema": "a"}))
    with pytest.raises(ValueError, match=r"^extra_args.banned_words: cannot be combined with"):
        processor.claims(SamplingParams(extra_args={"banned_words": ["thee"]},
                                        so_args={"schema_type": "regex", "schema": "a"}))
    with pytest.raises(ValueError, match=r"^extra_args.banned_words: needs the model's tokenizer"):
        processor.prepare(SamplingParams(extra_args={"banned_words": ["thee"]}), tokenizer=None,
                          vocab_size=100, eos_token_id=None)


def test_mask_mask_drafts_and_advance_on_logits(proc_mod):
    processor = proc_mod.BannedWordsProcessor()
    constraint = processor.prepare(SamplingParams(extra_args={"banned_words": ["thee", "my lord"]}),
                                   tokenizer=FakeTokenizer(), vocab_size=16, eos_token_id=1)
    a, b = constraint.new_state(None, 1), constraint.new_state(None, 1)   # two completions (n=2)
    assert processor.advance([a, b], [8, 3]) == [False, False]
    logits = torch.zeros(3, 16)
    processor.mask(logits, [0, 2], [a, b])           # row 1: a request without the ban
    banned = {(int(r), int(t)) for r, t in zip(*torch.nonzero(logits.isneginf(), as_tuple=True))}
    assert banned == {(0, 7), (0, 9), (2, 7)}
    # verify rows: request a at rows 0..3 with drafts [9, ...] refused at once; b at rows 4..7
    logits = torch.zeros(8, 16)
    assert processor.mask_drafts(logits, [0, 4], [a, b], [[9, 1, 1], [5, 6, 8]]) == [0, 1]
    masked = {(int(r), int(t)) for r, t in zip(*torch.nonzero(logits.isneginf(), as_tuple=True))}
    assert masked == {(0, 7), (0, 9), (4, 7), (5, 7), (5, 6)}
    assert a.history == [8] and b.history == [3]
