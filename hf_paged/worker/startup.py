"""A runner's start-up, in order: allocate a hybrid model's state pools, time the projections'
kernels, compile every kernel variant ahead, calibrate an FP8 KV cache's scales (where the
checkpoint ships none), size and allocate the KV cache, run the warm-up steps, capture the
CUDA graphs.

On CUDA every kernel variant compiles first, all at once, so that sizing the KV cache, the
warm-up steps and the captures run compiled kernels only. The KV cache is sized from free GPU
memory after one run of the largest step the scheduler can make on a throwaway cache (its
peak activation memory), or from ``cpu_kv_cache_gib`` on the CPU; ``num_kv_blocks`` overrides
both. A hybrid model's state pools are allocated first and are never resized: on CUDA the
sizing sees the memory they took, on the CPU they are part of ``cpu_kv_cache_gib``. Each stage
is logged as it begins (where a slow or stuck start is) and timed.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator

import torch

from hf_paged.config import EngineConfig
from hf_paged.kernels import ORDERED_MIN_SEQS
from hf_paged.kernels.launch import compiling_only
from hf_paged.modeling.attention import AttentionMetadata
from hf_paged.modeling.paged_model import PagedModel
from hf_paged.modeling.tp import TensorParallel
from hf_paged.step import RowSampling
from hf_paged.worker.fp8_tuning import tune_fp8_projections
from hf_paged.worker.inputs import CASCADE_MIN_SEQS
from hf_paged.worker.kv_cache import KVCache
from hf_paged.worker.kv_scales import calibrate
from hf_paged.worker.prefill_graphs import PrefillGraphs
from hf_paged.worker.projection_tuning import tune_projections
from hf_paged.worker.sampler import Sampler
from hf_paged.worker.state_cache import StateCache

logger = logging.getLogger(__name__)
# What the warm-up steps sample with: every branch of the sampling kernel.
_WARM_SAMPLING = RowSampling(seq_id=-1, temperature=1.0, top_k=2, top_p=0.5,
                             repetition_penalty=1.0, history=[], hooks=None, request=None)


class Startup:
    """Runs the stages over a runner's parts; ``graphs`` are its (uncaptured) decode and
    prefill graphs, or none; ``states``: a hybrid model's state pools, of ``num_state_slots``
    slots; ``adapters``: LoRA stacks are allocated (``enable_lora``), and the graphs adding
    adapter deltas will be captured after start-up."""

    def __init__(self, model: PagedModel, kv: KVCache, sampler: Sampler, config: EngineConfig,
                 max_model_len: int, tp: TensorParallel, graphs: list,
                 states: StateCache | None = None, num_state_slots: int = 0,
                 adapters: bool = False):
        self.model, self.kv, self.sampler = model, kv, sampler
        self.states, self.num_state_slots = states, num_state_slots
        self.config, self.max_model_len, self.tp = config, max_model_len, tp
        self.graphs, self.adapters = graphs, adapters
        self.device = kv.device
        self.block_size = config.block_size
        self.max_blocks_per_seq = -(-max_model_len // self.block_size)
        self.seconds: dict[str, float] = {}
        # Start-up's measurements behind its choice of kernel for each projection shape.
        self.projection_timings: dict[str, dict] = {}

    def run(self) -> None:
        cuda = self.device.type == "cuda"
        if self.states is not None:  # first: every step below runs the linear layers
            self.states.allocate(self.num_state_slots)
            self._log(f"state pools of {self.num_state_slots} slots "
                      f"({self._state_bytes() / 2**30:.2f} GiB)")
        if cuda:
            with self._stage("projections", "timing the projections"):
                self.projection_timings = tune_projections(self.model.layers, self.model.lm_head)
                self.projection_timings |= tune_fp8_projections(
                    self.model.layers, self.model.embed_tokens.weight.dtype)
            chosen = {shape: r["small_m_rows"] for shape, r in self.projection_timings.items()}
            self._log(f"small-M kernel up to these rows, by projection shape: {chosen}")
            gemms = {shape: (r["w8a8_rows"], r["cublas_rows"], r.get("fp8_mma", "w8a8_linear"))
                     for shape, r in self.projection_timings.items() if "cublas_rows" in r}
            if gemms:
                self._log("FP8 GEMMs, (w8a8, cuBLAS) from these rows (0: never) and the w8a8 "
                          f"GEMM's kernel: {gemms}")
            with self._stage("kernels", "compiling kernels"):
                self._compile_ahead()
        if self.kv.calibrates:
            with self._stage("kv_scales", "calibrating the FP8 KV cache's scales"):
                calibrate(self.model, self.block_size, self.max_model_len)
        with self._stage("kv_cache", "sizing and allocating the KV cache"):
            self.kv.allocate(self._num_blocks())
        self._log(f"KV cache of {self.kv.num_blocks} blocks "
                  f"({self.kv.num_blocks * self.kv.block_bytes() / 2**30:.2f} GiB)")
        if cuda:
            with self._stage("warm_up", "warm-up steps"):
                self._warm_steps()
        if self.graphs:
            with self._stage("graphs", "capturing the decode and prefill graphs"):
                for graphs in self.graphs:
                    graphs.capture()
        self._log(f"ready; start-up seconds {self.seconds}")

    @contextlib.contextmanager
    def _stage(self, name: str, message: str) -> Iterator[None]:
        """A stage: logged as it begins, its seconds kept in ``seconds``."""
        self._log(message)
        start = time.perf_counter()
        yield
        self.seconds[name] = time.perf_counter() - start

    def _log(self, message: str) -> None:
        logger.info("rank %d of %d: %s", self.tp.rank, self.tp.size, message)

    # ---- KV cache sizing ------------------------------------------------------------------

    def _num_blocks(self) -> int:
        cfg = self.config
        if cfg.num_kv_blocks is not None:
            num_blocks = cfg.num_kv_blocks
        else:
            if self._sizing_runs():
                num_blocks = self._blocks_that_fit_on_gpu()
            else:
                num_blocks = (int(cfg.cpu_kv_cache_gib * 2**30) - self._state_bytes()) \
                    // self.kv.block_bytes()
            # More blocks than every running sequence at full length could use is waste (and
            # on a shared GPU, memory taken from its neighbours).
            num_blocks = min(num_blocks, cfg.max_num_seqs * self.max_blocks_per_seq)
        num_blocks = self.tp.min_over_ranks(num_blocks, self.device)  # one cache shape for all
        if num_blocks < 1:
            memory = "gpu_memory_utilization" if self.device.type == "cuda" else "cpu_kv_cache_gib"
            raise ValueError(
                f"no memory is left for the KV cache: raise {memory} or set num_kv_blocks"
            )
        return num_blocks

    def _state_bytes(self) -> int:
        """Bytes of the state pools (0: not a hybrid model)."""
        return self.states.slot_bytes() * self.num_state_slots if self.states else 0

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
        self.kv.allocate(num_seqs * -(-per_seq // self.block_size))
        self._warmup(num_seqs, per_seq)
        self.kv.allocate(0)
        free, total = torch.cuda.mem_get_info()
        used_now = total - free
        peak_extra = torch.cuda.max_memory_allocated() - torch.cuda.memory_allocated()
        # The prefill graphs keep their largest bucket's activations in a pool of their own,
        # beside what an eager step of the same size allocates: reserve both.
        graph_tokens = max((g.buckets[-1] for g in self.graphs if isinstance(g, PrefillGraphs)),
                           default=0)
        peak_extra *= 1 + min(1.0, graph_tokens / (num_seqs * per_seq))
        budget = total * self.config.gpu_memory_utilization - used_now - peak_extra
        return int(budget) // self.kv.block_bytes()

    # ---- steps that compile and warm --------------------------------------------------------

    @torch.inference_mode()
    def _warmup(self, num_seqs: int, per_seq: int, context: int = 0, shared: bool = False):
        """One sampled step of ``num_seqs`` sequences computing ``per_seq`` tokens each after
        ``context`` cached ones, all in block 0's neighbourhood, storing nothing: it runs (and
        so compiles) every kernel such a step needs."""
        dev = self.device
        if self.states is not None and per_seq > 1:  # a prefill needs a slot per sequence
            num_seqs = min(num_seqs, self.num_state_slots)
        tokens = torch.zeros(num_seqs * per_seq, dtype=torch.long, device=dev)
        positions = torch.arange(context, context + per_seq, device=dev).repeat(num_seqs)
        bps = -(-(context + per_seq) // self.block_size)
        meta = AttentionMetadata(
            slot_mapping=torch.full_like(tokens, -1),
            cu_seqlens_q=torch.arange(0, num_seqs + 1, device=dev, dtype=torch.int32) * per_seq,
            seq_lens=torch.full((num_seqs,), context + per_seq, device=dev, dtype=torch.int32),
            block_tables=torch.zeros((num_seqs, bps), device=dev, dtype=torch.int32),
            max_query_len=per_seq,
            shared_prefix=torch.tensor([context], device=dev, dtype=torch.int32)
            if shared else None,
            decode_order=torch.arange(num_seqs, device=dev, dtype=torch.int32)
            if per_seq == 1 else None,
        )
        if self.states is not None:  # distinct slots; rows past them are padding (-1)
            slots = torch.arange(num_seqs, device=dev, dtype=torch.int32)
            meta.state_slots = slots.masked_fill(slots >= self.num_state_slots, -1)
            meta.has_initial_state = torch.full((num_seqs,), context > 0, device=dev)
        hidden = self.model.forward(tokens, positions, meta)
        logits = self.model.compute_logits(hidden[:num_seqs])
        if logits is not None:  # rank 0 samples
            self.sampler.sample(logits, [_WARM_SAMPLING] * num_seqs)
        if dev.type == "cuda":
            torch.cuda.synchronize()

    def _compile_ahead(self, workers: int | None = None) -> None:
        """Compile every kernel variant a request can need, on ``workers`` threads, so none
        compiles inside one: the KV-cache sizing step, the warm-up steps and every graph's
        step run with each launch only compiling its kernel (``compiling_only``), over the
        first two layers (the first norms without a residual, the others with one; every
        other layer launches the same variants as the second), plus a hybrid model's first
        layer of the kind they lack (linear or full attention), and a two-block cache. If
        this fails, kernels compile one at a time as the steps first run them, with a
        warning."""
        layers = self.model.layers
        self.model.layers = compile_layers(layers)
        self.kv.allocate(2)
        try:
            with torch.inference_mode(), compiling_only(workers):
                if self._sizing_runs():
                    self._warmup(*self._sizing_step())
                self._warm_steps()
                # every graph's step once, over its capture layout (those adding adapter
                # deltas too, whose LoRA kernels no other step launches)
                for graphs in self.graphs:
                    for adapters in (False, True)[:1 + self.adapters]:
                        for _, step in graphs.steps(adapters):
                            step()
        except Exception as e:  # e.g. a Triton without asynchronous compilation
            logger.warning("rank %d of %d: kernels compile one at a time (%s)", self.tp.rank,
                           self.tp.size, e)
        finally:
            self.model.layers = layers
            self.kv.allocate(0)

    def _warm_steps(self) -> None:
        """Steps that launch every kernel variant of prefill, sampling and decode (with and
        without split-K, the small-M projections and cascade). Run eagerly before the graphs
        are captured, so that no capture launches a kernel for the first time (and they are
        what eager decode runs when nothing is captured)."""
        self._warmup(2, 3)
        context = self.block_size * min(4, self.max_blocks_per_seq - 1)
        # Decode in batch order (one sequence) and longest first (the fewest sequences that
        # take it), each unsplit (a context of one key tile) and split (several, on a GPU
        # they do not fill); then the largest batch: every decode variant a batch can reach.
        for num_seqs in (1, min(ORDERED_MIN_SEQS, self.config.max_num_seqs)):
            for ctx in (0, context):
                self._warmup(num_seqs, 1, ctx)
        self._warmup(self.config.max_num_seqs, 1, context)
        if self.config.attention_backend == "triton":
            self._warmup(CASCADE_MIN_SEQS, 1, context, shared=True)


def compile_layers(layers: list) -> list:
    """The layers whose steps launch every kernel variant of the model: the first two, and a
    hybrid model's first layer of the kind they lack (full attention: ``self_attn``, or
    linear attention)."""
    kinds = {hasattr(layer, "self_attn") for layer in layers[:2]}
    other = [layer for layer in layers[2:] if hasattr(layer, "self_attn") not in kinds]
    return [*layers[:2], *other[:1]]
