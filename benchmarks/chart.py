"""What `bench_peers` reports: medians per system and workload, the tables, the ratios, the chart.

Kept apart from the run so a saved ``peers.json`` can be re-rendered:
``python -m benchmarks.chart benchmarks/results/peers.json [out.png]``.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

from .common import GB, MiB, format_table, median

__all__ = ["plot", "report", "summarize", "text"]

_SYSTEMS = ("s3ckpt", "s3ckpt-tuned", "s3torchconnector", "fsspec", "local", "raw")
_WORKLOADS = ("large", "small", "reshard", "partial")
_OURS = ("s3ckpt", "s3ckpt-tuned")
_VERSUS = ("s3torchconnector", "fsspec", "raw", "local")
_COLORS = {
    "s3ckpt": "#1f77b4",
    "s3ckpt-tuned": "#17becf",
    "s3torchconnector": "#ff7f0e",
    "fsspec": "#d62728",
    "local": "#7f7f7f",
    "raw": "#2ca02c",
}


def _op_summary(runs: list[dict[str, Any]], checks: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over the timed repetitions; memory is the worst one; requests and bytes on the
    wire from the check pass (through the counting proxy)."""
    seconds = median([r["seconds"] for r in runs])
    size = runs[0]["bytes"]
    wire = [r.get("wire") or {} for r in checks + runs if r.get("wire")]
    moved = [w.get("bytes_up", 0) + w.get("bytes_down", 0) for w in wire]
    return {
        "seconds": seconds,
        "gb_per_s": size / GB / seconds if seconds else None,
        "bytes": size,
        "stall_s": median([r.get("stall_s") for r in runs]),
        "first_stall_s": median([r.get("first_stall_s") for r in runs]),
        "cpu_s": median([r["cpu_s"] for r in runs]),
        "rss_extra_max": max(r["rss_extra"] for r in runs),
        # the proxy's count, else (--no-proxy) what s3ckpt counted itself
        "requests": _whole(
            median([w.get("requests") for w in wire])
            or median([r.get("client_requests") for r in runs])
        ),
        "requests_by_method": {
            m: median([w.get(m, 0) for w in wire])
            for m in sorted({k for w in wire for k in w if k.isupper()})
        },
        "wire_bytes": median([m or None for m in moved]),
        "client_requests": median([r.get("client_requests") for r in runs]),
        "repetitions": len(runs),
    }


def _whole(value: float | None) -> float | int | None:
    """Counts print as integers unless a median falls between two."""
    return int(value) if value is not None and float(value).is_integer() else value


Runs = dict[str, dict[str, dict[str, list[dict[str, Any]]]]]


def summarize(runs: Runs, checks: Runs | None = None) -> dict[str, Any]:
    checks = checks or {}

    def checked(system: str, workload: str, op: str) -> list[dict[str, Any]]:
        return checks.get(system, {}).get(workload, {}).get(op, [])

    return {
        system: {
            workload: {
                op: _op_summary(r, checked(system, workload, op)) for op, r in ops.items() if r
            }
            for workload, ops in workloads.items()
        }
        for system, workloads in runs.items()
    }


def ratios(summary: dict[str, Any]) -> dict[str, Any]:
    """s3ckpt GB/s over each peer's, per workload and operation (above 1: s3ckpt is faster)."""
    out: dict[str, Any] = {}
    for ours in _OURS:
        for workload in _WORKLOADS:
            for op in ("save", "load"):
                mine = _speed(summary, ours, workload, op)
                for peer in _VERSUS:
                    theirs = _speed(summary, peer, workload, op)
                    if mine and theirs:
                        key = f"{ours}/{peer}"
                        out.setdefault(key, {}).setdefault(workload, {})[op] = mine / theirs
    return out


def _speed(summary: dict[str, Any], system: str, workload: str, op: str) -> float | None:
    value = summary.get(system, {}).get(workload, {}).get(op, {}).get("gb_per_s")
    return float(value) if value else None


def report(
    bench: Any, args: Any, machine: dict[str, Any], ep: Any, started: float
) -> dict[str, Any]:
    summary = summarize(bench.runs, bench.checks)
    return {
        "machine": machine,
        "server": {
            "name": ep.server,
            "endpoint": ep.url,
            "counting_proxy": bench.counting_proxy,
            "timed_through_proxy": False,
        },
        "settings": {
            "size_gib": args.size_gib,
            "small_count": args.small_count,
            "repeat": args.repeat,
            "systems": args.systems,
            "workloads": args.workloads,
            "tuned_part_mib": bench.tuned[0],
            "tuned_concurrency": bench.tuned[1],
            "tuned_by": "sweep" if bench.sweep else "--tuned",
            "seed": args.seed,
            "wall_s": time.time() - started,
        },
        "sweep": bench.sweep,
        "summary": summary,
        "ratios": ratios(summary),
        "failed": sorted(f"{s} {w}" for s, w in bench.failed),
        "runs": bench.runs,
        "checks": bench.checks,
        "failures": bench.failures,
    }


