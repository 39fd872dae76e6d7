"""`SamplingParams`: vLLM field names and defaults, plus DS-DeepInfer's aliases.

Aliases (accepted by the constructor, readable as properties):
  * `seq_seed`     -> `seed`      (DS-DeepInfer; uint64, masked to 64 bits)
  * `top_logprobs` -> `logprobs`  (DS-DeepInfer; number of top logprobs per generated token)
"""
from __future__ import annotations

import copy
from dataclasses import InitVar, dataclass
from typing import Any

from .structured_outputs import parse_so_args, structured_outputs_to_so_args

MASK64 = (1 << 64) - 1
INT32_MAX = (1 << 31) - 1
# Temperatures below this are treated as greedy (exact argmax), as in vLLM; DS-DeepInfer clamps here.
GREEDY_EPS = 1e-5


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


@dataclass
class SamplingParams:
    """Per-request sampling and stopping options (vLLM semantics unless noted)."""

    n: int = 1
    temperature: float = 1.0              # < 1e-5 (e.g. 0) = greedy: argmax, lowest index on ties
    top_p: float = 1.0                    # in (0, 1]
    top_k: int = 0                        # 0 or -1 = off
    min_p: float = 0.0                    # in [0, 1]
    presence_penalty: float = 0.0         # in [-2, 2]
    frequency_penalty: float = 0.0        # in [-2, 2]
    repetition_penalty: float = 1.0       # > 0; applied over prompt + output tokens (vLLM)
    seed: int | None = None               # None = derived from the LLM seed and a request counter
    stop: str | list[str] | None = None   # normalised to list[str]
    stop_token_ids: list[int] | None = None   # normalised to list[int]
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16           # None = up to max_model_len
    min_tokens: int = 0
    logprobs: int | None = None           # top-K logprobs per generated token (0 = sampled token only)
    prompt_logprobs: int | None = None    # top-K logprobs per prompt token
    detokenize: bool = True
    skip_special_tokens: bool = True
    so_args: dict[str, Any] | None = None     # structured output (DS-DeepInfer), api/structured_outputs.py
    structured_outputs: Any = None            # vLLM's spelling (StructuredOutputsParams or dict) -> so_args
    extra_args: dict[str, Any] | None = None  # free-form, for plugins
    seq_seed: InitVar[int | None] = None      # alias of `seed`
    top_logprobs: InitVar[int | None] = None  # alias of `logprobs`

    def __post_init__(self, seq_seed: int | None, top_logprobs: int | None) -> None:
        self.seed = self._merge_alias("seed", self.seed, "seq_seed", seq_seed)
        self.logprobs = self._merge_alias("logprobs", self.logprobs, "top_logprobs", top_logprobs)
        if self.structured_outputs is not None:
            if self.so_args is not None:
                raise ValueError("SamplingParams: pass so_args or structured_outputs, not both")
            self.so_args = structured_outputs_to_so_args(self.structured_outputs)
        self._normalise()
        self._validate()

    # ---- aliases ------------------------------------------------------------------------------
    @staticmethod
    def _merge_alias(name: str, value: Any, alias: str, alias_value: Any) -> Any:
        if alias_value is None:
            return value
        if value is not None and value != alias_value:
            raise ValueError(f"SamplingParams: {name}={value!r} and its alias {alias}={alias_value!r} "
                             f"disagree; pass only one")
        return alias_value

    # ---- normalisation --------------------------------------------------------------------------
    def _normalise(self) -> None:
        if self.seed is not None:
            if not _is_int(self.seed):
                raise TypeError(f"SamplingParams: seed (alias seq_seed) must be an int, "
                                f"got {type(self.seed).__name__}")
            self.seed &= MASK64   # DS-DeepInfer: uint64, masked to 64 bits
        # DS-DeepInfer passes logprobs=False ("off"); True means the sampled token's logprob only.
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if isinstance(v, bool):
                setattr(self, name, 0 if v else None)
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        elif isinstance(self.stop, (list, tuple)) and all(isinstance(s, str) for s in self.stop):
            self.stop = list(self.stop)
        else:
            raise ValueError(f"SamplingParams: stop must be a str, a list of str or None, "
                             f"got {self.stop!r}")
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        elif isinstance(self.stop_token_ids, (list, tuple)) and all(_is_int(t) for t in self.stop_token_ids):
            self.stop_token_ids = list(self.stop_token_ids)
        else:
            raise ValueError(f"SamplingParams: stop_token_ids must be a list of int or None, "
                             f"got {self.stop_token_ids!r}")

    def validate(self) -> None:
        """Check every field again (a SamplingParams may be changed after construction)."""
        self._normalise()
        self._validate()

    # ---- validation -----------------------------------------------------------------------------
    def _validate(self) -> None:
        def bad(name: str, allowed: str) -> ValueError:
            return ValueError(f"SamplingParams: {name}={getattr(self, name)!r} is out of range; "
                              f"allowed: {allowed}")

        numbers = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                   "repetition_penalty")
        for name in numbers:
            if not _is_number(getattr(self, name)):
                raise ValueError(f"SamplingParams: {name} must be a number, got {getattr(self, name)!r}")
        ints = ("n", "top_k", "min_tokens")
        for name in ints:
            if not _is_int(getattr(self, name)):
                raise ValueError(f"SamplingParams: {name} must be an int, got {getattr(self, name)!r}")
        if self.n < 1:
            raise bad("n", "n >= 1")
        if self.temperature < 0:
            raise bad("temperature", "temperature >= 0 (0 = greedy)")
        if not 0 < self.top_p <= 1:
            raise bad("top_p", "0 < top_p <= 1")
        if self.top_k not in (-1, 0) and not 1 <= self.top_k <= INT32_MAX:
            raise bad("top_k", "-1 or 0 (off), or 1 <= top_k <= 2^31-1")
        if not 0 <= self.min_p <= 1:
            raise bad("min_p", "0 <= min_p <= 1")
        if not -2 <= self.presence_penalty <= 2:
            raise bad("presence_penalty", "-2 <= presence_penalty <= 2")
        if not -2 <= self.frequency_penalty <= 2:
            raise bad("frequency_penalty", "-2 <= frequency_penalty <= 2")
        if not self.repetition_penalty > 0:
            raise bad("repetition_penalty", "repetition_penalty > 0")
        if self.max_tokens is not None:
            if not _is_int(self.max_tokens) or not 1 <= self.max_tokens <= INT32_MAX:
                raise bad("max_tokens", "1 <= max_tokens <= 2^31-1, or None")
        if self.min_tokens < 0 or (self.max_tokens is not None and self.min_tokens > self.max_tokens):
            raise bad("min_tokens", "0 <= min_tokens <= max_tokens")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not _is_int(v) or v < 0):
                raise bad(name, "None or an int >= 0")
        if any(s == "" for s in self.stop):
            raise ValueError("SamplingParams: stop contains an empty string; allowed: non-empty strings")
        if self.stop and not self.detokenize:
            raise ValueError("SamplingParams: stop strings need detokenize=True")
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError(f"SamplingParams: stop_token_ids={self.stop_token_ids} has a negative id; "
                             f"allowed: ids >= 0")
        if self.extra_args is not None and not isinstance(self.extra_args, dict):
            raise ValueError(f"SamplingParams: extra_args must be a dict or None, "
                             f"got {type(self.extra_args).__name__}")
        if self.so_args is not None:
            parse_so_args(self.so_args)

    # ---- derived --------------------------------------------------------------------------------
    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS

    def all_stop_token_ids(self, eos_token_id: int | None) -> set[int]:
        """Ids that end the completion: stop_token_ids plus EOS unless ignore_eos."""
        ids = set(self.stop_token_ids)
        if eos_token_id is not None and not self.ignore_eos:
            ids.add(eos_token_id)
        return ids

    def clone(self) -> "SamplingParams":
        return copy.deepcopy(self)


# Read-only views of the DS-DeepInfer aliases. Assigned after the dataclass is built: the generated
# __init__ has already bound the InitVar defaults (None), so the properties do not leak into it.
SamplingParams.seq_seed = property(lambda self: self.seed, doc="DS-DeepInfer alias of `seed`.")
SamplingParams.top_logprobs = property(lambda self: self.logprobs,
                                       doc="DS-DeepInfer alias of `logprobs`.")
