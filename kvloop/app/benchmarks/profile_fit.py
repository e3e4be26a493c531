"""The fit behind ``kvloop bench profile``: measured samples in, an :class:`~kvloop.shared.engine_model.EngineProfile`
and its residuals out. Pure: no clock, no I/O.

The unknowns are the profile's step-time coefficients and the API server's cost per request, fitted jointly by
non-negative least squares on relative residuals (each row divided by its measured time, so a 10 ms decode step
weighs as much as a 1 s prefill):

- a prefill sample (one request alone, ``max_tokens=1``) lasts ``api_request_s`` plus the steps of its chunks, cut
  by the step budget as :class:`~kvloop.shared.engine_model.EngineSim` cuts them (:func:`prefill_chunks`);
- a decode sample (``S`` streams decoding in lockstep) is one step: ``step_base_s + decode_stream_s * S +
  decode_context_s * C``, ``C`` the streams' total context.

Prefill rows alone cannot tell the per-step base from the per-request cost (a short prompt is one step and one
request); the decode rows, which are steps without requests, can. A pull lasts ``pull_latency_s + bytes /
pull_bytes_per_s``; :func:`fit_pull` fits those two from measured pulls the same way.
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from kvloop.shared.engine_model import EngineProfile
from kvloop.shared.errors import KvloopError

COLUMNS = ("step_base_s", "prefill_token_s", "attention_token_s", "decode_stream_s", "decode_context_s",
           "api_request_s")
"""The fitted unknowns, in the order of a design row."""
MIN_PREFILL_LENGTHS = 3
"""Distinct prompt lengths the prefill fit needs: a per-token and an attention term besides the fixed costs."""
RANK_TOLERANCE = 1e-9
"""A column whose part independent of the others is below this share of its norm counts as dependent on them."""


class FitError(KvloopError):
    """The samples cannot determine the profile (too few distinct shapes, or a coefficient fitted to zero that
    cannot be zero)."""


@dataclass(frozen=True, slots=True)
class PrefillSample:
    prompt_tokens: int
    latency_s: float
    """Request sent to reply read, at the client: one request alone, no prefix-cache hit, ``max_tokens=1``."""


@dataclass(frozen=True, slots=True)
class DecodeSample:
    streams: int
    prompt_tokens: int
    """Each stream's prompt."""
    context_tokens: float
    """The streams' total context (prompts plus tokens generated) in the middle of the measured window."""
    step_s: float
    """The window's time over the tokens each stream got in it: one decode step."""
    tokens: int
    """Tokens (steps) per stream in the window."""


@dataclass(frozen=True, slots=True)
class PullSample:
    nbytes: int
    seconds: float


@dataclass(frozen=True, slots=True)
class EngineFacts:
    """The figures an engine states rather than shows: its scheduler's settings and its KV pool, with their
    sources."""

    max_num_batched_tokens: int
    max_num_seqs: int
    block_size: int
    kv_pool_blocks: int
    bytes_per_block: int
    scheduler_source: str
    pool_source: str


@dataclass(frozen=True, slots=True)
class GivenFigures:
    """Figures this fit does not make, each group with its source."""

    pull_latency_s: float
    pull_bytes_per_s: float
    pull_source: str
    router_turn_s: float
    router_source: str


@dataclass(frozen=True, slots=True)
class GroupFit:
    """How well the fitted figures reproduce one group's samples."""

    n: int
    r2: float | None
    """None where the samples do not vary (fewer than two, or all equal)."""
    max_rel_error: float


@dataclass(frozen=True)
class ProfileFit:
    profile: EngineProfile
    errors: dict[str, GroupFit] = field(default_factory=dict)
    """Per sample group (``prefill``, ``decode``, and ``pull`` when fitted here)."""

    def errors_json(self) -> dict[str, Any]:
        return {group: asdict(fit) for group, fit in self.errors.items()}


# ---------------------------------------------------------------------------------------------- design rows
def prefill_chunks(prompt_tokens: int, step_tokens: int) -> list[tuple[int, int]]:
    """(tokens before the chunk, chunk tokens) of one request prefilled alone: EngineSim's rule, each step takes
    what is left of the prompt up to the step budget."""
    chunks, done = [], 0
    while done < prompt_tokens:
        n = min(prompt_tokens - done, step_tokens)
        chunks.append((done, n))
        done += n
    return chunks


def prefill_row(prompt_tokens: int, step_tokens: int) -> tuple[float, ...]:
    """The design row of a lone request's latency (see :data:`COLUMNS`)."""
    chunks = prefill_chunks(prompt_tokens, step_tokens)
    pairs = sum(n * (done + n / 2) for done, n in chunks)  # as EngineSim: each token attends to its mean position
    return (float(len(chunks)), float(prompt_tokens), pairs / 1000.0, 0.0, 0.0, 1.0)


def decode_row(streams: int, context_tokens: float) -> tuple[float, ...]:
    """The design row of one decode step of ``streams`` streams with ``context_tokens`` in all."""
    return (1.0, 0.0, 0.0, float(streams), float(context_tokens), 0.0)


