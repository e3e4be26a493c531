"""What a turn did, beside its plan: the engines' own accounts as they arrive (the prefill's report, a
DECODE_LOCAL stream's usage), which engines served it, and where its time went. The derived figures (the actual
path, plan against outcome) come from :mod:`.truth`; headers, records, spans and metrics all read them here."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from kvloop.router.directory import EngineInfo
from kvloop.router.plan import TurnPlan
from kvloop.router.truth import actual_path, plan_outcome, report_from_usage
from kvloop.shared.protocol import PrefillReport
from kvloop.shared.vocabulary import Path, PlanOutcome


@dataclass
class TurnOutcome:
    """The engines' side of a turn, filled in as it runs."""

    prefill_engine: str = ""
    """The engine that computed the prompt (the decode engine on DECODE_LOCAL; another after a prefill fail-over)."""
    decode: EngineInfo | None = None
    """The decode engine that answered (None until one did)."""
    decode_params: dict[str, Any] = field(default_factory=dict)
    report: PrefillReport | None = None
    """The prefill engine's own account (None: no kvloop connector reported, e.g. the prefill failed over); on
    DECODE_LOCAL, the decode engine's, from its usage once the reply is complete."""
    usage: dict[str, Any] | None = None
    client_usage: bool = True
    """False when the router asked the decode engine for usage that the client did not ask for."""
    decode_started_ns: int = 0
    timings_ms: dict[str, float] = field(default_factory=dict)
    """Where the turn's time went before its first token, by step (``x-kvloop-timing``; the benchmark's breakdown):
    tokenize, place (with any publication wait), publication_wait, pin, prefill (the request's round trip),
    decode_first (the decode request to its first streamed line)."""


@dataclass
class Turn:
    """A turn in flight: the client's request, its plan (replaced only by a downgrade), what the engines did."""

    body: dict[str, Any]
    plan: TurnPlan
    span: Any
    started: float
    outcome: TurnOutcome = field(default_factory=TurnOutcome)
    as_tokens: dict[str, Any] | None = None
    """The chat request as a completions request of the router's token ids (:mod:`.chat_tokens`); None: sent as
    the client's request."""
    session: Any = None
    """The client's session and hints (``router.sessions.SessionCall``; typed ``Any`` as this module needs nothing of
    the server's); None for a turn made without a request (tests)."""

    @property
    def keeps_generated(self) -> bool:
        """False when the client said the next turn will not repeat this answer (``keep_generated: false``, on this
        turn or earlier in the session, as the broker's plan remembers it): the decode engine then retains the
        prompt's blocks only. The turn's own hint wins."""
        said = getattr(getattr(self.session, "hints", None), "keep_generated", None)
        if said is not None:
            return bool(said)
        plan = self.plan.broker_plan
        return not (plan is not None and plan.session_drops_generated)

    @property
    def engine_body(self) -> dict[str, Any]:
        """What the engines are sent: the client's request, or its token-ids form."""
        return self.body if self.as_tokens is None else self.as_tokens

    @property
    def endpoint(self) -> str:
        return "/v1/completions" if self.as_tokens is not None else self.plan.endpoint

    @property
    def decode(self) -> EngineInfo:
        return self.outcome.decode or self.plan.decode

    @property
    def measured(self) -> bool:
        """Whether an engine's own account of the prompt is in (a DECODE_LOCAL stream's comes at its end)."""
        return self.outcome.report is not None

    @property
    def done(self) -> PrefillReport:
        """The engine's report; until then (or without one) the plan's figures on DECODE_LOCAL, else a full
        recompute."""
        if self.outcome.report is not None:
            return self.outcome.report
        if self.plan.decode_local:
            return PrefillReport(local_tokens=self.plan.local_tokens,
                                 computed_tokens=self.plan.prompt_tokens - self.plan.local_tokens)
        return PrefillReport(computed_tokens=self.plan.prompt_tokens)

    @property
    def path(self) -> Path:
        """The path the turn actually took (:mod:`kvloop.router.truth`)."""
        return actual_path(self.plan.path, self.done)

    @property
    def plan_vs_actual(self) -> PlanOutcome:
        return plan_outcome(self.plan.path, self.path, self.plan.local_tokens + self.plan.pull_tokens,
                            self.done.reused_tokens, self.plan.block_size)

    def observe_reply(self, reply: dict[str, Any]) -> None:
        """Read a non-streamed DECODE_LOCAL reply's usage: the decode engine's account of the prompt."""
        if self.plan.decode_local:
            self.outcome.report = report_from_usage(reply.get("usage") or {}, self.plan.prompt_tokens)

    def observe(self, line: bytes) -> bool:
        """Read a DECODE_LOCAL stream's usage chunk off a streamed line; True when the line is for the router only
        (usage the client did not ask for)."""
        if not self.plan.decode_local or not line.startswith(b"data: {") or b'"usage"' not in line:
            return False
        try:
            data = json.loads(line[6:])
        except ValueError:
            return False
        if not isinstance(data, dict) or not data.get("usage"):
            return False
        self.outcome.usage = data["usage"]
        self.outcome.report = report_from_usage(self.outcome.usage, self.plan.prompt_tokens)
        return not self.outcome.client_usage and not data.get("choices")