def _ms(value: float | None) -> float | None:
    return None if value is None else value * 1000


def _mib(value: float | None) -> float | None:
    return None if value is None else value / MiB


def text(rep: dict[str, Any]) -> str:
    """The main table, then the ratios s3ckpt/peer."""
    summary, failed = rep["summary"], set(rep.get("failed", []))
    headers = ["workload", "system", "stall ms", "durable s", "save GB/s", "load s", "load GB/s"]
    headers += ["save +MiB", "load +MiB", "save CPU s", "load CPU s", "save req", "load req"]
    headers += ["load wire/B", "ok"]
    rows = []
    for workload in _WORKLOADS:
        for system in _SYSTEMS:
            ops = summary.get(system, {}).get(workload)
            if not ops and f"{system} {workload}" not in failed:
                continue
            save, load = (ops or {}).get("save", {}), (ops or {}).get("load", {})
            wire, size = load.get("wire_bytes"), load.get("bytes")
            amp = wire / size if wire and size else None
            rows.append(
                [
                    *(workload, system, _ms(save.get("stall_s")), save.get("seconds")),
                    *(save.get("gb_per_s"), load.get("seconds"), load.get("gb_per_s")),
                    *(_mib(save.get("rss_extra_max")), _mib(load.get("rss_extra_max"))),
                    *(save.get("cpu_s"), load.get("cpu_s"), save.get("requests")),
                    *(load.get("requests"), amp),
                    "FAIL" if f"{system} {workload}" in failed else "yes",
                ]
            )
    lines = [format_table(headers, rows), ""]
    pairs = rep.get("ratios", {})
    if pairs:
        headers = ["s3ckpt / peer", *(f"{w} {op}" for w in _WORKLOADS for op in ("save", "load"))]
        rows = [
            [pair] + [pairs[pair].get(w, {}).get(op) for w in _WORKLOADS for op in ("save", "load")]
            for pair in pairs
        ]
        lines += [
            "speed ratios (GB/s over GB/s; above 1: s3ckpt faster)",
            format_table(headers, rows),
        ]
    settings = rep["settings"]
    lines.append(
        f"s3ckpt-tuned: part {settings['tuned_part_mib']} MiB x {settings['tuned_concurrency']}"
        f" in flight (by {settings['tuned_by']}); GB = 1e9 bytes; medians of"
        f" {settings['repeat']} straight to the server; requests and wire bytes from a check"
        " pass through a counting proxy; +MiB is the worst repetition; reshard save = 2 ranks,"
        " sync; raw moves the same bytes as up to 4 objects (small: not per tensor)."
    )
    return "\n".join(lines)


def plot(rep: dict[str, Any], path: Path) -> bool:
    """Grouped bars: save and load GB/s per workload, one bar per system. False without mpl."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    summary = rep["summary"]
    systems = [s for s in _SYSTEMS if s in summary]
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8), sharey=False)
    width = 0.8 / max(1, len(systems))
    for ax, op in zip(axes, ("save", "load"), strict=True):
        workloads = [w for w in _WORKLOADS if any(_speed(summary, s, w, op) for s in systems)]
        for i, system in enumerate(systems):
            xs, ys = [], []
            for j, workload in enumerate(workloads):
                speed = _speed(summary, system, workload, op)
                if speed:
                    xs.append(j + (i - (len(systems) - 1) / 2) * width)
                    ys.append(speed)
            bars = ax.bar(xs, ys, width, label=system, color=_COLORS.get(system))
            ax.bar_label(bars, fmt="%.2f", fontsize=6, rotation=90, padding=2)
        ax.set_xticks(range(len(workloads)), workloads)
        ax.set_title(f"{op} GB/s (higher is better)")
        ax.margins(y=0.2)
    if axes[0].get_legend_handles_labels()[0]:
        axes[0].legend(fontsize=8)
    settings = rep["settings"]
    fig.suptitle(
        f"{rep['server']['name']}: large {settings['size_gib']:g} GiB,"
        f" small {settings['small_count']} tensors, medians of {settings['repeat']}",
        fontsize=10,
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


if __name__ == "__main__":
    saved = json.loads(Path(sys.argv[1]).read_text())
    print(text(saved))
    if len(sys.argv) > 2:
        plot(saved, Path(sys.argv[2]))
