"""Scaling over GPUs from the result JSONs: every throughput line measured at several data- or
tensor-parallel sizes (``output tok/s, data parallel size N``: ``bench_throughput
--data-parallel-size``, the W4 runs' ``tensor parallel size N``), as a markdown table (tok/s,
over one GPU, the share of the ideal N-fold, the fraction of the floor) and, where matplotlib
imports, ``scaling-<device>.png``: tok/s against GPUs beside the ideal line.

    python -m benchmarks.scaling_report [--results-dir benchmarks/results]
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from benchmarks.common import RESULTS_DIR

_LINE = re.compile(r"^(?P<what>output tok/s.*), (?P<kind>data|tensor) parallel size (?P<n>\d+)$")
HEADER = ("| result | line | GPUs | output tok/s | over one | of ideal | fraction of floor |\n"
          "|---|---|---|---|---|---|---|")


def series(result: dict) -> dict[tuple[str, str], dict[int, dict]]:
    """The result's throughput lines by (line, kind of parallelism), each by size: the summary
    entry of that size."""
    out: dict[tuple[str, str], dict[int, dict]] = {}
    for entry in result.get("summary", []):
        match = _LINE.match(entry["metric"])
        if match and entry.get("hf_paged"):
            key = (match["what"], f"{match['kind']} parallel")
            out.setdefault(key, {})[int(match["n"])] = entry
    return {key: sizes for key, sizes in out.items() if len(sizes) > 1 and 1 in sizes}


def rows(name: str, result: dict) -> list[str]:
    lines = []
    for (what, kind), sizes in series(result).items():
        one = sizes[1]["hf_paged"]
        for n, entry in sorted(sizes.items()):
            tok = entry["hf_paged"]
            floor = entry.get("fraction_of_floor")
            lines.append(f"| {name} | {what}, {kind} | {n} | {tok:,.0f} | {tok / one:.2f}x | "
                         f"{tok / one / n:.0%} | {'—' if floor is None else f'{floor:.1%}'} |")
    return lines


def plot(results: dict[str, dict], path: Path, device: str) -> bool:
    """tok/s against GPUs for every series of ``results``, each with its ideal line (the
    one-GPU figure times the GPUs) and its floor where the result has one; False when
    matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(6, 4.5))
    for name, result in results.items():
        for (what, kind), sizes in series(result).items():
            xs = sorted(sizes)
            line, = ax.plot(xs, [sizes[n]["hf_paged"] for n in xs], "o-",
                            label=f"{name}: {what}, {kind}")
            ax.plot(xs, [sizes[1]["hf_paged"] * n for n in xs], ":", color=line.get_color(),
                    label=f"{name}: ideal (one GPU's figure x GPUs)")
            if all(sizes[n].get("floor") for n in xs):
                ax.plot(xs, [sizes[n]["floor"] for n in xs], "--", color=line.get_color(),
                        label=f"{name}: floor")
    ax.set_xlabel("GPUs")
    ax.set_ylabel("output tok/s")
    ax.set_title(f"Scaling over GPUs, {device}")
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def report(results_dir: Path) -> str:
    """The table of every result with a scaling series, and a plot per device."""
    by_device: dict[str, dict[str, dict]] = {}
    for path in sorted(results_dir.glob("*.json")):
        result = json.loads(path.read_text())
        if isinstance(result, dict) and series(result):
            by_device.setdefault(result["device"]["name"], {})[path.stem] = result
    parts = []
    for device, results in by_device.items():
        slug = next(iter(results.values()))["device"]["slug"]
        png = results_dir / f"scaling-{slug}.png"
        table = [HEADER, *(r for name, result in results.items() for r in rows(name, result))]
        drawn = plot(results, png, device)
        parts.append("\n".join([f"{device}:", "", *table, "",
                                f"plot: {png.name}" if drawn else "no plot (matplotlib)"]))
    return "\n\n".join(parts)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    args = parser.parse_args(argv)
    print(report(args.results_dir) or f"no result with a scaling series in {args.results_dir}")


if __name__ == "__main__":
    main()
