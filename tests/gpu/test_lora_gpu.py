"""On a CUDA GPU, bf16, Qwen3-0.6B shape: LoRA adapters served unmerged against stock
transformers + peft on the same base and adapters (rank 16 on all seven projections, saved by
peft: ``benchmarks.lora_adapters``), a batch mixing three adapters and the base model, its
prefill and decode steps replayed from the graphs that add the adapters' deltas; and the LoRA
kernels (plain, normed, gated) against their twin at the 0.6B shape's projections, 16
adapters, decode and prefill batches, replayed from a CUDA graph too.

The parity check is test_gpu_parity's: rows agree with transformers + peft's own generation
until a near-tie, and fed our tokens transformers + peft ranks each within a near-tie of its
best; and the log-probabilities of our tokens under its logits and ours agree on average.
"""

from __future__ import annotations

import gc
from functools import partial

import numpy as np
import pytest
import torch
from peft import PeftModel

import hf_paged
from benchmarks.lora_adapters import make_adapters
from hf_paged.kernels import reference
from hf_paged.kernels.lora import add_lora
from hf_paged.kernels.lora_tiles import DECODE_ROWS, LoraTiles, fill_tiles, tile_bound
from hf_paged.lora.reading import read_adapter
from tests.gpu.test_fp8_gpu import agreement
from tests.gpu.test_gpu_parity import NEW, check_parity, load_transformers
from tests.kernels.test_lora import assert_close

pytestmark = pytest.mark.gpu
# Rows 0, 2 and 3 on an adapter each, row 1 on the base model.
ROWS = ["a0", "__base__", "a1", "a2"]
# The largest mean |log-probability difference| of our tokens, nats: the FP8 test's bound for
# the dense shape against its dequantized twin (0.096 measured there); not yet measured here.
LOGPROB_GAP = 0.2


class CountedGraph:
    """A captured graph whose replays are counted."""

    def __init__(self, graph):
        self.graph, self.replays = graph, 0

    def replay(self) -> None:
        self.replays += 1
        self.graph.replay()

    def __getattr__(self, name: str):
        return getattr(self.graph, name)


def count_replays(graphs) -> dict[tuple, CountedGraph]:
    """Decode or prefill ``graphs``' captured graphs, each counting its replays, by key
    (decode: rows, cascade, adapters; prefill: bucket, adapters)."""
    counted = {key: CountedGraph(graph) for key, (graph, *_) in graphs.graphs.items()}
    graphs.graphs = {key: (counted[key], *outputs)
                     for key, (_, *outputs) in graphs.graphs.items()}
    return counted


@pytest.fixture(scope="module")
def adapters(checkpoint, tmp_path_factory) -> dict[str, str]:
    folders = make_adapters(checkpoint, str(tmp_path_factory.mktemp("lora")), 3,
                            device="cuda")
    return {f"a{i}": folder for i, folder in enumerate(folders)}


@pytest.fixture(scope="module")
def stock(checkpoint, adapters):
    """Stock transformers (SDPA, bf16) with peft's adapters loaded, unmerged."""
    (first, path), *rest = adapters.items()
    model = PeftModel.from_pretrained(load_transformers(checkpoint), path, adapter_name=first)
    for name, path in rest:
        model.load_adapter(path, adapter_name=name)
    yield model.eval()
    del model
    gc.collect()
    torch.cuda.empty_cache()


