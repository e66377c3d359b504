"""The serving benchmark's README rows and its plot, from ``serving-<device>.json``
(``bench_serving``): one row per phase, hf-paged serve's figures with stock transformers
serve's in parentheses, and time per output token against offered load for both servers
(``serving-<device>.png``). Where the same folder holds W1's results for the device
(``w1-<device>.json``, ``w1-split-<device>.json``), the targets are read against them: output
tok/s at saturation over W1's offline figure, and TPOT p50 at 64 concurrent streams over the
engine's decode-step time at 64-127 sequences.

    python -m benchmarks.serving_report [--results-dir benchmarks/results]
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from benchmarks.common import RESULTS_DIR

HEADER = ("| offered | served req/s | output tok/s | TTFT p50 / p99 ms "
          "| time per output token p50 / p99 ms |\n|---|---|---|---|---|")


def offered(phase: dict) -> str:
    if "baseline_requests" in phase:
        return (f"first {phase['baseline_requests']} requests at once, "
                f"{phase['baseline_max_output']} tokens at most")
    if "concurrency" in phase:
        return f"{phase['concurrency']} clients (closed loop)"
    rate = phase["rate_requests_per_s"]
    return "all at once" if math.isinf(rate) else f"{rate:g} req/s"


def _cell(phase: dict | None, *keys: str) -> str:
    if phase is None:
        return "—"
    values = [phase.get(k) for k in keys]
    return " / ".join("—" if v is None else f"{v:,.3g}" if v < 100 else f"{v:,.0f}"
                      for v in values)


# hf-paged serve's runs, as bench_serving names them, and how the report names them.
OURS = {"hf_paged_engine_process": "hf-paged serve --engine-process",
        "hf_paged": "hf-paged serve (one process)"}


def rows(result: dict, system: str = "hf_paged") -> list[str]:
    """One markdown row per phase of hf-paged serve's ``system`` run, stock's figures in
    parentheses."""
    runs = result["runs"]
    ours = runs.get(system, {}).get("phases", [])
    stock = {offered(p): p for p in runs.get("transformers", {}).get("phases", [])
             if "skipped" not in p}
    lines = []
    for phase in ours:
        if "skipped" in phase:
            continue
        theirs = stock.get(offered(phase))
        cells = [offered(phase) + (" (timed out)" if phase["timed_out"] else "")]
        for keys in (("requests_per_s",), ("output_tok_per_s",), ("ttft_ms_p50", "ttft_ms_p99"),
                     ("tpot_ms_p50", "tpot_ms_p99")):
            mine = _cell(phase, *keys)
            cells.append(mine if theirs is None else f"{mine} (stock {_cell(theirs, *keys)})")
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def targets(result: dict, results_dir: Path, system: str = "hf_paged") -> list[str]:
    """The issue's two targets against W1's offline results for the same device, where they
    are in ``results_dir``."""
    slug = result["device"]["slug"]
    phases = [p for p in result["runs"].get(system, {}).get("phases", [])
              if "baseline_requests" not in p]  # W1's whole workload only
    out = []
    w1 = results_dir / f"w1-{slug}.json"
    if w1.exists() and phases:
        offline = json.loads(w1.read_text())["summary"][0]["hf_paged"]
        best = max(p.get("output_tok_per_s", 0) for p in phases)
        out.append(f"output tok/s at saturation: {best:,.0f}, {best / offline:.0%} of W1 "
                   f"offline ({offline:,.0f}; target 75%)")
    split = results_dir / f"w1-split-{slug}.json"
    at64 = [p for p in phases if p.get("concurrency") == 64 and p.get("tpot_ms_p50")]
    if split.exists() and at64:
        step = json.loads(split.read_text())["groups"]["decode_64+"]["ms_per_step"]
        tpot = at64[0]["tpot_ms_p50"]
        out.append(f"TPOT p50 at 64 streams: {tpot:.2f} ms, {tpot / step:.2f}x the engine's "
                   f"decode step at 64-127 sequences ({step:.2f} ms; target 1.3x)")
    return out


# The plot's panels: which phases each draws, by the key its x-axis reads, and the label.
PANELS = (("rate_requests_per_s", "offered requests/s (Poisson, W1)"),
          ("concurrency", "concurrent clients (closed loop, W1)"),
          ("baseline_requests", "first N requests at once (outputs cut short)"))


def plot(result: dict, path: Path) -> bool:
    """TPOT p50 (p99 dashed) against offered load, one panel per kind of phase (Poisson rates,
    W1's closed loops, the same-requests phases stock transformers serve also ran), both
    servers; False when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(1, len(PANELS), figsize=(15, 4))
    for system, label in (*OURS.items(), ("transformers", "transformers serve")):
        phases = result["runs"].get(system, {}).get("phases", [])
        for ax, (key, _) in zip(axes, PANELS):
            points = sorted(((p[key], p) for p in phases if _panel(p) == key
                             and p.get("tpot_ms_p50") and not math.isinf(p[key])),
                            key=lambda point: point[0])
            if not points:
                continue
            xs = [x for x, _ in points]
            line, = ax.plot(xs, [p["tpot_ms_p50"] for _, p in points], "o-", label=f"{label} p50")
            ax.plot(xs, [p["tpot_ms_p99"] for _, p in points], "--", color=line.get_color(),
                    label=f"{label} p99")
    for ax, (_, xlabel) in zip(axes, PANELS):
        ax.set_xlabel(xlabel)
        ax.set_ylabel("time per output token (ms)")
        ax.set_yscale("log")
        ax.legend(fontsize="small")
    fig.suptitle(f"W1 over HTTP, {result['device']['name']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def _panel(phase: dict) -> str | None:
    """The key of the panel that draws ``phase``: the first of PANELS' keys, read from the
    last, that it has (a same-requests phase also names its concurrency)."""
    return next((key for key, _ in reversed(PANELS) if key in phase), None)


def report(results_dir: Path) -> str:
    """Every serving result's rows, targets and plot; the markdown text."""
    parts = []
    for path in sorted(results_dir.glob("serving-*.json")):
        result = json.loads(path.read_text())
        if "phases" not in json.dumps(result["runs"]):
            continue  # an older result: rates only
        png = path.with_suffix(".png")
        drawn = plot(result, png)
        for system, label in OURS.items():
            if result["runs"].get(system, {}).get("phases"):
                parts.append("\n".join([
                    f"{label}, {result['device']['name']}: W1's first "
                    f"{result['num_requests']} requests", "", HEADER, *rows(result, system), "",
                    *(f"- {line}" for line in targets(result, results_dir, system))]))
        parts.append(f"plot: {png.name}" if drawn else "matplotlib does not import: no plot")
    return "\n\n".join(parts)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    args = parser.parse_args(argv)
    print(report(args.results_dir) or f"no serving result with phases in {args.results_dir}")


if __name__ == "__main__":
    main()
