"""The router's plan of one turn, decided by pure functions: which engines to call, in what order, with which
parameters, and what the turn falls back to. :mod:`.turn` carries the plan out; tests drive these on a
:class:`~kvloop.router.directory.Directory` built from a made-up broker reply (``tests/unit/test_turn_plan.py``).

The broker's plan is taken as given except where the router knows better at once:

- DECODE_LOCAL naming a decode engine this router does not know: RECOMPUTE (``decode_engine_unknown``);
- a TRANSFER whose pin was refused: RECOMPUTE (``pin_refused``), via :func:`downgraded`;
- no plan at all (no broker, no layout, broker unavailable or refusing): RECOMPUTE with the fallback's cause as
  the reason, on engines picked round-robin.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

from kvloop.router.directory import Directory, EngineInfo
from kvloop.router.errors import TurnError
from kvloop.shared.protocol import KEEP_GENERATED_KEY, decode_local_params
from kvloop.shared.vocabulary import (
    Fallback,
    NoVeto,
    Path,
    Reason,
    Role,
    TurnReason,
    Veto,
    reason_from_wire,
    veto_from_wire,
)
from kvloop.v1 import broker_pb2 as pb

PREFILL_ONLY_FIELDS = ("stream", "stream_options", "n", "logprobs", "top_logprobs", "echo")
"""Request fields a prefill (one token, not streamed, not returned) drops."""


@dataclass(frozen=True)
class Placement:
    """What the broker said about a turn: its plan (None: none; ``fallback`` says why), the prompt's block keys,
    the milliseconds spent waiting for a due publication, and the pin the broker took with a TRANSFER plan."""

    plan: pb.Plan | None
    keys: tuple[bytes, ...] = ()
    wait_ms: float = 0.0
    pin: pb.PinBlocksResponse | None = None
    fallback: Fallback | Literal[""] = ""


@dataclass(frozen=True)
class TurnPlan:
    """One turn's plan. ``prefill`` is the engine to prefill on (the decode engine itself on DECODE_LOCAL, where
    no prefill request is made); ``decodes`` the decode engines in the order to try them."""

    kind: str
    session: str
    model: str
    path: Path
    """The planned path (the broker's, or RECOMPUTE when there was no usable plan)."""
    reason: TurnReason
    """The plan's reason, or the fallback's cause when there was no plan."""
    prompt_tokens: int
    block_size: int
    prefill: EngineInfo
    decodes: tuple[EngineInfo, ...]
    keys: tuple[bytes, ...] = ()
    matched_tokens: int = 0
    local_tokens: int = 0
    pull_tokens: int = 0
    available_tokens: int = 0
    """The longest prefix any engine held (the broker's lease and soft indexes): the reuse this turn could have."""
    broker_plan: pb.Plan | None = None

    @property
    def veto(self) -> Veto | NoVeto:
        """Why DECODE_LOCAL was not taken though the decode engine held the prefix (the broker's
        ``decode_local_veto``; "" without a plan)."""
        return plan_veto(self.broker_plan) if self.broker_plan is not None else ""

    @property
    def decode(self) -> EngineInfo:
        return self.decodes[0]

    @property
    def decode_local(self) -> bool:
        return self.path == Path.DECODE_LOCAL

    @property
    def compute_tokens(self) -> int:
        """The prompt tokens the serving engine computes as planned: all but those it holds or pulls."""
        return max(0, self.prompt_tokens - self.local_tokens - self.pull_tokens)

    @property
    def endpoint(self) -> str:
        return "/v1/chat/completions" if self.kind == "chat" else "/v1/completions"


def plan_path(plan: pb.Plan) -> Path:
    """The broker's decision as a path (RECOMPUTE for one this router does not know)."""
    name = pb.Decision.Name(plan.decision).removeprefix("DECISION_")
    return Path(name) if name in Path.__members__ else Path.RECOMPUTE


def plan_reason(plan: pb.Plan) -> Reason:
    """The broker's reason, typed (a string on the wire, so that routers and brokers of different versions still
    interoperate: :mod:`kvloop.shared.vocabulary`); :attr:`Reason.UNKNOWN` for a word this router does not know
    (:class:`~kvloop.router.placement.Placer` logs it as the plan arrives)."""
    return reason_from_wire(plan.reason)


def plan_veto(plan: pb.Plan) -> Veto | NoVeto:
    """The broker's ``decode_local_veto``, typed as :func:`plan_reason` types the reason ("" when none)."""
    return veto_from_wire(plan.decode_local_veto)


def plan_turn(directory: Directory, kind: str, session: str, model: str, prompt_tokens: int,
              placement: Placement) -> TurnPlan:
    """The turn's plan from the broker's (or from none) and the engines this router knows.

    Raises :class:`TurnError` 503 when no prefill or no decode engine serving ``model`` is known. Picks engines
    round-robin where the broker named none (the directory's counters advance: the only state touched)."""
    plan = placement.plan
    path = plan_path(plan) if plan else Path.RECOMPUTE
    # Without a plan the placement names its cause (one that names none asked no broker).
    reason: TurnReason = plan_reason(plan) if plan else placement.fallback or Fallback.NO_BROKER
    prefill = directory.engines.get(plan.prefill_engine_id) if plan else None
    decode = directory.engines.get(plan.decode_engine_id) if plan else None
    if path == Path.DECODE_LOCAL and decode is None:
        path, reason = Path.RECOMPUTE, Reason.DECODE_ENGINE_UNKNOWN
    prefill = prefill or directory.pick(Role.PREFILL, model)
    decode = decode or directory.pick(Role.DECODE, model)
    if prefill is None or decode is None:
        raise TurnError(503, f"no prefill and decode engines serving '{model}' are available")
    others = [e for e in [*directory.of_role(Role.DECODE, model), *directory.last_resort(Role.DECODE, model)]
              if e.engine_id != decode.engine_id]
    layout = directory.layout(model)
    return TurnPlan(kind=kind, session=session, model=model, path=path, reason=reason, prompt_tokens=prompt_tokens,
                    block_size=layout[1] if layout else 0, prefill=decode if path == Path.DECODE_LOCAL else prefill,
                    decodes=(decode, *others), keys=placement.keys,
                    matched_tokens=int(plan.matched_tokens) if plan else 0,
                    local_tokens=int(plan.local_tokens) if plan else 0,
                    pull_tokens=int(plan.pull_tokens) if plan else 0,
                    available_tokens=int(plan.cached_tokens_seen) if plan else 0, broker_plan=plan)


def downgraded(plan: TurnPlan, reason: Reason) -> TurnPlan:
    """The same turn recomputed on the same engines, for ``reason`` (nothing pulled)."""
    return replace(plan, path=Path.RECOMPUTE, reason=reason, pull_tokens=0)


def candidates(first: Sequence[EngineInfo], more: Callable[[set[str]], EngineInfo | None] | None = None
               ) -> Iterator[EngineInfo]:
    """The engines a fail-over tries, in order: ``first``, then what ``more`` picks among those not yet tried,
    each engine once. Every engine call of a turn that may move to another engine walks this."""
    tried: set[str] = set()
    for engine in first:
        if engine.engine_id not in tried:
            tried.add(engine.engine_id)
            yield engine
    while more is not None and (engine := more(tried)) is not None:  # type: ignore[assignment]
        tried.add(engine.engine_id)
        yield engine


def prefill_request(body: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
    """The client's request as a prefill: one token, not streamed, with ``params`` as its transfer params."""
    request = dict(body)  # only top-level keys change; a deep copy of 3,400 prompt ids took 0.9 ms of the loop
    for key in PREFILL_ONLY_FIELDS:
        request.pop(key, None)
    request.update(max_tokens=1, stream=False, kv_transfer_params=params)
    if "max_completion_tokens" in request:
        request["max_completion_tokens"] = 1
    return request


def decode_request(plan: TurnPlan, body: dict[str, Any], params: dict[str, Any], *, retry: bool = False,
                   keep_generated: bool = True) -> tuple[dict[str, Any], bool]:
    """The decode request and whether the client asked for usage itself. ``keep_generated`` false (the client's
    session hint) tells the decode engine to retain the prompt's blocks only.

    A DECODE_LOCAL stream asks for usage (the decode engine's usage says what it found in its cache; the router
    drops the chunk again when the client did not ask). A retry on a second decode engine computes the prompt
    there, never with the first attempt's transfer params: the prefill engine frees the blocks they name once a
    decode has read them, and may have reused them, so a second read would return another request's KV."""
    request = dict(body)  # only top-level keys change; a deep copy of 3,400 prompt ids took 0.9 ms of the loop
    request["kv_transfer_params"] = decode_local_params(plan.session) if retry else params
    if not keep_generated:
        request["kv_transfer_params"] = {**request["kv_transfer_params"], KEEP_GENERATED_KEY: False}
    client_usage = True
    if plan.decode_local and request.get("stream"):
        options = dict(request.get("stream_options") or {})
        client_usage = bool(options.get("include_usage"))
        request["stream_options"] = {**options, "include_usage": True}
    return request, client_usage
