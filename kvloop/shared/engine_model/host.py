"""CPU engines share their host's cores with everything beside them: the client driving the load, the router, the
engines' API servers and EngineCore processes, the sidecars and the broker. On a GPU those run on cores the model's
steps do not need; on a CPU engine (this project's machines) they take time from the steps. Measured at b78629f on
two cores (``kvloop bench load``'s CPU table): 0.85-0.92 of a core beside the engines' workers, 0.53-0.64 of it
AIPerf's own polling, the rest per request; the profile, measured on an idle machine, then predicts ITL 10-43% short.

The model (:class:`HostShare`) is a fluid one, time an argument as everywhere in this package:

- background demand ``U`` (cores) is the client's constant share plus the CPU each request and turn costs beside
  the engines, as a rate averaged over ``window_s`` (charges are impulses, so an exponential average smooths them);
- the scheduler gives background work the cores the engines leave idle first (each engine's busy fraction is
  averaged the same way), and only what does not fit there (``spill``) competes with the engines' steps, spread
  over every core;
- a step on a core whose background share is ``u`` lasts ``seconds / (1 - u)``, ``u`` capped at ``max_share``
  (one runnable background thread beside an engine's worker gets half the core at most under Linux's fair
  scheduler).

``HostSpec.cores == 0`` means the engines run on hardware of their own (a GPU fleet): no step is stretched.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from kvloop.shared.errors import ConfigError


@dataclass(frozen=True, slots=True)
class HostSpec:
    cores: int = 0
    """Cores the engines and everything beside them share (0: engines on hardware of their own)."""
    client_cores: float = 0.0
    """The load generator's constant share (AIPerf's timing manager polls whether or not a request is due)."""
    engine_request_cpu_s: float = 0.0
    """CPU seconds an engine's API server and EngineCore process spend per request, beside its worker's steps."""
    turn_cpu_s: float = 0.0
    """CPU seconds per routed turn of the router, the sidecars and the broker together."""
    window_s: float = 10.0
    """How far back the averaged demand and busy fractions look."""
    max_share: float = 0.5
    """The largest share of a core background work takes from an engine's step."""
    source: str = ""
    """Where the figures came from (``measured here: ...``), reported with every prediction."""

    def __post_init__(self) -> None:
        if self.cores < 0:
            raise ConfigError(f"host.cores: 0 (engines on their own hardware) or more (got {self.cores})",
                              field="cores")
        for name in ("client_cores", "engine_request_cpu_s", "turn_cpu_s"):
            value = getattr(self, name)
            if not value >= 0:
                raise ConfigError(f"host.{name}: must not be negative (got {value})", field=name)
        if self.cores and self.client_cores >= self.cores:
            raise ConfigError(f"host.client_cores: {self.client_cores} leaves nothing of {self.cores} core(s)",
                              field="client_cores")
        if not self.window_s > 0:
            raise ConfigError(f"host.window_s: must be positive (got {self.window_s})", field="window_s")
        if not 0 <= self.max_share < 1:
            raise ConfigError(f"host.max_share: from 0 up to 1, 1 excluded (got {self.max_share})",
                              field="max_share")

    @property
    def shared(self) -> bool:
        return self.cores > 0


class HostShare:
    """The background work on one host, and each engine's share of its cores (module docstring)."""

    def __init__(self, spec: HostSpec, engine_cores: Mapping[str, float]) -> None:
        """``engine_cores``: the cores each engine computes on. More engines than cores (the load bench's two prefill
        engines on one core) leave no idle core to count; how they slow each other is not modelled."""
        self.spec = spec
        self.engine_cores = dict(engine_cores)
        self._rate = 0.0
        """Averaged background CPU per second beyond the client's constant share."""
        self._busy = dict.fromkeys(engine_cores, 0.0)
        self._clock = 0.0

    def charge(self, now: float, cpu_s: float) -> None:
        """Background work of ``cpu_s`` CPU seconds done around ``now`` (a request taken, a turn routed)."""
        self._decay(now)
        self._rate += cpu_s / self.spec.window_s

    def step(self, engine_id: str, now: float, seconds: float) -> float:
        """The wall time of a step of ``seconds`` (its time on an idle host) that ``engine_id`` starts at ``now``;
        the step counts towards the engine's busy fraction."""
        if not self.spec.shared:
            return seconds
        self._decay(now)
        stretched = seconds / (1.0 - self.background_share())
        self._busy[engine_id] += stretched / self.spec.window_s
        return stretched

    def background_share(self) -> float:
        """The share of each core's time background work takes from the engines now."""
        spec = self.spec
        idle = max(0.0, spec.cores - sum(cores * min(1.0, self._busy[e]) for e, cores in self.engine_cores.items()))
        spill = max(0.0, self.demand() - idle)
        return min(spec.max_share, spill / spec.cores)

    def demand(self) -> float:
        """Background demand in cores, averaged."""
        return self.spec.client_cores + self._rate

    def _decay(self, now: float) -> None:
        dt = now - self._clock
        if dt <= 0:
            return
        keep = math.exp(-dt / self.spec.window_s)
        self._rate *= keep
        for engine in self._busy:
            self._busy[engine] *= keep
        self._clock = now
