"""Structured outputs with DeepInfer: a JSON schema, a regex, an EBNF grammar and vLLM's `choice`.

    python examples/structured_outputs.py                      # bundled tiny model (trained on Shakespeare)
    DEEPINFER_HF_MODEL_DIR=/path/to/DeepSeek-V4-Flash python examples/structured_outputs.py

The tiny model's text is rough (a small model trained on Shakespeare), but every output still
follows its grammar (docs/structured_outputs.md has the semantics).
"""
from __future__ import annotations

import json

from offline_inference import model_path, run_example

from deepinfer_core import LLM, SamplingParams, StructuredOutputsParams

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "role"],
          "properties": {"name": {"type": "string", "maxLength": 16},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "role": {"enum": ["admin", "user", "guest"]}}}


def main() -> None:
    llm = LLM(model=model_path())
    chat = llm.get_tokenizer().encode("<｜begin▁of▁sentence｜><｜User｜>Describe a user.<｜Assistant｜>")
    requests = {
        # 320 tokens bound the longest JSON the schema allows (with the default of at most 16
        # whitespace characters per gap, DEEPINFER_SO_JSON_MAX_WHITESPACE): the object always closes.
        "json": SamplingParams(max_tokens=320, so_args={"schema_type": "json", "schema": PERSON}),
        "regex": SamplingParams(max_tokens=40, so_args={"schema_type": "regex",
                                                        "schema": r"[a-z]{3,8}@[a-z]{3,8}\.(com|org)"}),
        "ebnf": SamplingParams(max_tokens=40, so_args={"schema_type": "ebnf", "schema":
                                                       'root ::= "SELECT " col (", " col){0,2} " FROM users;"\n'
                                                       'col ::= "id" | "name" | "age"'}),
        "choice": SamplingParams(temperature=0, structured_outputs=StructuredOutputsParams(choice=["yes", "no"])),
    }
    outs = llm.generate(prompt_token_ids=[chat] * len(requests), sampling_params=list(requests.values()))
    for name, out in zip(requests, outs):
        text = out.outputs[0].text
        print(f"{name:6} -> {text!r} ({out.outputs[0].finish_reason})")
    print("json parses:", json.loads(outs[0].outputs[0].text))


if __name__ == "__main__":
    run_example(main)
