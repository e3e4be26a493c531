"""The analysis as Markdown (printed and written) and PNG plots."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvloop.app.analyze.analysis import Analysis
from kvloop.app.analyze.costs import ModelCheck
from kvloop.app.analyze.stats import quantile, spread
from kvloop.app.analyze.verdict import ENOUGH_HITS
from kvloop.router.records import TurnRecord


def _row(cells: Sequence[object]) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def _mb(n: float) -> str:
    return f"{n / 2**20:.2f} MiB"


def hints_said(records: Sequence[TurnRecord]) -> str:
    """What the turns' clients said of their sessions (docs/sessions.md), as a sentence; "" when none said anything.
    The replay below does not act on them: it prices the broker's eviction without hints."""
    said = [r.hints for r in records if r.hints]
    if not said:
        return ""
    pauses = [float(h["pause_s"]) for h in said if "pause_s" in h]
    parts = [f"{len(pauses)} paused (median {quantile(pauses, 0.5):.0f} s, max {max(pauses):.0f} s)"] if pauses else []
    parts += [f"{n} {what}" for what, n in (
        ("ended", sum(1 for h in said if h.get("end"))),
        ("said low priority", sum(1 for h in said if h.get("priority") == "low")),
        ("said high priority", sum(1 for h in said if h.get("priority") == "high")),
        ("said their answer will not be repeated", sum(1 for h in said if h.get("keep_generated") is False)))
        if n]
    prefetched = [r.prefetch for r in records if r.prefetch]
    used = (f" {len(prefetched)} turns followed a prefetch of their session's blocks, "
            f"{sum(p == 'used' for p in prefetched)} used it.") if prefetched else ""
    return (f" Session hints: {len(said)} turns said something ({', '.join(parts) or 'normal priority only'}); the "
            f"replay below does not act on them.{used}")


def markdown(a: Analysis, source: str, plots: list[str]) -> str:
    lengths = [len(t) for t in a.sessions.values()]
    m = a.model
    out = [f"# kvloop analyze: {source}", "", "## Verdict", "", a.verdict.text, "",
           "## Workload", "",
           f"{len(a.records)} turns in {len(a.sessions)} sessions over {a.span_s:.1f} s ({a.rate:.2f} turns/s); "
           f"block size {a.block_size} tokens. Session length (turns): p50 {quantile(lengths, 0.5):.0f}, "
           f"p90 {quantile(lengths, 0.9):.0f}, max {max(lengths, default=0)}. Gap between a turn's end and its "
           f"session's next turn (s): p50 {quantile(a.gaps, 0.5):.2f}, p90 {quantile(a.gaps, 0.9):.2f}, "
           f"max {max(a.gaps, default=0.0):.2f}. Prompt tokens reusable from earlier turns (nothing evicted): "
           f"{a.reuse_share:.1%}.{hints_said(a.records)}", "",
           "### Prefix share by turn", "",
           "The share of each turn's prompt (whole blocks, from its start) that repeats the previous turn's prompt; "
           "a lower bound: the previous answer's blocks have no keys in the records.", "",
           _row(["turn", "turns", "p10", "median", "p90"]), _row(["---:"] * 5)]
    out += [_row([p.index + 1, p.turns, f"{p.p10:.2f}", f"{p.p50:.2f}", f"{p.p90:.2f}"]) for p in a.curve]
    out += ["", "## Retention", "",
            f"The records replayed through the broker's core ({a.fleet.decode_engines} decode and "
            f"{a.fleet.prefill_engines} prefill engines, `{a.fleet.eviction_policy}` eviction). A turn finds its "
            "prefix when a lease still holds all the blocks an unbounded cache would hold for it "
            f"({a.ideal_hits.turns_needing} of {len(a.records)} turns need one; the ideal replay peaks at "
            f"{a.ideal_hits.peak_blocks} blocks held).", "",
            _row(["budget blocks/engine", "TTL s", "turns finding their prefix", "tokens found", "peak blocks held"]),
            _row(["---:"] * 5)]
    out += [_row([h.setting.budget_blocks, f"{h.setting.ttl_s:g}", f"{h.turn_share:.1%}", f"{h.token_share:.1%}",
                  h.peak_blocks]) for h in a.grid]
    s = a.chosen.setting
    evictions = ", ".join(f"{k} {v}" for k, v in sorted(a.chosen.evictions.items())) or "none"
    link = a.interconnect
    out += ["", f"Predictions below use TTL {s.ttl_s:g} s and {s.budget_blocks} blocks per decode engine "
            f"(the cheapest setting finding {ENOUGH_HITS:.0%} of the prefixes, else the most generous in the grid); "
            f"its evictions: {evictions}.", "",
            "## Interconnect", "",
            "Under strict P/D every reused block crosses from the decode engine to a prefill engine: "
            f"{link.turns_pulling} turns would pull, {_mb(link.bytes_per_turn['p50'])} per turn at p50 "
            f"({_mb(link.bytes_per_turn['p95'])} p95, {_mb(link.bytes_per_turn['p99'])} p99), {_mb(link.total_bytes)} "
            f"in all: {link.needed_bytes_per_s / 1e6:.2f} MB/s at the observed turn rate against "
            f"{link.bandwidth_bytes_per_s / 1e9:.2f} GB/s ({link.utilisation:.2%}). One pull takes "
            f"{link.pull_ms['p50']:.1f} ms at p50, {link.pull_ms['p99']:.1f} ms at p99.", "",
            "## Predicted TTFT", "",
            _row(["", "path", "turns", "p50 ms", "p95 ms", "p99 ms"]), _row(["---"] * 2 + ["---:"] * 4)]
    for label, table in (("with the return path", a.with_return), ("one-way P/D", a.without_return)):
        out += [_row([label, path, int(f["turns"]), f"{f['p50']:.1f}", f"{f['p95']:.1f}", f"{f['p99']:.1f}"])
                for path, f in table.items()]
    out += ["", "Assumptions (the broker's cost model; `kvloop analyze --help` sets each):", ""]
    figures = {"prefill_tokens_per_s": f"{m.prefill_tokens_per_s:.0f} tokens/s", "hop_s": f"{m.hop_s * 1e3:.1f} ms",
               "decode_tokens_per_s": f"{m.decode_tokens_per_s:.0f} tokens/s",
               "decode_local_s": f"{m.decode_local_s * 1e3:.1f} ms",
               "bandwidth_bytes_per_s": f"{m.bandwidth_bytes_per_s / 1e9:.3f} GB/s",
               "bytes_per_block": f"{m.bytes_per_block} B", "pull_overhead_s": f"{m.pull_overhead_s * 1e3:.1f} ms"}
    out += [f"- `{name}`: {value} ({m.sources.get(name, 'default')})" for name, value in figures.items()]
    out += ["- one-way P/D recomputes every prompt (no prefill-side prefix cache: an upper bound); with the return "
            "path each turn takes the broker's plan in the replay, without the engines' own prefix caches."]
    if a.check is not None:
        out += ["", "### The model against these records", "",
                "Each measured turn priced by the path and tokens it took; percentiles nearest-rank over n turns "
                "(a p99 over fewer than 100 turns is the largest but one or the largest).", "",
                _row(["model", "n", "predicted p50/p95/p99 ms", "measured p50/p95/p99 ms", "largest gap"]),
                _row(["---", "---:", "---:", "---:", "---:"]), _check_row("fitted on all turns", a.check)]
        if a.holdout is not None:
            out.append(_check_row("fitted on every other session, priced on the rest", a.holdout))
        measured = [r.ttft_ms for r in a.records if r.ttft_ms is not None and not r.error]
        w = a.with_return.get("all")
        if w and measured:
            seen = spread(measured)
            out += ["", f"The replay's own prediction (each turn on the path the broker's core planned, without the "
                    f"engines' prefix caches), against measured {seen['p50']:.1f}/{seen['p95']:.1f}/"
                    f"{seen['p99']:.1f} ms (p50/p95/p99): at the starting setting {w['p50']:.1f}/{w['p95']:.1f}/"
                    f"{w['p99']:.1f} ms"]
            if a.generous is not None:
                (g_setting, g) = a.generous
                out[-1] += (f"; at the grid's most generous setting (TTL {g_setting.ttl_s:g} s, "
                            f"{g_setting.budget_blocks} blocks per engine) {g['p50']:.1f}/{g['p95']:.1f}/"
                            f"{g['p99']:.1f} ms")
            out[-1] += "."
    if plots:
        out += ["", "## Plots", ""] + [f"![{Path(p).stem}]({Path(p).name})" for p in plots]
    return "\n".join(out) + "\n"


