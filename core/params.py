"""What a request asks of the sampler (``SamplingParams``) and of the loop guard
(``LoopGuardParams``), checked when built so a bad value fails the request that carries
it, with a message naming the field.

Kept apart from the sampler (worker/engine/sampling.py) and the guard
(worker/guided/loop_guard.py) so that front ends, which build requests, import no torch.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from core.config import unknown_key_message

MAX_LOGPROBS = 20
TEMPERATURE_FLOOR = 1e-5  # below this, sampling is greedy (see module doc)


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 1.0  # 0 (or anything below TEMPERATURE_FLOOR) means greedy
    top_k: int = 0  # 0 or -1: off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # HF style, over prompt and output tokens
    presence_penalty: float = 0.0  # OpenAI style, over output tokens
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # top-n alternatives per token (0..20); None: off
    # speculative decoding for this request (worker/engine/speculative.py); None: the
    # engine's default (``engine.speculative``). It changes speed, never the tokens
    speculative: bool | None = None

    def __post_init__(self):
        def bad(name, why):
            raise ValueError(f"invalid sampling parameter {name}={getattr(self, name)!r}: {why}")

        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            bad("max_new_tokens", "must be an integer >= 1")
        if not 0.0 <= self.temperature <= 100.0:
            bad("temperature", "must be in [0, 100] (0 is greedy)")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            bad("top_k", "must be an integer >= 1, or 0 / -1 to disable")
        if not 0.0 < self.top_p <= 1.0:
            bad("top_p", "must be in (0, 1]")
        if not 0.0 <= self.min_p <= 1.0:
            bad("min_p", "must be in [0, 1]")
        if not 0.0 < self.repetition_penalty <= 10.0:
            bad("repetition_penalty", "must be in (0, 10] (1 is off)")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                bad(name, "must be in [-2, 2]")
        if self.seed is not None and not isinstance(self.seed, int):
            bad("seed", "must be an integer")
        if any(not isinstance(s, str) or not s for s in self.stop):
            bad("stop", "must be non-empty strings")
        if self.speculative is not None and not isinstance(self.speculative, bool):
            bad("speculative", "must be true, false or null")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            bad("logprobs", f"must be in [0, {MAX_LOGPROBS}]")

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "SamplingParams":
        """Builds params from a plain dict; an unknown key is an error that lists the known,
        in the configs' words (``sampling.foo: unknown key; known keys: ...``)."""
        known = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(values) - set(known))
        if unknown:
            raise ValueError("; ".join(unknown_key_message(f"sampling.{k}", known)
                                       for k in unknown))
        return cls(**values)

    def speculate(self, default: bool) -> bool:
        return default if self.speculative is None else self.speculative

    @property
    def greedy(self) -> bool:
        return self.temperature < TEMPERATURE_FLOOR

    @property
    def has_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)


class LoopGuardFieldError(ValueError):
    """A ``loop_guard`` field out of its bounds; ``field`` names it (the edge's 400 says
    which)."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field

    def __reduce__(self):  # keeps ``field`` across pickling (Ray)
        return type(self), (self.field, str(self))


# every loop_guard field's (lowest, highest) value. The highest keep a request's guard
# cheap (its work per token grows with max_period, its copies' reads with the *_repeats)
# and its cuts few (each gives tokens back; the engine bounds the draws as well)
LOOP_GUARD_BOUNDS = {
    "min_repeats": (2, 16), "long_span": (1, 256), "min_chars": (1, 4096),
    "max_period": (1, 256), "hold_tokens": (0, 256), "max_cuts": (0, 64),
    "progression_repeats": (0, 32), "number_digits": (0, 256), "near_repeats": (0, 32),
    "sentence_repeats": (0, 32),
}


@dataclass(frozen=True)
class LoopGuardParams:
    """How a request's loop guard decides (per request; the server's default otherwise).
    ``hold_tokens``: how many of the newest tokens are held back from the stream, so that a
    cut can still remove them (0: a loop found after its text was sent ends where it is)."""

    enabled: bool = True
    min_repeats: int = 3
    long_span: int = 8
    min_chars: int = 16
    max_period: int = 48
    hold_tokens: int = 16
    max_cuts: int = 8
    progression_repeats: int = 8  # 0: progressions are not looked for
    number_digits: int = 20  # a number's digits repeating this long end it (0: never)
    near_repeats: int = 8  # array items in a row equal but for stepping numbers (0: off)
    sentence_repeats: int = 4  # sentences in a row restarting with a changed word (0: off)

    def __post_init__(self):
        for name, (low, high) in LOOP_GUARD_BOUNDS.items():
            value = getattr(self, name)
            if (not isinstance(value, int) or isinstance(value, bool)
                    or not low <= value <= high):
                raise LoopGuardFieldError(name, f"invalid loop_guard.{name}={value!r}: must "
                                                f"be an integer from {low} to {high}")
        for name in ("progression_repeats", "near_repeats", "sentence_repeats"):
            if getattr(self, name) == 1:
                raise LoopGuardFieldError(name, f"loop_guard.{name} must be 0 (off) or >= 2")

    @classmethod
    def from_value(cls, value) -> "LoopGuardParams":
        """A request's ``loop_guard``: true / false, or an object of these fields."""
        if isinstance(value, bool):
            return cls(enabled=value)
        if isinstance(value, dict):
            known = {f for f in cls.__dataclass_fields__}
            unknown = sorted(set(value) - known)
            if unknown:
                raise ValueError(f"unknown loop_guard field(s) {unknown}; known: "
                                 f"{sorted(known)}")
            return cls(**value)
        raise ValueError("loop_guard must be true, false or an object of its fields")
