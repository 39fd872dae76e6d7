"""A grammar that forces DSML tool calls (`tool_choice` "required" or a named function), as an EBNF
string for the structured-outputs plugin (`so_args` schema_type "ebnf").

The block is the one `api/chat.py` renders and `api/tool_calls.py` parses:

    <｜DSML｜tool_calls>
    <｜DSML｜invoke name="NAME">
    <｜DSML｜parameter name="KEY" string="true">raw text</｜DSML｜parameter>      a "string" property
    <｜DSML｜parameter name="KEY" string="false">JSON value</｜DSML｜parameter>   any other property
    </｜DSML｜invoke>
    </｜DSML｜tool_calls>

One or more invokes for "required" (any of the tools), exactly one of the named function otherwise.
A function's parameters follow its JSON schema's `properties` in declared order: the required ones
always, the others optional; each JSON value is constrained by its property's schema (xgrammar's JSON
schema converter). Raw string values cannot hold `<` (the format has no escapes). A function without
`properties` takes any parameters. The pieces are joined with xgrammar's grammar concat / union, which
keeps the JSON rules of different properties apart.
"""
from __future__ import annotations

import json
import re
from typing import Any

from ..api.chat import DSML_TOKEN

_T = DSML_TOKEN


def _lit(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def _xg():
    try:
        import xgrammar
    except ImportError:
        raise ValueError("tool_choice: forcing a tool call needs the structured-outputs plugin "
                         "(pip install deepinfer-structured-outputs, which brings xgrammar); allowed without "
                         "it: 'none', 'auto'") from None
    return xgrammar.Grammar


def _ebnf(text: str):
    return _xg().from_ebnf(f"root ::= {text}")


def _parameter(key: str, schema: Any, required: bool):
    """One parameter line as the renderer writes it: string values raw (string="true"), any other value
    as JSON (string="false"), so a schema that admits both gets both forms."""
    G = _xg()
    schema = schema if isinstance(schema, dict) else {}
    raw, js = _lit(f'<{_T}parameter name="{key}" string="true">'), _lit(f'<{_T}parameter name="{key}" string="false">')
    end = _lit(f"</{_T}parameter>\n")
    kind = schema.get("type")
    values = schema.get("enum") if isinstance(schema.get("enum"), list) else None
    if values is None and "const" in schema:
        values = [schema["const"]]
    if values == []:
        raise ValueError(f"tools: parameter {key!r} has an empty enum: no value can be written")
    forms = []
    if values is not None:                   # the allowed values themselves
        strings = [v for v in values if isinstance(v, str)]
        others = [v for v in values if not isinstance(v, str)]
        if strings:
            forms.append(_ebnf(f"{raw} ({' | '.join(_lit(v) for v in strings)}) {end}"))
        if others:
            forms.append(_ebnf(f"{js} ({' | '.join(_lit(json.dumps(v)) for v in others)}) {end}"))
    else:
        if kind is None or kind == "string" or (isinstance(kind, list) and "string" in kind):
            forms.append(_ebnf(f"{raw} [^<]* {end}"))
        if kind != "string":
            value = G.from_json_schema(json.dumps(schema), any_whitespace=False)
            forms.append(G.concat(_ebnf(js), value, _ebnf(end)))
    piece = G.union(*forms) if len(forms) > 1 else forms[0]
    return piece if required else G.union(piece, _ebnf('""'))


def _any_parameters():
    """Parameters of a function without `properties`: any names, raw or JSON values."""
    G = _xg()
    raw = _ebnf(f'{_lit(f"<{_T}parameter name=")} "\\"" [^"\\n<>]+ "\\" string=\\"true\\">" [^<]* '
                f'{_lit(f"</{_T}parameter>" + chr(10))}')
    js = G.concat(_ebnf(f'{_lit(f"<{_T}parameter name=")} "\\"" [^"\\n<>]+ "\\" string=\\"false\\">"'),
                  G.builtin_json_grammar(), _ebnf(_lit(f"</{_T}parameter>\n")))
    return G.from_ebnf(_rename(str(G.union(raw, js)), "param") + '\nroot ::= param*\n')


def _invoke(fn: dict[str, Any]):
    G = _xg()
    params = fn.get("parameters") or {}
    head = _ebnf(_lit(f'<{_T}invoke name="{fn["name"]}">\n'))
    tail = _ebnf(f'"\\n"? {_lit(f"</{_T}invoke>")}')      # the renderer writes a blank line for no parameters
    props = params.get("properties") if isinstance(params, dict) else None
    if not isinstance(props, dict):
        return G.concat(head, _any_parameters(), tail)
    required = set(params.get("required") or ())
    return G.concat(head, *(_parameter(k, s, k in required) for k, s in props.items()), tail)


_TOKENS = re.compile(r'"(?:[^"\\]|\\.)*"|\[(?:[^\]\\]|\\.)*\]|\broot((?:_\d+)*)\b')


def _rename(ebnf: str, name: str) -> str:
    """The grammar's `root` (and its numbered helper rules) renamed to `name`; quoted literals and
    character classes (a tool may be called "root") are left as they are."""
    return _TOKENS.sub(lambda m: m[0] if m[0][0] in '"[' else name + m[1], ebnf)


def tool_call_grammar(tools: list[dict[str, Any]], name: str | None) -> str:
    """EBNF for the forced block: any number >= 1 of calls to `tools` (name None), else one call of `name`."""
    G = _xg()
    fns = [t["function"] for t in tools if name is None or t["function"]["name"] == name]
    if not fns:
        raise ValueError(f"tool_choice: function {name!r} is not among the tools "
                         f"({', '.join(t['function']['name'] for t in tools)})")
    invokes = G.union(*(_invoke(f) for f in fns)) if len(fns) > 1 else _invoke(fns[0])
    calls = "invoke (\"\\n\" invoke)*" if name is None else "invoke"
    return (_rename(str(invokes), "invoke") +
            f'\nroot ::= {_lit(f"<{_T}tool_calls>" + chr(10))} {calls} {_lit(chr(10) + f"</{_T}tool_calls>")}\n')
