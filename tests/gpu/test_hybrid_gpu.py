"""On a CUDA GPU, bf16, the hybrid families at real width: four layers (three Gated DeltaNet, one
gated full attention) of the Qwen3.5-9B and Qwen3.5-35B-A3B shapes, each layer of its real
shape. Tokens against stock transformers (``test_gpu_parity.check_parity``: equal until the
first near-tie, every token a greedy choice under transformers' own logits; the MoE shape as
``test_moe_gpu`` holds Qwen3-MoE, since a bf16 routing flip moves a step by more than a
near-tie); CUDA graphs equal to eager (the MoE shape: until a near-tie); decode graphs
replayed over reused state slots and shrinking batches; prefix-cache hits through state
snapshots; and the Gated DeltaNet kernels (prefill, decode, causal convolution, gated norm)
against their twins at the real head sizes.

transformers runs its own torch fallbacks for the linear layers here (no flash-linear-attention
or causal-conv1d on the machine): slower, but the same numbers."""

from __future__ import annotations

import gc
import shutil

import pytest
import torch

import hf_paged
from hf_paged.kernels import reference
from hf_paged.kernels.causal_conv import causal_conv_decode, causal_conv_prefill
from hf_paged.kernels.gated_delta import gated_delta_decode
from hf_paged.kernels.gated_delta_chunked import gated_delta_prefill
from hf_paged.kernels.gated_norm import gated_rms_norm
from hf_paged.random_checkpoint import make_checkpoint
from tests.gpu.test_gpu_parity import (
    LENGTHS,
    NEAR_TIE,
    NEW,
    check_parity,
    left_padded,
    load_transformers,
    run,
    transformers_generate,
)
from tests.gpu.test_moe_gpu import AGREEING, agreeing_steps
from tests.kernels.conftest import assert_close
from tests.kernels.test_gated_delta import (
    decode_args,
    inputs,
    kernel_and_twin,
    pool,
    prefill_args,
)

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
SHAPES = ["qwen3.5-9b", "qwen3.5-35b-a3b"]
LAYERS = 4  # one of each kind's period: layers 0-2 linear attention, layer 3 full attention
# The Gated DeltaNet of both shapes: 16 key heads, 32 value heads, 128 wide; the convolution
# over query, key and value channels, kernel 4 (its state as wide as the kernel).
SIZES = (16, 32, 128, 128)
CHANNELS, WIDTH = 2 * 16 * 128 + 32 * 128, 4
KERNEL_LENS = [1, 37, 300, 1000]


def release(*objects) -> None:
    del objects
    gc.collect()
    torch.cuda.empty_cache()


@pytest.fixture(scope="module", params=SHAPES)
def case(request, tmp_path_factory, batch):
    """The shape's checkpoint, stock transformers on it and its greedy tokens and logits; the
    checkpoint (6 and 9 GB) removed after, so that the benchmarks' fit the disk beside it."""
    path = make_checkpoint(request.param, str(tmp_path_factory.mktemp(request.param)),
                           dtype="bfloat16", layers=LAYERS, device="cuda")
    model = load_transformers(path)
    yield request.param, path, model, transformers_generate(model, batch)
    release(model)
    shutil.rmtree(path)


def assert_greedy(shape: str, tokens, reference_run, model, batch) -> None:
    """The dense shape: ``check_parity``; the MoE shape: transformers, fed our tokens, ranks
    them within a near-tie of its best at nearly every step."""
    if "a3b" not in shape:
        check_parity(tokens, reference_run, model, batch)
        return
    share = agreeing_steps(tokens, model, batch)
    print(f"{shape}: {share:.1%} of steps within a near-tie of transformers' best")
    assert share >= AGREEING


@pytest.fixture(scope="module")
def graph_tokens(case, batch):
    return run(case[1], batch)[0]


def test_bf16_parity_with_graphs(case, batch, graph_tokens):
    shape, _, model, reference_run = case
    assert_greedy(shape, graph_tokens, reference_run, model, batch)


