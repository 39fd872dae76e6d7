"""Corpus of structured-output constraints (JSON Schema, regex, EBNF) plus validators that do not
use xgrammar, for engine tests that decode a *random-weight* model under grammar masks.

Why every grammar is length-bounded: a random model has no preference for ever closing a string,
an array or a parenthesis, so at temperature 1 it samples almost uniformly among the allowed tokens
and at temperature 0 it follows an arbitrary allowed path.  Any grammar admitting unbounded output
would then run into max_tokens instead of emitting EOS.  So every string is an enum/const or has
a pattern with bounded {m,n} repetition, every array has maxItems, every number minimum AND maximum
(xgrammar then emits at most 6 fractional digits), every regex uses {m,n} instead of * / +, and
every EBNF grammar spells its recursion out to a fixed depth.  Regexes and EBNF grammars admit no
string longer than 60 bytes, so no path can take more than 60 tokens.  JSON is compiled by the
engine with any_whitespace=True, max_whitespace_cnt=16, which bounds each whitespace GAP to 16
characters but not the total: a model that always picks " " spends 16 tokens per gap (policy W
in the self-check; several hundred tokens for the larger schemas), so JSON token counts are only
bounded in practice for near-uniform / arbitrary choices (policies A-D: <= ~125 tokens).

xgrammar 0.2.9 quirks found while building this (each led to dropping or replacing a feature):
  * plain {"type": "string", "maxLength": n} compiles to [^"\\\r\n]{0,n}: raw control characters
    such as TAB are allowed although JSON forbids them, so json.loads rejects such output.  The
    plugin rewrites such strings to a pattern (grammar_service.bounded_strings_fixed; the
    "plain_lengths" entry checks it); the other free-text strings carry a `pattern` of printable
    characters (_text(n) below).
  * maxLength/minLength are silently IGNORED when combined with `pattern` or `format` (a warning is
    logged), so a pattern must bound itself with {m,n}; format "email" is unbounded -> dropped.
  * formats "time" / "date-time" allow unbounded fractional seconds -> dropped.
  * format "date" accepts 2023-02-31 and "ipv4" accepts leading zeros (010.1.1.1); both fail a
    real format check -> dropped.  "uuid" is exact and kept.
  * oneOf falls back to anyOf semantics (warning); the oneOf branches below are disjoint (distinct
    const discriminators), so the output still satisfies oneOf.
"""
from __future__ import annotations

import json
import re
from functools import lru_cache

import jsonschema
import lark
from jsonschema import Draft202012Validator


def _text(n: int, m: int = 0) -> dict:
    """A free-text string of m..n printable ASCII characters (see the maxLength quirk above)."""
    return {"type": "string", "pattern": f"^[A-Za-z0-9 .,_-]{{{m},{n}}}$"}


def _int(lo: int, hi: int) -> dict:
    return {"type": "integer", "minimum": lo, "maximum": hi}


def _obj(props: dict, required: list[str] | None = None) -> dict:
    return {"type": "object", "properties": props, "required": list(props) if required is None
            else required, "additionalProperties": False}


_POINT = _obj({"x": _int(-100, 100), "y": _int(-100, 100)})

