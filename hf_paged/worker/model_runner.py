"""A scheduled batch -> input tensors and attention metadata -> model -> sampled tokens.

Owns the KV cache (sized from free GPU memory on CUDA, from ``cpu_kv_cache_gib`` on CPU) and
the CUDA graphs that replay decode steps (``decode_graphs``) and small prefill steps
(``prefill_graphs``), captured at start-up.

``launch`` only enqueues a step: its sampled tokens stay on the device (the next step reads
its pending input tokens from there) and reach the host through a pinned buffer that
``collect`` waits for, so the host prepares step N+1 while the device runs step N. Host
buffers that a copy may still be reading alternate between two twins.

Under tensor parallelism every rank holds a runner: rank 0 ``prepare``s a step's inputs on the
host (the executor sends them to the other ranks), every rank runs the same ``forward`` (graph
replay included), rank 0 alone receives the gathered logits and samples, and the sampled
tokens are broadcast back so that every rank reads the same pending tokens next step.

A step first makes its copy-on-write block copies (every rank, in its own cache shard). Rows of
a ``SequenceGroup`` member (beam search) are not sampled: their log-softmax, through the
group's processors, goes to the host as its top candidates (and as whole rows when the group
keeps them).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from hf_paged import kernels
from hf_paged.config import EngineConfig
from hf_paged.engine.scheduler import ScheduledBatch
from hf_paged.engine.sequence import Sequence
from hf_paged.kernels.launch import compiling_only
from hf_paged.modeling.attention import AttentionMetadata
from hf_paged.modeling.swap import PagedQwen3
from hf_paged.modeling.tp import SINGLE, TensorParallel
from hf_paged.sampling_params import SamplingParams
from hf_paged.worker.decode_graphs import DecodeGraphs
from hf_paged.worker.prefill_graphs import PrefillGraphs
from hf_paged.worker.projection_tuning import tune_projections

logger = logging.getLogger(__name__)
# Cascade attention (kernels.attention) pays two more kernels a layer to read a shared prefix
# once per tile of sequences instead of once per sequence: worth it from this many sequences
# times shared tokens and this many sequences (the smallest graph with a cascade twin).
_CASCADE_MIN_TOKENS = 1 << 13
_CASCADE_MIN_SEQS = 16
# Prefill steps of at most this many tokens and sequences replay a graph.
_PREFILL_GRAPH_TOKENS, _PREFILL_GRAPH_SEQS = 2048, 8


class BlockTableMirror:
    """Block tables of live sequences as rows of one int32 array, updated incrementally, so a
    step copies only new block ids instead of rebuilding every table."""

    def __init__(self, width: int):
        self.rows = np.zeros((0, width), dtype=np.int32)
        self.free_rows: list[int] = []
        # seq_id -> [row, number of entries synced, the block_table list they came from]
        self.state: dict[int, list] = {}

    def gather(self, seqs: list[Sequence]) -> np.ndarray:
        index, width = [], 1
        for seq in seqs:
            state = self.state.get(seq.seq_id)
            if state is None:
                state = self.state[seq.seq_id] = [self._take_row(), 0, seq.block_table]
            table = seq.block_table
            if state[2] is not table:  # preemption gave the sequence a new table
                state[1], state[2] = 0, table
            if len(table) > state[1]:
                self.rows[state[0], state[1] : len(table)] = table[state[1] :]
                state[1] = len(table)
            index.append(state[0])
            width = max(width, len(table))
        return self.rows[index, :width]

    def release(self, seqs: list[Sequence]) -> None:
        for seq in seqs:
            state = self.state.pop(seq.seq_id, None)
            if state is not None:
                self.free_rows.append(state[0])

    def _take_row(self) -> int:
        if not self.free_rows:
            old, width = self.rows.shape
            self.rows = np.vstack([self.rows, np.zeros((max(old, 64), width), np.int32)])
            self.free_rows = list(range(len(self.rows) - 1, old - 1, -1))
        return self.free_rows.pop()


def to_device(values: list, device: torch.device, dtype: torch.dtype = torch.long):
    """A host list on ``device`` without waiting for the device: ``torch.tensor(...,
    device=...)`` copies synchronously, which would wait for the step before."""
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)


@dataclass
class StepInputs:
    """One step's inputs as host data: what every rank needs to run the same forward.

    Per token: ``ids`` (0 where pending), ``src`` (its row in the last step's samples, or -1),
    ``positions``, ``slots``. Per sequence: ``cu_seqlens`` (B+1), ``seq_lens``, ``tables``
    (block-table rows). ``logits_rows``: the token rows whose logits are sampled. ``graph_bs``:
    the decode graph to replay (0: eager); ``shared``: cascade prefix tokens (0: none).
    """

    ids: list[int]
    src: list[int]
    positions: list[int]
    slots: list[int]
    cu_seqlens: list[int]
    seq_lens: list[int]
    tables: np.ndarray
    logits_rows: list[int]
    max_query_len: int
    graph_bs: int
    shared: int
    # Copy-on-write block copies (source, destination) to make before the forward, in order.
    block_copies: list[tuple[int, int]]
    # Tokens the step draws: sampled rows of no group, then one per follower forked by it.
    num_drawn: int


@dataclass
class LaunchedStep:
    """A step enqueued on the device; ``tokens`` (one per sampled row) is valid once ``done``
    has passed."""

    batch: ScheduledBatch
    tokens: torch.Tensor | None
    done: torch.cuda.Event | None
    # Group members' rows: (top scores, their token ids, whole score rows, whole logit rows).
    candidates: tuple | None = None

    @property
    def has_group_rows(self) -> bool:
        return self.candidates is not None


class ModelRunner:
    def __init__(self, model: PagedQwen3, config: EngineConfig, max_model_len: int,
                 tp: TensorParallel = SINGLE):
        self.model = model
        self.tp = tp
        self.config = config
        self.max_model_len = max_model_len
        self.block_size = config.block_size
        self.max_blocks_per_seq = -(-max_model_len // self.block_size)
        self.device = model.embed_tokens.weight.device
        self.dtype = model.embed_tokens.weight.dtype
        self.startup_seconds: dict[str, float] = {}
        self.block_tables = BlockTableMirror(self.max_blocks_per_seq)
        # The last step's sampled tokens, on the device, and the row of each sequence in them.
        self.last_tokens = torch.zeros(config.max_num_seqs, dtype=torch.long, device=self.device)
        self.last_rows: dict[int, int] = {}
        # Repetition penalties: one row per penalized sequence, True where a token was seen.
        self.seen = torch.zeros(0, model.config.vocab_size, dtype=torch.bool, device=self.device)
        self.seen_rows: dict[int, int] = {}
        self.free_seen_rows: list[int] = []
        # The value marked, on the device: assigning a Python True copies it from the host and
        # waits for the device (no asynchronous overlap).
        self.true = torch.ones((), dtype=torch.bool, device=self.device)
        self.flip = 0  # which twin of each double-buffered host buffer this step uses
        if self.device.type == "cuda":
            self.host_tokens = [
                torch.zeros(config.max_num_seqs, dtype=torch.long).pin_memory() for _ in "ab"
            ]
        # Start-up's measurements behind its choice of kernel for each projection shape.
        self.projection_timings: dict[str, dict] = {}
        self.decode_graphs: DecodeGraphs | None = None
        self.prefill_graphs: PrefillGraphs | None = None
        graphs = (self.device.type == "cuda" and config.attention_backend == "triton"
                  and not config.enforce_eager)
        if graphs:
            self.decode_graphs, self.prefill_graphs = self._new_graphs()
        # On CUDA every kernel variant compiles first, all at once, so that sizing the KV cache,
        # the warm-up steps and the captures run compiled kernels only.
        if self.device.type == "cuda":
            with self._stage("projections", "timing the projections"):
                self.projection_timings = tune_projections(self.model.layers)
            chosen = {shape: r["small_m_rows"] for shape, r in self.projection_timings.items()}
            self._log(f"small-M kernel up to these rows, by projection shape: {chosen}")
            with self._stage("kernels", "compiling kernels"):
                self._compile_ahead()
        with self._stage("kv_cache", "sizing and allocating the KV cache"):
            self.num_blocks = self._allocate_kv_cache()
        self._log(f"KV cache of {self.num_blocks} blocks "
                  f"({self.num_blocks * self._block_bytes() / 2**30:.2f} GiB)")
        if self.device.type == "cuda":
            with self._stage("warm_up", "warm-up steps"):
                self._warm_steps()
        if graphs:
            with self._stage("graphs", "capturing the decode and prefill graphs"):
                self.decode_graphs.capture()
                self.prefill_graphs.capture()
        self._log(f"ready; start-up seconds {self.startup_seconds}")

    @contextlib.contextmanager
    def _stage(self, name: str, message: str) -> Iterator[None]:
        """A start-up stage: logged as it begins, its seconds kept in ``startup_seconds``."""
        self._log(message)
        start = time.perf_counter()
        yield
        self.startup_seconds[name] = time.perf_counter() - start

    def _log(self, message: str) -> None:
        """Start-up stages, for ``logging`` at INFO (where a slow or stuck start is)."""
        logger.info("rank %d of %d: %s", self.tp.rank, self.tp.size, message)

    # ---- KV cache -------------------------------------------------------------------------

    def _block_bytes(self) -> int:
        attn = self.model.attention_layers[0]
        per_token = 2 * attn.num_kv_heads * attn.head_dim * self.dtype.itemsize
        return per_token * self.block_size * len(self.model.attention_layers)

    def _allocate_kv_cache(self) -> int:
        cfg = self.config
        if cfg.num_kv_blocks is not None:
            num_blocks = cfg.num_kv_blocks
        else:
            if self._sizing_runs():
                num_blocks = self._blocks_that_fit_on_gpu()
            else:
                num_blocks = int(cfg.cpu_kv_cache_gib * 2**30) // self._block_bytes()
            # More blocks than every running sequence at full length could use is waste (and
            # on a shared GPU, memory taken from its neighbours).
            num_blocks = min(num_blocks, cfg.max_num_seqs * self.max_blocks_per_seq)
        num_blocks = self.tp.min_over_ranks(num_blocks, self.device)  # one cache shape for all
        if num_blocks < 1:
            memory = "gpu_memory_utilization" if self.device.type == "cuda" else "cpu_kv_cache_gib"
            raise ValueError(
                f"no memory is left for the KV cache: raise {memory} or set num_kv_blocks"
            )
        self._set_kv_cache(num_blocks, separate=True)
        return num_blocks

    def _set_kv_cache(self, num_blocks: int, separate: bool = False) -> None:
        """Give every layer a zeroed cache of ``num_blocks`` blocks: separate K and V tensors
        (the real cache), or one tensor serving as both (a throwaway for start-up's steps,
        which store nothing)."""
        attn = self.model.attention_layers[0]
        shape = (num_blocks, self.block_size, attn.num_kv_heads, attn.head_dim)
        for layer in self.model.attention_layers:
            layer.k_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
            layer.v_cache = (torch.zeros(shape, dtype=self.dtype, device=self.device)
                             if separate else layer.k_cache)

    def _sizing_runs(self) -> bool:
        """Whether sizing the KV cache runs ``_sizing_step`` (on CUDA, unless given a size)."""
        return self.device.type == "cuda" and self.config.num_kv_blocks is None

    def _sizing_step(self) -> tuple[int, int]:
        """The largest step the scheduler can make: (sequences, tokens each)."""
        cfg = self.config
        num_seqs = min(cfg.max_num_seqs, cfg.max_num_batched_tokens)
        return num_seqs, min(cfg.max_num_batched_tokens // num_seqs, self.max_model_len)

    def _blocks_that_fit_on_gpu(self) -> int:
        """Run the largest step once on a throwaway cache to learn peak activation memory."""
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        num_seqs, per_seq = self._sizing_step()
        self._set_kv_cache(num_seqs * -(-per_seq // self.block_size))
        self._warmup(num_seqs, per_seq)
        self._set_kv_cache(0)
        free, total = torch.cuda.mem_get_info()
        used_now = total - free
        peak_extra = torch.cuda.max_memory_allocated() - torch.cuda.memory_allocated()
        budget = total * self.config.gpu_memory_utilization - used_now - peak_extra
        return int(budget) // self._block_bytes()

    @torch.inference_mode()
    def _warmup(self, num_seqs: int, per_seq: int, context: int = 0, shared: bool = False):
        """One sampled step of ``num_seqs`` sequences computing ``per_seq`` tokens each after
        ``context`` cached ones, all in block 0's neighbourhood, storing nothing: it runs (and
        so compiles) every kernel such a step needs."""
        tokens = torch.zeros(num_seqs * per_seq, dtype=torch.long, device=self.device)
        positions = torch.arange(context, context + per_seq, device=self.device).repeat(num_seqs)
        bps = -(-(context + per_seq) // self.block_size)
        meta = AttentionMetadata(
            slot_mapping=torch.full_like(tokens, -1),
            cu_seqlens_q=torch.arange(0, num_seqs + 1, device=self.device, dtype=torch.int32)
            * per_seq,
            seq_lens=torch.full((num_seqs,), context + per_seq, device=self.device,
                                dtype=torch.int32),
            block_tables=torch.zeros((num_seqs, bps), device=self.device, dtype=torch.int32),
            max_query_len=per_seq,
            shared_prefix=torch.tensor([context], device=self.device, dtype=torch.int32)
            if shared else None,
        )
        hidden = self.model.forward(tokens, positions, meta)
        logits = self.model.compute_logits(hidden[:num_seqs])
        if logits is not None:  # rank 0 samples
            sampled = SamplingParams(temperature=1.0, top_k=2, top_p=0.5)
            self._sample(logits, [Sequence([0], sampled)] * num_seqs)
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def _new_graphs(self) -> tuple[DecodeGraphs, PrefillGraphs]:
        """The decode and prefill graphs this configuration captures (not captured yet)."""
        config = self.config
        return (DecodeGraphs(self, config.max_graph_batch_size or min(config.max_num_seqs, 512),
                             _CASCADE_MIN_SEQS),
                PrefillGraphs(self, min(_PREFILL_GRAPH_TOKENS, config.max_num_batched_tokens),
                              min(_PREFILL_GRAPH_SEQS, config.max_num_seqs)))

    def _compile_ahead(self, workers: int | None = None) -> None:
        """Compile every kernel variant a request can need, on ``workers`` threads, so none
        compiles inside one: the KV-cache sizing step, the warm-up steps and every graph's
        step run with each launch only compiling its kernel (``compiling_only``), over the
        first two layers (the first norms without a residual, the others with one; every
        other layer launches the same variants as the second) and a two-block cache. If this
        fails, kernels compile one at a time as the steps first run them, with a warning."""
        layers = self.model.layers
        self.model.layers = layers[:2]
        self._set_kv_cache(2)
        try:
            with torch.inference_mode(), compiling_only(workers):
                if self._sizing_runs():
                    self._warmup(*self._sizing_step())
                self._warm_steps()
                self._graph_steps()
        except Exception as e:  # e.g. a Triton without asynchronous compilation
            logger.warning("rank %d of %d: kernels compile one at a time (%s)", self.tp.rank,
                           self.tp.size, e)
        finally:
            self.model.layers = layers
            self._set_kv_cache(0)

    def _graph_steps(self) -> None:
        """Every graph's step once, eagerly, over the layout its capture runs on."""
        for graphs in (self.decode_graphs, self.prefill_graphs):
            for _, step in graphs.steps() if graphs else ():
                step()

    def _warm_steps(self) -> None:
        """Steps that launch every kernel variant of prefill, sampling and decode (with and
        without split-K, the small-M projections and cascade). Run eagerly before the graphs
        are captured, so that no capture launches a kernel for the first time (and they are
        what eager decode runs when nothing is captured)."""
        self._warmup(2, 3)
        context = self.block_size * min(4, self.max_blocks_per_seq - 1)
        for num_seqs in (1, self.config.max_num_seqs):
            self._warmup(num_seqs, 1, context)
        if self.config.attention_backend == "triton":
            self._warmup(_CASCADE_MIN_SEQS, 1, context, shared=True)

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
        self.last_tokens = self.seen = None
        for layer in self.model.attention_layers:
            layer.k_cache = layer.v_cache = torch.empty(0)

    # ---- inputs ---------------------------------------------------------------------------

    def prepare(self, batch: ScheduledBatch) -> StepInputs:
        """Flat token ids, positions and slots, plus per-sequence metadata, built with plain
        ints for the one-token (decode) rows: this runs on the host every step. A token still
        pending on the device gets id 0 here and ``src`` names its row in ``last_tokens``
        (-1 everywhere else)."""
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        src: list[int] = []
        cu_seqlens, seq_lens, logits_rows = [0], [], []
        for seq, start, n, sample in zip(batch.seqs, batch.starts, batch.num_tokens, batch.sample):
            end = start + n
            table = seq.block_table
            if n == 1:
                if start < len(seq.token_ids):
                    input_ids.append(seq.token_ids[start])
                    src.append(-1)
                else:  # only the newest token can be pending, and only in a one-token chunk
                    input_ids.append(0)
                    src.append(self.last_rows[seq.seq_id])
                positions.append(start)
                slots.append(table[start // bs] * bs + start % bs)
            else:
                input_ids.extend(seq.token_ids[start:end])
                src.extend([-1] * n)
                pos = np.arange(start, end)
                positions.extend(pos.tolist())
                slots.extend((np.asarray(table)[pos // bs] * bs + pos % bs).tolist())
            cu_seqlens.append(cu_seqlens[-1] + n)
            seq_lens.append(end)
            if sample:
                logits_rows.append(cu_seqlens[-1] - 1)
        tables = self.block_tables.gather(batch.seqs)
        drawn = sum(1 for s, m in zip(batch.seqs, batch.sample) if m and s.group is None)
        graph_bs = self.decode_graphs.batch_size(batch) if self.decode_graphs else 0
        return StepInputs(
            input_ids, src, positions, slots, cu_seqlens, seq_lens, tables, logits_rows,
            max(batch.num_tokens), graph_bs,
            self._shared_prefix_len(batch, tables), batch.block_copies,
            drawn + len(batch.sample_copies),
        )

    def release(self, seqs: list[Sequence]) -> None:
        """Forget finished or aborted sequences."""
        self.block_tables.release(seqs)
        for seq in seqs:
            row = self.seen_rows.pop(seq.seq_id, None)
            if row is not None:
                self.free_seen_rows.append(row)

    # ---- running --------------------------------------------------------------------------

    def launch(self, batch: ScheduledBatch) -> LaunchedStep:
        """Enqueue the batch's forward and sampling on the device without waiting for it."""
        return self.run(batch, self.prepare(batch))

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch, inputs: StepInputs) -> LaunchedStep:
        """Rank 0: the forward of prepared ``inputs``, then sampling."""
        sampled_seqs = [s for s, sample in zip(batch.seqs, batch.sample) if sample]
        logits, drawn = self.forward(inputs, [s.params for s in sampled_seqs])
        if logits is None:  # only partial prefill chunks: nothing to sample yet
            return LaunchedStep(batch, None, None)
        tokens = candidates = None
        try:
            if batch.sample_copies or any(s.group is not None for s in sampled_seqs):
                logits, drawn, sampled_seqs, candidates = self._split_rows(
                    batch, logits, drawn, sampled_seqs)
            tokens = self._sample(logits, sampled_seqs, drawn)
        finally:  # the other ranks wait for this step's tokens even if sampling failed
            if inputs.num_drawn:
                self._share_tokens(tokens, inputs.num_drawn)
        self.last_rows = {s.seq_id: row for row, s in enumerate(sampled_seqs)}
        if self.device.type != "cuda":
            return LaunchedStep(batch, tokens, None, candidates)
        host = self.host_tokens[self.flip][: len(tokens)]
        host.copy_(tokens, non_blocking=True)
        if candidates is not None:
            candidates = tuple(None if t is None else self._to_host(t) for t in candidates)
        done = torch.cuda.Event()
        done.record()
        return LaunchedStep(batch, host, done, candidates)

    @torch.inference_mode()
    def follow(self, inputs: StepInputs) -> None:
        """Ranks other than 0: the same forward as rank 0, then rank 0's sampled tokens."""
        self.forward(inputs)
        if inputs.logits_rows and inputs.num_drawn:
            self._share_tokens(None, inputs.num_drawn)

    def forward(
        self, inputs: StepInputs, params: list[SamplingParams] | None = None
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Logits of the sampled rows (on rank 0; None elsewhere or when no row is sampled),
        and the tokens a decode graph drew from them with ``params`` (rank 0's)."""
        if inputs.block_copies:
            self._copy_blocks(inputs.block_copies)
        self.flip ^= 1
        if inputs.graph_bs:
            return self.decode_graphs.run(inputs, params, self.flip)
        bucket = self.prefill_graphs.bucket(inputs) if self.prefill_graphs else 0
        if bucket:
            return self.prefill_graphs.run(inputs, bucket, self.flip), None
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=self._to_device(inputs.slots, torch.long),
            cu_seqlens_q=self._to_device(inputs.cu_seqlens, torch.int32),
            seq_lens=self._to_device(inputs.seq_lens, torch.int32),
            block_tables=torch.from_numpy(inputs.tables).to(dev, non_blocking=True),
            max_query_len=inputs.max_query_len,
            shared_prefix=self._to_device([inputs.shared], torch.int32) if inputs.shared else None,
        )
        input_ids = self._to_device(inputs.ids, torch.long)
        if max(inputs.src) >= 0:
            input_ids = self._take_pending(input_ids, self._to_device(inputs.src, torch.long))
        positions = self._to_device(inputs.positions, torch.long)
        hidden = self.model.forward(input_ids, positions, meta)
        rows = inputs.logits_rows
        if not rows:
            return None, None
        if len(rows) != hidden.shape[0]:
            hidden = hidden[self._to_device(rows, torch.long)]
        return self.model.compute_logits(hidden), None

    def _split_rows(self, batch: ScheduledBatch, logits, drawn, sampled_seqs):
        """Rows to sample (plain sequences, then each follower on its leader's row) and the
        group members' candidates. A graph's drawn tokens serve the plain rows, unless
        followers must draw their own from their leader's row."""
        row_of = {}  # batch index -> row of logits
        for i, sample in enumerate(batch.sample):
            if sample:
                row_of[i] = len(row_of)
        plain = [r for r, s in enumerate(sampled_seqs) if s.group is None]
        grouped = [r for r, s in enumerate(sampled_seqs) if s.group is not None]
        rows = plain + [row_of[i] for i, _ in batch.sample_copies]
        members = [sampled_seqs[r] for r in grouped]
        candidates = self._candidates(logits[self._to_device(grouped, torch.long)], members)
        index = self._to_device(rows, torch.long)
        seqs = [sampled_seqs[r] for r in plain] + [f for _, f in batch.sample_copies]
        drawn = None if drawn is None or batch.sample_copies else drawn[index]
        return logits[index], drawn, seqs, candidates

    def _candidates(self, logits: torch.Tensor, members: list[Sequence]):
        """Each member's top ``num_candidates`` log-probabilities after its group's processors,
        as (scores, token ids, whole score rows or None, whole logit rows or None)."""
        if not members:
            return None
        logits = logits.float()
        scores = torch.log_softmax(logits, dim=-1)
        by_scorer: dict[int, list[int]] = {}
        for row, seq in enumerate(members):
            if seq.group.scorer is not None:
                by_scorer.setdefault(id(seq.group.scorer), []).append(row)
        for rows in by_scorer.values():
            index = self._to_device(rows, torch.long)
            scorer = members[rows[0]].group.scorer
            scores[index] = scorer.process([members[r] for r in rows], scores[index])
        k = max(seq.group.num_candidates for seq in members)
        top, ids = scores.topk(min(k, scores.shape[-1]), dim=-1)
        if any(seq.group.keep_rows for seq in members):
            return top, ids, scores, logits
        return top, ids, None, None

    def _to_host(self, tensor: torch.Tensor) -> torch.Tensor:
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        return host.copy_(tensor, non_blocking=True)

    def _copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write copies in the order made. A block that one copy reads may have been
        freed (preemption) and become a later copy's destination: such reads go first, so no
        launch has a block both as a source and a destination."""
        destinations = {d for _, d in copies}
        first = [c for c in copies if c[0] in destinations]
        for wave in (first, [c for c in copies if c[0] not in destinations]):
            if wave:
                src, dst = (self._to_device(list(x), torch.long) for x in zip(*wave))
                for layer in self.model.attention_layers:
                    kernels.copy_blocks(layer.k_cache, layer.v_cache, src, dst)

    def _share_tokens(self, tokens: torch.Tensor | None, n: int) -> None:
        """Keep the sampled tokens on the device as the next step's pending inputs; under
        tensor parallelism rank 0 broadcasts them (zeros if its sampling failed)."""
        if tokens is not None:
            self.last_tokens[:n].copy_(tokens)
        elif self.tp.rank == 0:
            self.last_tokens[:n].zero_()
        self.tp.broadcast_from_first(self.last_tokens[:n])

    @staticmethod
    def collect(step: LaunchedStep) -> tuple[list[int], list[tuple]]:
        """Wait for a launched step; return its sampled tokens and, for each group member's
        row, (scores, token ids, score row, logit row) (the rows None unless kept)."""
        if step.tokens is None:
            return [], []
        if step.done is not None:
            step.done.synchronize()
        if step.candidates is None:
            return step.tokens.tolist(), []
        top, ids, scores, logits = step.candidates
        rows = [(None, None)] * len(top) if scores is None else list(zip(scores, logits))
        return step.tokens.tolist(), [(t, i, *r) for t, i, r in zip(top, ids, rows)]

    def _shared_prefix_len(self, batch: ScheduledBatch, tables: np.ndarray) -> int:
        """Leading context tokens that every sequence of a decode batch holds in the same
        blocks, when enough for cascade attention (0 otherwise)."""
        if (self.config.attention_backend != "triton" or not batch.is_decode
                or len(batch.seqs) < _CASCADE_MIN_SEQS):
            return 0
        # Whole blocks before each sequence's newest token (a mirror row may be stale after).
        limit = min(min(batch.starts) // self.block_size, tables.shape[1])
        same = (tables[:, :limit] == tables[:1, :limit]).all(axis=0)
        shared = (limit if same.all() else int(same.argmin())) * self.block_size
        return shared if len(batch.seqs) * shared >= _CASCADE_MIN_TOKENS else 0

    def _to_device(self, values: list, dtype: torch.dtype) -> torch.Tensor:
        return to_device(values, self.device, dtype)

    def _take_pending(self, ids: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
        """``ids`` with each pending token (``src >= 0``) read from the last step's samples."""
        return torch.where(src >= 0, self.last_tokens[src.clamp(min=0)], ids)

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence], drawn=None) -> torch.Tensor:
        """One token per row of ``logits`` for ``seqs``. ``drawn``: the tokens a decode graph
        already drew from ``logits`` with these requests' settings. Requests without a
        repetition penalty or hooks skip logits processing altogether."""
        params = [s.params for s in seqs]
        penalized = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0]
        processed = penalized or any(p.hooks is not None for p in params)
        if processed:
            logits = self._process(logits, seqs, penalized)
        if drawn is not None and not processed:
            tokens = drawn
        elif not any(p.temperature for p in params):
            tokens = logits.argmax(-1)
        else:
            tokens = kernels.sample(
                logits,
                self._to_device([p.temperature for p in params], torch.float32),
                self._to_device([p.top_k for p in params], torch.int32),
                self._to_device([p.top_p for p in params], torch.float32),
            )
        for members in self._hook_groups(seqs) if processed else ():
            index = self._to_device(members, torch.long)
            seqs[members[0]].params.hooks.record([seqs[i] for i in members], tokens[index])
        if penalized:  # the new tokens count as seen from the next step on
            rows = self._to_device([self.seen_rows[seqs[i].seq_id] for i in penalized], torch.long)
            self.seen.index_put_((rows, tokens[self._to_device(penalized, torch.long)]),
                                 self.true)
        return tokens

    def _process(self, logits: torch.Tensor, seqs: list[Sequence], penalized: list[int]):
        """Repetition penalties over each request's seen-token mask, then each hooks object's
        ``process`` over all of its requests at once. Works in place: ``logits`` is this
        step's own (a graph's output buffer is rewritten only by a later replay)."""
        if penalized:
            rows = self._to_device([self._seen_row(seqs[i]) for i in penalized], torch.long)
            penalty = self._to_device([seqs[i].params.repetition_penalty for i in penalized],
                                      torch.float32)[:, None]
            every = len(penalized) == len(seqs)  # the common case: no gather, no scatter
            index = None if every else self._to_device(penalized, torch.long)
            scores = logits if every else logits[index]
            penalized_scores = torch.where(scores < 0, scores * penalty, scores / penalty)
            scores = torch.where(self.seen[rows], penalized_scores, scores)
            if every:
                logits = scores
            else:
                logits[index] = scores
        for members in self._hook_groups(seqs):
            hooks = seqs[members[0]].params.hooks
            index = self._to_device(members, torch.long)
            logits[index] = hooks.process([seqs[i] for i in members], logits[index])
        return logits

    @staticmethod
    def _hook_groups(seqs: list[Sequence]) -> list[list[int]]:
        """Indices of ``seqs`` grouped by the hooks object their requests share."""
        groups: dict[int, list[int]] = {}
        for i, seq in enumerate(seqs):
            if seq.params.hooks is not None:
                groups.setdefault(id(seq.params.hooks), []).append(i)
        return list(groups.values())

    def _seen_row(self, seq: Sequence) -> int:
        """The row of ``seen`` marking the tokens ``seq`` holds, filled on first use."""
        row = self.seen_rows.get(seq.seq_id)
        if row is not None:
            return row
        vocab = self.model.config.vocab_size
        if not self.free_seen_rows:
            old = len(self.seen)
            grown = torch.zeros(max(2 * old, 8), vocab, dtype=torch.bool, device=self.device)
            grown[:old] = self.seen
            self.seen = grown
            self.free_seen_rows = list(range(len(grown) - 1, old - 1, -1))
        row = self.seen_rows[seq.seq_id] = self.free_seen_rows.pop()
        self.seen[row] = False
        self.seen.index_put_((self._to_device([row], torch.long),
                              self._to_device(seq.token_ids, torch.long)), self.true)
        return row
