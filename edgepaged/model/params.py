"""Sampling parameters: plain data, no torch (the scheduler and the doors import it)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_num(x) -> bool:
    return (isinstance(x, (int, float)) and not isinstance(x, bool)) and math.isfinite(x)


MIN_TEMPERATURE = 1e-4   # a positive temperature below this samples greedily (0 does)
MAX_TEMPERATURE = 1e6    # (far past uniform already; 1e308 overflows float32)
MIN_PENALTY, MAX_PENALTY = 0.01, 100.0   # repetition_penalty: beyond these logits overflow or vanish


@dataclass
class SamplingParams:
    temperature: float = 1.0     # 0 = greedy
    top_k: int = 0               # 0 = off
    top_p: float = 1.0           # 1 = off
    min_p: float = 0.0           # 0 = off
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int = 256
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    presence_penalty: float = 0.0    # OpenAI's: minus this for every token already in the answer
    frequency_penalty: float = 0.0   # OpenAI's: minus this times the token's count in the answer
    logit_bias: dict = field(default_factory=dict)   # token id -> added to its logit, -100..100
    logprobs: int | None = None      # None: off; k: the sampled token's log-probability and the k likeliest (<= 20)

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if _is_num(self.temperature) and 0 < self.temperature < MIN_TEMPERATURE:
            self.temperature = 0.0     # logits / 1e-40 overflow: so small a temperature is greedy
        checks = [
            (_is_num(self.temperature) and 0 <= self.temperature <= MAX_TEMPERATURE,
             f"temperature must be a number in [0, {MAX_TEMPERATURE:g}], got {self.temperature!r}"),
            (_is_int(self.top_k) and self.top_k >= 0, f"top_k must be an int >= 0 (0 = off), got {self.top_k!r}"),
            (_is_num(self.top_p) and 0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p!r}"),
            (_is_num(self.min_p) and 0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p!r}"),
            (_is_num(self.repetition_penalty) and MIN_PENALTY <= self.repetition_penalty <= MAX_PENALTY,
             f"repetition_penalty must be in [{MIN_PENALTY}, {MAX_PENALTY}], got {self.repetition_penalty!r}"),
            (_is_int(self.max_tokens) and self.max_tokens >= 1, f"max_tokens must be an int >= 1, got {self.max_tokens!r}"),
            (self.seed is None or _is_int(self.seed) and 0 <= self.seed < 2**63,
             f"seed must be an int in [0, 2**63), got {self.seed!r}"),
            (isinstance(self.stop, list) and all(isinstance(s, str) and s for s in self.stop),
             "stop must be a list of non-empty strings"),
            (isinstance(self.stop_token_ids, list) and all(_is_int(t) and t >= 0 for t in self.stop_token_ids),
             "stop_token_ids must be a list of token ids >= 0"),
            (isinstance(self.ignore_eos, bool), "ignore_eos must be a boolean"),
            (_is_num(self.presence_penalty) and -2 <= self.presence_penalty <= 2,
             f"presence_penalty must be in [-2, 2], got {self.presence_penalty!r}"),
            (_is_num(self.frequency_penalty) and -2 <= self.frequency_penalty <= 2,
             f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty!r}"),
            (isinstance(self.logit_bias, dict) and len(self.logit_bias) <= 300 and all(
                _is_int(k) and k >= 0 and _is_num(v) and -100 <= v <= 100 for k, v in self.logit_bias.items()),
             "logit_bias must map at most 300 token ids to numbers in [-100, 100]"),
            (self.logprobs is None or _is_int(self.logprobs) and 0 <= self.logprobs <= 20,
             f"top_logprobs must be an int in 0..20, got {self.logprobs!r}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    def check_model(self, vocab_size: int) -> None:
        """The rules that depend on the model: ValueError naming the field."""
        if self.top_k > vocab_size:
            raise ValueError(f"top_k must be at most the vocabulary size {vocab_size} (0 = off), got {self.top_k}")
        bad = [t for t in self.stop_token_ids if t >= vocab_size]
        if bad:
            raise ValueError(f"stop_token_ids must be in 0..{vocab_size - 1}, got {bad[0]}")
        bad = [t for t in self.logit_bias if t >= vocab_size]
        if bad:
            raise ValueError(f"logit_bias token ids must be in 0..{vocab_size - 1}, got {bad[0]}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def needs_history(self) -> bool:
        """Whether sampling reads the sequence's tokens so far (penalties, seeded streams)."""
        return self.repetition_penalty != 1.0 or self.seed is not None or self.counts_output

    @property
    def counts_output(self) -> bool:
        """Whether sampling reads the answer's tokens (presence and frequency penalties)."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0
