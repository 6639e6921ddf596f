"""Requests for the simulated node: a seeded synthetic generator or a JSONL trace.

Synthetic traffic (`SyntheticWorkload`) has the three shapes prefix caching lives on:
* shared system prompts, picked with Zipf popularity (prompt 0 most popular);
* multi-turn conversations: turn k+1's prompt = turn k's prompt + turn k's output + new user
  tokens, arriving a few steps after turn k finished (closed loop, like a chat client);
* exact repeats of an earlier prompt (a retried or duplicated request).

Determinism: everything that decides *tokens* is a pure function of seeds and ids — system prompts
of `prompt_seed` (so nodes with different traffic seeds share the same system prompts, which is
what makes cross-node routing interesting), user turns of `(seed, conversation, turn)`, outputs of
the request id (`output_tokens`). Only arrival steps of follow-up turns depend on when the previous
turn finished, and the scheduler is deterministic too, so a whole run is reproducible.

Trace format (`TraceWorkload`), one JSON object per line, blank lines and `#` lines ignored:
    {"request_id": "r1", "prompt_token_ids": [1, 2, 3], "max_tokens": 16, "arrival_step": 0}
`max_tokens` defaults to 16, `arrival_step` to 0; optional `output_token_ids` (at least
`max_tokens` ids) fixes the generated tokens, else they come from `output_tokens(request_id)`.
Requests arrive in file order within a step.
"""
from __future__ import annotations

import json
import random
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

VOCAB_SIZE = 32_000


def output_tokens(request_id: str, n: int, vocab: int = VOCAB_SIZE) -> list[int]:
    """The `n` tokens a request generates: deterministic pseudo-random ids of its request id."""
    rng = random.Random(f"out:{request_id}")
    return [rng.randrange(vocab) for _ in range(n)]


@dataclass(slots=True)
class RequestSpec:
    """One request as the client sends it. `output_token_ids` has exactly `max_tokens` ids."""

    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    arrival_step: int = 0
    output_token_ids: list[int] = field(default_factory=list)
    conversation: int | None = None
    turn: int = 0
    system_prompt: int | None = None  # index of the shared system prompt it starts with

    def __post_init__(self) -> None:
        if self.max_tokens <= 0:
            raise ValueError(f"request {self.request_id}: max_tokens must be positive, got {self.max_tokens}")
        if not self.prompt_token_ids:
            raise ValueError(f"request {self.request_id}: empty prompt_token_ids")
        if not self.output_token_ids:
            self.output_token_ids = output_tokens(self.request_id, self.max_tokens)
        elif len(self.output_token_ids) < self.max_tokens:
            raise ValueError(f"request {self.request_id}: {len(self.output_token_ids)} output_token_ids "
                             f"for max_tokens={self.max_tokens}")


class Workload(Protocol):
    system_prompts: list[list[int]]

    def arrivals(self, step: int) -> list[RequestSpec]:
        """Requests arriving at `step` (called once per step, steps increasing)."""

    def on_finished(self, spec: RequestSpec, step: int) -> None:
        """`spec` finished (or was dropped) at `step`: a conversation may schedule its next turn."""


@dataclass(frozen=True, slots=True)
class SyntheticConfig:
    seed: int = 0
    prompt_seed: int = 0
    num_system_prompts: int = 6
    system_prompt_tokens: tuple[int, int] = (64, 320)
    zipf_s: float = 1.1
    arrivals_per_step: float = 0.3  # mean new conversations per step (0.3 keeps the default node in steady state)
    max_turns: int = 4
    user_tokens: tuple[int, int] = (8, 64)
    max_tokens: tuple[int, int] = (4, 32)
    think_steps: tuple[int, int] = (1, 8)
    repeat_prob: float = 0.15
    max_prompt_tokens: int = 1536  # a conversation ends before its prompt would exceed this
    vocab: int = VOCAB_SIZE


def make_system_prompts(cfg: SyntheticConfig) -> list[list[int]]:
    rng = random.Random(f"system:{cfg.prompt_seed}")
    lo, hi = cfg.system_prompt_tokens
    return [[rng.randrange(cfg.vocab) for _ in range(rng.randint(lo, hi))]
            for _ in range(cfg.num_system_prompts)]