def _check_row(label: str, c: ModelCheck) -> str:
    p, m = c.predicted, c.measured
    return _row([label, c.turns, f"{p['p50']:.1f} / {p['p95']:.1f} / {p['p99']:.1f}",
                 f"{m['p50']:.1f} / {m['p95']:.1f} / {m['p99']:.1f}", f"{c.worst_gap():.0%}"])


def plot(a: Analysis, out_dir: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    fig, ax = plt.subplots(figsize=(7, 4))
    xs = [p.index + 1 for p in a.curve]
    ax.plot(xs, [p.p50 for p in a.curve], marker="o", label="median")
    ax.fill_between(xs, [p.p10 for p in a.curve], [p.p90 for p in a.curve], alpha=0.3, label="p10..p90")
    ax.set(xlabel="turn", ylabel="share of prompt repeating the previous turn", ylim=(0, 1.05),
           title="Prefix share by turn")
    ax.legend()
    paths.append(_save(fig, out_dir / "prefix_share.png"))

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.hist([len(t) for t in a.sessions.values()], bins=20)
    left.set(xlabel="turns per session", ylabel="sessions", title="Session lengths")
    right.hist(a.gaps or [0.0], bins=30)
    right.set(xlabel="seconds from a turn's end to the next turn", ylabel="turns", title="Inter-turn gaps")
    paths.append(_save(fig, out_dir / "sessions.png"))

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for budget in sorted({h.setting.budget_blocks for h in a.grid}):
        row = [h for h in a.grid if h.setting.budget_blocks == budget]
        left.plot([h.setting.ttl_s for h in row], [h.turn_share for h in row], marker="o", label=f"{budget} blocks")
    left.set(xscale="log", xlabel="retention TTL (s)", ylabel="turns finding their prefix", ylim=(0, 1.05),
             title="Retention")
    left.legend(title="budget per engine")
    t0 = min((t for t, _ in a.ideal.held), default=0.0)
    for run, label in ((a.ideal, "unbounded"), (a.chosen, f"TTL {a.chosen.setting.ttl_s:g} s, "
                                                          f"{a.chosen.setting.budget_blocks} blocks")):
        right.step([t - t0 for t, _ in run.held], [n for _, n in run.held], where="post", label=label)
    right.set(xlabel="seconds", ylabel="blocks retained (all engines)", title="Blocks held over time")
    right.legend()
    paths.append(_save(fig, out_dir / "retention.png"))
    return paths


def _save(fig: Any, path: Path) -> str:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)
