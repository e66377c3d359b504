"""What the benchmarks share: command-line options, device facts, timing, and the result JSON
(written after every measurement, so a run cut short keeps its figures). The memory-traffic
floor is ``benchmarks.floor``, the table's lines ``benchmarks.summary``."""

from __future__ import annotations

import argparse
import ast
import datetime
import gc
import json
import logging
import os
import platform
import re
import shutil
import subprocess
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch
from transformers import AutoConfig

from benchmarks.summary import print_summary

T = TypeVar("T")
# hf_paged's start-up stages, rank by rank, with times: where a slow or stuck start is.
logging.basicConfig(format="%(asctime)s %(name)s: %(message)s")
logging.getLogger("hf_paged").setLevel(logging.INFO)
RESULTS_DIR = Path(__file__).parent / "results"

# The transformers baselines: command-line key -> name in the result JSON.
BASELINE_NAMES = {
    "generate": "transformers_generate",
    "static": "transformers_static_cache",
    "cb": "transformers_continuous_batching",
}

# ---- command line ---------------------------------------------------------------------------


def add_common_args(parser: argparse.ArgumentParser, baselines: tuple[str, ...]) -> None:
    parser.add_argument(
        "--model", required=True, help="checkpoint folder (benchmarks.make_checkpoint)"
    )
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--baselines",
        nargs="*",
        choices=baselines,
        default=list(baselines),
        help="transformers baselines to measure (none when the flag has no value)",
    )
    parser.add_argument(
        "--reuse-baselines",
        metavar="FILE",
        help="take the baseline figures from an earlier result JSON instead of measuring them; "
        "'auto': from the result file this run replaces (same workload, tag and device)",
    )
    parser.add_argument(
        "--engine-option",
        "-E",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="an hf_paged EngineConfig field, e.g. -E max_num_seqs=128 (repeatable)",
    )
    parser.add_argument(
        "--bandwidth",
        type=float,
        help="memory bandwidth for the floor in B/s (default: by device name, else measured)",
    )
    parser.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    parser.add_argument(
        "--tag",
        help="a name for the checkpoint, e.g. 30b-a3b, in the result file's name "
        "(<workload>-<tag>-<device>.json) and the report: runs on other shapes keep their files",
    )


def engine_options(pairs: list[str]) -> dict[str, Any]:
    """``["max_num_seqs=128", "enforce_eager=True"]`` -> ``{"max_num_seqs": 128, ...}``."""
    options = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep:
            raise SystemExit(f"--engine-option takes NAME=VALUE, got {pair!r}")
        try:
            options[name] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            options[name] = value
    return options


def max_token_id(model_path: str) -> int:
    """Workload token ids stay below 10,000 and inside the checkpoint's vocabulary."""
    return min(10000, AutoConfig.from_pretrained(model_path).vocab_size - 1)


# ---- device and timing ----------------------------------------------------------------------


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def device_info(device: torch.device) -> dict[str, Any]:
    name = device_name(device)
    info = {
        "name": name,
        "slug": re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": _version("transformers"),
        "triton": _version("triton"),
        "cpu": platform.processor() or platform.machine(),
    }
    if device.type == "cuda":
        info["cuda"] = torch.version.cuda
        info["gpu_count"] = torch.cuda.device_count()  # on the machine, not only those used
        info["gpu_memory_gib"] = round(
            torch.cuda.get_device_properties(device).total_memory / 2**30, 1
        )
    return info


def _version(module: str) -> str | None:
    try:
        return __import__(module).__version__
    except ImportError:
        return None


def git_commit() -> str | None:
    """HEAD, with "+modified" when tracked files differ from it (a run over unlanded work);
    ``$BENCH_GIT_COMMIT`` instead when set (a copy of the tree whose history lags it)."""
    if os.environ.get("BENCH_GIT_COMMIT"):
        return os.environ["BENCH_GIT_COMMIT"]

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], capture_output=True, text=True, check=True,
                              cwd=Path(__file__).parent).stdout.strip()

    try:
        head = git("rev-parse", "HEAD")
        modified = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + ("+modified" if modified else "")


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], T], device: torch.device) -> tuple[T, float]:
    """``fn()`` and its wall time in seconds, with the device's queue drained on both sides."""
    synchronize(device)
    start = time.perf_counter()
    result = fn()
    synchronize(device)
    return result, time.perf_counter() - start


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def guarded(name: str, fn: Callable[[], dict]) -> dict:
    """``fn()``, or ``{"error": ...}`` when it raises: one failing baseline keeps the run."""
    try:
        return fn()
    except Exception as exc:  # the error is the baseline's result
        traceback.print_exc()
        print(f"{name} failed: {type(exc).__name__}: {exc}")
        return {"error": f"{type(exc).__name__}: {exc}"}
    finally:
        free_memory()


