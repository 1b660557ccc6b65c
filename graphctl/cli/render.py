"""What ``graphctl capture`` draws: the header, the per-(variant, bucket) table, the coverage
table, a DOT chain of an emulated graph, the latency and memory plot."""
from __future__ import annotations

import platform
from typing import Any

import torch

import graphctl
from graphctl.graphs.face import Key

__all__ = ["device_header", "header_text", "table", "coverage_table", "dot_of_nodes", "plot"]


def device_header(backend: str) -> dict[str, Any]:
    from graphctl.cli.info import gpus

    head: dict[str, Any] = {"graphctl": graphctl.__version__, "python": platform.python_version(),
                            "torch": torch.__version__, "torch_cuda": torch.version.cuda, "backend": backend}
    g = gpus()
    if torch.cuda.is_available() and isinstance(g, list) and g:
        idx = torch.cuda.current_device()
        head["device"] = g[idx] if idx < len(g) else g[0]
    else:
        head["device"] = {"name": "no CUDA device: emulated graphs on the CPU",
                          "detail": g if isinstance(g, str) else "torch.cuda.is_available() is False"}
    return head


def header_text(head: dict[str, Any]) -> str:
    d = head["device"]
    if "compute_capability" in d:
        dev = (f"{d['name']} (sm {d['compute_capability']}, {d['memory_gib']} GiB, SM clock {d.get('sm_clock_now_mhz')}"
               f"/{d['sm_clock_mhz']} MHz, driver {d['driver']})")
    else:
        dev = f"{d['name']} ({d['detail']})"
    return (f"device: {dev}\ntorch {head['torch']} (CUDA {head['torch_cuda']}), python {head['python']}, "
            f"graphctl {head['graphctl']}, backend {head['backend']}")


def table(name: str, report: Any, verify: dict[tuple[str, int], list], audits: dict[Any, Any],
           per_item: dict[str, int]):
    from rich.table import Table

    t = Table(title=f"{name}: {report.backend} graphs")
    variants = any(b.variant for b in report.buckets)
    if variants:
        t.add_column("variant", no_wrap=True)
    for col in ("bucket", "tokens", "capture ms", "pool MiB", "nodes", "replay us", "eager us", "speedup", "verify",
                "audit"):
        t.add_column(col, justify="right")
    for b in report.buckets:
        speed = f"{b.eager_us / b.replay_us:.2f}x" if b.replay_us and b.eager_us else "-"
        vs = verify.get((b.variant, b.bucket))
        v = "-" if vs is None else ("ok" if all(r.ok for r in vs) else "[red]MISMATCH")
        a = audits.get(Key(b.variant, b.bucket))
        au = "-" if a is None else (f"[red]{len(a.errors)} err[/] {len(a.warnings)} warn" if a.errors else
                                    f"[yellow]{len(a.possible)} possible[/]" if a.possible else
                                    "clean" if not a.warnings else f"{len(a.warnings)} warn")
        t.add_row(*((b.variant,) if variants else ()), str(b.bucket), str(b.bucket * per_item[b.variant]),
                  f"{b.capture_ms:.1f}", f"{b.pool_bytes / 2**20:.2f}",
                  str(b.nodes), _num(b.replay_us), _num(b.eager_us), speed, v, au)
    return t


def coverage_table(rows: list[dict[str, Any]]):
    from rich.markup import escape
    from rich.table import Table

    t = Table(title="coverage: which batch sizes each bucket serves")
    variants = any(r["variant"] for r in rows)
    for col in (("variant",) if variants else ()) + ("batch", "served by", "tokens", "worst padding"):
        t.add_column(col, justify="right")
    for r in rows:
        pad = "-" if r["padding"] is None else f"{100 * r['padding']:.0f}%"
        how = r["served_by"] if r["served_by"].startswith("bucket") else f"[red]{escape(r['served_by'])}"
        tokens = "-" if r["tokens"] is None else str(r["tokens"])
        t.add_row(*((r["variant"],) if variants else ()), r["batch"], how, tokens, pad)
    return t


def _num(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}"


def dot_of_nodes(nodes, segments) -> str:
    """A DOT chain of an emulated graph's ops, one cluster per segment (CUDA graphs use
    ``cudaGraphDebugDotPrint`` instead)."""
    lines = ["digraph graphctl {", "  rankdir=TB; node [shape=box, fontsize=10];"]
    for s in segments:
        lines.append(f'  subgraph "cluster_{s.name}" {{ label="{s.name}";')
        lines += [f'    n{i} [label="{i}: {nodes[i].name}"];' for i in range(s.start, min(s.end, len(nodes)))]
        lines.append("  }")
    lines += [f"  n{i} -> n{i + 1};" for i in range(len(nodes) - 1)]
    return "\n".join(lines + ["}"]) + "\n"


def plot(path: str, report) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    bs = [b.bucket for b in report.buckets]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    if any(b.replay_us for b in report.buckets):
        ax1.plot(bs, [b.replay_us or float("nan") for b in report.buckets], "o-", label="graph replay")
        ax1.plot(bs, [b.eager_us or float("nan") for b in report.buckets], "s--", label="eager")
        ax1.set(xscale="log", yscale="log", xlabel="bucket (batch items)", ylabel="median latency (us)",
                title="latency per bucket")
        ax1.set_xticks(bs, [str(b) for b in bs])
        # plain numbers on the log latency axis: matplotlib's minor labels read "3x10^0" within one decade
        plain = matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}")
        ax1.yaxis.set_major_formatter(plain)
        ax1.yaxis.set_minor_formatter(plain)
        ax1.legend()
    else:
        ax1.set(title="latency per bucket", xticks=[], yticks=[])
        ax1.text(0.5, 0.5, "not timed\n(graphctl capture --time)", ha="center", va="center")
    ax2.bar([str(b) for b in bs], [b.pool_bytes / 2**20 for b in report.buckets])
    ax2.set(xlabel="bucket (batch items)", ylabel="MiB", title="pool memory added by each capture")
    fig.suptitle(f"{report.function} ({report.backend}, {report.device})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
