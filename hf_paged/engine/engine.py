"""The engine core: requests in, continuous-batching steps through the executor, tokens out.

It schedules on the host (``scheduler``, ``block_manager``) and talks to the device side only
through the executor, in plain data (``hf_paged.step``). The transformers-shaped ``generate``
lives one floor up, on ``hf_paged.PagedEngine``.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from transformers import GenerationConfig, PretrainedConfig

from hf_paged.config import EngineConfig
from hf_paged.engine import followers
from hf_paged.engine.adapters import Adapters
from hf_paged.engine.admission import Admission
from hf_paged.engine.batch import ScheduledBatch
from hf_paged.engine.block_manager import BlockManager
from hf_paged.engine.loading import load
from hf_paged.engine.padded_forward import PaddedForward
from hf_paged.engine.run_loop import progress_text, step_until_finished, stream_new_tokens
from hf_paged.engine.scheduler import Scheduler
from hf_paged.engine.sequence import Sequence
from hf_paged.engine.speculation.speculator import Speculator, default_speculation
from hf_paged.engine.state_slots import StateSlots
from hf_paged.engine.state_snapshots import StateSnapshots
from hf_paged.sampling_params import SamplingParams
from hf_paged.worker.executor import Executor


class EngineCore(Admission, PaddedForward):
    """A model served by continuous batching over a paged KV cache.

    ``generate_tokens`` takes token-id lists with per-request ``SamplingParams``;
    ``add_request``/``add_requests``/``step`` drive the engine by hand.

    Under torchrun with ``tensor_parallel_size > 1`` every rank holds an engine and makes the
    same calls; rank 0's schedules and samples, the others follow its steps inside ``run``
    (so ``generate``/``generate_tokens``) and return its results. Only rank 0 may ``step``.
    """

    def __init__(
        self,
        executor: Executor,
        config: EngineConfig,
        generation_config: GenerationConfig,
        max_model_len: int,
        tokenizer=None,
    ):
        self.executor = executor
        self.model = executor.model  # the swapped model, whose modules the drop-in class adopts
        self.hf_config: PretrainedConfig = self.model.config
        self.config = config
        self.generation_config = generation_config
        self.max_model_len = max_model_len
        self.tokenizer = tokenizer
        # Start-up phases: weights loaded, KV cache sized and allocated, decode graphs captured.
        self.startup_seconds = dict(executor.startup_seconds)
        # A hybrid model's linear-attention layers keep a state slot per running sequence
        # (and, for prefix caching, snapshots in the slots after those).
        state_slots = StateSlots(executor.num_state_slots, executor.state_slot_bytes,
                                 StateSnapshots(executor.num_state_slots,
                                                executor.num_state_snapshots)
                                 if executor.num_state_snapshots else None) \
            if executor.num_state_slots else None
        if state_slots is not None and config.speculative_method is not None:
            executor.close()
            raise ValueError(f"speculative_method: {self.hf_config.model_type} has "
                             "linear-attention layers, whose state cannot take rejected draft "
                             "tokens back; speculative decoding is not supported on it")
        self.block_manager = BlockManager(
            executor.num_blocks, config.block_size, config.enable_prefix_caching, state_slots
        )
        # A draft checkpoint (``speculative_model``) loads into an engine like this one.
        self.speculator = Speculator(config, max_model_len, default_speculation(
            config, self.device, self.dtype, max_model_len, executor.num_blocks,
            self.hf_config.vocab_size, EngineCore.from_pretrained, executor.is_leader))
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs,
                                   config.max_num_batched_tokens, max_model_len, self.speculator)
        # The step launched whose tokens are not collected yet: its batch and the executor's
        # handle of it.
        self.in_flight: tuple[ScheduledBatch, object] | None = None
        self._last_batch = None
        self.closed = False
        self.adapters = Adapters(executor, config.max_loras)  # LoRA: see add_lora

    @property
    def device(self) -> torch.device:
        return self.executor.device

    @property
    def dtype(self) -> torch.dtype:
        return self.executor.dtype

    @property
    def is_leader(self) -> bool:
        """Whether this rank schedules (rank 0 of a tensor-parallel group; always in one
        process)."""
        return self.executor.is_leader

    @property
    def broken(self) -> str | None:
        """Why a rank can no longer run steps, once one cannot (None while all is well)."""
        return self.executor.broken

    @classmethod
    def from_pretrained(
        cls,
        path_or_id: str,
        *,
        dtype: torch.dtype | str | None = None,
        device: torch.device | str | None = None,
        hf_config: PretrainedConfig | None = None,
        quantization_config: object = None,
        **engine_options,
    ) -> EngineCore:
        """Load a checkpoint (a folder or a hub id) into a new engine.

        ``dtype`` defaults to the checkpoint's own (float32 when it names none), ``device``
        to CUDA when available (under torchrun, the local rank's GPU). ``hf_config`` replaces
        the checkpoint's config.json (transformers' config overrides). A quantized checkpoint
        (its config's ``quantization_config``) is served as it is or refused by name;
        ``quantization_config`` (a transformers ``FineGrainedFP8Config`` or its dict)
        quantizes an unquantized one as it loads. Any ``EngineConfig`` field may be passed
        by name.
        """
        return cls(*load(path_or_id, dtype, device, hf_config, engine_options,
                         quantization_config))

    def step(self) -> list[Sequence]:
        """Launch the next step, then collect the previous one's tokens while the device runs
        it; return the requests that finished. A request's last token therefore arrives one
        ``step`` after the step that computed it. A step holding beam-search rows is collected
        before the next is scheduled instead: the host's choice of beams is that step's input."""
        if not self.is_leader:
            raise RuntimeError(
                "under torchrun only rank 0 of a tensor-parallel group steps the engine; call "
                "generate() or generate_tokens() on every rank instead"
            )
        previous, self.in_flight = self.in_flight, None
        batch = None
        finished: list[Sequence] = []
        try:
            if previous is not None and previous[0].feeds_next_step:
                finished = self._collect(previous)
                previous = None
            self.speculator.propose(self.scheduler.running)
            batch = self.scheduler.schedule()
            if batch.seqs:
                self.in_flight = batch, self.executor.launch(batch.plan())
                self._last_batch = batch
            if previous is not None:
                finished = self._collect(previous)
        except BaseException:
            # These steps' results are lost: drop every request they touched.
            for touched in (previous[0] if previous else None, batch):
                for seq in touched.seqs if touched else ():
                    if not seq.is_finished:
                        self.abort(seq)
            self.in_flight = None
            raise
        return finished

    def _collect(self, launched: tuple[ScheduledBatch, object]) -> list[Sequence]:
        batch, handle = launched
        result = self.executor.collect(handle)
        finished = self.scheduler.postprocess(batch, result.tokens, result.candidates)
        self._release(finished + self.scheduler.take_dropped())
        return finished

    def _release(self, seqs: list[Sequence]) -> None:
        self.executor.release([s.seq_id for s in seqs])
        self.speculator.release(seqs)

    def abort(self, seq: Sequence) -> None:
        self.scheduler.abort(seq)
        root = seq.group.root if seq.group is not None else seq
        self._release([seq, root, *self.scheduler.take_dropped()])

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_work() or self.in_flight is not None

    def generate_tokens(
        self,
        prompts: list[list[int]],
        params: SamplingParams | list[SamplingParams],
        progress_bar: bool | None = None,
    ) -> list[list[int]]:
        """Generate for each prompt; returns the new token ids of each, in input order."""
        seqs = self.run(self.add_requests(prompts, params), progress_bar)
        return [s.output_token_ids for s in seqs]

    def stream(
        self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]
    ) -> Iterator[tuple[int, list[int]]]:
        """Generate for each prompt, yielding ``(prompt index, new token ids)`` as the engine
        collects them. Requests still running when the iterator is closed are aborted."""
        yield from stream_new_tokens(self.add_requests(prompts, params), self.step, self.abort)

    def run(
        self, seqs: list[Sequence], progress_bar: bool | None = None, on_step=None
    ) -> list[Sequence]:
        """Step until every one of ``seqs`` has finished, calling ``on_step(seqs)`` after each
        step. If anything fails, the requests are dropped so that the engine stays usable.
        Under torchrun, ranks other than 0 follow rank 0's steps instead and take its results
        at the end (``on_step`` runs once then)."""
        if not self.is_leader:
            followers.adopt(seqs, self.executor.follow_run(), self.scheduler)
            if on_step is not None:
                on_step(seqs)
            return seqs
        # Off unless asked for (per call or by the engine option).
        show = self.config.progress_bar if progress_bar is None else progress_bar
        try:
            step_until_finished(seqs, self.step, self.abort, on_step,
                                self._progress if show else None)
        except BaseException as e:
            self.executor.finish_run(f"{type(e).__name__}: {e}")
            raise
        self.executor.finish_run(followers.outcome(seqs))
        return seqs

    def _progress(self, seconds: float) -> str:
        return progress_text(self._last_batch, self.stats(), seconds)

    # ---- lifecycle ------------------------------------------------------------------------

    def close(self) -> None:
        """Stop the tensor-parallel worker processes (joined, or killed if they do not stop)
        and free the process groups, the KV cache, the CUDA graphs and the weights, so that
        another model can load in this process; the engine serves nothing afterwards. Calling
        it again does nothing."""
        if self.closed:
            return
        self.closed = True
        self.in_flight = self._last_batch = None
        self.speculator.close()
        self.executor.close()

    def __enter__(self) -> EngineCore:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def stats(self) -> dict[str, int]:
        s, bm = self.scheduler, self.block_manager
        return {
            "prefix_cache_queries": s.prefix_cache_queries,
            "prefix_cache_hits": s.prefix_cache_hits,
            "num_blocks": bm.num_blocks,
            "num_free_blocks": bm.num_free_blocks,
            "num_cached_blocks": bm.num_cached_blocks,
            "num_shared_blocks": bm.num_shared_blocks,
            "num_blocks_saved": bm.num_blocks_saved,
            **_state_slot_stats(bm.state_slots),
            "num_preemptions": s.num_preemptions,
            "num_running": len(s.running),
            "num_waiting": len(s.waiting),
            "num_loras": len(self.adapters.loaded),
            "lora_bytes": self.executor.lora_bytes,
            **self.speculator.stats(),
        }


def _state_slot_stats(slots: StateSlots | None) -> dict[str, int]:
    """A hybrid model's state slots and snapshots in use, of how many, and the device bytes
    of them all."""
    if slots is None:
        return {}
    snapshots = slots.snapshots
    num_snapshots = snapshots.num_snapshots if snapshots else 0
    return {"num_state_slots": slots.num_slots, "num_used_state_slots": slots.num_used,
            "num_state_snapshots": num_snapshots,
            "num_used_state_snapshots": snapshots.num_used if snapshots else 0,
            "state_bytes": (slots.num_slots + num_snapshots) * slots.slot_bytes}
