"""Offline entry point `LLM`: vLLM's call shape, DS-DeepInfer's kwargs accepted.

Requests run through the continuous-batching engine (`engine/`): chunked prefill under
`max_num_batched_tokens`, up to `max_num_seqs` sequences per step, preemption by recompute when the
paged state cache is full. The cache is sized once from `num_cache_blocks` (exact), else
`kv_cache_memory_bytes`, else `gpu_memory_utilization` on CUDA or `cpu_kv_cache_bytes` on CPU. Every
option is resolved once into `self.config` (`EngineConfig`, deepinfer_core/engine_config.py).

Bad requests: a malformed call (prompts not a list, a length mismatch) raises at once. A bad request
inside a good call (empty prompt, too long, wrong type, invalid SamplingParams) does not stop the
others: they run to completion, then `InvalidRequestError` (a ValueError naming each bad request and
field) is raised, carrying `.outputs` (None for the bad requests) and `.errors`.

`generate` returns vLLM-style `RequestOutput`s; `LLM(..., decode_sequence=True)` is DS-DeepInfer's
compat mode (one decoded string per prompt; DS-DeepInfer's default, not ours).
"""
from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..contracts import EngineRunner, missing_members
from ..engine.engine import Engine
from ..engine_config import EngineConfig
from ..ops.sampler import mix_seed
from .engine_builder import allocator, build_engine
from .inputs import parse_prompts, per_request_params
from .inputs import resolve_model_dir as _resolve_model
from .outputs import InvalidRequestError, RequestOutput
from .sampling_params import SamplingParams
from .tokenizer import Tokenizer, load_tokenizer

logger = logging.getLogger("deepinfer.llm")

# ---- LLM ------------------------------------------------------------------------------------------
def _make_runner(model_dir: Path, config: EngineConfig) -> EngineRunner:
    from ..runner.model_runner import ModelRunner  # lazy, as above
    return ModelRunner(model_dir, config)


