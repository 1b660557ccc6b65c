"""What a :class:`~graphctl.graphs.runner.GraphRunner` reports about its graphs.

``runner.report()`` returns a :class:`Report`; ``str(report)`` is a table, ``report.to_dict()``
the JSON form documented in ``docs/user-guide.md`` (``schema`` names its version)::

    {"schema": "graphctl.report/2", "function": "...", "backend": "cuda" | "emulated",
     "device": "...", "torch": "...", "fallbacks": {"<reason>": count},
     "eager_streak": 0, "bypassed": false,
     "host_changes": [{"path": "sampler.probs_valid", "before": false, "after": true, "policy": "warn"}],
     "padding_hazards": [{"input": "slots", "op": "aten::index_copy_", "where": "model.py:12",
                          "target": "kv_cache"}],
     "unreached": [{"shape": [4], "dtype": "float32", "device": "cuda:0", "op": "aten::mul",
                    "where": "model.py:20"}],
     "buckets": [{"bucket": 8, "variant": "" | "k=3", "warmup_ms": 40.1, "capture_ms": 12.5,
                  "pool_bytes": 2097152, "nodes": 41, "replay_us": 31.0 | null, "eager_us": 212.0 | null,
                  "replays": 3, "eager_runs": 0,
                  "segments": [{"name": "target", "start": 0, "end": 30}, ...]}],
     "side_effects": [{"path": "cache.layers[0].keys", "op": "aten::index_copy_",
                       "where": "cache_utils.py:487", "nbytes": 32768, "policy": "restore"}],
     "reach": {"objects": 412, "tensors": 150, "host_values": 310, "paths_checked": 66,
               "paths_unchecked": 0, "past_depth": 0, "past_bound": 0}}

``nodes`` and segment bounds count graph nodes (CUDA) or recorded ops (emulated); -1 where
cuda-bindings is missing. ``replay_us``/``eager_us`` are medians from ``runner.measure()``,
null until it ran. ``eager_runs`` counts the calls of a bucket's size that fell back to eager;
``eager_streak`` the calls since the last replay that all ran eagerly, and ``bypassed`` is true
once it reaches ``GRAPHCTL_BYPASS_WINDOW`` (the graphs are captured but serve nothing).
(``/2`` added ``eager_runs``, ``eager_streak``, ``bypassed``, ``host_changes``,
``padding_hazards`` and ``unreached`` to ``/1``; ``compiled``, ``compile``, ``reach`` and a
bucket's ``warmup_ms`` and ``variant`` were added since, as keys only: readers of ``/2`` ignore
them; so were a bucket's ``eager_regions`` (``[{"name", "calls", "mean_us", "capture_us"}]``) and
the report's ``random_state`` (``[{"generator", "op", "where"}]``: draws from default or undeclared
generators).) A
variant runner's report has a row per (variant, bucket), ``variant`` naming its values
(``"k=3"``); ``compile`` then sums dynamo's work per bucket size over the variants.
"""
from __future__ import annotations

import dataclasses
import io
import json
from typing import Any

from graphctl.graphs.findings import REPORTED, grouped

__all__ = ["Segment", "BucketReport", "Report", "SCHEMA"]


SCHEMA = "graphctl.report/2"


@dataclasses.dataclass(frozen=True, slots=True)
class Segment:
    """A named part of one capture, ``[start, end)`` in nodes or recorded ops."""

    name: str
    start: int
    end: int


@dataclasses.dataclass(frozen=True, slots=True)
class BucketReport:
    bucket: int
    capture_ms: float
    pool_bytes: int
    nodes: int
    replay_us: float | None
    eager_us: float | None
    replays: int
    segments: tuple[Segment, ...]
    eager_runs: int = 0
    warmup_ms: float = 0.0  # the bucket's eager warmups, tracked ones included, device work waited for
    variant: str = ""  # a variant runner's row: its variant values ("k=3"); "" for a plain runner
    # eager regions between the graph's pieces (graphs/capture/pieces.py), in order: name, calls, mean_us (host wall
    # time of a call at replay, copies included; None before any), capture_us; () for a whole graph
    eager_regions: tuple[dict[str, Any], ...] = ()

    @property
    def pieces(self) -> int:
        return len(self.eager_regions) + 1


