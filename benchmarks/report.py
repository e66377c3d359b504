"""Collect the result JSONs into a markdown table and a throughput plot.

    python -m benchmarks.report [--results-dir benchmarks/results]

Writes ``README-table.md`` and, when matplotlib imports, ``throughput.png`` (log scale) into
the results folder, and prints the table.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from benchmarks import serving_report
from benchmarks.common import RESULTS_DIR

BASELINES = {
    "transformers_generate": "transformers generate",
    "transformers_static_cache": "static cache + compile",
    "transformers_continuous_batching": "transformers continuous batching",
}
NOTES = """\
Baseline cells read `figure (×speedup)`, the speedup being hf_paged's over that baseline on the
same requests; the throughput baselines run on the first {requests} of the workload.
Fraction of floor: the time of the memory-traffic floor (weights and KV cache read once per decode
step at the device's bandwidth, a cached prefix common to all prompts once for all of them; of a
mixture of experts, the experts a step's batch is expected to route to; with LoRA adapters, each
distinct adapter of a step's requests once; `floor_model` in each JSON) over hf_paged's measured
time. A workload's tag in parentheses names the checkpoint's shape.
"""


def load(results_dir: Path) -> list[dict]:
    results = [json.loads(path.read_text()) for path in sorted(results_dir.glob("*.json"))]
    return [r for r in results if r.get("summary")]


def workload_label(result: dict) -> str:
    """The workload, with the checkpoint's tag when the run has one: ``w1 (30b-a3b)``."""
    return result["workload"] + (f" ({result['tag']})" if result.get("tag") else "")


def number(value: float) -> str:
    return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.3g}"


def table(results: list[dict]) -> str:
    header = ["workload", "device", "metric", "hf_paged", *BASELINES.values(), "fraction of floor"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for result in results:
        workload = workload_label(result) + ("" if result["complete"] else " (partial)")
        reused = " (baselines reused)" if result.get("baselines_reused_from") else ""
        for row in result["summary"]:
            cells = [
                workload,
                result["device"]["name"] + reused,
                row["metric"],
                number(row["hf_paged"]),
            ]
            for name in BASELINES:
                value = row["baselines"].get(name)
                if isinstance(value, (int, float)):
                    cells.append(f"{number(value)} (×{row['speedup'][name]:.2f})")
                else:
                    cells.append("error" if value else "—")
            fraction = row["fraction_of_floor"]
            cells.append("—" if fraction is None else f"{fraction:.1%}")
            lines.append("| " + " | ".join(cells) + " |")
    requests = sorted({r["baseline_requests"] for r in results if r.get("baseline_requests")})
    notes = NOTES.format(requests=" / ".join(map(str, requests)) + " requests" if requests
                         else "requests")
    return "\n".join(lines) + "\n\n" + notes


def plot(results: list[dict], path: Path) -> bool:
    """A grouped bar chart of every output tok/s line; False when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rows = [
        (f"{workload_label(r)}{row['metric'].removeprefix('output tok/s')}\n{r['device']['slug']}",
         row)
        for r in results
        for row in r["summary"]
        if row["metric"].startswith("output tok/s")
    ]
    series = {"hf_paged": [row["hf_paged"] for _, row in rows]}
    for name, label in BASELINES.items():
        values = [row["baselines"].get(name) for _, row in rows]
        series[label] = [v if isinstance(v, (int, float)) else float("nan") for v in values]
    width = 0.8 / len(series)
    fig, ax = plt.subplots(figsize=(max(6, 2.5 * len(rows)), 4.5))
    for i, (label, values) in enumerate(series.items()):
        ax.bar([x + i * width for x in range(len(rows))], values, width, label=label)
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(rows))], [name for name, _ in rows])
    ax.set_yscale("log")
    ax.set_ylabel("output tokens / s")
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    args = parser.parse_args(argv)
    results = load(args.results_dir)
    if not results:
        raise SystemExit(f"no result JSON with a summary in {args.results_dir}")
    text = table(results)
    serving = serving_report.report(args.results_dir)  # its own rows: phases, not speedups
    text += f"\n\nServing (bench_serving):\n\n{serving}\n" if serving else ""
    (args.results_dir / "README-table.md").write_text(text)
    print(text)
    png = args.results_dir / "throughput.png"
    print(f"wrote {png}" if plot(results, png) else "matplotlib does not import: no plot")


if __name__ == "__main__":
    main()
