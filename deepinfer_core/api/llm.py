"""Offline entry point `LLM`: vLLM's call shape, DS-DeepInfer's kwargs accepted.

For now requests run one sequence at a time straight on `ModelRunner` (prefill in chunks, then
token-by-token decode). The request-processing pieces (`parse_prompts`, `validate_prompt`, `Request`,
`CompletionState`, `check_stop`, `logprobs_entry`, `completion_seed`) are module-level so that the
continuous-batching engine can reuse them unchanged.

`generate` returns vLLM-style `RequestOutput`s; `LLM(..., decode_sequence=True)` is DS-DeepInfer's
compat mode (one decoded string per prompt; DS-DeepInfer's default, not ours).
"""
from __future__ import annotations

import copy
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch

from ..ops.sampler import LogprobsResult, Sampler, apply_penalties, compute_logprobs, mix_seed
from .outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from .sampling_params import SamplingParams
from .tokenizer import Tokenizer, load_tokenizer

logger = logging.getLogger("deepinfer.llm")

_DTYPES = {"float32": "float32", "float": "float32", "bfloat16": "bfloat16", "auto": "bfloat16"}
# vLLM / DS-DeepInfer options that have no meaning for this engine on CPU: accepted and ignored.
_IGNORED_KWARGS = frozenset({
    "gpu_memory_utilization", "expert_parallel_size", "tensor_parallel_size", "pipeline_parallel_size",
    "data_parallel_size", "context_parallel_size", "engram_parallel_size", "engine_rank",
    "engine_group_rank", "trust_remote_code", "enforce_eager", "revision", "tokenizer_revision",
    "tokenizer_mode", "swap_space", "cpu_offload_gb", "disable_log_stats", "served_model_name",
    "stop_preempted_request", "offline_inference", "chunked_prefill", "enable_chunked_prefill",
    "enable_prefix_caching", "disable_custom_all_reduce", "ignore_len", "tokens_per_block",
    "lookahead_tokens", "compilation_config", "quantization", "kv_cache_dtype", "engine_type",
})
# Options the LLM itself uses, with defaults.
_LLM_OPTIONS = {"max_num_batched_tokens": 8192, "max_num_seqs": 256, "decode_sequence": False}
# Options handed to ModelRunner(**options).
_RUNNER_OPTIONS = frozenset({"load_format", "batch_invariant", "max_backtracking_tokens"})


# ---- reusable request-processing pieces ----------------------------------------------------------
def parse_prompts(prompts: Any, prompt_token_ids: Any) -> list[tuple[str | None, list[int] | None]]:
    """Normalise the `generate` inputs to [(prompt text or None, token ids or None)]."""
    if prompts is None and prompt_token_ids is None:
        raise ValueError("generate: pass prompts or prompt_token_ids")
    texts: list[Any] = []
    if prompts is not None:
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)):
            raise TypeError(f"generate: prompts must be a str, a dict with 'prompt_token_ids', or a list "
                            f"of those; got {type(prompts).__name__}")
        texts = list(prompts)
    ids: list[Any] = []
    if prompt_token_ids is not None:
        if not isinstance(prompt_token_ids, (list, tuple)):
            raise TypeError(f"generate: prompt_token_ids must be a list of lists of int, "
                            f"got {type(prompt_token_ids).__name__}")
        ids = list(prompt_token_ids)
        if ids and all(isinstance(t, int) for t in ids):
            ids = [ids]      # one prompt given as a flat list
    if prompts is not None and prompt_token_ids is not None and len(texts) != len(ids):
        raise ValueError(f"generate: prompts has {len(texts)} entries but prompt_token_ids has {len(ids)}")
    out: list[tuple[str | None, list[int] | None]] = []
    for i in range(max(len(texts), len(ids))):
        text, toks = (texts[i] if texts else None), (ids[i] if ids else None)
        if isinstance(text, dict):
            if "prompt_token_ids" not in text and "prompt" not in text:
                raise ValueError(f"generate: prompts[{i}] is a dict without 'prompt_token_ids' or 'prompt'")
            text, toks = text.get("prompt"), (toks if toks is not None else text.get("prompt_token_ids"))
        if text is not None and not isinstance(text, str):
            raise TypeError(f"generate: prompts[{i}] must be a str or a dict with 'prompt_token_ids', "
                            f"got {type(text).__name__}")
        if toks is not None and not isinstance(toks, (list, tuple)):
            raise TypeError(f"generate: prompt_token_ids[{i}] must be a list of int, "
                            f"got {type(toks).__name__}")
        out.append((text, None if toks is None else list(toks)))
    return out


