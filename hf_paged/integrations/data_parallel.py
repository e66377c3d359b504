"""``data_parallel_size=N``: N engine replicas, each in a process of its own (the engine
process of ``engine_process``, its ``generate`` call), behind one engine-like front.

Replica ``i`` runs on GPUs ``[i * tp, (i + 1) * tp)`` of those visible here (its
``CUDA_VISIBLE_DEVICES``; on the CPU it is just a process). ``DataParallelEngine.generate``
(and ``generate_tokens``) deals a call's rows, heaviest first, to the live replica with the
fewest outstanding tokens (prompt plus new-token budget, for each return sequence: a row's
beams and return sequences stay together on one replica), runs each replica's share as one
call there, and puts the rows back in order. A replica whose
process exits fails the calls it held with ``ProcessDied`` naming it; the others go on, and
later rows go to live replicas only.
"""

from __future__ import annotations

import os
import pickle
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, fields

import torch
from transformers.utils import ModelOutput

from hf_paged.config import EngineConfig
from hf_paged.device_copy import moved
from hf_paged.generation.paged_engine import PagedEngine
from hf_paged.integrations.data_parallel_replicas import start_replicas, stop_replicas
from hf_paged.integrations.engine_process import EngineProcess, ProcessDied
from hf_paged.sampling_params import SamplingParams

# generate() keywords that differ by row: split with the rows (the rest go to every share).
_ROW_KEYWORDS = ("input_ids", "attention_mask", "adapter_names")
# What cannot cross to another process, refused by name instead of failing in pickle.
_REFUSED = {"streamer": "streams tokens in this process",
            "assistant_model": "is a model object of this process"}
# generate() objects of the caller's that may keep state per row of the whole batch (lm-eval's
# stop-sequence criteria, a processor, prefix_allowed_tokens_fn's batch ids): a call that
# passes one runs whole on one replica.
_WHOLE_BATCH = ("stopping_criteria", "logits_processor", "prefix_allowed_tokens_fn")
# Output fields that are one list over the whole call's steps, not rows: not merged.
_PER_STEP = ("scores", "logits", "sequences_scores", "beam_indices")


@dataclass
class Replica:
    index: int
    process: EngineProcess
    outstanding: int = 0  # tokens (prompt plus new-token budget) dealt and not yet returned
    served: int = 0  # rows returned


@dataclass
class Share:
    """The rows of one call dealt to one replica, and their outstanding tokens."""

    replica: Replica
    rows: list[int]
    weight: int


def from_pretrained(path_or_id: str, **options) -> PagedEngine | DataParallelEngine:
    """``hf_paged.from_pretrained``: a ``PagedEngine``, or with ``data_parallel_size > 1`` a
    ``DataParallelEngine`` over that many replicas (its options are ``PagedEngine``'s)."""
    if options.get("data_parallel_size", 1) == 1:
        return PagedEngine.from_pretrained(path_or_id, **options)
    if "hf_config" in options:  # the replicas load with transformers' keyword
        options["config"] = options.pop("hf_config")
    return DataParallelEngine(path_or_id, options)