JSON_SCHEMAS: list[tuple[str, dict]] = [
    ("person", _obj({"name": _text(10, 1), "age": _int(0, 120), "nickname": _text(8)},
                    required=["name", "age"])),
    ("point", _POINT),
    ("enum_color", _obj({"color": {"enum": ["red", "green", "blue"]}})),
    ("enum_mixed_top", {"enum": [1, "two", None, True, 3.5]}),
    ("const_fields", _obj({"version": {"const": "1.0"}, "kind": {"const": 3},
                           "flag": {"const": True}})),
    ("bounded_numbers", _obj({"temperature": {"type": "number", "minimum": -50, "maximum": 50},
                              "lat": {"type": "number", "minimum": -90, "maximum": 90}})),
    ("exclusive_bounds", _obj({"ratio": {"type": "number", "exclusiveMinimum": 0,
                                         "exclusiveMaximum": 1},
                               "count": {"type": "integer", "exclusiveMinimum": 0,
                                         "exclusiveMaximum": 10}})),
    ("fractional_bounds", _obj({"p": {"type": "number", "minimum": -1.5, "maximum": 2.25}})),
    ("booleans", _obj({"enabled": {"type": "boolean"}, "visible": {"type": "boolean"}})),
    ("nulls", _obj({"value": {"type": "null"},
                    "maybe": {"anyOf": [_text(5), {"type": "null"}]}})),
    ("int_array", {"type": "array", "items": _int(0, 9), "minItems": 1, "maxItems": 4}),
    ("tags", _obj({"tags": {"type": "array", "items": _text(6, 1), "maxItems": 3}})),
    ("tuple_prefix_items", {"type": "array", "prefixItems": [_int(0, 5), {"type": "boolean"},
                                                             {"enum": ["a", "b"]}],
                            "items": False}),
    ("nested_objects", _obj({"user": _obj({"id": _int(1, 999),
                                           "profile": _obj({"first": _text(6, 1),
                                                            "last": _text(6, 1)})})})),
    ("four_levels", _obj({"a": _obj({"b": _obj({"c": _obj({"d": _int(0, 9)})})})})),
    ("array_of_objects", _obj({"items": {"type": "array", "minItems": 1, "maxItems": 2,
                                         "items": _obj({"sku": {"type": "string",
                                                                "pattern": "^[A-Z]{2}[0-9]{2}$"},
                                                        "qty": _int(1, 99)})}})),
    ("matrix", {"type": "array", "maxItems": 3,
                "items": {"type": "array", "items": _int(-9, 9), "maxItems": 3}}),
    ("ref_defs_address", {"$defs": {"address": _obj({"city": _text(8, 1), "zip": {
        "type": "string", "pattern": "^[0-9]{5}$"}})},
        **_obj({"home": {"$ref": "#/$defs/address"}, "work": {"$ref": "#/$defs/address"}},
               required=["home"])}),
    ("ref_defs_line", {"$defs": {"point": _POINT},
                       **_obj({"start": {"$ref": "#/$defs/point"},
                               "end": {"$ref": "#/$defs/point"}})}),
    # Depth-bounded "tree": three distinct definitions instead of a recursive one.
    ("ref_defs_tree", {"$defs": {
        "leaf": _obj({"v": _int(0, 9)}),
        "mid": _obj({"v": _int(0, 9), "kids": {"type": "array", "maxItems": 2,
                                               "items": {"$ref": "#/$defs/leaf"}}}),
        "top": _obj({"v": _int(0, 9), "kids": {"type": "array", "maxItems": 1,
                                               "items": {"$ref": "#/$defs/mid"}}})},
        "$ref": "#/$defs/top"}),
    ("any_of", _obj({"value": {"anyOf": [_int(0, 9), _text(4), {"type": "boolean"}]}})),
    ("one_of_shapes", {"oneOf": [_obj({"kind": {"const": "circle"}, "r": _int(1, 50)}),
                                 _obj({"kind": {"const": "square"}, "side": _int(1, 50)})]}),
    ("patterns", _obj({"zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                       "code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{2,4}$"},
                       "hex": {"type": "string", "pattern": "^#[0-9a-f]{6}$"}})),
    ("format_uuid", _obj({"id": {"type": "string", "format": "uuid"}})),
    ("string_lengths", _obj({"code": {"type": "string", "pattern": "^[a-z]{3}$"},
                             "word": _text(12, 2)})),
    ("all_optional", _obj({"a": _int(0, 9), "b": {"type": "boolean"}, "c": _text(4),
                           "d": {"type": "null"}}, required=[])),
    ("top_level_int", _int(-1000, 1000)),
    ("plain_lengths", _obj({"note": {"type": "string", "maxLength": 8},
                            "code": {"type": "string", "minLength": 2, "maxLength": 4}})),
    ("order", _obj({"id": _int(1, 9999), "lines": {"type": "array", "minItems": 1, "maxItems": 2,
                              "items": _obj({"item": _text(6, 1), "n": _int(1, 9)})}},
                   required=["id", "lines"])),
]

