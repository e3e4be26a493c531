"""One modelled vLLM engine, step by step, as vLLM V1 schedules it with chunked prefill: each step, every decoding
stream gets one token, then requests still to prefill get chunks of their prompts, first come first served, until
the step's token budget is spent. A step lasts what the profile says its contents cost; requests that arrive
during a step wait for the next one, as they do in vLLM.

A request's prompt tokens are computed unless the engine's prefix cache holds them (:mod:`.pool`) or they are
known elsewhere (``SimRequest.known_tokens``: the P/D hand-off, or a TRANSFER's lease), in which case the engine
pulls what its cache lacks before its prefill starts (the profile's pull time). A request is admitted only when
the pool has room for all of its blocks, its answer's included, so it is never preempted (vLLM would preempt and
recompute instead: a simplification that errs towards queueing).

Pure: time is an argument of every call, nothing here reads a clock or does I/O.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

from kvloop.shared.engine_model.host import HostShare
from kvloop.shared.engine_model.pool import BlockPool
from kvloop.shared.engine_model.profile import EngineProfile
from kvloop.shared.errors import ConfigError, ResourceExhausted


class EventKind(StrEnum):
    FIRST_TOKEN = "first_token"
    FINISHED = "finished"


@dataclass(frozen=True, slots=True)
class SimRequest:
    request_id: str
    prompt_tokens: int
    max_tokens: int
    keys: tuple[bytes, ...] = ()
    """Keys of the full blocks of the prompt and, beyond it, of the answer as far as they are known (a session's
    next prompt): the blocks this request leaves in the engine's prefix cache."""
    known_tokens: int = 0
    """Leading prompt tokens whose KV another engine holds: pulled where this engine's cache lacks them, never
    computed."""


@dataclass(frozen=True, slots=True)
class Account:
    """What the engine did for one finished request."""

    submitted_t: float
    admitted_t: float
    first_token_t: float
    finished_t: float
    local_tokens: int
    """Prompt tokens found in the engine's own prefix cache."""
    pulled_tokens: int
    pulled_blocks: int
    computed_tokens: int
    generated: int
    max_gap_s: float
    """The longest wait between two of its tokens after the first."""


@dataclass(frozen=True, slots=True)
class Event:
    kind: EventKind
    request_id: str
    t: float
    account: Account | None = None
    """On ``FINISHED`` only."""


@dataclass(slots=True)
class _Run:
    req: SimRequest
    submitted: float
    admitted: float = math.nan
    ready_at: float = 0.0
    held: int = 0
    """Leading keys of the request the pool holds for it (cache hits, then blocks it cached itself)."""
    private: int = 0
    local: int = 0
    pulled: int = 0
    pulled_blocks: int = 0
    done: int = 0
    """Prompt tokens whose KV exists here (cached, pulled or computed)."""
    generated: int = 0
    first_token: float = math.nan
    last_token: float = math.nan
    max_gap: float = 0.0

    @property
    def prefilled(self) -> bool:
        return self.done >= self.req.prompt_tokens

    @property
    def context(self) -> int:
        return self.done + self.generated


@dataclass(frozen=True, slots=True)
class _Step:
    start: float
    end: float
    decodes: tuple[_Run, ...]
    chunks: tuple[tuple[_Run, int], ...]

    @property
    def tokens(self) -> int:
        return len(self.decodes) + sum(n for _, n in self.chunks)


