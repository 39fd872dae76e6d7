"""Offline entry point `LLM`: vLLM's call shape, DS-DeepInfer's kwargs accepted.

Requests run through the continuous-batching engine (`engine/`): chunked prefill under
`max_num_batched_tokens`, up to `max_num_seqs` sequences per step, preemption by recompute when the
paged state cache is full. The cache is sized once from `num_cache_blocks` (exact), else
`kv_cache_memory_bytes`, else `gpu_memory_utilization` on CUDA or DEEPINFER_CPU_KV_CACHE_BYTES on CPU.

Bad requests: a malformed call (prompts not a list, a length mismatch) raises at once. A bad request
inside a good call (empty prompt, too long, wrong type, invalid SamplingParams) does not stop the
others: they run to completion, then `InvalidRequestError` (a ValueError naming each bad request and
field) is raised, carrying `.outputs` (None for the bad requests) and `.errors`.

`generate` returns vLLM-style `RequestOutput`s; `LLM(..., decode_sequence=True)` is DS-DeepInfer's
compat mode (one decoded string per prompt; DS-DeepInfer's default, not ours).
"""
from __future__ import annotations

import copy
import logging
import time
from pathlib import Path
from typing import Any, Sequence


from ..cache.block_allocator import BlockAllocator
from .options import LLM_OPTION_DEFAULTS
from ..cache.budget import CacheRequest, validate_utilization
from ..engine.constraints import attach_constraint
from ..engine.engine import Engine
from ..engine.output_processor import CompletionState, Request
from ..engine.scheduler import Scheduler, SchedulerConfig
from ..engine.sequence import Sequence as EngineSequence
from ..ops.sampler import Sampler, mix_seed
from ..plugin_context import normalize_dtype
from .outputs import InvalidRequestError, RequestMetrics, RequestOutput
from .sampling_params import SamplingParams
from .tokenizer import Tokenizer, load_tokenizer

logger = logging.getLogger("deepinfer.llm")

# vLLM / DS-DeepInfer options that have no meaning for this engine on CPU: accepted and ignored.
_IGNORED_KWARGS = frozenset({
    "expert_parallel_size", "tensor_parallel_size", "pipeline_parallel_size",
    "data_parallel_size", "context_parallel_size", "engram_parallel_size", "engine_rank",
    "engine_group_rank", "trust_remote_code", "revision", "tokenizer_revision",
    "tokenizer_mode", "swap_space", "cpu_offload_gb", "disable_log_stats", "served_model_name",
    "stop_preempted_request", "offline_inference", "chunked_prefill", "enable_chunked_prefill",
    "enable_prefix_caching", "disable_custom_all_reduce", "ignore_len", "tokens_per_block",
    "lookahead_tokens", "compilation_config", "quantization", "engine_type",
})
# Options the LLM itself uses, with defaults (shared with the CLI's help).
_LLM_OPTIONS = LLM_OPTION_DEFAULTS
# Options handed to ModelRunner(**options).
_RUNNER_OPTIONS = frozenset({"load_format", "batch_invariant", "max_backtracking_tokens", "enforce_eager",
                             "kv_cache_dtype"})


# ---- reusable request-processing pieces ----------------------------------------------------------
def parse_prompts(prompts: Any, prompt_token_ids: Any) -> list[Any]:
    """Normalise the `generate` inputs to [(prompt text or None, token ids or None)]; an entry that is
    malformed on its own becomes a ValueError in its place (the call itself raises)."""
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
    out: list[Any] = []
    for i in range(max(len(texts), len(ids))):
        try:
            out.append(_parse_one(i, texts[i] if texts else None, ids[i] if ids else None))
        except ValueError as e:
            out.append(e)
    return out