def eager_run(path, batch) -> tuple[torch.Tensor, torch.Tensor]:
    """The eager engine's tokens and their float32 scores ``[rows, steps, vocab]``."""
    ids, mask = batch
    engine = hf_paged.from_pretrained(path, max_model_len=4096, gpu_memory_utilization=0.5,
                                      max_num_seqs=16, dtype=torch.bfloat16, enforce_eager=True)
    out = engine.generate(ids, attention_mask=mask, max_new_tokens=NEW, eos_token_id=None,
                          output_scores=True, return_dict_in_generate=True)
    engine.close()
    scores = torch.stack(out.scores, 1).float().cpu()
    tokens = out.sequences[:, ids.shape[1]:].cpu()
    release(engine, out)
    return tokens, scores


def test_cuda_graphs_equal_eager(case, batch, graph_tokens):
    """The dense shape: the same tokens. The MoE shape: the same tokens in each row until a
    step where the eager run's own scores put the graphs' token within a near-tie of its own.
    A prefill graph runs its bucket's padded row count, and cuBLAS picks its GEMM kernels by
    row count, so a prefill's sums round differently from eager's; through a router choosing 8
    of 256 experts that can flip an expert choice and move later logits by a near-tie or more
    (measured on an H100: eager's logits parted from the graphs' by up to 1.05 before any
    token differed, and with prefill graphs off, the decode graphs' logits matched eager's bit
    for bit)."""
    shape, path = case[0], case[1]
    eager, scores = eager_run(path, batch)
    if "a3b" not in shape:
        assert torch.equal(eager, graph_tokens)
        return
    for row, (ours, theirs) in enumerate(zip(graph_tokens, eager)):
        diff = (ours != theirs).nonzero()
        if len(diff):
            step = int(diff[0])
            gap = float(scores[row, step, theirs[step]] - scores[row, step, ours[step]])
            assert gap < NEAR_TIE, f"row {row} parts at step {step}, score gap {gap:.3f}"


def test_decode_graphs_over_reused_slots_and_shrinking_batches(case):
    """Six prompts on four state slots: the last two start in slots that held finished
    sequences (their state must not leak in), and the decode graphs replay at four rows, then
    at the padded sizes of two."""
    shape, path, model, _ = case
    gen = torch.Generator().manual_seed(1)
    six = left_padded([torch.randint(0, 10000, (n,), generator=gen)
                       for n in [*LENGTHS, 31, 170]])
    tokens, stats = run(path, six, max_num_seqs=4)
    assert stats["num_state_slots"] == 4
    share = agreeing_steps(tokens, model, six)
    assert share >= (AGREEING if "a3b" in shape else 1.0), f"{share:.1%} of steps agree"


def test_prefix_cache_hits_through_state_snapshots(case):
    """Six prompts sharing a 256-token prefix (four 64-token blocks) in one call: all but the
    first or two resume from the snapshot of its end (on the CPU's tiny Qwen3.5 five do),
    and still decode transformers' tokens."""
    shape, path, model, _ = case
    gen = torch.Generator().manual_seed(2)
    prefix = torch.randint(0, 10000, (256,), generator=gen)
    shared = left_padded([torch.cat([prefix, torch.randint(0, 10000, (20,), generator=gen)])
                          for _ in range(6)])
    tokens, stats = run(path, shared, enable_prefix_caching=True, num_state_snapshots=8)
    assert stats["prefix_cache_hits"] >= 4 * 256, stats
    share = agreeing_steps(tokens, model, shared)
    assert share >= (AGREEING if "a3b" in shape else 1.0), f"{share:.1%} of steps agree"


# ---- the kernels at the real head sizes, bf16 inputs (float32 states) ----------------------


# A batch of sequences, and a lone one.
@pytest.mark.parametrize("lens,slots,initial", [
    (KERNEL_LENS, [4, 0, 2, 5], [True, False, True, False]), ([1000], [4], [True])])
