"""A step's plan -> inputs -> forward (a CUDA graph's replay where one fits) -> sampled tokens.

``launch`` only enqueues a step: its sampled tokens stay on the device (the next step reads
its pending input tokens from there) and reach the host through a pinned buffer that
``collect`` waits for, so the host prepares step N+1 while the device runs step N. Host
buffers that a copy may still be reading alternate between two twins.

Under tensor parallelism every rank holds a runner: rank 0 ``prepare``s a step's inputs on the
host (the executor sends them to the other ranks), every rank runs the same ``forward`` (graph
replay included), rank 0 alone receives the gathered logits and samples, and the sampled
tokens are broadcast back so that every rank reads the same pending tokens next step.

The parts, one job each: ``inputs.StepPreparer`` (plan -> inputs), ``kv_cache.KVCache``,
a hybrid model's ``state_cache.StateCache``, ``sampler.Sampler``, the graphs
(``decode_graphs``, ``prefill_graphs``) and ``startup``.
"""

from __future__ import annotations

import torch

from hf_paged import kernels
from hf_paged.config import EngineConfig
from hf_paged.device_copy import to_device
from hf_paged.families import family_for
from hf_paged.modeling.attention import AttentionMetadata
from hf_paged.modeling.paged_model import PagedModel
from hf_paged.modeling.tp import SINGLE, TensorParallel
from hf_paged.step import StepInputs, StepPlan
from hf_paged.worker.decode_graphs import DecodeGraphs, on_adapters
from hf_paged.worker.inputs import CASCADE_MIN_SEQS, StepPreparer, device_metadata
from hf_paged.worker.kv_cache import KVCache, cache_dtype
from hf_paged.worker.launched_step import LaunchedStep, collect, pinned_copy, to_host
from hf_paged.worker.lora_slots import LoraSlots
from hf_paged.worker.prefill_graphs import PrefillGraphs
from hf_paged.worker.sampler import Sampler, draw_counts, kernel_settings, per_draw
from hf_paged.worker.shard import SYMMETRIC_ALL_REDUCE_TOKENS
from hf_paged.worker.startup import Startup
from hf_paged.worker.state_cache import state_cache_for

# Prefill steps of up to this many tokens and sequences replay a graph (a full step budget:
# launching an 8,192-token step eagerly takes the host longer than the device's 18 ms), and
# so do steps verifying drafts that draw up to this many rows (a row costs the LM head little).
_PREFILL_GRAPH_TOKENS, _PREFILL_GRAPH_SEQS, _PREFILL_GRAPH_ROWS = 8192, 256, 64