_IP_OCTET = r"(25[0-5]|2[0-4][0-9]|1[0-9]{2}|[1-9]?[0-9])"
REGEXES: list[tuple[str, str]] = [
    ("email", r"[a-z0-9._]{1,10}@[a-z]{1,8}\.(com|org|net)"),
    ("iso_date", r"[0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"),
    ("phone_us", r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}"),
    ("ipv4", rf"({_IP_OCTET}\.){{3}}{_IP_OCTET}"),
    ("hex_color", r"#([0-9a-fA-F]{3}|[0-9a-fA-F]{6})"),
    ("identifier", r"[A-Za-z_][A-Za-z0-9_]{0,11}"),
    ("float", r"-?(0|[1-9][0-9]{0,3})\.[0-9]{1,4}"),
    ("yes_no_maybe", r"(yes|no|maybe)"),
    ("time_24h", r"([01][0-9]|2[0-3]):[0-5][0-9](:[0-5][0-9])?"),
    ("semver", r"[0-9]{1,2}\.[0-9]{1,2}\.[0-9]{1,3}(-(alpha|beta|rc)[0-9]?)?"),
    ("uuid", r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"),
    ("zip_plus4", r"[0-9]{5}(-[0-9]{4})?"),
    ("sentence", r"[A-Z][a-z]{1,6}( [a-z]{1,6}){0,4}[.!?]"),
    ("url", r"https?://[a-z]{1,10}\.(com|org)(/[a-z0-9]{1,6}){0,2}"),
    ("mac_address", r"([0-9A-F]{2}:){5}[0-9A-F]{2}"),
    ("digits_d_class", r"\d{2,4}-\w{1,5}"),
]

# (name, xgrammar EBNF with root rule `root`, equivalent Lark grammar with start rule `start`).
# Lark regex terminals are matched with lexer="dynamic_complete" (all match lengths considered);
# Earley refuses zero-width regexps, so xgrammar's {0,n} becomes Lark's /{1,n}/?.
EBNF_GRAMMARS: list[tuple[str, str, str]] = [
    ("arith_depth2", r'''
root ::= term (("+" | "-") term)?
term ::= factor ("*" factor)?
factor ::= num | "(" inner ")"
inner ::= num (("+" | "-" | "*") num){0,2}
num ::= [0-9]{1,2}
''', r'''
start: term (("+" | "-") term)?
term: factor ("*" factor)?
factor: NUM | "(" inner ")"
inner: NUM (("+" | "-" | "*") NUM) ~ 0..2
NUM: /[0-9]{1,2}/
'''),
    ("sexpr_depth2", r'''
root ::= "(" atom (" " item){0,3} ")"
item ::= atom | "(" atom (" " atom){0,2} ")"
atom ::= [a-z]{1,4} | [0-9]{1,3}
''', r'''
start: "(" atom (" " item) ~ 0..3 ")"
item: atom | "(" atom (" " atom) ~ 0..2 ")"
atom: /[a-z]{1,4}/ | /[0-9]{1,3}/
'''),
    ("sql_select", r'''
root ::= "SELECT " cols " FROM " table where? ";"
cols ::= "*" | col (", " col)?
col ::= "id" | "name" | "age" | "email"
table ::= "users" | "orders"
where ::= " WHERE " col (" = " | " > " | " < ") value
value ::= [0-9]{1,3} | "'" [a-z]{1,4} "'"
''', r'''
start: "SELECT " cols " FROM " table where? ";"
cols: "*" | col (", " col)?
col: "id" | "name" | "age" | "email"
table: "users" | "orders"
where: " WHERE " col (" = " | " > " | " < ") value
value: /[0-9]{1,3}/ | "'" /[a-z]{1,4}/ "'"
'''),
    ("key_value_list", r'''
root ::= pair ("&" pair){0,3}
pair ::= [a-z]{1,5} "=" [a-zA-Z0-9]{1,6}
''', r'''
start: pair ("&" pair) ~ 0..3
pair: /[a-z]{1,5}/ "=" /[a-zA-Z0-9]{1,6}/
'''),
    ("balanced_depth3", r'''
root ::= b1{1,3}
b1 ::= "(" b2{0,2} ")" | "[" b2{0,2} "]"
b2 ::= "(" b3{0,2} ")" | "[" b3{0,2} "]"
b3 ::= "()" | "[]"
''', r'''
start: b1 ~ 1..3
b1: "(" b2 ~ 0..2 ")" | "[" b2 ~ 0..2 "]"
b2: "(" b3 ~ 0..2 ")" | "[" b3 ~ 0..2 "]"
b3: "()" | "[]"
'''),
    ("csv_line", r'''
root ::= field ("," field){0,4}
field ::= [A-Za-z0-9]{1,8} | "\"" [A-Za-z0-9 ,]{0,6} "\""
''', r'''
start: field ("," field) ~ 0..4
field: /[A-Za-z0-9]{1,8}/ | "\"" /[A-Za-z0-9 ,]{1,6}/? "\""
'''),
    ("yes_no_sentence", r'''
root ::= ("Yes" | "No") ", " ("I think" | "because") " " word (" " word){0,4} "."
word ::= [a-z]{1,6}
''', r'''
start: ("Yes" | "No") ", " ("I think" | "because") " " WORD (" " WORD) ~ 0..4 "."
WORD: /[a-z]{1,6}/
'''),
    ("function_call", r'''
root ::= [a-z_]{1,8} "(" (arg (", " arg){0,2})? ")"
arg ::= [0-9]{1,3} | "\"" [a-z]{0,5} "\"" | "true" | "false"
''', r'''
start: /[a-z_]{1,8}/ "(" (arg (", " arg) ~ 0..2)? ")"
arg: /[0-9]{1,3}/ | "\"" /[a-z]{1,5}/? "\"" | "true" | "false"
'''),
]


def check_json(text: str, schema: dict) -> None:
    """json.loads (strict: raw control characters in strings are an error) + Draft 2020-12
    validation including the `format` keyword (only formats jsonschema can check are checked)."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise AssertionError(f"not JSON ({e}): {text!r}") from None
    try:
        checker = Draft202012Validator.FORMAT_CHECKER
        Draft202012Validator(schema, format_checker=checker).validate(obj)
    except jsonschema.ValidationError as e:
        raise AssertionError(f"schema violation ({e.message}): {text!r}") from None


def check_regex(text: str, regex: str) -> None:
    if re.fullmatch(regex, text) is None:
        raise AssertionError(f"{text!r} does not fully match {regex!r}")


@lru_cache(maxsize=None)
def _lark(grammar: str) -> lark.Lark:
    return lark.Lark(grammar, start="start", parser="earley", lexer="dynamic_complete")


def check_ebnf(text: str, lark_grammar: str) -> None:
    try:
        _lark(lark_grammar).parse(text)
    except lark.exceptions.LarkError as e:
        raise AssertionError(f"{text!r} rejected by Lark grammar: {e}") from None


# --------------------------------------------------------------------------------------------
# Self-check: python tests/structured/so_corpus.py [number of policy-A seeds, default 20]
# --------------------------------------------------------------------------------------------
def _self_check(n_uniform: int = 20) -> None:  # pragma: no cover - run by hand
    import time
    import torch
    import xgrammar as xgr
    from deepinfer_core.api.tokenizer import Tokenizer
    from deepinfer_core.tools.make_tiny_checkpoint import tokenizer_dir
    from deepinfer_core.api.structured_outputs import parse_so_args
    from deepinfer_structured_outputs.grammar_service import parse_grammar
    from deepinfer_structured_outputs.tokenizer_info import build_tokenizer_info

    t_start = time.time()
    tokenizer = Tokenizer.from_path(tokenizer_dir())       # the engine's tokenizer and TokenizerInfo
    backend = tokenizer.backend
    V, EOS, SPACE = 129280, 1, backend.token_to_id("Ġ")
    info = build_tokenizer_info(tokenizer, V, EOS)
    enc = [""] * V                                           # the token strings, for the byte cross-check
    added = backend.get_added_tokens_decoder()
    for tok, i in backend.get_vocab(with_added_tokens=True).items():
        if i < V and i not in added:
            enc[i] = tok
    compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)
    # Byte-level BPE: one token-string character is one byte; rebuild exact bytes to cross-check
    # backend.decode (a mismatch would mean U+FFFD from a UTF-8 sequence split or lost bytes).
    bs = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    extra = [b for b in range(256) if b not in bs]
    byte_of = {chr(c): b for b, c in zip(bs + extra, bs + [256 + n for n in range(len(extra))])}
    nbytes = torch.tensor([len(t) for t in enc], dtype=torch.int64)
    shifts = torch.arange(32, dtype=torch.int32)

    def allowed(matcher, bm) -> torch.Tensor:
        matcher.fill_next_token_bitmask(bm, 0)
        return ((((bm[0].unsqueeze(1) >> shifts) & 1).flatten()[:V]).nonzero().flatten())

    def pick(policy, ids, rng):
        if policy == "A":  # uniform among allowed (temperature-1 random model)
            return int(ids[torch.randint(len(ids), (1,), generator=rng)])
        if policy == "B":  # argmax of fresh random logits (greedy random model)
            return int(ids[torch.randn(V, generator=rng)[ids].argmax()])
        if policy == "C":  # longest token; ties -> lowest id
            return int(ids[nbytes[ids].argmax()])
        if policy == "W" and bool((ids == SPACE).any()):  # info only: pad every gap with " "
            return SPACE
        non_stop = ids[ids != EOS]   # "D": shortest non-stop token; ties -> lowest id
        return EOS if len(non_stop) == 0 else int(non_stop[nbytes[non_stop].argmin()])

    def generate(compiled, policy, seed, limit):
        matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=[EOS])
        bm, rng, out = xgr.allocate_token_bitmask(1, V), torch.Generator().manual_seed(seed), []
        for _ in range(limit):  # EOS included in the limit
            tok = pick(policy, allowed(matcher, bm), rng)
            assert matcher.accept_token(tok), f"accept_token({tok}) refused"
            if tok == EOS:
                assert matcher.is_terminated()
                return out, True
            out.append(tok)
        return out, False

    runs = ([("A", s) for s in range(n_uniform)] + [("B", 100 + s) for s in range(5)]
            + [("C", 0), ("D", 0)])
    def grammar(kind, text):                                 # exactly as the engine parses it
        return parse_grammar(parse_so_args({"schema_type": kind, "schema": text}), 16)

    cases = ([("json", n, grammar("json", s), lambda t, s=s: check_json(t, s), 150) for n, s in JSON_SCHEMAS]
             + [("regex", n, grammar("regex", r), lambda t, r=r: check_regex(t, r), 60)
                for n, r in REGEXES]
             + [("ebnf", n, grammar("ebnf", e), lambda t, g=g: check_ebnf(t, g), 60)
                for n, e, g in EBNF_GRAMMARS])
    print(f"{'kind':6} {'name':20} {'max_tok':>7} {'A/B/C/D max':>13} {'pass':>5} {'W':>4}  "
          f"example (policy C)")
    failures, worst, decode_mismatch = [], {}, 0
    for kind, name, grammar, check, limit in cases:
        compiled, per_policy, ok, example = compiler.compile_grammar(grammar), {}, True, ""
        # Policy W (greedy single spaces: worst-case whitespace padding) is reported, not bounded.
        for policy, seed in runs + [("W", 0)]:
            ids, done = generate(compiled, policy, seed, 100_000 if policy == "W" else limit)
            text = backend.decode(ids)
            exact = bytes(byte_of[c] for i in ids for c in enc[i]).decode("utf-8", "replace")
            decode_mismatch += text != exact
            per_policy[policy] = max(per_policy.get(policy, 0), len(ids))
            example = text if policy == "C" else example
            try:
                assert done, f"no EOS within {limit} tokens"
                check(text)
            except AssertionError as e:
                ok = False
                failures.append(f"{kind}/{name} policy {policy} seed {seed}: {e}")
        try:  # the validator must not be vacuous
            check(example + "\x00")
            failures.append(f"{kind}/{name}: validator accepted {example + chr(0)!r}")
        except AssertionError:
            pass
        max_tok = max(v for k, v in per_policy.items() if k != "W")
        worst[kind] = max(worst.get(kind, 0), max_tok)
        abcd = "/".join(str(per_policy[k]) for k in "ABCD")
        print(f"{kind:6} {name:20} {max_tok:7d} {abcd:>13} {str(ok):>5} {per_policy['W']:4d}  "
              f"{example[:40]!r}")
    print(f"entries: json={len(JSON_SCHEMAS)} regex={len(REGEXES)} ebnf={len(EBNF_GRAMMARS)}; "
          f"max tokens per kind (A-D): {worst}; decode mismatches: {decode_mismatch}; "
          f"time {time.time() - t_start:.1f}s")
    for f in failures:
        print("FAIL", f)
    assert not failures, f"{len(failures)} failures"


if __name__ == "__main__":
    import sys
    _self_check(int(sys.argv[1]) if len(sys.argv) > 1 else 20)  # optional: policy-A seed count