class DataParallelEngine:
    """The replicas' front: ``generate`` and ``generate_tokens`` over them, ``stats``
    summed, ``close``."""

    def __init__(self, path_or_id: str, options: dict):
        known = {f.name for f in fields(EngineConfig)}
        self.config = EngineConfig.from_options(**{n: v for n, v in options.items() if n in known})
        size, tp = self.config.data_parallel_size, self.config.tensor_parallel_size
        load = dict(options, model=os.fspath(path_or_id))
        start = time.perf_counter()
        self.device, processes = start_replicas(load, size, tp, lambda index, message: None)
        # the replicas' own stages stay in their processes: here, their start side by side
        self.startup_seconds = {"replicas": time.perf_counter() - start}
        self.replicas = [Replica(i, process) for i, process in enumerate(processes)]
        self._finalizer = weakref.finalize(self, stop_replicas, processes)
        self._lock = threading.Lock()
        first = self.replicas[0].process
        self.hf_config, self.generation_config = first.config, first.generation_config
        self.dtype = first.config.dtype
        self._pool = ThreadPoolExecutor(4 * size, thread_name_prefix="hf_paged-replica")

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def live(self) -> list[Replica]:
        return [r for r in self.replicas if r.process.died is None]

    def generate(self, inputs: torch.Tensor | None = None, generation_config=None, **kwargs):
        """``PagedEngine.generate``'s arguments and results, the rows over the replicas."""
        for name, why in _REFUSED.items():
            if kwargs.get(name) is not None:
                raise ValueError(f"{name} is not supported with data_parallel_size > 1: it "
                                 f"{why}, and generate runs in the replicas' processes")
        if inputs is not None:
            kwargs["input_ids"], inputs = inputs, None
        ids, mask = kwargs.get("input_ids"), kwargs.get("attention_mask")
        rows = 1 if ids is None else ids.shape[0]
        copies = _setting("num_return_sequences", kwargs, generation_config) or 1
        budget = _setting("max_new_tokens", kwargs, generation_config or self.generation_config)
        prompt = [0] * rows if ids is None else (
            mask.sum(1).tolist() if mask is not None else [ids.shape[1]] * rows)
        shares = self._deal([copies * (int(n) + (budget or 0)) for n in prompt],
                            whole=any(kwargs.get(name) for name in _WHOLE_BATCH))
        try:
            if len(shares) > 1 and _setting("return_dict_in_generate", kwargs, generation_config) \
                    and any(_setting(f"output_{n}", kwargs, generation_config)
                            for n in ("scores", "logits")):
                raise ValueError("output_scores / output_logits with return_dict_in_generate "
                                 "over several data-parallel replicas is not supported (each "
                                 "share's steps differ): pass one row a call")
            results = self._run_shares(shares, lambda picked: (
                "generate", (), dict(_share(kwargs, picked), generation_config=generation_config)))
        finally:
            self._settle(shares)
        device = ids.device if ids is not None else self.device
        if len(results) == 1:
            return moved(results[0][1], device)
        pad = _pad_token(kwargs, generation_config or self.generation_config)
        return moved(_merged(results, rows, copies, pad), device)

    def generate_tokens(self, prompts: list[list[int]],
                        params: SamplingParams | list[SamplingParams],
                        progress_bar: bool | None = None) -> list[list[int]]:
        """``PagedEngine.generate_tokens`` over the replicas: the new token ids of each prompt,
        in input order."""
        each = [params] * len(prompts) if isinstance(params, SamplingParams) else params
        shares = self._deal([len(p) + q.max_new_tokens for p, q in zip(prompts, each)])
        try:
            results = self._run_shares(shares, lambda picked: ("generate_tokens", (
                [prompts[i] for i in picked], [each[i] for i in picked], progress_bar), {}))
        finally:
            self._settle(shares)
        outputs: list[list[int]] = [[] for _ in prompts]
        for picked, share in results:
            for row, tokens in zip(picked, share):
                outputs[row] = tokens
        return outputs

    def _deal(self, weights: list[int], whole: bool = False) -> list[Share]:
        """Each row (``weights``: its outstanding tokens, prompt plus new-token budget, times
        its return sequences) to a live replica by ``deal``, counted as outstanding there;
        ``whole``: every row to the least loaded one."""
        with self._lock:
            live = self.live()
            if not live:
                raise RuntimeError("every data-parallel replica died: "
                                   + "; ".join(r.process.died for r in self.replicas))
            loads = [r.outstanding for r in live]
            parts = deal([sum(weights)], loads) if whole else deal(weights, loads)
            if whole:
                parts = [list(range(len(weights))) if part else [] for part in parts]
            for replica, load in zip(live, loads):
                replica.outstanding = load
        return [Share(replica, rows, sum(weights[row] for row in rows))
                for replica, rows in zip(live, parts) if rows]

    def _run_shares(self, shares: list[Share], call: Callable[[list[int]], tuple]
                    ) -> list[tuple[list[int], object]]:
        """Each share's ``call(rows)`` (method name, arguments, keywords) in its replica's
        process, side by side; (rows, result) of each once every one is back."""
        running = [self._pool.submit(self._run, share, call(share.rows)) for share in shares]
        wait(running)  # every share back (or failed) before the counts drop
        return [(share.rows, r.result()) for r, share in zip(running, shares)]

    def _run(self, share: Share, call: tuple):
        name, args, kwargs = call
        # this model's generation config as it is now (set or changed here): the replica's
        blob = pickle.dumps((name, args, moved(kwargs, "cpu"), self.generation_config))
        result = pickle.loads(share.replica.process.call("generate", blob, timeout=None,
                                                         raw=True))
        with self._lock:
            share.replica.served += len(share.rows)
        return result

    def _settle(self, shares: list[Share]) -> None:
        with self._lock:
            for share in shares:
                share.replica.outstanding -= share.weight

    def stats(self) -> dict:
        """The live replicas' engine stats summed, and each replica's under ``replicas``
        (its index, pid, outstanding tokens, rows served, and its stats or how it died)."""
        total: dict = {}
        per_replica = []
        for replica in self.replicas:
            entry = dict(index=replica.index, pid=replica.process.process.pid,
                         outstanding=replica.outstanding, served=replica.served)
            try:
                own = replica.process.call("stats")[0]
            except ProcessDied as error:
                entry["died"] = str(error)
            else:
                entry.update(own)
                for name, value in own.items():
                    total[name] = total.get(name, 0) + value
            per_replica.append(entry)
        return dict(total, replicas=per_replica)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                position_ids: torch.Tensor, logits_to_keep: int | torch.Tensor = 0,
                adapters: list[str | None] | None = None, output_hidden_states: bool = False
                ) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """``PagedEngine.forward`` (the model call's logits), the rows over the replicas."""
        return self._model_call("forward", input_ids, attention_mask, position_ids, adapters,
                                logits_to_keep, output_hidden_states=output_hidden_states)

    def hidden_states(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                      position_ids: torch.Tensor, adapters: list[str | None] | None = None,
                      output_hidden_states: bool = False
                      ) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """``PagedEngine.hidden_states`` (the inner model's call), the rows over the
        replicas."""
        return self._model_call("hidden_states", input_ids, attention_mask, position_ids,
                                adapters, output_hidden_states=output_hidden_states)

    def _model_call(self, name: str, ids: torch.Tensor, mask: torch.Tensor,
                    positions: torch.Tensor, adapters, *rest, **options
                    ) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """Each replica scores a share of the rows (dealt by their kept tokens); the rows put
        back in order (each tensor of a tuple result alike)."""
        if adapters is not None:
            raise ValueError("adapter names in the model call are not supported with "
                             "data_parallel_size > 1: the replicas hold no peft adapters")
        positions = positions.expand(ids.shape)
        shares = self._deal([max(int(n), 1) for n in mask.sum(1)])
        try:
            results = self._run_shares(shares, lambda picked: (name, (
                ids[picked], mask[picked], positions[picked], *rest), options))
        finally:
            self._settle(shares)
        order = torch.argsort(torch.tensor([row for picked, _ in results for row in picked]))
        parts = [part if isinstance(part, tuple) else (part,) for _, part in results]
        out = tuple(torch.cat(pieces)[order].to(ids.device) for pieces in zip(*parts))
        return out if isinstance(results[0][1], tuple) else out[0]

    def close(self) -> None:
        """Stop every replica's process."""
        self._finalizer()
        self._pool.shutdown(wait=False)