class EngineSim:
    """One engine: ``submit`` requests, ask ``next_event_time``, ``advance`` to a time and read the events."""

    def __init__(self, engine_id: str, profile: EngineProfile, host: HostShare | None = None) -> None:
        self.engine_id = engine_id
        self.profile = profile
        self.host = host
        """The cores it shares with what runs beside it (a CPU engine), which stretch its steps; None: its own."""
        self.pool = BlockPool(profile.kv_pool_blocks)
        self.waiting: deque[_Run] = deque()
        self.running: list[_Run] = []
        self._step: _Step | None = None
        self._clock = 0.0
        self._blocked = False
        """The head of the queue did not fit and nothing has freed blocks since: no step to form for it."""
        self._leases: dict[str, tuple[bytes, ...]] = {}
        self.steps = 0
        self.max_step_tokens = 0

    # ------------------------------------------------------------------ requests in
    def submit(self, request: SimRequest, now: float) -> None:
        """Queue ``request`` at ``now``; it starts at the next step that has room for it."""
        if request.prompt_tokens < 1 or request.max_tokens < 1:
            raise ConfigError(f"request {request.request_id}: needs a prompt and at least one token to generate",
                              field="prompt_tokens")
        if self.profile.blocks_for(request.prompt_tokens + request.max_tokens) > self.pool.capacity:
            raise ResourceExhausted(f"request {request.request_id}: larger than {self.engine_id}'s whole KV pool")
        self._clock = max(self._clock, now)
        self.waiting.append(_Run(request, now))
        self._blocked = False

    def retain(self, lease_id: str, keys: Sequence[bytes]) -> int:
        """Hold the leading ``keys`` the cache has for a lease (kvloop's retention): pinned until released."""
        held = tuple(keys[: self.pool.cached_prefix(keys)])
        for key in held:
            self.pool.hold(key)
        self._leases[lease_id] = held
        return len(held)

    def release(self, lease_id: str) -> None:
        """End a lease's hold (the broker's eviction); its blocks stay cached until the pool needs them."""
        for key in self._leases.pop(lease_id, ()):
            self.pool.drop(key)
        self._blocked = False

    # ------------------------------------------------------------------ time
    def next_event_time(self) -> float:
        """When this engine next does something by itself: its step's end, or the start of the next step."""
        if self._step is not None:
            return self._step.end
        starts = [max(self._clock, r.ready_at) for r in self.running]
        if self.waiting and not self._blocked:
            starts.append(self._clock)
        return min(starts, default=math.inf)

    def advance(self, now: float) -> list[Event]:
        """Run every step that ends by ``now`` (and start the next); the events they produced, in time order."""
        events: list[Event] = []
        while (t := self.next_event_time()) <= now:
            if self._step is not None:
                events += self._complete(self._step)
                self._clock, self._step = self._step.end, None
                continue
            self._clock = t
            self._step = self._form_step(t)
            if self._step is None:
                # Nothing to compute at t: what remains waits for a pull (its ready time) or for room.
                self._blocked = bool(self.waiting)
                if self.next_event_time() <= t:
                    break
        return events

    # ------------------------------------------------------------------ scheduling
    def _form_step(self, now: float) -> _Step | None:
        """vLLM V1's order: the running requests first (decodes, then prefill chunks), then waiting requests admitted
        while the step's budget lasts, each looking up the prefix cache as it is admitted (so a burst sharing a
        prefix computes it once per step, not once per request)."""
        budget = self.profile.max_num_batched_tokens
        decodes = tuple(r for r in self.running if r.prefilled)[:budget]
        budget -= len(decodes)
        chunks: list[tuple[_Run, int]] = []
        for run in self.running:
            if budget <= 0:
                break
            if run.prefilled or run.ready_at > now:
                continue
            n = min(run.req.prompt_tokens - run.done, budget)
            chunks.append((run, n))
            budget -= n
        while budget > 0 and (admitted := self._admit_next(now)) is not None:
            if admitted.ready_at <= now and not admitted.prefilled:
                n = min(admitted.req.prompt_tokens - admitted.done, budget)
                chunks.append((admitted, n))
                budget -= n
        if not decodes and not chunks:
            return None
        prefill = sum(n for _, n in chunks)
        pairs = sum(n * (run.done + n / 2) for run, n in chunks)  # each token attends to its position, on average
        seconds = self.profile.step_seconds(prefill, pairs, len(decodes), sum(r.context for r in decodes))
        if self.host is not None:
            seconds = self.host.step(self.engine_id, now, seconds)
        step = _Step(now, now + seconds, decodes, tuple(chunks))
        self.steps += 1
        self.max_step_tokens = max(self.max_step_tokens, step.tokens)
        return step

    def _admit_next(self, now: float) -> _Run | None:
        """First come first served: the head of the queue, running now, or None while the pool or the seats lack
        room for it (and so for all behind it)."""
        if not self.waiting or len(self.running) >= self.profile.max_num_seqs or not self._admit(self.waiting[0], now):
            return None
        run = self.waiting.popleft()
        self.running.append(run)
        return run

    def _admit(self, run: _Run, now: float) -> bool:
        req, bs = run.req, self.profile.block_size
        # The last prompt token is always computed: its step samples the first token.
        usable = (req.prompt_tokens - 1) // bs
        hits = req.keys[: min(self.pool.cached_prefix(req.keys), usable)]
        private = self.profile.blocks_for(req.prompt_tokens + req.max_tokens) - len(hits)
        if not self.pool.fits(hits, private):
            return False
        self.pool.take(hits, private)
        run.admitted, run.held, run.private = now, len(hits), private
        run.local = len(hits) * bs
        known = min(req.known_tokens, req.prompt_tokens - 1)
        run.done = max(run.local, known)
        run.pulled = run.done - run.local
        run.pulled_blocks = self.profile.blocks_for(known) - len(hits) if run.pulled else 0
        run.ready_at = now + self.profile.pull_seconds(run.pulled_blocks)
        return True

    # ------------------------------------------------------------------ a step ends
    def _complete(self, step: _Step) -> list[Event]:
        t, events = step.end, []
        for run in step.decodes:
            run.generated += 1
            run.max_gap = max(run.max_gap, t - run.last_token)
            run.last_token = t
        for run, n in step.chunks:
            run.done += n
            if run.prefilled:
                self._cache_upto(run, run.req.prompt_tokens // self.profile.block_size)
                run.generated, run.first_token, run.last_token = 1, t, t
                events.append(Event(EventKind.FIRST_TOKEN, run.req.request_id, t))
        for run in [r for r in self.running if r.prefilled and r.generated >= r.req.max_tokens]:
            events.append(self._finish(run, t))
        return events

    def _cache_upto(self, run: _Run, blocks: int) -> None:
        """Cache the request's computed full blocks up to ``blocks`` (as far as it has keys for them)."""
        for key in run.req.keys[run.held: min(blocks, len(run.req.keys))]:
            self.pool.cache(key)
            run.held += 1
            run.private -= 1

    def _finish(self, run: _Run, t: float) -> Event:
        # Every token but the last sampled one has KV: those full blocks stay in the prefix cache.
        self._cache_upto(run, (run.req.prompt_tokens + run.generated - 1) // self.profile.block_size)
        for key in run.req.keys[: run.held]:
            self.pool.drop(key)
        self.pool.release(run.private)
        self.running.remove(run)
        self._blocked = False
        computed = run.req.prompt_tokens - run.local - run.pulled
        return Event(EventKind.FINISHED, run.req.request_id, t, Account(
            run.submitted, run.admitted, run.first_token, t, run.local, run.pulled, run.pulled_blocks, computed,
            run.generated, run.max_gap))

    # ------------------------------------------------------------------ read-only figures
    def cached_prefix_tokens(self, keys: Sequence[bytes]) -> int:
        return self.pool.cached_prefix(keys) * self.profile.block_size

    @property
    def queued_prefill_tokens(self) -> int:
        """Prompt tokens submitted here and not computed yet (known tokens excepted)."""
        waiting = sum(r.req.prompt_tokens - min(r.req.known_tokens, r.req.prompt_tokens - 1) for r in self.waiting)
        return waiting + sum(r.req.prompt_tokens - r.done for r in self.running)

    @property
    def running_streams(self) -> int:
        return sum(1 for r in self.running if r.prefilled)

    @property
    def running_context(self) -> int:
        return sum(r.context for r in self.running if r.prefilled)

    @property
    def requests(self) -> int:
        return len(self.running) + len(self.waiting)

    @property
    def waiting_requests(self) -> int:
        return len(self.waiting)

    @property
    def free_blocks(self) -> int:
        return self.pool.free

    @property
    def retained_blocks(self) -> int:
        return sum(len(keys) for keys in self._leases.values())

    def blocks_short(self) -> int:
        """Blocks the head of the queue lacks (0: it fits, or nothing waits): what memory pressure asks for."""
        if not self.waiting:
            return 0
        req = self.waiting[0].req
        hits = req.keys[: min(self.pool.cached_prefix(req.keys), (req.prompt_tokens - 1) // self.profile.block_size)]
        need = self.profile.blocks_for(req.prompt_tokens + req.max_tokens) - len(hits)
        return max(0, need - self.pool.room(hits))

    def take_cache_events(self) -> tuple[list[bytes], list[bytes]]:
        """Keys cached and evicted since the last call (what vLLM's KV cache events report)."""
        return self.pool.take_events()
