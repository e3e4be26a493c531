"""A queueing model of vLLM engines: what one engine costs (:mod:`.profile`) and one engine step by step
(:mod:`.engine`), with its KV pool and prefix cache (:mod:`.pool`) and, for CPU engines, the host cores it shares
with what runs beside it (:mod:`.host`). Pure: time is an argument, no clock, no I/O besides reading and writing a
profile file. The fleet replay (``kvloop.app.fleet``) composes these engines with
the broker's core."""

from kvloop.shared.engine_model.engine import Account, EngineSim, Event, EventKind, SimRequest
from kvloop.shared.engine_model.host import HostShare, HostSpec
from kvloop.shared.engine_model.pool import BlockPool
from kvloop.shared.engine_model.profile import (
    FIGURE_GROUPS,
    PROFILE_VERSION,
    SOURCE_KINDS,
    EngineProfile,
    dump_profile,
    load_profile,
    profile_from_dict,
    profile_to_dict,
)

__all__ = [
    "FIGURE_GROUPS",
    "PROFILE_VERSION",
    "SOURCE_KINDS",
    "Account",
    "BlockPool",
    "EngineProfile",
    "EngineSim",
    "Event",
    "EventKind",
    "HostShare",
    "HostSpec",
    "SimRequest",
    "dump_profile",
    "load_profile",
    "profile_from_dict",
    "profile_to_dict",
]