class ModelRunner:
    def __init__(self, model: PagedModel, config: EngineConfig, max_model_len: int,
                 tp: TensorParallel = SINGLE):
        self.model = model
        self.tp = tp
        self.config = config
        self.max_model_len = max_model_len
        self.device = model.embed_tokens.weight.device
        self.dtype = model.embed_tokens.weight.dtype
        self.width = -(-max_model_len // config.block_size)  # blocks of the longest sequence
        self.kv = KVCache(model.attention_layers, config.block_size,
                          cache_dtype(config.kv_cache_dtype, self.dtype), self.device)
        # A hybrid model's linear-attention states: a slot per sequence that may run, then
        # the prefix cache's snapshots.
        self.states = state_cache_for(model, tp.size, self.dtype, self.device)
        self.num_state_slots = config.max_num_seqs if self.states else 0
        self.num_state_snapshots = config.num_state_snapshots \
            if self.states and config.enable_prefix_caching else 0
        self.preparer = StepPreparer(config.block_size, self.width,
                                     cascade=config.attention_backend == "triton")
        self.sampler = Sampler(model.config.vocab_size, self.device)
        self.lora = LoraSlots(model, config.max_loras, config.max_lora_rank,
                              family_for(model.config).weight_target)
        if config.enable_lora:  # before the KV cache takes what memory is left
            self.lora.allocate()
        # The last step's sampled tokens, on the device: the next step's pending inputs.
        self.last_tokens = torch.zeros(config.max_num_seqs, dtype=torch.long, device=self.device)
        self.flip = 0  # which twin of each double-buffered host buffer this step uses
        if self.device.type == "cuda":
            self.host_tokens = [
                torch.zeros(config.max_num_seqs, dtype=torch.long).pin_memory() for _ in "ab"
            ]
            self.host_probs = [
                torch.zeros(config.max_num_seqs, dtype=torch.float32).pin_memory() for _ in "ab"
            ]
        self.decode_graphs: DecodeGraphs | None = None
        self.prefill_graphs: PrefillGraphs | None = None
        if (self.device.type == "cuda" and config.attention_backend == "triton"
                and not config.enforce_eager):
            self.decode_graphs, self.prefill_graphs = self.new_graphs()
        startup = Startup(model, self.kv, self.sampler, config, max_model_len, tp,
                          [g for g in (self.decode_graphs, self.prefill_graphs) if g],
                          self.states, self.num_state_slots + self.num_state_snapshots)
        startup.run()
        if self.lora.stacks and self.decode_graphs is not None:
            self.decode_graphs.capture_adapters()
        self.startup_seconds = startup.seconds
        self.projection_timings = startup.projection_timings

    @property
    def num_blocks(self) -> int:
        return self.kv.num_blocks

    @property
    def state_slot_bytes(self) -> int:
        """Device bytes of one state slot over every linear layer (0: not a hybrid model)."""
        return self.states.slot_bytes() if self.states else 0

    # ---- the graphs and the steps they capture -----------------------------------------------

    def new_graphs(self) -> tuple[DecodeGraphs, PrefillGraphs]:
        """The decode and prefill graphs the engine's settings call for (not captured yet)."""
        config = self.config
        max_tokens = min(_PREFILL_GRAPH_TOKENS, config.max_num_batched_tokens)
        if self.tp.size > 1:  # a larger step's all-reduces leave symmetric memory for NCCL
            max_tokens = min(max_tokens, SYMMETRIC_ALL_REDUCE_TOKENS)
        return (self.new_decode_graphs(config.max_graph_batch_size
                                       or min(config.max_num_seqs, 512)),
                self.new_prefill_graphs(max_tokens, min(_PREFILL_GRAPH_SEQS,
                                                        config.max_num_seqs)))

    def new_decode_graphs(self, max_bs: int) -> DecodeGraphs:
        """Decode graphs up to ``max_bs`` rows over this runner's steps (not captured yet)."""
        return DecodeGraphs(self._decode_step, self._decode_outputs, self.tp.size == 1, max_bs,
                            self.width, self.device, CASCADE_MIN_SEQS, self.lora.rows,
                            states=self.states is not None)

    def new_prefill_graphs(self, max_tokens: int, max_seqs: int) -> PrefillGraphs:
        """Prefill graphs up to ``max_tokens`` tokens of ``max_seqs`` sequences (not captured
        yet)."""
        return PrefillGraphs(self._prefill_step, self.model.gather_logits, max_tokens, max_seqs,
                             self.width, self.device, min(_PREFILL_GRAPH_ROWS, max_tokens),
                             states=self.states is not None)

    def _forward_pending(self, ids, src, positions, meta: AttentionMetadata) -> torch.Tensor:
        """The model's hidden states, each pending token (``src >= 0``) read from the last
        step's samples."""
        return self.model.forward(ids, positions, meta, pending=(src, self.last_tokens))

    def _decode_step(self, ids, src, positions, meta, temperature, top_k, top_p, min_p
                     ) -> tuple:
        """Logits in the model dtype and the tokens drawn from them (one rank), or this rank's
        logits slice. The sampling kernel reads them as float32 as it loads them: a float32
        copy of a large batch's logits would cost more than the draw."""
        hidden = self._forward_pending(ids, src, positions, meta)
        logits = self.model.lm_head(hidden)
        if self.tp.size > 1:
            return (logits,)
        # Drawn straight into the next step's pending tokens (``_share_tokens`` then has
        # nothing to copy); greedy rows take the argmax.
        return logits, kernels.sample(logits, temperature, top_k, top_p, min_p,
                                      out=self.last_tokens[: logits.shape[0]])

    def _decode_outputs(self, outputs: tuple, n: int) -> tuple:
        """A decode graph's outputs for its first ``n`` rows: (logits, drawn tokens), or the
        gathered logits (rank 0; None elsewhere) and no tokens. Logits in the model dtype
        reach the sampler, which takes float32 copies of the rows it processes."""
        if self.tp.size > 1:
            return self.model.gather_logits(outputs[0][:n]), None
        logits, drawn = outputs
        return logits[:n], drawn[:n]

    def _prefill_step(self, ids, src, positions, meta, logits_rows) -> tuple[torch.Tensor]:
        hidden = self._forward_pending(ids, src, positions, meta)
        return (self.model.lm_head(hidden.index_select(0, logits_rows)),)

    # ---- running --------------------------------------------------------------------------

    def prepare(self, plan: StepPlan) -> StepInputs:
        graph_bs = (self.decode_graphs.batch_size(plan.is_decode, len(plan.seq_ids),
                                                  on_adapters(plan.lora_slots))
                    if self.decode_graphs else 0)
        return self.preparer.prepare(plan, graph_bs)

    def launch(self, plan: StepPlan) -> LaunchedStep:
        """Enqueue the step's forward and sampling on the device without waiting for it."""
        return self.run(plan, self.prepare(plan))

    @torch.inference_mode()
    def run(self, plan: StepPlan, inputs: StepInputs) -> LaunchedStep:
        """Rank 0: the forward of prepared ``inputs``, then sampling."""
        rows = [row for row, sample in zip(plan.sampling, plan.sample) if sample]
        settings = kernel_settings(rows) if inputs.graph_bs and self.tp.size == 1 else None
        logits, drawn = self.forward(inputs, settings)
        if logits is None:  # only partial prefill chunks: nothing to sample yet
            return LaunchedStep(None, None)
        tokens = candidates = probs = None
        try:
            if plan.sample_copies or any(r.candidates is not None for r in rows):
                logits, drawn, rows, candidates = self.sampler.split_rows(plan, logits, drawn,
                                                                          rows)
            elif plan.num_draft_tokens:
                rows = per_draw(rows, draw_counts(plan))
            # Taken before sampling, which may process float32 logits in place: the raw
            # logits' softmax, as transformers' ConfidenceCriteria reads a greedy assistant's.
            scores = torch.softmax(logits, -1, dtype=torch.float32) if plan.report_probs \
                else None
            tokens = self.sampler.sample(logits, rows, drawn)
            if scores is not None:
                probs = scores.gather(-1, tokens[:, None])[:, 0]
        finally:  # the other ranks wait for this step's tokens even if sampling failed
            if inputs.num_drawn:
                self._share_tokens(tokens, inputs.num_drawn)
        self.preparer.sampled([r.seq_id for r in rows])
        if self.device.type != "cuda":
            return LaunchedStep(tokens, None, candidates, probs)
        host = pinned_copy(tokens, self.host_tokens[self.flip])
        if probs is not None:
            probs = pinned_copy(probs, self.host_probs[self.flip])
        if candidates is not None:
            candidates = tuple(None if t is None else to_host(t) for t in candidates)
        done = torch.cuda.Event()
        done.record()
        return LaunchedStep(host, done, candidates, probs)

    @torch.inference_mode()
    def follow(self, inputs: StepInputs) -> None:
        """Ranks other than 0: the same forward as rank 0, then rank 0's sampled tokens."""
        self.forward(inputs)
        if inputs.logits_rows and inputs.num_drawn:
            self._share_tokens(None, inputs.num_drawn)

    def forward(self, inputs: StepInputs, settings: tuple | None = None
                ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Logits of the sampled rows (on rank 0; None elsewhere or when no row is sampled),
        and the tokens a decode graph drew from them with ``settings`` (rank 0's)."""
        if inputs.block_copies:
            self.kv.copy_blocks(inputs.block_copies)
        if inputs.state_copies:
            self.states.copy_slots(inputs.state_copies)
        self.flip ^= 1
        if inputs.graph_bs:
            return self.decode_graphs.run(inputs, settings, self.flip)
        # The prefill graphs are captured without adapters: a prefill with adapter rows runs
        # eagerly.
        adapters = on_adapters(inputs.lora_slots)
        bucket = self.prefill_graphs.bucket(inputs) if self.prefill_graphs and not adapters \
            else 0
        if bucket:
            return self.prefill_graphs.run(inputs, bucket, self.flip), None
        dev = self.device
        meta = device_metadata(inputs, dev)
        input_ids = to_device(inputs.ids, dev)
        positions = to_device(inputs.positions, dev)
        self.lora.set_rows(meta.cu_seqlens_q, inputs.lora_slots if adapters else [],
                           inputs.max_query_len)
        try:
            if max(inputs.src) >= 0:
                hidden = self._forward_pending(input_ids, to_device(inputs.src, dev), positions,
                                               meta)
            else:
                hidden = self.model.forward(input_ids, positions, meta)
        finally:
            self.lora.set_rows(None, [], 0)
        rows = inputs.logits_rows
        if not rows:
            return None, None
        if len(rows) != hidden.shape[0]:
            hidden = hidden[to_device(rows, dev)]
        return self.model.compute_logits(hidden), None

    def _share_tokens(self, tokens: torch.Tensor | None, n: int) -> None:
        """Keep the sampled tokens on the device as the next step's pending inputs; under
        tensor parallelism rank 0 broadcasts them (zeros if its sampling failed)."""
        if tokens is not None:
            if tokens.data_ptr() != self.last_tokens.data_ptr():  # not drawn in place
                self.last_tokens[:n].copy_(tokens)
        elif self.tp.rank == 0:
            self.last_tokens[:n].zero_()
        self.tp.broadcast_from_first(self.last_tokens[:n])

    collect = staticmethod(collect)

    def load_lora(self, slot: int, adapter) -> None:
        """Put a LoRA adapter in ``slot``; after the first, capture the decode graphs that add
        adapter deltas. A capture draws into the pending tokens of the steps in flight, which
        are kept aside meanwhile."""
        self.lora.load(slot, adapter)
        if self.decode_graphs is not None and not self.decode_graphs.with_adapters:
            pending = self.last_tokens.clone()
            self.decode_graphs.capture_adapters()
            self.last_tokens.copy_(pending)

    def release(self, seq_ids: list[int]) -> None:
        """Forget finished or aborted sequences."""
        self.preparer.release(seq_ids)
        self.sampler.release(seq_ids)

    # ---- lifecycle ------------------------------------------------------------------------

    def drop_graphs(self) -> None:
        """Destroy the CUDA graphs (and free their memory pool and input buffers) now: NCCL
        frees or aborts a communicator only once no graph holds collectives of it. No device
        synchronisation: a replay still running (on a broken group, waiting for a dead rank)
        is freed when it ends."""
        for graphs in (self.decode_graphs, self.prefill_graphs):
            for graph, *_ in graphs.graphs.values() if graphs else ():
                graph.reset()
        self.decode_graphs = self.prefill_graphs = None

    def close(self, synchronize: bool = True) -> None:
        """Drop the graphs, the KV cache and the other device buffers (after the device's
        work, when ``synchronize``)."""
        if self.device.type == "cuda" and synchronize:
            torch.cuda.synchronize(self.device)
        self.drop_graphs()
        self.last_tokens = None
        self.sampler.close()
        self.kv.close()
        if self.states:
            self.states.close()
