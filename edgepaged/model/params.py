"""Sampling parameters: plain data, no torch (the scheduler and the doors import it); their
rules are the request's field rules (`edgepaged/common/fields.py`)."""
from __future__ import annotations

from dataclasses import dataclass, field

from ..common.fields import (MAX_PENALTY, MAX_TEMPERATURE, MIN_PENALTY, MIN_TEMPERATURE,  # noqa: F401 (re-exported)
                      SAMPLING_FIELDS, check_sampling)


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
        if isinstance(self.temperature, float) and 0 < self.temperature < MIN_TEMPERATURE:
            self.temperature = 0.0     # logits / 1e-40 overflow: so small a temperature is greedy
        # the request schema's rules (schema.py), whichever door or code built these
        check_sampling({name: getattr(self, name) for name in (*SAMPLING_FIELDS, "max_tokens")})

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