def decode_sample(prompt_tokens: int, arrivals: Sequence[Sequence[tuple[float, int]]], skip_chunks: int = 2
                  ) -> DecodeSample | None:
    """One decode sample from concurrent streams started together: ``arrivals`` per stream, (time, tokens received
    so far) per streamed chunk. Only the window where every stream decodes counts: from the last stream's first
    token (plus ``skip_chunks`` chunks, the hand-over from prefill) to the first stream's end. None when a stream
    has fewer than two steps in it."""
    if not arrivals or any(len(a) <= skip_chunks + 2 for a in arrivals):
        return None
    start = max(a[skip_chunks][0] for a in arrivals)
    end = min(a[-1][0] for a in arrivals)
    step_times, steps, mid_tokens = [], [], []
    for stream in arrivals:
        inside = [(t, k) for t, k in stream if start <= t <= end]
        if len(inside) < 2 or inside[-1][1] - inside[0][1] < 2:
            return None
        (t0, k0), (t1, k1) = inside[0], inside[-1]
        # Time over tokens, not the median gap: a chunk that carries two tokens (the API server fell behind) then
        # counts as the two steps it was.
        step_times.append((t1 - t0) / (k1 - k0))
        steps.append(k1 - k0)
        # The steps of tokens k0+1..k1 attend to the prompt and k0..k1-1 tokens: on average this many.
        mid_tokens.append((k0 + k1 - 1) / 2)
    return DecodeSample(streams=len(arrivals), prompt_tokens=prompt_tokens,
                        context_tokens=sum(prompt_tokens + k for k in mid_tokens),
                        step_s=statistics.fmean(step_times), tokens=min(steps))


# ---------------------------------------------------------------------------------------------- least squares
def _dot(a: Sequence[float], b: Sequence[float]) -> float:
    return math.fsum(x * y for x, y in zip(a, b, strict=True))


def least_squares(rows: Sequence[Sequence[float]], y: Sequence[float]) -> list[float] | None:
    """``x`` minimising ``|rows x - y|`` (modified Gram-Schmidt on columns scaled to 1); None when the columns
    are not independent."""
    n = len(rows[0])
    scale = [max(abs(r[j]) for r in rows) or 1.0 for j in range(n)]
    q = [[r[j] / scale[j] for r in rows] for j in range(n)]
    r_ = [[0.0] * n for _ in range(n)]
    for j in range(n):
        norm0 = math.sqrt(_dot(q[j], q[j]))
        for i in range(j):
            r_[i][j] = _dot(q[i], q[j])
            q[j] = [a - r_[i][j] * b for a, b in zip(q[j], q[i], strict=True)]
        norm = math.sqrt(_dot(q[j], q[j]))
        if norm0 == 0 or norm <= RANK_TOLERANCE * norm0:
            return None
        r_[j][j] = norm
        q[j] = [a / norm for a in q[j]]
    qty = [_dot(q[j], y) for j in range(n)]
    x = [0.0] * n
    for j in range(n - 1, -1, -1):
        x[j] = (qty[j] - sum(r_[j][k] * x[k] for k in range(j + 1, n))) / r_[j][j]
    return [x[j] / scale[j] for j in range(n)]


def nonnegative_least_squares(rows: Sequence[Sequence[float]], y: Sequence[float]) -> list[float]:
    """The least-squares ``x >= 0``, by trying every set of free columns (few columns: exact and simple);
    ``FitError`` when the columns are not independent."""
    n = len(rows[0])
    if least_squares(rows, y) is None:
        raise FitError("the samples cannot tell the fitted figures apart (their design matrix is rank deficient)")
    best: tuple[float, list[float]] | None = None
    for k in range(n, 0, -1):
        for free in itertools.combinations(range(n), k):
            sub = least_squares([[r[j] for j in free] for r in rows], y)
            if sub is None or min(sub) < 0:
                continue
            x = [0.0] * n
            for j, v in zip(free, sub, strict=True):
                x[j] = v
            cost = math.fsum((_dot(r, x) - t) ** 2 for r, t in zip(rows, y, strict=True))
            if best is None or cost < best[0]:
                best = (cost, x)
    if best is None:
        raise FitError("no non-negative figures fit the samples")
    return best[1]


def group_fit(measured: Sequence[float], predicted: Sequence[float]) -> GroupFit:
    mean = statistics.fmean(measured)
    total = math.fsum((m - mean) ** 2 for m in measured)
    residual = math.fsum((m - p) ** 2 for m, p in zip(measured, predicted, strict=True))
    r2 = 1 - residual / total if len(measured) > 1 and total > 0 else None
    worst = max(abs(p - m) / m for m, p in zip(measured, predicted, strict=True))
    return GroupFit(n=len(measured), r2=None if r2 is None else round(r2, 6), max_rel_error=round(worst, 6))