def deal(weights: list[int], loads: list[int]) -> list[list[int]]:
    """Rows (their ``weights``) heaviest first, each to the part with the least load so far
    (the lowest index on a tie), ``loads`` counted up in place; each part's rows in order."""
    parts: list[list[int]] = [[] for _ in loads]
    for row in sorted(range(len(weights)), key=lambda row: -weights[row]):
        part = loads.index(min(loads))
        loads[part] += weights[row]
        parts[part].append(row)
    return [sorted(rows) for rows in parts]


def _share(kwargs: dict, picked: list[int]) -> dict:
    """A share's generate keywords: its rows of the per-row ones, the others as they are."""
    share = dict(kwargs)
    for name in _ROW_KEYWORDS:
        value = kwargs.get(name)
        if isinstance(value, torch.Tensor):
            share[name] = value[picked]
        elif value is not None:
            share[name] = [value[row] for row in picked]
    return share


def _setting(name: str, kwargs: dict, generation_config):
    """A generation setting as generate reads it: the keyword, else the passed config's."""
    if name in kwargs:
        return kwargs[name]
    return getattr(generation_config, name, None) if generation_config is not None else None


def _pad_token(kwargs: dict, generation_config) -> int:
    """The id transformers pads finished rows with: pad_token_id, else the first EOS id."""
    pad = _setting("pad_token_id", kwargs, generation_config)
    if pad is None:
        pad = _setting("eos_token_id", kwargs, generation_config)
        if isinstance(pad, (list, tuple)):
            pad = pad[0] if pad else None
    return 0 if pad is None else int(pad)


def _merged(results: list[tuple[list[int], object]], rows: int, copies: int, pad: int):
    """The shares' sequences as one batch in row order, padded on the right to the longest."""
    sequences = [r.sequences if isinstance(r, ModelOutput) else r for _, r in results]
    width = max(s.shape[1] for s in sequences)
    merged = sequences[0].new_full((rows * copies, width), pad)
    for (picked, _), share in zip(results, sequences):
        at = torch.tensor([row * copies + c for row in picked for c in range(copies)])
        merged[at, : share.shape[1]] = share
    first = results[0][1]
    if not isinstance(first, ModelOutput):
        return merged
    refused = [n for n in _PER_STEP if getattr(first, n, None) is not None]
    if refused:
        raise ValueError(f"{', '.join(refused)} over several data-parallel replicas are not "
                         "supported (each share's steps differ): pass one row a call")
    first.sequences = merged
    return first