class SyntheticWorkload:
    def __init__(self, cfg: SyntheticConfig | None = None) -> None:
        self.cfg = cfg or SyntheticConfig()
        self.system_prompts = make_system_prompts(self.cfg)
        self._rng = random.Random(f"traffic:{self.cfg.seed}")
        weights = [1.0 / (i + 1) ** self.cfg.zipf_s for i in range(self.cfg.num_system_prompts)]
        total = sum(weights)
        self._cum = [sum(weights[: i + 1]) / total for i in range(len(weights))]
        self._pending: dict[int, list[RequestSpec]] = defaultdict(list)  # follow-up turns by step
        self._turns_left: dict[int, int] = {}
        self._recent: list[list[int]] = []  # recent prompts, for exact repeats
        self._next_conv = 0
        self._next_repeat = 0

    def _zipf(self) -> int:
        x = self._rng.random()
        for i, c in enumerate(self._cum):
            if x <= c:
                return i
        return len(self._cum) - 1

    def _user(self, conv: int, turn: int) -> list[int]:
        rng = random.Random(f"user:{self.cfg.seed}:{conv}:{turn}")
        lo, hi = self.cfg.user_tokens
        return [rng.randrange(self.cfg.vocab) for _ in range(rng.randint(lo, hi))]

    def _max_tokens(self, conv: int, turn: int) -> int:
        return random.Random(f"max:{self.cfg.seed}:{conv}:{turn}").randint(*self.cfg.max_tokens)

    def arrivals(self, step: int) -> list[RequestSpec]:
        out = self._pending.pop(step, [])
        rate = self.cfg.arrivals_per_step
        n = int(rate) + (self._rng.random() < rate - int(rate))
        for _ in range(n):
            if self._recent and self._rng.random() < self.cfg.repeat_prob:
                prompt = self._rng.choice(self._recent)
                rid = f"s{self.cfg.seed}-rep{self._next_repeat}"
                self._next_repeat += 1
                out.append(RequestSpec(rid, list(prompt), self._rng.randint(*self.cfg.max_tokens), step))
                continue
            conv = self._next_conv
            self._next_conv += 1
            sp = self._zipf()
            self._turns_left[conv] = self._rng.randint(1, self.cfg.max_turns) - 1
            out.append(RequestSpec(f"s{self.cfg.seed}-c{conv}t0", self.system_prompts[sp] + self._user(conv, 0),
                                   self._max_tokens(conv, 0), step, conversation=conv, turn=0,
                                   system_prompt=sp))
        for spec in out:
            self._remember(spec.prompt_token_ids)
        return out

    def _remember(self, prompt: list[int]) -> None:
        self._recent.append(prompt)
        if len(self._recent) > 64:
            self._recent.pop(0)

    def on_finished(self, spec: RequestSpec, step: int) -> None:
        conv = spec.conversation
        if conv is None or self._turns_left.get(conv, 0) <= 0:
            self._turns_left.pop(conv, None)  # type: ignore[arg-type]
            return
        turn = spec.turn + 1
        prompt = spec.prompt_token_ids + spec.output_token_ids[: spec.max_tokens] + self._user(conv, turn)
        if len(prompt) > self.cfg.max_prompt_tokens:
            self._turns_left.pop(conv, None)
            return
        self._turns_left[conv] -= 1
        think = random.Random(f"think:{self.cfg.seed}:{conv}:{turn}").randint(*self.cfg.think_steps)
        self._pending[step + think].append(RequestSpec(
            f"s{self.cfg.seed}-c{conv}t{turn}", prompt, self._max_tokens(conv, turn), step + think,
            conversation=conv, turn=turn, system_prompt=spec.system_prompt))


class TraceWorkload:
    """Requests replayed from a JSONL trace (format in the module docstring)."""

    def __init__(self, specs: Sequence[RequestSpec]) -> None:
        self._by_step: dict[int, list[RequestSpec]] = defaultdict(list)
        for s in specs:
            self._by_step[s.arrival_step].append(s)
        self.system_prompts: list[list[int]] = []
        self.last_arrival = max(self._by_step, default=-1)

    @classmethod
    def from_file(cls, path: str | Path) -> TraceWorkload:
        specs = []
        seen: set[str] = set()
        for lineno, line in enumerate(Path(path).read_text().splitlines(), 1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            where = f"{path}:{lineno}"
            try:
                obj = json.loads(line)
                rid = str(obj["request_id"])
                prompt = [int(t) for t in obj["prompt_token_ids"]]
                spec = RequestSpec(rid, prompt, int(obj.get("max_tokens", 16)), int(obj.get("arrival_step", 0)),
                                   [int(t) for t in obj.get("output_token_ids") or []])
            except (KeyError, TypeError, ValueError) as exc:
                raise ValueError(f"{where}: bad trace line ({exc!r}); expected "
                                 '{"request_id": str, "prompt_token_ids": [int], "max_tokens": int, '
                                 '"arrival_step": int}') from None
            if rid in seen:
                raise ValueError(f"{where}: duplicate request_id {rid!r}")
            seen.add(rid)
            specs.append(spec)
        return cls(specs)

    def arrivals(self, step: int) -> list[RequestSpec]:
        return self._by_step.pop(step, [])

    def on_finished(self, spec: RequestSpec, step: int) -> None:
        return None
