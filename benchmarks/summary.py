"""The lines of a benchmark's results table: hf_paged's figure, each baseline's, hf_paged's
speedup over each and the fraction of the floor it reaches (``summary`` in the result JSON),
and their printout."""

from __future__ import annotations

from typing import Any


def summary_row(
    metric: str,
    hf_paged: float,
    baselines: dict[str, dict],
    key: str,
    floor: float | None,
    higher_is_better: bool,
    compare: float | None = None,
) -> dict[str, Any]:
    """One line of the results table: hf_paged's figure, each baseline's ``key`` figure (or
    its error), hf_paged's speedup over each (from ``compare``, hf_paged's figure on the
    baselines' requests, when that differs from ``hf_paged``) and the fraction of the floor
    that hf_paged reaches."""

    def speedup(mine: float, other: float) -> float:
        return mine / other if higher_is_better else other / mine

    values = {
        name: fig.get(key, fig.get("error"))
        for name, fig in baselines.items()
        if key in fig or "error" in fig
    }
    compare = hf_paged if compare is None else compare
    return {
        "metric": metric,
        "hf_paged": hf_paged,
        "baselines": values,
        "speedup": {
            name: speedup(compare, value)
            for name, value in values.items()
            if isinstance(value, (int, float))
        },
        "floor": floor,
        "fraction_of_floor": None if floor is None else speedup(hf_paged, floor),
    }


def print_summary(rows: list[dict]) -> None:
    for row in rows:
        parts = [f"{row['metric']}: hf_paged {row['hf_paged']:.4g}"]
        for name, value in row["baselines"].items():
            shown = (
                f"{value:.4g} (x{row['speedup'][name]:.2f})" if name in row["speedup"] else value
            )
            parts.append(f"{name} {shown}")
        if row["fraction_of_floor"] is not None:
            parts.append(f"floor {row['floor']:.4g}, fraction {row['fraction_of_floor']:.1%}")
        print(" | ".join(parts))
