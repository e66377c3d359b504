"""Data-parallel replicas' processes: ``size`` engine processes (``engine_process``) started side
by side, replica ``i`` on GPUs ``[i * tp, (i + 1) * tp)`` of those visible here (its
``CUDA_VISIBLE_DEVICES``; on the CPU just a process). Used by ``data_parallel`` (``generate``
over replicas) and by ``remote_manager`` (``hf-paged serve --data-parallel-size``)."""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch

from hf_paged.integrations.engine_process import EngineProcess
from hf_paged.integrations.loading import resolve_device_map


def start_replicas(load: dict, size: int, tp: int, on_message: Callable[[int, tuple], None]
                   ) -> tuple[torch.device, list[EngineProcess]]:
    """``size`` engine processes loading ``load`` (``from_pretrained``'s keywords, ``model``
    the checkpoint) side by side, replica ``i``'s messages to ``on_message(i, message)``;
    their device type, and the processes. One that fails to load stops the others."""
    device = _device(load)
    load = dict(load, data_parallel_size=1)
    if device.type == "cuda":
        load.pop("device_map", None)
        load["device"] = "cuda:0"  # the first of the replica's own visible GPUs
    envs = [_replica_env(device, i, size, tp) for i in range(size)]

    def start(i: int) -> EngineProcess:
        return EngineProcess(load, lambda message: on_message(i, message),
                             f"data-parallel replica {i}", envs[i])

    with ThreadPoolExecutor(size) as pool:
        started = [pool.submit(start, i) for i in range(size)]
    failures = [f.exception() for f in started if f.exception() is not None]
    if failures:
        stop_replicas([f.result() for f in started if f.exception() is None])
        raise failures[0]
    return device, [f.result() for f in started]


def stop_replicas(processes: list[EngineProcess]) -> None:
    for process in processes:
        process.stop()


def _device(options: dict) -> torch.device:
    """The replicas' device type (CUDA: their first GPU, index 0 of their own)."""
    if options.get("device_map") is not None and options.get("device") is not None:
        raise ValueError("pass device_map or device, not both")
    device = options.get("device")
    device = resolve_device_map(options["device_map"]) if "device_map" in options else (
        torch.device(device) if device is not None else None)
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda" and device.index not in (None, 0):
        raise ValueError(f"data_parallel_size > 1 places replica i on GPUs [i * tp, (i + 1) * "
                         f"tp) of those visible: a device of its own ({device}) is refused; "
                         "choose the GPUs with CUDA_VISIBLE_DEVICES")
    return torch.device(device.type)


def _replica_env(device: torch.device, index: int, size: int, tp: int) -> dict[str, str] | None:
    """Replica ``index``'s environment: its GPUs as the only ones visible (CUDA)."""
    if device.type != "cuda":
        return None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    gpus = visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]
    if len(gpus) < size * tp:
        raise ValueError(f"data_parallel_size={size} x tensor_parallel_size={tp} needs "
                         f"{size * tp} GPUs, {len(gpus)} visible")
    return dict(os.environ, CUDA_VISIBLE_DEVICES=",".join(gpus[index * tp:(index + 1) * tp]))