@dataclasses.dataclass(frozen=True, slots=True)
class Report:
    function: str
    backend: str
    device: str
    torch: str
    buckets: tuple[BucketReport, ...]
    fallbacks: dict[str, int]
    # every finding, as records (graphs/findings/): padding hazards, unreached tensors, draws from undeclared
    # generators, host values the warmups changed, side effects (each with the runner's policy): a JSON list a kind
    records: tuple[Any, ...] = ()
    eager_streak: int = 0  # calls since the last replay, all eager
    bypassed: bool = False  # eager_streak reached the bypass window: the graphs serve nothing
    # torch.compile (graphs/capture/compiled.py): the compiled callables the forward reaches, by path, and per
    # bucket dynamo's work: warmup_frames / warmup_graphs (recompiles), breaks, uncompiled (frames
    # dynamo was asked to convert during the capture: they ran uncompiled)
    compiled: tuple[str, ...] = ()
    compile: dict[int, dict[str, int]] = dataclasses.field(default_factory=dict)
    # what the capture's walk of the forward's objects saw and left out (graphs/findings/reach.py): objects,
    # tensors, host_values, paths_checked, paths_unchecked (past the cap), past_depth, past_bound
    reach: dict[str, int] = dataclasses.field(default_factory=dict)
    # seconds the runner spent in each phase so far: capture (warmups and captures), verify, audit, coverage,
    # measure (graphs/face.py's timed; per bucket, warmup_ms and capture_ms are in the rows)
    phases: dict[str, float] = dataclasses.field(default_factory=dict)

    # each kind's records as JSON dicts (graphs/findings/: the JSON key is the kind's)
    side_effects = property(lambda self: grouped(self.records)["side_effects"])
    host_changes = property(lambda self: grouped(self.records)["host_changes"])
    padding_hazards = property(lambda self: grouped(self.records)["padding_hazards"])
    unreached = property(lambda self: grouped(self.records)["unreached"])
    random_state = property(lambda self: grouped(self.records)["random_state"])

    @classmethod
    def merge(cls, function: str, parts: list[tuple[str, Report]], fallbacks: dict[str, int]) -> Report:
        """One report of several units' (``(variant label, report)``, a plain runner's one unlabelled):
        a row per (variant, bucket); every finding of every unit, each listed once (every field
        holding findings, so a finding kind added later is merged too); dynamo's work summed per
        bucket size; the reach counts at their largest."""
        first = parts[0][1]
        merged: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            values = [getattr(r, f.name) for _, r in parts]
            if f.name == "buckets":
                merged[f.name] = tuple(dataclasses.replace(b, variant=label) for label, r in parts for b in r.buckets)
            elif f.name == "compile":
                total: dict[int, dict[str, int]] = {}
                for st_by_bucket in values:
                    for b, st in st_by_bucket.items():
                        into = total.setdefault(b, {})
                        for k, c in st.items():
                            into[k] = into.get(k, 0) + c
                merged[f.name] = total
            elif f.name == "reach":
                merged[f.name] = {k: max(v.get(k, 0) for v in values) for k in first.reach}
            elif isinstance(f.default, tuple):  # a tuple of findings (dicts) or of names: each listed once
                seen: dict[str, Any] = {}
                for v in values:
                    for item in v:
                        seen.setdefault(repr(sorted(item.items())) if isinstance(item, dict) else repr(item), item)
                merged[f.name] = tuple(seen.values())
        return dataclasses.replace(first, function=function, fallbacks=fallbacks,
                                   eager_streak=max(r.eager_streak for _, r in parts),
                                   bypassed=any(r.bypassed for _, r in parts), **merged)

    @property
    def uncompiled(self) -> int:
        """Compiled frames run uncompiled during the capture pass, over every bucket."""
        return sum(st.get("uncompiled", 0) for st in self.compile.values())

    @property
    def compile_summary(self) -> str:
        """One line: the compiled callables, graphs compiled in each bucket's warmups, graph breaks."""
        per = ", ".join(f"{b}: {st['warmup_graphs']}" for b, st in sorted(self.compile.items()))
        hits = sum(st.get("cache_hits", 0) for st in self.compile.values())
        fresh = sum(st.get("cache_misses", 0) for st in self.compile.values())
        cache = f"; Inductor graphs from torch's compile cache: {hits} of {hits + fresh}" if hits + fresh else ""
        return (f"compiled: {', '.join(self.compiled)}; graphs compiled in warmup per bucket: {per}; graph breaks: "
                f"{sum(st['breaks'] for st in self.compile.values())}{cache}")

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "records"}
        d["buckets"] = [dataclasses.asdict(b) for b in self.buckets]
        d.update({k: list(v) for k, v in grouped(self.records).items()})
        d["schema"] = SCHEMA
        return d

    def to_json(self, **kw: Any) -> str:
        return json.dumps(self.to_dict(), **kw)

    def table(self) -> Any:
        from rich.table import Table

        t = Table(title=f"{self.function}: {self.backend} graphs on {self.device} (torch {self.torch})")
        variants = any(b.variant for b in self.buckets)
        if variants:
            t.add_column("variant", no_wrap=True)
        for col in ("bucket", "warmup ms", "capture ms", "pool MiB", "nodes", "segments", "replay us", "eager us",
                    "speedup", "replays", "eager runs"):
            t.add_column(col, justify="right" if col != "segments" else "left")
        for b in self.buckets:
            speed = f"{b.eager_us / b.replay_us:.2f}x" if b.replay_us and b.eager_us else "-"
            segs = " ".join(f"{s.name}:{s.end - s.start}" for s in b.segments)
            t.add_row(*((b.variant,) if variants else ()), str(b.bucket), f"{b.warmup_ms:.1f}",
                      f"{b.capture_ms:.1f}", f"{b.pool_bytes / 2**20:.2f}", str(b.nodes), segs, _us(b.replay_us),
                      _us(b.eager_us), speed, str(b.replays), str(b.eager_runs))
        return t

    def findings(self) -> list[str]:
        """One line per thing the capture found beyond the table (``str(report)`` and ``graphctl
        capture`` print these): padding hazards, what the reach walk left out, unreached reads,
        host values changed, side effects."""
        out: list[str] = []
        for kind in REPORTED:  # each kind's lines, in the kinds' order; what the reach walk left out after the first
            out += [r.line() for r in self.records if type(r) is kind]
            if kind is REPORTED[0]:
                left = {k: self.reach.get(k, 0) for k in ("paths_unchecked", "past_depth", "past_bound")}
                if any(left.values()):
                    out.append("reach walk left out: " + ", ".join(f"{k} {v:,}" for k, v in left.items() if v))
        return out

    def __str__(self) -> str:
        from rich.console import Console

        buf = io.StringIO()
        Console(file=buf, width=120, color_system=None).print(self.table())
        if self.bypassed:
            buf.write(f"warning: the last {self.eager_streak} calls all ran eagerly: the graphs are captured but "
                      "bypassed (see the fallbacks below)\n")
        if self.compiled:
            buf.write(f"{self.compile_summary}; compiled frames run uncompiled: {self.uncompiled}\n")
        for b in self.buckets:
            if b.eager_regions:
                buf.write(f"{b.variant + ' ' if b.variant else ''}bucket {b.bucket}: {b.pieces} pieces; " + "; ".join(
                    f"eager region {r['name']}: " + ("not replayed yet" if r["mean_us"] is None else
                                                      f"{r['mean_us']:.1f} us a call" + (
                                                          f" ({100 * r['mean_us'] / b.replay_us:.0f}% of the replay)"
                                                          if b.replay_us else ""))
                    for r in b.eager_regions) + "\n")
        if self.fallbacks:
            buf.write("eager fallbacks: " + "; ".join(f"{r} (x{c})" for r, c in self.fallbacks.items()) + "\n")
        for line in self.findings():
            buf.write(line + "\n")
        return buf.getvalue()


def _us(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}"
