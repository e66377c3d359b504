"""On a CUDA GPU: the unmodified-script check in bf16, two models loaded one after the other
in one process (close() and garbage collection give the memory back; the default KV cache of
a small model leaves the rest of the GPU free), and the forward's logits."""

from __future__ import annotations

import gc

import pytest
import torch
import transformers

import hf_paged
from hf_paged.random_checkpoint import make_checkpoint
from tests.integrations.test_script import check_same_text

pytestmark = pytest.mark.gpu
IDS = torch.tensor([[5, 60, 7, 80, 9, 10, 11]])


@pytest.fixture(scope="module")
def bf16_checkpoint(tmp_path_factory):
    return make_checkpoint("tiny", str(tmp_path_factory.mktemp("tiny-bf16")), dtype="bfloat16")


def test_unmodified_script_bf16(bf16_checkpoint):
    check_same_text(bf16_checkpoint, loss_tolerance=0.05, exact=False)


def test_two_models_one_after_another(bf16_checkpoint):
    first = hf_paged.AutoModelForCausalLM.from_pretrained(bf16_checkpoint)
    runner = first.engine.executor.runner
    # A small model's default cache: what max_num_seqs full-length sequences could use.
    assert runner.num_blocks == first.engine.config.max_num_seqs * runner.max_blocks_per_seq
    free, total = torch.cuda.mem_get_info()
    assert free > 0.5 * total, f"the model left {free / 2**30:.1f} of {total / 2**30:.1f} GiB"
    expected = first.generate(IDS.cuda(), max_new_tokens=16)
    weights = sum(p.numel() * p.element_size() for p in first.parameters())
    cache = sum(c.numel() * c.element_size() for layer in first.engine.model.attention_layers
                for c in (layer.k_cache, layer.v_cache))
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated()
    first.close()
    after_close = torch.cuda.memory_allocated()
    assert held - after_close >= weights + cache, "close() left weights or KV cache behind"
    second = hf_paged.AutoModelForCausalLM.from_pretrained(bf16_checkpoint)
    assert torch.equal(second.generate(IDS.cuda(), max_new_tokens=16), expected)
    del second
    gc.collect()
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() <= after_close + 2**20, "garbage collection kept memory"
    with hf_paged.AutoModelForCausalLM.from_pretrained(bf16_checkpoint) as third:
        assert torch.equal(third.generate(IDS.cuda(), max_new_tokens=16), expected)


# bf16: logits reach about 16, where bf16 steps by 0.125; another summation order moves them
# by a step or two.
@pytest.mark.parametrize("dtype, atol", [(torch.float32, 1e-4), (torch.bfloat16, 0.25)])
def test_forward_logits_on_gpu(bf16_checkpoint, dtype, atol):
    model = hf_paged.AutoModelForCausalLM.from_pretrained(bf16_checkpoint, dtype=dtype,
                                                          max_model_len=256)
    stock = transformers.AutoModelForCausalLM.from_pretrained(bf16_checkpoint, dtype=dtype,
                                                              device_map="cuda")
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 1024, (3, 40), generator=gen).cuda()
    mask = torch.ones_like(ids)
    mask[0, :13], mask[1, 30:], mask[2, 7] = 0, 0, 0
    with torch.no_grad():
        ours = model(ids, attention_mask=mask).logits.float()
        ref = stock(ids, attention_mask=mask).logits.float()
    diff = (ours - ref).abs()
    attended = diff[mask.bool()].amax().item()
    print(f"{dtype}: logits differ by up to {attended} where attended, "
          f"{diff.amax().item()} anywhere")
    # Positions the mask drops attend to nothing real; in bf16 their values are rounding noise.
    worst = diff.amax().item() if dtype == torch.float32 else attended
    assert worst <= atol, f"{dtype}: logits differ by up to {worst}"
    model.close()