def validate_prompt(token_ids: list[int], vocab_size: int, max_model_len: int, index: int = 0) -> None:
    """Raise ValueError for an empty prompt, an id outside [0, vocab) or a prompt over max_model_len."""
    if not token_ids:
        raise ValueError(f"generate: prompt {index} is empty; a prompt needs at least one token")
    for pos, t in enumerate(token_ids):
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size:
            raise ValueError(f"generate: prompt {index} has token id {t!r} at position {pos}, "
                             f"outside [0, vocab_size={vocab_size})")
    if len(token_ids) > max_model_len:
        raise ValueError(f"generate: prompt {index} has {len(token_ids)} tokens, more than "
                         f"max_model_len={max_model_len}")


def completion_seed(base_seed: int, index: int) -> int:
    """Seed of completion `index` of a request: the request seed itself for the first one, so n=1
    and the first of n>1 completions agree."""
    return base_seed if index == 0 else mix_seed(base_seed, index)


def _find_stop_string(text: str, stops: Sequence[str], search_from: int) -> tuple[int, str] | None:
    best: tuple[int, str] | None = None
    for s in stops:
        i = text.find(s, max(0, search_from - len(s) + 1))
        if i >= 0 and (best is None or i < best[0]):
            best = (i, s)
    return best


@dataclass
class Request:
    """One validated request: prompt, its own copy of the params, and its base seed."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int                          # completion j samples with completion_seed(seed, j)
    metrics: RequestMetrics


@dataclass
class CompletionState:
    """One completion being generated: tokens, text, logprobs and the finish state."""

    index: int
    seed: int
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def to_output(self) -> CompletionOutput:
        return CompletionOutput(self.index, self.text, list(self.token_ids), self.cumulative_logprob,
                                self.logprobs, self.finish_reason, self.stop_reason)


def check_stop(state: CompletionState, params: SamplingParams, *, eos_token_id: int | None,
               max_tokens: int, tokenizer: Tokenizer | None) -> bool:
    """Update `state.text` for the newest token and set finish/stop reasons; True when finished.

    Stop tokens (EOS, stop_token_ids) and stop strings count only once min_tokens are out (the
    sampler also masks stop tokens before that). Their text is cut unless include_stop_str_in_output.
    """
    ids, last = state.token_ids, state.token_ids[-1]
    detok = tokenizer is not None and params.detokenize
    prev_len = len(state.text.rstrip("\ufffd"))   # a partial UTF-8 char may still change
    if detok:
        state.text = tokenizer.decode(ids, skip_special_tokens=params.skip_special_tokens)
    if len(ids) >= params.min_tokens:
        stop_token = last in params.all_stop_token_ids(eos_token_id)
        if stop_token:
            state.finish_reason = "stop"
            # vLLM: EOS leaves stop_reason None; a stop_token_ids hit records the id.
            state.stop_reason = last if last in params.stop_token_ids else None
            if detok and not params.include_stop_str_in_output:
                state.text = tokenizer.decode(ids[:-1], skip_special_tokens=params.skip_special_tokens)
            return True
        hit = _find_stop_string(state.text, params.stop, prev_len) if detok and params.stop else None
        if hit is not None:
            pos, s = hit
            state.finish_reason, state.stop_reason = "stop", s
            state.text = state.text[:pos + len(s)] if params.include_stop_str_in_output else state.text[:pos]
            return True
    if len(ids) >= max_tokens:
        state.finish_reason = "length"
        return True
    return False


def logprobs_entry(res: LogprobsResult, row: int, token_id: int | None,
                   tokenizer: Tokenizer | None) -> dict[int, Logprob]:
    """token id -> Logprob for one position: `token_id` (sampled or actual prompt token, with its true
    rank) first, then the top-K with ranks 1..K."""
    def decoded(t: int) -> str | None:
        return None if tokenizer is None else tokenizer.decode([t], skip_special_tokens=False)

    out: dict[int, Logprob] = {}
    if token_id is not None:
        out[token_id] = Logprob(float(res.sampled_logprobs[row]), int(res.sampled_ranks[row]),
                                decoded(token_id))
    for rank, (lp, t) in enumerate(zip(res.top_logprobs[row].tolist(), res.top_ids[row].tolist()), 1):
        if t not in out:
            out[t] = Logprob(lp, rank, decoded(t))
    return out


# ---- LLM ------------------------------------------------------------------------------------------
def _resolve_model(model: str) -> Path:
    from ..model.weights import resolve_model_path   # lazy: the model package is heavy
    return Path(resolve_model_path(model))


def _make_runner(model_dir: Path, **kwargs: Any) -> Any:
    from ..runner.model_runner import ModelRunner    # lazy, as above
    return ModelRunner(model_dir, **kwargs)


def _env_model_dir() -> str | None:
    from .. import envs    # validated there: an existing directory or unset
    return envs.get("DEEPINFER_HF_MODEL_DIR")


def _normalise_dtype(dtype: Any) -> str:
    if isinstance(dtype, torch.dtype):
        dtype = {torch.float32: "float32", torch.bfloat16: "bfloat16"}.get(dtype, str(dtype))
    if isinstance(dtype, str) and dtype.lower() in _DTYPES:
        return _DTYPES[dtype.lower()]
    raise ValueError(f"LLM: dtype={dtype!r} is not supported; allowed: 'float32', 'bfloat16', "
                     f"'auto' (= bfloat16), torch.float32, torch.bfloat16")


class LLM:
    """Generate completions for a batch of prompts with a DeepSeek-V4 checkpoint.

    `model`: a local directory, an HF cache snapshot, or a repo id in the local HF cache; None reads
    DEEPINFER_HF_MODEL_DIR. `seed` seeds requests that set no seed of their own (derived from it and a
    request counter, so a run is reproducible).
    """

    def __init__(self, model: str | None = None, tokenizer: str | None = None, dtype: Any = "float32",
                 simulate_qat: bool = True, seed: int = 0, max_model_len: int | None = None,
                 device: str = "cpu", **engine_options: Any):
        dtype_name = _normalise_dtype(dtype)
        runner_options = self._split_options(engine_options)
        if model is None:
            model = _env_model_dir()
            if model is None:
                raise ValueError("LLM: pass model=... or set DEEPINFER_HF_MODEL_DIR")
        model_dir = _resolve_model(str(model))
        tok = load_tokenizer(model_dir, tokenizer)   # before the (slow) weight load: fail fast
        runner = _make_runner(model_dir, dtype=dtype_name, simulate_qat=simulate_qat, device=device,
                              **runner_options)
        self._setup(runner, tok, seed, max_model_len)
        self.model_dir, self.dtype, self.device = model_dir, dtype_name, device

    @classmethod
    def from_runner(cls, runner: Any, tokenizer: Any = None, seed: int = 0,
                    max_model_len: int | None = None, **engine_options: Any) -> "LLM":
        """An LLM over an already-built runner (tests, tools); `tokenizer` a Tokenizer or a path."""
        self = cls.__new__(cls)
        self._split_options(engine_options)
        self._setup(runner, load_tokenizer(None, tokenizer), seed, max_model_len)
        self.model_dir, self.dtype, self.device = None, None, None
        return self

    def _split_options(self, options: dict[str, Any]) -> dict[str, Any]:
        unknown = sorted(k for k in options
                         if k not in _IGNORED_KWARGS and k not in _LLM_OPTIONS and k not in _RUNNER_OPTIONS)
        if unknown:
            accepted = ["model", "tokenizer", "dtype", "simulate_qat", "seed", "max_model_len", "device",
                        *sorted(_LLM_OPTIONS), *sorted(_RUNNER_OPTIONS)]
            raise TypeError(f"LLM: unexpected keyword argument(s) {unknown}; accepted: {accepted} "
                            f"(ignored on this engine: {sorted(_IGNORED_KWARGS)})")
        for k in sorted(options):
            if k in _IGNORED_KWARGS:
                logger.debug("LLM: ignoring %s=%r (no effect on this engine)", k, options[k])
        opts = {k: options.get(k, v) for k, v in _LLM_OPTIONS.items()}
        for k in ("max_num_batched_tokens", "max_num_seqs"):
            if isinstance(opts[k], bool) or not isinstance(opts[k], int) or opts[k] < 1:
                raise ValueError(f"LLM: {k}={opts[k]!r}; allowed: an int >= 1")
        self.max_num_batched_tokens = opts["max_num_batched_tokens"]
        self.max_num_seqs = opts["max_num_seqs"]
        self.decode_sequence = bool(opts["decode_sequence"])
        return {k: v for k, v in options.items() if k in _RUNNER_OPTIONS}

    def _setup(self, runner: Any, tokenizer: Tokenizer | None, seed: int, max_model_len: int | None) -> None:
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"LLM: seed must be an int, got {type(seed).__name__}")
        cfg = runner.model_config
        limit = int(cfg.max_position_embeddings)
        if max_model_len is None:
            max_model_len = limit
        elif (isinstance(max_model_len, bool) or not isinstance(max_model_len, int)
              or not 1 <= max_model_len <= limit):
            raise ValueError(f"LLM: max_model_len={max_model_len!r}; allowed: 1..{limit} "
                             f"(max_position_embeddings) or None")
        self.runner, self.tokenizer, self.seed = runner, tokenizer, seed
        self.model_config, self.max_model_len = cfg, max_model_len
        self.vocab_size, self.eos_token_id = int(cfg.vocab_size), cfg.eos_token_id
        self.sampler = Sampler()
        self._request_counter = 0

    def get_tokenizer(self) -> Tokenizer | None:
        return self.tokenizer

    def close(self) -> None:
        self.runner = None

    # ---- generate ---------------------------------------------------------------------------------
    def generate(self, prompts: Any = None,
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 prompt_token_ids: Any = None, use_tqdm: bool = True) -> list[RequestOutput] | list[str]:
        """One RequestOutput per prompt, in input order (`decode_sequence=True`: the first
        completion's text instead, DS-DeepInfer's compat mode)."""
        parsed = parse_prompts(prompts, prompt_token_ids)
        params = self._per_request_params(sampling_params, len(parsed))
        # Validate every request before running any; the counter moves only once all are accepted.
        requests = [self._make_request(i, text, ids, p)
                    for i, ((text, ids), p) in enumerate(zip(parsed, params))]
        self._request_counter += len(requests)
        outputs = []
        bar = _progress(len(requests), use_tqdm)
        try:
            for req in requests:
                outputs.append(self._run_request(req))
                bar.update(1)
        finally:
            bar.close()
        if self.decode_sequence:
            return [o.outputs[0].text for o in outputs]
        return outputs

    def chat(self, messages: Any, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             thinking_mode: str = "chat", reasoning_effort: str | None = None, tools: list | None = None,
             use_tqdm: bool = True) -> list[RequestOutput] | list[str]:
        """Render one conversation (list of message dicts) or a list of them with the DeepSeek-V4 chat
        format (`api/chat.py`), then `generate`. The rendered text already holds BOS: none is added."""
        from .chat import chat_prompts, encode_chat_prompt
        prompts = chat_prompts(messages, thinking_mode, reasoning_effort, tools)
        ids = [encode_chat_prompt(self.tokenizer, p) for p in prompts]
        return self.generate(prompts, sampling_params, prompt_token_ids=ids, use_tqdm=use_tqdm)

    def _per_request_params(self, sp: Any, n: int) -> list[SamplingParams]:
        if sp is None:
            sp = SamplingParams()
        if isinstance(sp, SamplingParams):
            return [copy.deepcopy(sp) for _ in range(n)]   # deep copy: requests never share state
        if not isinstance(sp, (list, tuple)) or not all(isinstance(p, SamplingParams) for p in sp):
            raise TypeError(f"generate: sampling_params must be a SamplingParams or a list of them, "
                            f"got {type(sp).__name__}")
        if len(sp) != n:
            raise ValueError(f"generate: sampling_params has {len(sp)} entries for {n} prompts")
        return [copy.deepcopy(p) for p in sp]

    def _make_request(self, index: int, text: str | None, ids: list[int] | None,
                      params: SamplingParams) -> Request:
        arrival = time.time()
        if ids is None:
            if self.tokenizer is None:
                raise ValueError(f"generate: prompt {index} is text but the checkpoint has no tokenizer "
                                 f"files; pass prompt_token_ids or LLM(tokenizer=...)")
            ids = self.tokenizer.encode(text)
        validate_prompt(ids, self.vocab_size, self.max_model_len, index)
        if params.stop and (self.tokenizer is None or not params.detokenize):
            raise ValueError("generate: stop strings need a tokenizer; pass LLM(tokenizer=...) or use "
                             "stop_token_ids")
        for name in ("logprobs", "prompt_logprobs"):
            if (getattr(params, name) or 0) > self.vocab_size:
                raise ValueError(f"generate: {name}={getattr(params, name)} exceeds "
                                 f"vocab_size={self.vocab_size}")
        # Seed: the request's own, else derived from the LLM seed and a request counter.
        counter = self._request_counter + index
        base = params.seed if params.seed is not None else mix_seed(self.seed, counter)
        return Request(str(counter), text, ids, params, base, RequestMetrics(arrival_time=arrival))

    def _run_request(self, req: Request) -> RequestOutput:
        params, prompt_ids, metrics = req.params, req.prompt_token_ids, req.metrics
        metrics.first_scheduled_time = time.time()
        prompt_logprobs = None
        completions = []
        for j in range(params.n):
            # Independent sequences, each re-prefilled (no fork/prefix sharing yet).
            state = CompletionState(index=j, seed=completion_seed(req.seed, j))
            want_plp = j == 0 and params.prompt_logprobs is not None
            plp = self._generate_one(state, prompt_ids, params, metrics, want_plp)
            prompt_logprobs = plp if want_plp else prompt_logprobs
            completions.append(state.to_output())
        metrics.finished_time = time.time()
        return RequestOutput(req.request_id, req.prompt, list(prompt_ids), prompt_logprobs, completions,
                             True, metrics)

    def _generate_one(self, state: CompletionState, prompt_ids: list[int], params: SamplingParams,
                      metrics: RequestMetrics, want_prompt_logprobs: bool) -> list | None:
        runner = self.runner
        seq = runner.new_sequence()
        try:
            logits, plp = self._prefill(seq, prompt_ids, params.prompt_logprobs if want_prompt_logprobs
                                        else None, self.tokenizer if params.detokenize else None)
            # vLLM: prompt + output stays within max_model_len (a full-length prompt still gets one).
            max_tokens = max(1, self.max_model_len - len(prompt_ids))
            if params.max_tokens is not None:
                max_tokens = min(max_tokens, params.max_tokens)
            if params.logprobs is not None:
                state.logprobs, state.cumulative_logprob = [], 0.0
            stop_ids = sorted(params.all_stop_token_ids(self.eos_token_id))
            while True:
                token = self._sample(logits, state, prompt_ids, params, stop_ids)
                now = time.time()
                metrics.token_times.append(now)
                if metrics.first_token_time is None:
                    metrics.first_token_time = now
                if check_stop(state, params, eos_token_id=self.eos_token_id, max_tokens=max_tokens,
                              tokenizer=self.tokenizer):
                    return plp
                logits = runner.forward(seq, [token])
        finally:
            runner.release(seq)

    def _prefill(self, seq: Any, prompt_ids: list[int], k: int | None,
                 tokenizer: Tokenizer | None) -> tuple[torch.Tensor, list | None]:
        """Feed the prompt in chunks of max_num_batched_tokens; returns the last position's logits
        [1, V] and, when k is not None, the prompt logprobs (first entry None)."""
        plp: list | None = None if k is None else [None]
        step = self.max_num_batched_tokens
        logits = None
        for start in range(0, len(prompt_ids), step):
            chunk = prompt_ids[start:start + step]
            out = self.runner.forward(seq, chunk, all_logits=k is not None)
            if k is not None:
                # Row r predicts prompt token start + r + 1 (the last row predicts the first output).
                targets = prompt_ids[start + 1:start + len(chunk) + 1]
                rows = out[:len(targets)]
                if len(targets):
                    res = compute_logprobs(rows, k, torch.tensor(targets, device=rows.device))
                    plp.extend(logprobs_entry(res, r, t, tokenizer) for r, t in enumerate(targets))
            logits = out[-1:]
        return logits, plp

    def _sample(self, logits: torch.Tensor, state: CompletionState, prompt_ids: list[int],
                params: SamplingParams, stop_ids: list[int]) -> int:
        raw = logits.reshape(1, -1)
        proc = apply_penalties(raw, [params], [state.token_ids], [prompt_ids])
        if len(state.token_ids) < params.min_tokens and stop_ids:
            # min_tokens: stop tokens may not be sampled yet.
            proc = proc.clone() if proc is raw else proc
            proc[:, [t for t in stop_ids if t < proc.shape[-1]]] = float("-inf")
        position = len(prompt_ids) + len(state.token_ids)
        tok = self.sampler.sample(proc, [params], [position], [state.seed])
        token = int(tok[0])
        if params.logprobs is not None:
            res = compute_logprobs(raw, params.logprobs, tok)
            state.logprobs.append(logprobs_entry(res, 0, token, self.tokenizer
                                                 if params.detokenize else None))
            state.cumulative_logprob += float(res.sampled_logprobs[0])
        state.token_ids.append(token)
        return token


class _NoProgress:
    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


def _progress(total: int, use_tqdm: bool) -> Any:
    try:
        from tqdm.auto import tqdm
    except ImportError:
        use_tqdm = False
    if not use_tqdm or total == 0:
        return _NoProgress()
    return tqdm(total=total, desc="Processed prompts", dynamic_ncols=True)