# ---- results --------------------------------------------------------------------------------


def write_result(path: Path, data: dict) -> None:
    """``data`` as JSON at ``path``, and a copy in ``$OUT`` when it is set (and elsewhere)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")
    copy = Path(os.environ["OUT"]) / path.name if os.environ.get("OUT") else None
    if copy is not None and copy.resolve() != path.resolve():
        shutil.copy(path, copy)


class ResultFile:
    """``<results_dir>/<workload>-<device slug>.json`` (``<workload>-<tag>-<device slug>.json``
    with ``--tag``), copied to ``$OUT`` when it is set.
    Every save refreshes ``summary`` (the table lines) with ``summarize(data)`` once hf_paged
    has a figure."""

    def __init__(
        self,
        workload: str,
        args: argparse.Namespace,
        device: torch.device,
        summarize: Callable[[dict], list[dict]],
    ):
        info = device_info(device)
        self.summarize = summarize
        name = "-".join(part for part in (workload, args.tag, info["slug"]) if part)
        self.path = args.results_dir / f"{name}.json"
        self.data: dict[str, Any] = {
            "workload": workload,
            "tag": args.tag,
            "complete": False,
            "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "git_commit": git_commit(),
            "device": info,
            "checkpoint": {"path": args.model, "dtype": args.dtype},
            "summary": None,
            "workload_description": None,
            "floor": None,
            "baseline_requests": None,
            "hf_paged": {},
            "baselines": {},
        }

    def __getitem__(self, key: str) -> Any:
        return self.data[key]

    def __setitem__(self, key: str, value: Any) -> None:
        self.data[key] = value

    def save(self) -> None:
        if self.data["hf_paged"]:
            self.data["summary"] = self.summarize(self.data)
        write_result(self.path, self.data)


def reuse_baselines(result: ResultFile, args: argparse.Namespace) -> None:
    """Take the baselines of the ``--reuse-baselines`` file, if given: call it before the first
    save, which may overwrite that very file."""
    if args.reuse_baselines is None:
        return
    path = result.path if args.reuse_baselines == "auto" else Path(args.reuse_baselines)
    earlier = json.loads(path.read_text())
    for field in ("workload", "baseline_requests"):
        if earlier.get(field) != result[field]:
            raise SystemExit(
                f"{path} has {field} {earlier.get(field)!r}, this run {result[field]!r}: "
                "its baselines are not comparable"
            )
    if not earlier.get("baselines"):
        raise SystemExit(f"{path} holds no baseline figures")
    result["baselines"] = earlier["baselines"]
    result["baselines_reused_from"] = str(path)


def run_baselines(
    result: ResultFile, args: argparse.Namespace, measures: dict[str, Callable[[], dict]]
) -> None:
    """Measure the baselines named by ``--baselines``, each failure recorded as its result,
    unless they were reused."""
    if args.reuse_baselines is not None:
        return
    for key in args.baselines:
        name = BASELINE_NAMES[key]
        print(f"{result['workload']} {name}")
        result["baselines"][name] = guarded(name, measures[key])
        result.save()


def parts_baseline(measured: dict[str, dict], keys: tuple[str, ...], **facts: Any) -> dict:
    """One baseline entry for a benchmark of several parts: each part's headline figure
    (``keys``) on top, what the summary reads, and its full figures under the part's name;
    the first error where no part has a figure."""
    figures = {key: fig[key] for fig in measured.values() for key in keys if key in fig}
    errors = [fig["error"] for fig in measured.values() if "error" in fig]
    if errors and not figures:
        return {"error": errors[0]}
    return {**facts, **figures, **measured}


def finish(result: ResultFile) -> None:
    result["complete"] = True
    result.save()
    print_summary(result["summary"])
    print(f"wrote {result.path}")