def generate(model, batch, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy tokens for ``batch`` and, for each step, the logits they were chosen from."""
    ids, mask = batch
    out = model.generate(ids.cuda(), attention_mask=mask.cuda(), max_new_tokens=NEW,
                         do_sample=False, eos_token_id=None, return_dict_in_generate=True,
                         output_logits=True, **kwargs)
    return out.sequences[:, ids.shape[1]:].cpu(), torch.stack(out.logits, 1).float().cpu()


@pytest.fixture(scope="module")
def stock_run(stock, batch) -> tuple[torch.Tensor, torch.Tensor]:
    return generate(stock, batch, adapter_names=ROWS)


@pytest.fixture(scope="module")
def engine_runs(checkpoint, adapters, batch):
    """The engine's greedy tokens and logits for ``batch`` with ``ROWS``' adapters, then with
    every row on the base model, and the replays of the graphs adding adapter deltas and of
    the plain ones meanwhile."""
    engine = hf_paged.from_pretrained(checkpoint, dtype=torch.bfloat16, max_model_len=4096,
                                      gpu_memory_utilization=0.5, max_num_seqs=16,
                                      max_loras=4, max_lora_rank=16)
    try:
        for name, path in adapters.items():
            engine.add_lora(name, read_adapter(path, name, engine.hf_config, torch.bfloat16))
        runner = engine.executor.runner
        assert runner.decode_graphs.with_adapters and runner.prefill_graphs.with_adapters
        counted = count_replays(runner.decode_graphs)
        prefills = count_replays(runner.prefill_graphs)
        mixed = generate(engine, batch, adapter_names=ROWS)
        on_adapters = sum(g.replays for key, g in counted.items() if key[2])
        prefills_on_adapters = sum(g.replays for key, g in prefills.items() if key[1])
        base = generate(engine, batch)
        plain = sum(g.replays for key, g in counted.items() if not key[2])
    finally:
        engine.close()
        del engine
        gc.collect()
        torch.cuda.empty_cache()
    return {"mixed": mixed, "base": base, "adapter_replays": on_adapters,
            "adapter_prefills": prefills_on_adapters, "plain_replays": plain}


def test_adapters_change_the_tokens(stock_run, reference):
    """The oracle's own check: each adapter's row leaves the base model's greedy tokens."""
    tokens, _ = stock_run
    for row, name in enumerate(ROWS):
        if name != "__base__":
            assert not torch.equal(tokens[row], reference[0][row]), name


def test_mixed_adapters_against_transformers_peft(engine_runs, stock, stock_run, batch):
    """Three adapters and the base model in one batch, prefilled and decoded by the graphs
    adding the adapters' deltas."""
    tokens, logits = engine_runs["mixed"]
    oracle = partial(stock, adapter_names=ROWS)  # the teacher-forced forward, row by row
    check_parity(tokens, stock_run, oracle, batch)
    share, logprob_gap = agreement(tokens, logits, oracle, batch)
    print(f"mixed adapters: {share:.1%} of steps within a near-tie, mean |logprob gap| "
          f"{logprob_gap:.4f}")
    assert logprob_gap <= LOGPROB_GAP
    assert engine_runs["adapter_replays"] >= NEW - 1 and engine_runs["adapter_prefills"] >= 1


def test_base_batches_keep_the_plain_graphs(engine_runs, reference, hf_model, batch):
    """Adapters loaded, a batch all on the base model: the plain graphs, transformers'
    tokens."""
    tokens, _ = engine_runs["base"]
    check_parity(tokens, reference, hf_model, batch)
    assert engine_runs["plain_replays"] >= NEW - 1


# The 0.6B shape's projections as the engine merges them: (K, output rows of each part).
PROJECTIONS = {"qkv": (1024, [2048, 1024, 1024]), "o": (2048, [1024]),
               "gate_up": (1024, [3072, 3072]), "down": (3072, [1024])}
ADAPTERS = 16
# Decode: 256 sequences of a row, on the 16 adapters in turn, every seventh on the base model;
# one sequence alone. Prefill: W1-like prompts beside decode rows.
DECODE = [1] * 256
PREFILL = [600, 257, 100, 13, 1, 1, 1024]


def kernel_case(projection: str, lens: list[int], rank: int) -> dict:
    """``add_lora``'s arguments for ``lens`` (rows a sequence) at a projection of the 0.6B
    shape: 16 adapters of ``rank`` in bf16, ``lora_A`` as peft draws it, ``lora_B`` of an
    adapter changing the output by a few percent; the rows' tiles as an eager step sends
    them."""
    k, parts = PROJECTIONS[projection]
    gen = torch.Generator("cuda").manual_seed(len(lens) * rank)
    n, num_parts = sum(parts), len(parts)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device="cuda")

    slots = [-1 if i % 7 == 6 else i % ADAPTERS for i in range(len(lens))]
    return dict(
        out=randn(sum(lens), n).bfloat16(), x=randn(sum(lens), k).bfloat16(),
        a=(randn(ADAPTERS, num_parts * rank, k) / k ** 0.5).bfloat16(),
        b=(randn(ADAPTERS, n, rank) * 0.01).bfloat16(),
        scaling=torch.full((ADAPTERS, num_parts), 2.0, device="cuda"),
        row_part=torch.repeat_interleave(torch.arange(num_parts, device="cuda"),
                                         torch.tensor(parts, device="cuda")).to(torch.int32),
        tiles=LoraTiles.build(lens, slots, torch.device("cuda")))


