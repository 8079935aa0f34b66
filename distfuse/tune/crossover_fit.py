"""Where fused beats unfused, from measured points: the crossover maths (:func:`crossover`, pure) and the table
entry the tuner writes (:func:`entry_for`; ``bench plot`` shades the interval).

Each entry also quotes its gains (:func:`gain_fields`), which dispatch shows in ``Decision.entry``
(``layer.explain(x)``).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from distfuse.fused import registry
from distfuse.fused.crossover_table import NEVER

__all__ = ["Crossover", "crossover", "entry_for", "provider_fields", "provider_choice", "gain_fields", "decisive",
           "interval_text"]


@dataclass(frozen=True)
class Crossover:
    """Where fused beats unfused, from measured points.

    ``min_size``/``max_size`` are None where the interval is open (fused already wins at
    the smallest / still wins at the largest size measured; the table then extends it).
    """

    min_size: float | None
    max_size: float | None
    fused: str  # "interval", "always" or "never"
    wins: tuple[float, ...] = ()  # sizes where fused won (by more than the margin)
    excluded_wins: tuple[float, ...] = ()  # wins outside the chosen interval (isolated: treated as noise)

    def fused_at(self, size: float) -> bool:
        return self.fused != "never" and registry.in_interval(size, self.min_size, self.max_size)

    def entry(self) -> dict:
        """The table entry dispatch reads (``min_size``/``max_size``) plus what it rests on."""
        out: dict = {"fused": self.fused}
        if self.fused == "never":
            out["max_size"] = NEVER
            return out
        if self.min_size is not None:
            out["min_size"] = self.min_size
        if self.max_size is not None:
            out["max_size"] = self.max_size
        if self.excluded_wins:
            out["excluded_wins"] = list(self.excluded_wins)
        return out


def _crossing(s0: float, g0: float, s1: float, g1: float) -> float:
    """Size where the gain crosses zero between (s0, g0) and (s1, g1) (opposite signs or a zero), log-interpolated."""
    if g0 == g1:
        return s0
    t = g0 / (g0 - g1)
    if s0 > 0 and s1 > 0:
        return float(math.exp(math.log(s0) + t * (math.log(s1) - math.log(s0))))
    return float(s0 + t * (s1 - s0))


def crossover(points: Iterable[tuple[float, float | None, float]], margin: float = 0.0) -> Crossover:
    """The size interval where fused wins, from ``(size, fused_ms, unfused_ms)`` points.

    The gain at a point is ``log(unfused_ms / (fused_ms * (1 + margin)))``: positive when
    fused is faster by more than ``margin``.  Points of equal size are averaged (in the
    log).  The interval is the contiguous run of sizes with the largest total gain (a
    maximum-subarray), so one noisy loss inside a winning region does not split it, and
    an isolated noisy win outside it is reported in ``excluded_wins`` instead of
    becoming a second interval (dispatch reads one).  Its bounds are where the gain
    crosses zero between the last losing and first winning sizes, interpolated in
    log-size (sizes span decades); an interval reaching the smallest or the largest
    size measured is left open on that side.  Points without a fused time are ignored.
    """
    by_size: dict[float, list[float]] = {}
    for size, fused_ms, unfused_ms in points:
        if fused_ms is None or unfused_ms is None or not (fused_ms > 0 and unfused_ms > 0):
            continue
        by_size.setdefault(float(size), []).append(math.log(unfused_ms / (fused_ms * (1.0 + margin))))
    if not by_size:
        raise ValueError("crossover: no point has both a fused and an unfused time")
    sizes = sorted(by_size)
    gains = [sum(by_size[s]) / len(by_size[s]) for s in sizes]
    wins = tuple(s for s, g in zip(sizes, gains, strict=True) if g > 0)
    # Kadane: the run [lo, hi] with the largest sum of gains (strictly positive, else "never").
    best, best_lo, best_hi = 0.0, -1, -1
    run, run_lo = 0.0, 0
    for i, g in enumerate(gains):
        if run <= 0:
            run, run_lo = g, i
        else:
            run += g
        if run > best:
            best, best_lo, best_hi = run, run_lo, i
    if best_lo < 0:
        return Crossover(None, None, "never", wins, wins)
    # The run starts and ends on a win: it restarts wherever its sum is <= 0, and grows past ``best`` only on one.
    lo = None if best_lo == 0 else _crossing(sizes[best_lo - 1], gains[best_lo - 1], sizes[best_lo], gains[best_lo])
    hi = None if best_hi == len(sizes) - 1 else _crossing(sizes[best_hi], gains[best_hi], sizes[best_hi + 1],
                                                          gains[best_hi + 1])
    excluded = tuple(s for s in wins if not sizes[best_lo] <= s <= sizes[best_hi])
    kind = "always" if lo is None and hi is None else "interval"
    return Crossover(lo, hi, kind, wins, excluded)


def provider_fields(points: Sequence[dict]) -> dict:
    """:func:`provider_choice` of points whose ``provider_ms`` maps names to times (a size measured more than once:
    its times averaged in the log); empty where no point timed more than one provider.
    :func:`distfuse.fused.providers.select_provider` reads them."""
    by_size: dict[float, dict[str, list[float]]] = {}
    for p in points:
        times = p.get("provider_ms") or {}
        for name, ms in times.items():
            if ms is not None and ms > 0:
                by_size.setdefault(float(p["size"]), {}).setdefault(name, []).append(math.log(ms))
    if not any(len(v) > 1 for v in by_size.values()):
        return {}
    sizes = []
    for size in sorted(by_size):
        mean = {name: sum(v) / len(v) for name, v in by_size[size].items()}
        sizes.append([size, min(mean, key=mean.get)])
    return provider_choice(sizes)


def provider_choice(sizes: list) -> dict:
    """``provider`` (the name fastest at most sizes; ties: the first in size order) and ``provider_sizes``
    (``sizes``, ``[[size, fastest provider], ...]``) of a table entry."""
    counts = Counter(name for _, name in sizes)
    return dict(provider=max(counts, key=counts.get), provider_sizes=sizes)


def interval_text(entry: dict, digits: int) -> str:
    """``"<size_key> in [lo, hi]"`` of a fusing entry (``-inf``/``inf`` where it is open)."""
    lo, hi = entry.get("min_size"), entry.get("max_size")
    return (f"{entry['size_key']} in [{'-inf' if lo is None else f'{lo:.{digits}g}'}, "
            f"{'inf' if hi is None else f'{hi:.{digits}g}'}]")


def decisive(gains: Sequence[Sequence[float]], fused: str, min_size: float | None,
             max_size: float | None) -> tuple[float, float] | None:
    """``(gain, margin)`` an entry quotes from its ``[[size, gain, margin], ...]``: the smallest gain inside the
    fused interval, or the best gain of a "never" entry (how far it is from winning)."""
    if not gains:
        return None
    if fused == "never":
        return tuple(max(gains, key=lambda x: x[1])[1:])
    inside = [x for x in gains if registry.in_interval(x[0], min_size, max_size)] or list(gains)
    return tuple(min(inside, key=lambda x: x[1])[1:])


def gain_fields(points: Sequence[dict], fused: str, min_size: float | None, max_size: float | None) -> dict:
    """``gains`` (``[[size, gain, margin], ...]``, one per size: its worst point) and the decisive ``gain`` and
    ``margin`` (:func:`decisive`), from points with ``fused_ms``/``unfused_ms`` and optionally
    ``fused_q80``/``unfused_q20``: ``gain = unfused / fused - 1``, and ``margin`` what the timings' spread takes
    off it (the fused time at its 80th percentile against the unfused at its 20th)."""
    by_size: dict[float, tuple[float, float]] = {}
    for p in points:
        f, u = p.get("fused_ms"), p.get("unfused_ms")
        if f is None or u is None or not (f > 0 and u > 0):
            continue
        g = u / f - 1
        pess = (p.get("unfused_q20") or u) / (p.get("fused_q80") or f) - 1
        size = float(p["size"])
        if size not in by_size or g < by_size[size][0]:
            by_size[size] = (g, max(g - pess, 0.0))
    gains = [[s, round(g, 4), round(m, 4)] for s, (g, m) in sorted(by_size.items())]
    d = decisive(gains, fused, min_size, max_size)
    return {} if d is None else dict(gain=d[0], margin=d[1], gains=gains)


def entry_for(op: str, points: Sequence[dict], margin: float = 0.0, **info) -> dict:
    """Table entry for measured sweep points (dicts with ``size``, ``fused_ms``, ``unfused_ms``; optionally
    ``provider_ms``, the fused time of each provider, whose fastest is ``fused_ms``, and ``fused_q80`` /
    ``unfused_q20``, the timings' spread).  ``"source": "measured"``; the tuner's ``margin`` (fused must win
    by this fraction) is ``win_margin``; ``margin`` is the gain's (:func:`gain_fields`)."""
    xo = crossover([(p["size"], p.get("fused_ms"), p["unfused_ms"]) for p in points], margin)
    entry = xo.entry()
    entry.update(size_key=registry.get(op).size_key, source="measured", win_margin=margin,
                 points=[[p["size"], p.get("fused_ms"), p["unfused_ms"]] for p in points], **info)
    entry.update(gain_fields(points, xo.fused, xo.min_size, xo.max_size))
    entry.update(provider_fields(points))
    return entry