# ---------------------------------------------------------------------------------------------- the fits
def check_shapes(prefill: Sequence[PrefillSample], decode: Sequence[DecodeSample]) -> None:
    """Refuse sample sets that cannot determine the profile, saying what they lack."""
    lengths = sorted({s.prompt_tokens for s in prefill})
    if len(lengths) < MIN_PREFILL_LENGTHS:
        raise FitError(f"the prefill fit needs prompts of at least {MIN_PREFILL_LENGTHS} different lengths "
                       f"(got {len(lengths)}: {lengths})")
    streams = sorted({s.streams for s in decode})
    contexts = sorted({s.prompt_tokens for s in decode})
    if len(streams) < 2 or len(contexts) < 2:
        raise FitError("the decode fit needs runs at 2 or more stream counts and 2 or more contexts "
                       f"(got streams {streams}, contexts {contexts})")
    if any(s.latency_s <= 0 for s in prefill) or any(s.step_s <= 0 for s in decode):
        raise FitError("every sample needs a positive time")


def fit_profile(prefill: Sequence[PrefillSample], decode: Sequence[DecodeSample], facts: EngineFacts,
                given: GivenFigures, *, name: str, measured: str) -> ProfileFit:
    """The profile whose prefill, decode and API figures best fit the samples (relative least squares, figures
    >= 0), the rest from ``facts`` and ``given``; ``measured``: the source of the fitted groups ("measured here:
    ..."). ``FitError`` when the samples cannot determine them."""
    check_shapes(prefill, decode)
    rows = [prefill_row(s.prompt_tokens, facts.max_num_batched_tokens) for s in prefill]
    rows += [decode_row(s.streams, s.context_tokens) for s in decode]
    times = [s.latency_s for s in prefill] + [s.step_s for s in decode]
    weighted = [[v / t for v in row] for row, t in zip(rows, times, strict=True)]
    x = nonnegative_least_squares(weighted, [1.0] * len(times))
    figures = dict(zip(COLUMNS, x, strict=True))
    if figures["prefill_token_s"] <= 0:
        raise FitError("prefill_token_s fitted to 0: the prompts' lengths do not change their latency; use longer "
                       "prompts or more repeats")
    predicted = [_dot(row, x) for row in rows]
    n = len(prefill)
    errors = {"prefill": group_fit(times[:n], predicted[:n]), "decode": group_fit(times[n:], predicted[n:])}
    how = (f"{measured}; fitted jointly by non-negative least squares on relative residuals, {n} prefill "
           f"requests and {len(decode)} decode runs")
    profile = EngineProfile(
        name=name, **figures, max_num_batched_tokens=facts.max_num_batched_tokens, max_num_seqs=facts.max_num_seqs,
        block_size=facts.block_size, kv_pool_blocks=facts.kv_pool_blocks, bytes_per_block=facts.bytes_per_block,
        pull_latency_s=given.pull_latency_s, pull_bytes_per_s=given.pull_bytes_per_s, router_turn_s=given.router_turn_s,
        source={"prefill": how, "decode": how, "api": f"{how} (the per-request term)",
                "scheduler": facts.scheduler_source, "pool": facts.pool_source, "pull": given.pull_source,
                "router": given.router_source})
    return ProfileFit(profile, errors)


def fit_pull(samples: Sequence[PullSample]) -> tuple[float, float, GroupFit]:
    """(latency s, bytes per s, residuals) of ``seconds = latency + bytes / rate`` over measured pulls."""
    sizes = sorted({s.nbytes for s in samples})
    if len(sizes) < 2 or any(s.seconds <= 0 for s in samples):
        raise FitError(f"the pull fit needs pulls of at least 2 sizes, each with a positive time (got sizes {sizes})")
    rows = [(1.0, float(s.nbytes)) for s in samples]
    times = [s.seconds for s in samples]
    latency, per_byte = nonnegative_least_squares([[v / t for v in r] for r, t in zip(rows, times, strict=True)],
                                                  [1.0] * len(times))
    if per_byte <= 0:
        raise FitError("pull time does not grow with bytes in these samples: no bandwidth to fit")
    return latency, 1.0 / per_byte, group_fit(times, [latency + per_byte * s.nbytes for s in samples])


def figures_table(fit: ProfileFit) -> list[tuple[str, str, str, str]]:
    """(figure, value, fit error, n) per figure: fitted ones with their group's R² and worst relative error."""
    from kvloop.shared.engine_model import FIGURE_GROUPS

    group_of_sample = {"prefill": "prefill", "decode": "decode", "api": "prefill", "pull": "pull"}
    out = []
    for group, names in FIGURE_GROUPS.items():
        err = fit.errors.get(group_of_sample.get(group, ""))
        for figure in names:
            value = getattr(fit.profile, figure)
            shown = f"{value:.4g}" if isinstance(value, float) else str(value)
            error = (f"R² {err.r2 if err.r2 is not None else '-'}, max {err.max_rel_error:.1%}"
                     if err is not None else "-")
            out.append((figure, shown, error, str(err.n) if err is not None else "-"))
    return out


def samples_json(prefill: Sequence[PrefillSample], decode: Sequence[DecodeSample],
                 extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    return {"prefill": [asdict(s) for s in prefill], "decode": [asdict(s) for s in decode], **(extra or {})}