def variant(args: dict, name: str) -> dict:
    """``args`` for the plain kernels, the normed shrink (``x`` a residual stream, a norm's
    weight near 1) or the gated expand (and normed: gate/up as a layer calls it)."""
    if name == "plain":
        return args
    gen = torch.Generator("cuda").manual_seed(7)
    weight = (torch.rand(args["x"].shape[1], generator=gen, device="cuda") + 0.5).bfloat16()
    return dict(args, x=args["x"] * 4, norm=(weight, 1e-6), gated=name == "gated")


VARIANTS = [(p, v) for p in PROJECTIONS for v in ("plain", "normed", "gated")
            if v == "plain" or (v == "normed" and p == "qkv") or (v == "gated" and p == "gate_up")]


@pytest.mark.parametrize("rank", [16, 64])
@pytest.mark.parametrize("lens", [DECODE, [1], PREFILL], ids=["decode256", "decode1", "prefill"])
@pytest.mark.parametrize("projection,name", VARIANTS)
def test_kernels_against_their_twin(projection, name, lens, rank):
    args = variant(kernel_case(projection, lens, rank), name)
    expected = reference.add_lora(**dict(args, out=args["out"].clone()))
    assert_close(add_lora(**dict(args, out=args["out"].clone())), expected)


@pytest.mark.parametrize("projection,name", [("qkv", "normed"), ("down", "plain"),
                                             ("gate_up", "gated")])
def test_kernels_replay_in_a_cuda_graph(projection, name):
    """Captured once over a decode graph's tiles for 64 rows (its bound on 16 adapters, filled
    on the host), replayed with new rows and new slots, the base model's among them."""
    args = variant(kernel_case(projection, [1] * 64, 16), name)
    order = torch.zeros(64, dtype=torch.int32, device="cuda")
    tiles = torch.zeros(3, tile_bound(64, ADAPTERS, DECODE_ROWS), dtype=torch.int32,
                        device="cuda")
    graph_tiles = LoraTiles(order, tiles, DECODE_ROWS)

    def fill(slots: list[int]) -> None:
        host_order, host_tiles = np.empty(64, np.int32), np.empty(tuple(tiles.shape), np.int32)
        fill_tiles(host_order, host_tiles, 1, slots, DECODE_ROWS)
        order.copy_(torch.from_numpy(host_order))
        tiles.copy_(torch.from_numpy(host_tiles))

    fill([-1] * 64)
    args["tiles"] = graph_tiles
    start = args["out"].clone()
    add_lora(**dict(args, out=start.clone()))  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    out = start.clone()
    with torch.cuda.graph(graph):
        result = add_lora(**dict(args, out=out))
    gen = torch.Generator("cuda").manual_seed(1)
    for _ in range(2):
        args["x"].copy_(torch.randn(args["x"].shape, generator=gen, device="cuda"))
        fill(torch.randint(-1, ADAPTERS, (64,), generator=gen, device="cuda").tolist())
        out.copy_(start)
        graph.replay()
        assert_close(result, reference.add_lora(**dict(args, out=start.clone())))