class LLM:
    """Generate completions for a batch of prompts with a DeepSeek-V4 checkpoint.

    `model`: a local directory, an HF cache snapshot, or a repo id in the local HF cache; None reads
    DEEPINFER_HF_MODEL_DIR, and without it runs the bundled tiny model (deepinfer_core/tools/bundled_model.py).
    `seed` seeds requests that set no seed of their own (derived from it and a
    request counter, so a run is reproducible). `data_parallel_size > 1`: `generate` / `chat` run on that
    many engine processes (parallel/dp_engine.py; `close()` or `with LLM(...)` stops them); with
    `launcher='torchrun'` one per torchrun process, and `LLM(...)` returns on global rank 0 only (every
    other rank runs its engine inside it, then exits: parallel/torchrun.py);
    `engine_process=True`: on one engine process (the same machinery with one rank).
    """

    def __init__(self, model: str | None = None, **options: Any):
        """`options`: the fields of `EngineConfig` by name (`deepinfer_core/engine_config.py`, the
        table in docs/configuration.md), plus the vLLM / DS-DeepInfer spellings it accepts with the
        values this engine implements."""
        config = EngineConfig.from_options(model=model, **options)   # validated, env defaults filled once
        if config.model.model is None:      # the bundled trained tiny model (built on first use)
            from ..tools.bundled_model import bundled_tiny_model_dir
            config = config.replace(model=str(bundled_tiny_model_dir()))
            logger.warning("LLM: no model given (model=... or DEEPINFER_HF_MODEL_DIR): using the bundled tiny "
                        "model at %s", config.model.model)
        if config.parallel.in_processes:
            self._start_data_parallel(config)
            return
        model_dir = _resolve_model(config.model.model)
        tok = load_tokenizer(model_dir, config.model.tokenizer)   # before the (slow) weight load: fail fast
        runner = _make_runner(model_dir, config)
        self._setup(runner, tok, config)
        self.model_dir, self.dtype = model_dir, config.model.dtype
        allocator(self.runner, self.config)   # size the state cache now: a budget that is too small fails here

    def _start_data_parallel(self, config: EngineConfig) -> None:
        """data_parallel_size > 1 (or engine_process=True): `generate` (and `chat`) run on that many engine
        processes (parallel/dp_engine.py); this process holds no runner, so the in-process engine APIs refuse."""
        # lazy: spawns processes, needs torch.distributed
        from ..parallel.dp_engine import DataParallelLLM
        dp = self._dp = DataParallelLLM.from_config(config)
        self.config, self.tokenizer, self.model_config = dp.config, dp.tokenizer, dp.model_config
        self.model_dir, self.dtype, self.device = dp.model_dir, dp.config.model.dtype, dp.device
        self.vocab_size, self.eos_token_id = int(dp.model_config.vocab_size), dp.model_config.eos_token_id
        self._request_counter = 0

    def __getattr__(self, name: str) -> Any:
        # only reached for attributes never set: under data parallelism, the runner's
        if name in _IN_PROCESS and self.__dict__.get("_dp") is not None:
            raise AttributeError(_dp_refusal(self.config, f"LLM.{name}"))
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @classmethod
    def from_runner(cls, runner: EngineRunner, tokenizer: Any = None, config: EngineConfig | None = None,
                    **options: Any) -> LLM:
        """An LLM over an already-built runner (tests, tools); `tokenizer` a Tokenizer or a path;
        `config` (e.g. another LLM's `.config.replace(...)`) or `options` as for `LLM(...)` (the model
        options are those the runner was built with)."""
        if config is not None and options:
            raise TypeError(f"LLM.from_runner: pass config or options, not both (got {sorted(options)})")
        if (config or EngineConfig.from_options(**options)).parallel.in_processes:
            raise ValueError("LLM.from_runner with data_parallel_size > 1 or engine_process=True: a runner is "
                             "this process's engine; use LLM(model, ...) (it starts the engine processes), or "
                             "data_parallel_size=1 and engine_process=None here")
        missing = missing_members(runner, EngineRunner)
        if missing:
            raise TypeError(f"LLM.from_runner: {type(runner).__qualname__} is not a runner: missing "
                            f"{', '.join(missing)} (deepinfer_core/contracts.py EngineRunner)")
        self = cls.__new__(cls)
        self._setup(runner, load_tokenizer(None, tokenizer), config or EngineConfig.from_options(**options))
        self.model_dir, self.dtype = None, None
        return self

    def _setup(self, runner: EngineRunner, tokenizer: Tokenizer | None, config: EngineConfig) -> None:
        cfg = runner.model_config
        self.config = config.with_model_limit(cfg.max_position_embeddings)   # max_model_len resolved
        self.runner, self.tokenizer, self.model_config, self.device = runner, tokenizer, cfg, runner.device
        self.vocab_size, self.eos_token_id = int(cfg.vocab_size), cfg.eos_token_id
        # both chosen through the hooks when the runner was built (deepinfer_sampler,
        # deepinfer_logits_processors)
        self.sampler, self.logits_processors = runner.sampler, list(runner.logits_processors)
        self._request_counter = 0

    # Read-only views of the config (tests and tools read them; the config is the one place).
    seed = property(lambda self: self.config.model.seed)
    max_model_len = property(lambda self: self.config.model.max_model_len)
    max_num_seqs = property(lambda self: self.config.scheduler.max_num_seqs)
    max_num_batched_tokens = property(lambda self: self.config.scheduler.max_num_batched_tokens)
    async_scheduling = property(lambda self: self.config.scheduler.async_scheduling)
    decode_sequence = property(lambda self: self.config.decode_sequence)

    def get_tokenizer(self) -> Tokenizer | None:
        return self.tokenizer

    def serving_engine(self) -> Any:
        """The online engine the server drives (serve/engine_loop.py): `self.engine`, or under data
        parallelism the ranks' front end (parallel/dp_online.py), with the same add / abort / step calls."""
        dp = self.__dict__.get("_dp")
        return dp if dp is not None else self.engine

    def close(self) -> None:
        """Release the runner; under data parallelism, stop the ranks (their processes exit)."""
        dp = self.__dict__.get("_dp")
        if dp is not None:
            dp.close()
            return
        self.runner = None

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- generate ---------------------------------------------------------------------------------
    def generate(self, prompts: Any = None,
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 prompt_token_ids: Any = None, use_tqdm: bool = True) -> list[RequestOutput] | list[str]:
        """One RequestOutput per prompt, in input order (`decode_sequence=True`: the first
        completion's text instead, DS-DeepInfer's compat mode). A loop over the online engine:
        the prompts are added, then stepped until all of them are finished."""
        dp = self.__dict__.get("_dp")
        if dp is not None:       # the ranks' outputs arrive together: no progress bar to show
            return dp.generate(prompts, sampling_params, prompt_token_ids)
        parsed = parse_prompts(prompts, prompt_token_ids)
        params = per_request_params(sampling_params, len(parsed))
        engine = self.engine
        # Each request is validated at submission; a bad one is reported, the others still run.
        index: dict[str, int] = {}
        errors: dict[int, ValueError] = {}
        try:
            for i, (entry, p) in enumerate(zip(parsed, params)):
                try:
                    if isinstance(entry, ValueError):
                        raise entry
                    rid = self._submit(i, *entry, p)
                    index[rid] = i
                except (ValueError, TypeError) as e:
                    errors[i] = e
                    logger.error("%s", e)
            self._request_counter += len(parsed)
            done = self._run(index, errors, use_tqdm)
        except BaseException:
            for rid in index:
                if rid in engine._requests:
                    engine.abort_request(rid)
            raise
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
        prompts = chat_prompts(messages, thinking_mode, reasoning_effort, tools,
                               getattr(self.model_config, "vision", False))
        ids = [encode_chat_prompt(self.tokenizer, p) for p in prompts]
        return self.generate(prompts, sampling_params, prompt_token_ids=ids, use_tqdm=use_tqdm)

    def _submit(self, index: int, text: str | None, ids: list[int] | None, salt: str | None,
                params: SamplingParams) -> str:
        """Add one prompt to the engine; returns its request id (ValueError: refused, nothing added)."""
        if ids is None:
            if self.tokenizer is None:
                raise ValueError(f"generate: prompt {index} is text but the checkpoint has no tokenizer "
                                 f"files; pass prompt_token_ids or LLM(tokenizer=...)")
            ids = self.tokenizer.encode(text)
        # Seed: the request's own, else derived from the LLM seed and a request counter.
        counter = self._request_counter + index
        seed = params.seed if isinstance(params, SamplingParams) and params.seed is not None else None
        if seed is None:
            seed = mix_seed(self.seed, counter)
        rid = str(counter)
        try:
            self.engine.add_request(rid, ids, params, prompt=text, seed=seed, stream=False, cache_salt=salt)
        except ValueError as e:
            raise ValueError(f"generate: prompt {index} is invalid: {e}") from None
        return rid

    def _run(self, index: dict[str, int], errors: dict[int, ValueError], use_tqdm: bool) -> dict[int, RequestOutput]:
        """Step the engine until every request of this call is finished; a request whose grammar
        failed or timed out joins `errors`."""
        engine, done = self.engine, {}
        bar = _progress(len(index), use_tqdm)
        try:
            pending = len(index)
            while pending:
                if not engine.has_unfinished_requests():
                    raise RuntimeError(f"LLM.generate: the engine finished with {pending} request(s) of this "
                                       f"call unreported (an engine bug)")
                for out in engine.step():
                    i = index.get(out.request_id)
                    if i is None or not out.finished:
                        continue
                    reason = engine.refused.pop(out.request_id, None)
                    if reason is not None:
                        errors[i] = ValueError(f"request {i}: {reason}")
                        logger.error("%s", errors[i])
                    else:
                        done[i] = out
                    pending -= 1
                    bar.update(1)
        finally:
            bar.close()
        return done

    def reset_prefix_cache(self) -> bool:
        """Drop every cached prefix no running request holds; True when the cache is then empty (False
        also when prefix caching is off). With engine processes (data_parallel_size > 1,
        engine_process=True): every rank's cache, True only when every one is empty."""
        dp = self.__dict__.get("_dp")
        return dp.reset_prefix_cache() if dp is not None else self.engine.reset_prefix_cache()

    @property
    def engine(self) -> Engine:
        """The online engine of this LLM, kept for its lifetime. Rebuilt only when another LLM over
        the same runner (tests, tools: `from_runner`) re-sized the runner's state cache meanwhile."""
        if self.__dict__.get("_dp") is not None:
            raise RuntimeError(_dp_refusal(self.config, "LLM.engine"))
        blocks = allocator(self.runner, self.config)
        engine = self.__dict__.get("_engine")
        if engine is None or engine.scheduler.blocks.allocator is not blocks:
            if engine is not None and engine.has_unfinished_requests():
                raise RuntimeError("LLM: the runner's state cache was re-sized by another LLM while this "
                                   "one has requests in flight")
            engine = self._engine = build_engine(self.runner, self.tokenizer, self.config, blocks)
        return engine


# What only the in-process engine has (set by _setup); under data parallelism each rank has its own.
_IN_PROCESS = ("runner", "sampler", "logits_processors")


def _dp_refusal(config: EngineConfig, what: str) -> str:
    par = config.parallel
    return (f"{what} is the in-process engine, which LLM(data_parallel_size={par.data_parallel_size}, "
            f"engine_process={par.engine_process}) does not have: its engines run in child processes; "
            "use generate() / chat(), or data_parallel_size=1 and engine_process=None")


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
