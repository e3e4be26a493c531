"""CPU engines share their host's cores with everything beside them: the client driving the load, the router, the
engines' API servers and EngineCore processes, the sidecars and the broker. On a GPU those run on cores the model's
steps do not need; on a CPU engine (this project's machines) they take time from the steps. Measured at b78629f on
two cores (``kvloop bench load``'s CPU table): 0.85-0.92 of a core beside the engines' workers, 0.53-0.64 of it
AIPerf's own polling, 0.07-0.09 each engine's API server and EngineCore whatever the load, the rest per turn; the
profile, measured on an idle machine, then predicts ITL 10-43% short.

The model (:class:`HostShare`) is a fluid one, time an argument as everywhere in this package:

- background demand ``U`` (cores) is the client's constant share, each engine's API server and EngineCore
  processes (constant too), and the CPU each routed turn costs the router, sidecars and broker, as a rate averaged
  over ``window_s`` (charges are impulses, so an exponential average smooths them);
- the scheduler spreads it over the cores by the room the engines pinned there leave (each engine's CPU demand is
  averaged the same way): a core whose engine is busy takes little of it, one whose engine is mostly idle takes
  much, and the background work there runs beside that engine's steps, not only in its idle time;
- a step on a core whose background share is ``u`` lasts ``seconds / (1 - u)`` (processor sharing), ``u`` capped
  at ``max_share`` (the fair scheduler gives the engine's worker its turn however many others wait);
- engines bound to a common core (the load bench's two prefill engines on core 0) share it while both compute: a
  step that starts while another's is still running pays for the overlap, its own time plus what remains of the
  other steps up to its own time again. Under processor sharing each would pay half; the one that starts second
  pays both halves, since a step already under way is not lengthened here (time is an argument, steps are not
  revised): the total delay is the same. Measured on the Mooncake replay (AVX-512 machine, speed 2, cores 30%
  busy): RECOMPUTE prefills took 191 ms + 0.33 ms a token where the idle profile gives ~10 ms + 0.04 ms, the two
  prefill engines on one core taking the trace's bursts together.

Measured in 2026-12-07's runs (router records, ``kvloop bench load --configs kvloop --loads 4``): the prefill engine,
mostly idle, computed its turns 2.2-2.6x slower than the idle-machine profile, the busy decode engine's ITL only
1.1x: background work goes where the engines leave room, and then shares those cores' time.

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
    engine_process_cores: float = 0.0
    """Each engine's API server and EngineCore processes beside its worker, in cores: constant in time, not per
    request (EngineCore polls its queues; measured 0.07-0.09 of a core per engine whatever the load)."""
    turn_cpu_s: float = 0.0
    """CPU seconds per routed turn of the router, the sidecars and the broker together."""
    window_s: float = 10.0
    """How far back the averaged demand and busy fractions look."""
    max_share: float = 0.6
    """The largest share of a core background work takes from an engine's step (more than half: several background
    processes can be runnable beside one engine worker)."""
    source: str = ""
    """Where the figures came from (``measured here: ...``), reported with every prediction."""

    def __post_init__(self) -> None:
        if self.cores < 0:
            raise ConfigError(f"host.cores: 0 (engines on their own hardware) or more (got {self.cores})",
                              field="cores")
        for name in ("client_cores", "engine_process_cores", "turn_cpu_s"):
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

    def __init__(self, spec: HostSpec, engine_cores: Mapping[str, tuple[int, ...]]) -> None:
        """``engine_cores``: the cores each engine computes on (indexes below ``spec.cores``)."""
        bad = sorted(e for e, cores in engine_cores.items()
                     if spec.shared and (not cores or any(not 0 <= c < spec.cores for c in cores)))
        if bad:
            raise ConfigError(f"host.cores: engines {bad} are bound to no core or to one the host lacks "
                              f"({spec.cores} cores)", field="cores")
        self.spec = spec
        self.engine_cores = {e: tuple(cores) for e, cores in engine_cores.items()}
        bound = self.engine_cores
        self._neighbours = {e: tuple(o for o, theirs in bound.items() if o != e and set(cores) & set(theirs))
                            for e, cores in bound.items()}
        """The engines that share a core with each engine."""
        self._busy_until = dict.fromkeys(engine_cores, 0.0)
        """When each engine's step under way ends (its wall time as this host gave it)."""
        self._rate = 0.0
        """Averaged background CPU per second beyond the client's constant share."""
        self._demand = dict.fromkeys(engine_cores, 0.0)
        """Each engine's averaged CPU demand (its steps' idle-host time per second)."""
        self._clock = 0.0

    def charge(self, now: float, cpu_s: float) -> None:
        """Background work of ``cpu_s`` CPU seconds done around ``now`` (a turn routed)."""
        self._decay(now)
        self._rate += cpu_s / self.spec.window_s

    def step(self, engine_id: str, now: float, seconds: float) -> float:
        """The wall time of a step of ``seconds`` (its time on an idle host) that ``engine_id`` starts at ``now``;
        the step counts towards the engine's demand."""
        if not self.spec.shared:
            return seconds
        self._decay(now)
        self._demand[engine_id] += seconds / self.spec.window_s
        overlap = sum(max(0.0, self._busy_until[o] - now) for o in self._neighbours[engine_id])
        wall = (seconds + min(seconds, overlap)) / (1.0 - self.background_share(engine_id))
        self._busy_until[engine_id] = now + wall
        return wall

    def background_share(self, engine_id: str) -> float:
        """The share of ``engine_id``'s cores that background work takes now (the mean over its cores)."""
        per_core = self.core_shares()
        cores = self.engine_cores[engine_id]
        return sum(per_core[c] for c in cores) / len(cores)

    def core_shares(self) -> list[float]:
        """Each core's background share: the demand spread over the cores by the room the engines leave on each,
        capped at ``max_share``."""
        spec = self.spec
        room = [1.0] * spec.cores
        for engine, cores in self.engine_cores.items():
            for c in cores:
                room[c] -= self._demand[engine] / len(cores)
        room = [max(0.0, r) for r in room]
        total = sum(room)
        demand = self.demand()
        shares = [demand * r / total for r in room] if total > 0 else [demand / spec.cores] * spec.cores
        return [min(spec.max_share, share) for share in shares]

    def demand(self) -> float:
        """Background demand in cores, averaged."""
        spec = self.spec
        return spec.client_cores + spec.engine_process_cores * len(self.engine_cores) + self._rate

    def _decay(self, now: float) -> None:
        dt = now - self._clock
        if dt <= 0:
            return
        keep = math.exp(-dt / self.spec.window_s)
        self._rate *= keep
        for engine in self._demand:
            self._demand[engine] *= keep
        self._clock = now
