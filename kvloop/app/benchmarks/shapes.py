"""Workload shapes for ``kvloop bench load`` (issue 52): the agent workload the placement knobs were set on, and
neighbours it was not developed on, so that a placement tuned to one shape shows. Each shape changes the base
workload's flags (``--turns``, ``--user-tokens``, ``--answer-tokens``, ``--think-ms``, ``--sessions-per-load``)
the same way at every load, relative to them, so a sweep of shapes is comparable point by point. Pure.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from kvloop.app.benchmarks.aiperf import AgentLoad


@dataclass(frozen=True)
class Shape:
    name: str
    stresses: str
    """What it asks of placement that the base shape does not."""
    turns_spread: float = 0.0
    """The turn count's standard deviation, as a share of its mean."""
    user_spread: float = 0.0
    answer_spread: float = 0.0
    think_spread: float = 0.0
    private_share: float = 0.0
    """Each session's own context ahead of its turns, as a share of the shared system prompt (which shrinks by as
    much, so the first prompt keeps its length)."""
    sessions_factor: int = 1
    """Conversations per concurrent slot, times the base's ``--sessions-per-load``."""


SHAPES: dict[str, Shape] = {s.name: s for s in (
    Shape("agent", "nothing new: the shape the knobs were set on (every turn alike, one shared system prompt)"),
    Shape("varied", "turns of unequal length: user turns and answers spread 50% around their means, turn counts "
                    "30%; tails that DECODE_LOCAL cannot always absorb", turns_spread=0.3, user_spread=0.5,
          answer_spread=0.5),
    Shape("bursty", "think times spread as wide as their mean: sessions bunch and starve in turn", think_spread=1.0),
    Shape("private", "most of each first prompt is the session's own (70% of the system prompt's length), so "
                     "prefill engines' caches hold little that other sessions share", private_share=0.7),
    Shape("many", "four times the conversations per concurrent slot: more sessions start cold, more leases compete "
                  "for the retention budget", sessions_factor=4),
)}


def shaped(shape: Shape, load: AgentLoad) -> AgentLoad:
    """``load`` (the base flags' agent workload at one point) in ``shape``."""
    private = round(load.system_tokens * shape.private_share)
    return replace(load, sessions=load.sessions * shape.sessions_factor,
                   turns_stddev=round(load.turns * shape.turns_spread),  # AIPerf takes whole turns
                   user_stddev=load.user_tokens * shape.user_spread,
                   answer_stddev=load.answer_tokens * shape.answer_spread,
                   think_stddev_ms=load.think_ms * shape.think_spread,
                   system_tokens=load.system_tokens - private, private_tokens=private)


def parse_shapes(text: str) -> list[Shape]:
    """``--shapes``: comma-separated names; ValueError naming the unknown ones."""
    names = [n for n in text.split(",") if n]
    unknown = [n for n in names if n not in SHAPES]
    if unknown or not names or len(set(names)) != len(names):
        raise ValueError(f"--shapes: unknown {unknown} or repeated; choose from {list(SHAPES)}")
    return [SHAPES[n] for n in names]