def test_gated_delta_prefill_at_real_heads(lens, slots, initial):
    args = prefill_args(inputs(lens, torch.bfloat16, SIZES), pool(7, SIZES), slots, initial)
    before = args["state_pool"].clone()
    kernel_and_twin(gated_delta_prefill, reference.gated_delta_prefill, args)
    untouched = [i for i in range(7) if i not in slots]
    assert torch.equal(args["state_pool"][untouched], before[untouched])


def test_gated_delta_decode_at_real_heads():
    rows = 64
    args = decode_args(inputs([1] * rows, torch.bfloat16, SIZES),
                       [*range(rows - 1), -1], pool(rows + 2, SIZES))
    kernel_and_twin(gated_delta_decode, reference.gated_delta_decode, args)


def test_causal_conv_at_real_channels():
    """A strided view of the projection (query, key, value channels of a wider one), a
    padding slot, then two decode steps rolling the states, against the twin."""
    weight = torch.randn(CHANNELS, WIDTH, device="cuda").bfloat16()
    conv_pool = torch.randn(8, CHANNELS, WIDTH, device="cuda").bfloat16()
    lens = [*KERNEL_LENS, 5]
    slots = torch.tensor([7, 2, 0, 5, -1], dtype=torch.int32, device="cuda")
    has_initial = torch.tensor([True, False, True, False, True], device="cuda")
    wide = torch.randn(sum(lens), CHANNELS + 4096, device="cuda").bfloat16()
    x = wide[:, :CHANNELS]
    cu = torch.tensor([0, *lens], device="cuda").cumsum(0).to(torch.int32)
    expected_pool = conv_pool.clone()
    expected = reference.causal_conv_prefill(x, weight, None, cu, expected_pool, slots,
                                             has_initial)
    assert_close(causal_conv_prefill(x, weight, None, cu, conv_pool, slots, has_initial),
                 expected)
    assert torch.equal(conv_pool, expected_pool)
    for _ in range(2):
        step = torch.randn(len(lens), CHANNELS, device="cuda").bfloat16()
        expected = reference.causal_conv_decode(step, weight, None, expected_pool, slots)
        assert_close(causal_conv_decode(step, weight, None, conv_pool, slots), expected)
        assert torch.equal(conv_pool, expected_pool)


@pytest.mark.parametrize("weight_dtype", [torch.bfloat16, torch.float32])
def test_gated_norm_at_real_heads(weight_dtype):
    """The Gated DeltaNet output [T, 32, 128] and its gate, a slice of the wider projection."""
    tokens, (_, heads, _, dim) = 300, SIZES
    x = torch.randn(tokens, heads, dim, device="cuda").bfloat16()
    z = torch.randn(tokens, 3 * heads * dim, device="cuda").bfloat16()
    z = z[:, heads * dim:2 * heads * dim].view(tokens, heads, dim)
    weight = (1 + 0.1 * torch.randn(dim, device="cuda")).to(weight_dtype)
    assert_close(gated_rms_norm(x, z, weight, 1e-6), reference.gated_rms_norm(x, z, weight, 1e-6))


def test_engine_reports_state_pools_at_real_width(case):
    """Each running sequence's state at the real shape: per linear layer a float32 recurrent
    state of 32 x 128 x 128 and a bf16 convolution state of 8,192 channels x 4."""
    _, path, _, _ = case
    engine = hf_paged.from_pretrained(path, dtype=torch.bfloat16, max_num_seqs=4,
                                      max_model_len=4096, gpu_memory_utilization=0.5)
    try:
        stats = engine.stats()
    finally:
        engine.close()
        release(engine)
    per_seq = 3 * (32 * 128 * 128 * 4 + CHANNELS * WIDTH * 2)
    assert stats["num_state_slots"] == 4 and stats["state_bytes"] == 4 * per_seq