def _parse_one(i: int, text: Any, toks: Any) -> tuple[str | None, list[int] | None]:
    if isinstance(text, dict):
        if "prompt_token_ids" not in text and "prompt" not in text:
            raise ValueError(f"generate: prompts[{i}] is a dict without 'prompt_token_ids' or 'prompt'")
        text, toks = text.get("prompt"), (toks if toks is not None else text.get("prompt_token_ids"))
    if text is not None and not isinstance(text, str):
        raise ValueError(f"generate: prompts[{i}] must be a str or a dict with 'prompt_token_ids', "
                         f"got {type(text).__name__}")
    if toks is not None and not isinstance(toks, (list, tuple)):
        raise ValueError(f"generate: prompt_token_ids[{i}] must be a list of int, "
                         f"got {type(toks).__name__}")
    return text, None if toks is None else list(toks)


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


class LLM:
    """Generate completions for a batch of prompts with a DeepSeek-V4 checkpoint.

    `model`: a local directory, an HF cache snapshot, or a repo id in the local HF cache; None reads
    DEEPINFER_HF_MODEL_DIR. `seed` seeds requests that set no seed of their own (derived from it and a
    request counter, so a run is reproducible).
    """

    def __init__(self, model: str | None = None, tokenizer: str | None = None, dtype: Any = "float32",
                 simulate_qat: bool = True, seed: int = 0, max_model_len: int | None = None,
                 device: str | None = None, **engine_options: Any):
        dtype_name = normalize_dtype(dtype)
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
        self.model_dir, self.dtype, self.device = model_dir, dtype_name, getattr(runner, "device", device)
        self._allocator()            # size the state cache now: a budget that is too small fails here

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
        for k in ("max_num_batched_tokens", "max_num_seqs", "num_cache_blocks", "kv_cache_memory_bytes"):
            if k in ("num_cache_blocks", "kv_cache_memory_bytes") and opts[k] is None:
                continue                       # sized from the budget
            if isinstance(opts[k], bool) or not isinstance(opts[k], int) or opts[k] < 1:
                raise ValueError(f"LLM: {k}={opts[k]!r}; allowed: an int >= 1")
        if opts["async_scheduling"] not in (None, True, False):
            raise ValueError(f"LLM: async_scheduling={opts['async_scheduling']!r}; allowed: True, False, "
                             f"None (= DEEPINFER_ZERO_OVERHEAD_SCHEDULING)")
        self.gpu_memory_utilization = validate_utilization(opts["gpu_memory_utilization"])
        self.kv_cache_memory_bytes = opts["kv_cache_memory_bytes"]
        self.async_scheduling = opts["async_scheduling"]
        self.num_cache_blocks = opts["num_cache_blocks"]
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
        # The runner resolved the sampler through the hooks; runners without one (test fakes,
        # tools) get the portable sampler.
        self.sampler = getattr(runner, "sampler", None) or Sampler()
        # Chosen through deepinfer_logits_processors with the other hooks (structured outputs).
        self.logits_processors = list(getattr(runner, "logits_processors", None) or [])
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
        # Each request is validated at submission; a bad one is reported, the others still run.
        requests: dict[int, Request] = {}
        errors: dict[int, ValueError] = {}
        for i, (entry, p) in enumerate(zip(parsed, params)):
            try:
                if isinstance(entry, ValueError):
                    raise entry
                requests[i] = self._make_request(i, entry[0], entry[1], p)
            except (ValueError, TypeError) as e:
                errors[i] = e
                logger.error("%s", e)
        self._request_counter += len(parsed)
        bar = _progress(len(requests), use_tqdm)
        try:
            done = self._run(requests, errors, bar)
        finally:
            bar.close()
        outputs = [done.get(i) for i in range(len(parsed))]
        if self.decode_sequence:
            outputs = [None if o is None else o.outputs[0].text for o in outputs]
        if errors:
            raise InvalidRequestError(errors, outputs)
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
        params.validate()        # again: a SamplingParams may have been changed after construction
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
        # Last: a grammar starts compiling here, so only for a request that is otherwise valid.
        constraint = attach_constraint(self.logits_processors, params, tokenizer=self.tokenizer,
                                       vocab_size=self.vocab_size, eos_token_id=self.eos_token_id)
        # Seed: the request's own, else derived from the LLM seed and a request counter.
        counter = self._request_counter + index
        base = params.seed if params.seed is not None else mix_seed(self.seed, counter)
        return Request(str(counter), text, ids, params, base, RequestMetrics(arrival_time=arrival),
                       constraint)

    def _sequences(self, req: Request) -> list[EngineSequence]:
        p = req.params
        # vLLM: prompt + output stays within max_model_len (a full-length prompt still gets one).
        max_tokens = max(1, self.max_model_len - len(req.prompt_token_ids))
        max_tokens = min(max_tokens, p.max_tokens) if p.max_tokens is not None else max_tokens
        return [EngineSequence(self._next_seq_id(), req, CompletionState(index=j, seed=completion_seed(req.seed, j)),
                               max_tokens, want_prompt_logprobs=j == 0 and p.prompt_logprobs is not None)
                for j in range(p.n)]

    def _run(self, requests: dict[int, Request], errors: dict[int, ValueError], bar: Any) -> dict[int, RequestOutput]:
        """The valid requests through the continuous-batching engine; a request that can never fit
        the cache joins `errors`."""
        engine = self._make_engine()
        seqs: dict[int, list[EngineSequence]] = {}
        for i, req in requests.items():
            group = self._sequences(req)
            try:
                for s in group:
                    engine.scheduler.check_fits(s)      # refuse before anything runs
            except ValueError as e:
                errors[i] = e
                logger.error("%s", e)
                continue
            seqs[i] = group
            for s in group:
                engine.add(s)
        remaining = {i: len(g) for i, g in seqs.items()}
        owner = {s.seq_id: i for i, g in seqs.items() for s in g}
        try:
            while engine.has_unfinished():
                for s in engine.step():
                    remaining[owner[s.seq_id]] -= 1
                    if remaining[owner[s.seq_id]] == 0:
                        s.request.metrics.finished_time = time.time()
                        bar.update(1)
            engine.close()
        except BaseException:
            engine.abort_all()
            raise
        for sid, reason in engine.refused.items():     # a grammar that failed or timed out
            i = owner[sid]
            if seqs.pop(i, None) is not None:
                errors[i] = ValueError(f"request {i}: {reason}")
                logger.error("%s", errors[i])
        return {i: RequestOutput(g[0].request.request_id, g[0].request.prompt, list(g[0].request.prompt_token_ids),
                                 g[0].prompt_logprobs, [s.completion.to_output() for s in g], True, g[0].request.metrics)
                for i, g in seqs.items()}

    def _cache_request(self) -> CacheRequest:
        return CacheRequest(num_slots=self.max_num_seqs, num_blocks=self.num_cache_blocks,
                            memory_bytes=self.kv_cache_memory_bytes,
                            gpu_memory_utilization=self.gpu_memory_utilization, max_model_len=self.max_model_len)

    def _allocator(self) -> BlockAllocator:
        """The runner's real cache allocator (sized on first use, re-sized when the options change);
        runners without a state cache (test fakes) get a plain counter of the same shape."""
        if hasattr(self.runner, "allocate_cache"):
            self.runner.profile_tokens = self.max_num_batched_tokens
            return self.runner.allocate_cache(self._cache_request()).allocator
        blocks = self.num_cache_blocks or self.max_num_seqs * -(-self.max_model_len // 128)
        return BlockAllocator(blocks, self.max_num_seqs)

    def _make_engine(self) -> Engine:
        cfg = SchedulerConfig(max_num_seqs=self.max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens)
        use_async = self.async_scheduling
        if use_async is None:
            from .. import envs
            use_async = envs.get("DEEPINFER_ZERO_OVERHEAD_SCHEDULING")
        self.last_engine = Engine(self.runner, self.sampler, Scheduler(cfg, self._allocator()), self.tokenizer,
                                  self.eos_token_id, async_scheduling=use_async)
        return self.last_engine      # kept for inspection (tests, stats)

    def _next_seq_id(self) -> int:
        self._seq_counter = getattr(self, "_seq_counter", 0) + 1
        return self._seq_counter


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
