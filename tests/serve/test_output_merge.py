"""The engine thread's hand-off to the handlers (serve/engine_loop.py `Outputs`): deltas a handler has not
read yet are merged into one, in order, without touching the engine's objects; an error stays after them."""
import asyncio

from deepinfer_core.api.outputs import CompletionOutput, Logprob, RequestOutput
from deepinfer_core.serve.engine_loop import EngineStopped, Outputs


def _delta(tokens: list[int], index: int = 0, finish: str | None = None, lp: bool = False) -> RequestOutput:
    logprobs = [{t: Logprob(-0.5 * t, 1)} for t in tokens] if lp else None
    c = CompletionOutput(index, "".join(f"<{t}>" for t in tokens), list(tokens), -float(sum(tokens)) if lp else None,
                         logprobs, finish)
    return RequestOutput("r", None, [5, 6], None, [c], finish is not None)


def test_lagging_deltas_merge_in_order_and_engine_objects_stay_unchanged():
    async def main():
        box = Outputs()
        first, second, third = _delta([1], lp=True), _delta([2, 3], lp=True), _delta([4], finish="length", lp=True)
        other = _delta([9], index=1)
        for d in (first, second, other, third):
            box.put(d)
        merged = await box.get()
        assert [c.index for c in merged.outputs] == [0, 1]
        c0 = merged.outputs[0]
        assert (c0.text, c0.token_ids, c0.finish_reason) == ("<1><2><3><4>", [1, 2, 3, 4], "length")
        assert [list(e) for e in c0.logprobs] == [[1], [2], [3], [4]] and c0.cumulative_logprob == -4.0
        assert merged.finished and merged.outputs[1].token_ids == [9]
        assert first.outputs[0].token_ids == [1] and first.outputs[0].text == "<1>" and not first.finished
        assert len(first.outputs[0].logprobs) == 1
    asyncio.run(main())


def test_a_reader_that_keeps_up_gets_every_delta_and_an_error_comes_after_the_outputs():
    async def main():
        box = Outputs()
        reader = asyncio.create_task(box.get())
        await asyncio.sleep(0)
        d = _delta([1])
        box.put(d)
        assert await reader is d                 # nothing to merge with: the engine's object itself
        box.put(_delta([2]))
        box.put(EngineStopped("gone"))
        box.put(_delta([3]))                     # cannot merge across the error
        assert (await box.get()).outputs[0].token_ids == [2]
        assert isinstance(await box.get(), EngineStopped)
        assert (await box.get()).outputs[0].token_ids == [3]
    asyncio.run(main())


def test_a_ruled_out_token_is_sent_as_the_json_floor_in_both_apis():
    """JSON has no -inf: a token the model rules out (a banned or grammar-masked one among the top
    entries) goes out as -9999.0, as OpenAI and vLLM send it, from completions and chat alike."""
    import json
    import math

    from deepinfer_core.serve.chat import _logprobs
    from deepinfer_core.serve.completions import logprobs_object

    class Tok:
        def decode(self, ids, skip_special_tokens=False):
            return f"<{ids[0]}>"

    entry = {5: Logprob(-0.25, 1, "a"), 7: Logprob(-math.inf, 2, "b")}
    out = CompletionOutput(0, "a", [5], -0.25, [entry], "length")
    chat = _logprobs(out, Tok(), top=2)
    completions = logprobs_object([([5], [entry])], Tok())
    assert [e["logprob"] for e in chat["content"][0]["top_logprobs"]] == [-0.25, -9999.0]
    assert completions["top_logprobs"][0] == {"a": -0.25, "b": -9999.0}
    json.dumps([chat, completions], allow_nan=False)      # valid JSON: no -Infinity left
