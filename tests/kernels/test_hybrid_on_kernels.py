"""The hybrid families with every op sent to Triton (the interpreter, on CPU): the causal
convolution, the delta rule (prefill and decode), the gated and zero-centred norms, the gated
attention's partial RoPE and the Triton attention backend, as the layers wire them, against the
plain-torch twins over a prefill of mixed lengths and decode steps, and over the model call's
padded rows; FP8 weights through the FP8 kernels."""

from __future__ import annotations

import shutil

import pytest
import torch
import transformers

from hf_paged import kernels
from hf_paged.families.build import build_model
from hf_paged.modeling.full_forward import full_forward
from hf_paged.random_checkpoint import quantize_fp8
from tests.hybrid_steps import HybridSteps
from tests.kernels.conftest import HALF
from tests.kernels.test_engine_on_kernels import kernel_and_twin_tokens
from tests.parity.test_hybrid_families import prompts
from tests.parity.test_hybrid_forward import padded_batch


def logits_of_steps(monkeypatch, path: str, dtype: torch.dtype, through_triton: bool
                    ) -> list[torch.Tensor]:
    """The logits of a prefill of three prompts and three decode steps (greedy tokens)."""
    monkeypatch.setattr(kernels, "_TRITON_ON_CPU", through_triton)
    config = transformers.AutoConfig.from_pretrained(path)
    model = build_model(config, path, dtype, torch.device("cpu"),
                        "triton" if through_triton else "sdpa", 256)
    batch = prompts(3, (4, 67, 1))
    steps = HybridSteps(model, len(batch))
    logits = [steps.step(list(enumerate(batch)))]
    rows = logits[0][torch.tensor([len(p) for p in batch]).cumsum(0) - 1]
    for _ in range(3):
        logits.append(steps.step([(seq, [token]) for seq, token in
                                  enumerate(rows.argmax(-1).tolist())]))
        rows = logits[-1]
    return logits


@pytest.mark.skipif(torch.cuda.is_available(), reason="on CUDA the kernels always run")
@pytest.mark.parametrize("name, dtype", [("next_dense1", torch.float32),
                                         ("qwen3.5_tied", HALF)])
def test_a_hybrid_model_on_the_kernels_gives_the_twins_logits(hybrid_checkpoints, monkeypatch,
                                                              name, dtype):
    """Within 5e-5 of the logits' size in float32 (the Triton delta rule and attention sum in
    their own order: 2.6e-5 measured after 67 tokens and three decode steps, as much as
    transformers' own float32 logits differ from its float64 ones), 1e-2 in half precision."""
    path = hybrid_checkpoints[name]
    twins = logits_of_steps(monkeypatch, path, dtype, through_triton=False)
    tolerance = 5e-5 if dtype == torch.float32 else 1e-2
    for got, want in zip(logits_of_steps(monkeypatch, path, dtype, through_triton=True), twins):
        scale = want.abs().max().item()
        torch.testing.assert_close(got, want, atol=tolerance * scale, rtol=0)


def model_call_logits(monkeypatch, path: str, through_triton: bool) -> torch.Tensor:
    """The float32 model call's logits over ``padded_batch``'s rows padded left, right, in
    holes and throughout, its state pools' every slot garbage (rows start from zeros)."""
    monkeypatch.setattr(kernels, "_TRITON_ON_CPU", through_triton)
    config = transformers.AutoConfig.from_pretrained(path)
    model = build_model(config, path, torch.float32, torch.device("cpu"),
                        "triton" if through_triton else "sdpa", 256)
    ids, mask = (t[1:5] for t in padded_batch())
    HybridSteps(model, len(ids))  # a KV cache to take the dtype of, garbage state pools
    hidden = full_forward(model, ids, mask, torch.arange(ids.shape[1])[None], 8)
    return model.compute_logits(hidden)


@pytest.mark.skipif(torch.cuda.is_available(), reason="on CUDA the kernels always run")
def test_the_model_call_on_the_kernels_gives_the_twins_logits(hybrid_checkpoints, monkeypatch):
    """The padded rows' metadata as the Triton convolution and delta rule read it: within
    5e-5 of the logits' size, as above."""
    path = hybrid_checkpoints["qwen3.5_one_value_head_a_key"]
    want = model_call_logits(monkeypatch, path, through_triton=False)
    got = model_call_logits(monkeypatch, path, through_triton=True)
    torch.testing.assert_close(got, want, atol=5e-5 * want.abs().max().item(), rtol=0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="on CUDA the kernels always run")
def test_fp8_weights_on_the_kernels_give_the_twins_tokens(hybrid_checkpoints, monkeypatch,
                                                          tmp_path):
    """Qwen3-Next's FP8 weights (16-row blocks: the packed input projections' grids side by
    side; experts and the shared expert) through the FP8 kernels, decode rows by the small-M
    kernel: float32 tokens equal the twins'. (Qwen3.5's split in_proj_qkv grid is the loader's
    work, held to the definition in tests/parity/test_hybrid_fp8.py.)"""
    path = str(tmp_path / "fp8")
    shutil.copytree(hybrid_checkpoints["next_dense1"], path)
    quantize_fp8(path, transformers.AutoConfig.from_pretrained(path), (16, 16))
    triton_tokens, twin_tokens = kernel_and_twin_tokens(monkeypatch, path, torch.float32,
                                                        small_m=True)
    assert torch.equal(triton_tokens, twin_tokens)
