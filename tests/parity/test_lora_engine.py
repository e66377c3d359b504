"""LoRA adapters inside the engine (float32, CPU), against stock transformers + peft on the
same base and adapters: requests on different adapters and on the base model in one batch,
beams and forked samples, the model call, a Qwen3-MoE base, the Triton kernels (interpreter)
against their twins, prefix-cache blocks never shared between adapters, and adapters loaded and
unloaded while requests run."""

from __future__ import annotations

import pytest
import torch

import hf_paged
from hf_paged import kernels
from hf_paged.lora.reading import read_adapter
from hf_paged.sampling_params import SamplingParams
from tests.conftest import FLOAT32_RTOL, left_padded
from tests.lora_adapters import ADAPTERS, save_adapter, stock_peft
from tests.parity.test_graph_inputs import with_eager_decode_graphs, with_eager_prefill_graphs

NEW = 8


@pytest.fixture(scope="module")
def dense(checkpoints, tmp_path_factory):
    """The gqa4_untied checkpoint, its adapters (name -> folder), stock + peft on them."""
    base = checkpoints["gqa4_untied"]
    folder = tmp_path_factory.mktemp("lora_dense")
    adapters = {name: save_adapter(base, str(folder / name), seed, **lora)
                for seed, (name, lora) in enumerate(ADAPTERS.items())}
    return base, adapters, stock_peft(base, adapters)


def engine_with(base: str, adapters: dict[str, str], **options):
    engine = hf_paged.from_pretrained(base, device="cpu", dtype=torch.float32, **options)
    for name, path in adapters.items():
        engine.add_lora(name, read_adapter(path, name, engine.hf_config, torch.float32))
    return engine


def test_adapters_change_the_tokens(dense):
    """The oracle's own check: each adapter moves greedy decoding off the base model's."""
    _, adapters, stock = dense
    ids, mask = left_padded([9, 14], 1024)
    outs = {name: stock.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW,
                                 do_sample=False, adapter_names=[name] * 2)
            for name in [*adapters, "__base__"]}
    for name in adapters:
        assert not torch.equal(outs[name], outs["__base__"]), name


@pytest.mark.parametrize("generate_kwargs", [{}, dict(num_beams=3), dict(
    do_sample=True, num_return_sequences=2, top_k=1)], ids=["greedy", "beams", "forked"])
def test_mixed_adapters_in_one_batch(dense, generate_kwargs):
    base, adapters, stock = dense
    ids, mask = left_padded([5, 17, 11, 8], 1024, seed=2)
    names = ["qv", "__base__", "all", "attn"]
    kwargs = dict(attention_mask=mask, max_new_tokens=NEW,
                  **{"do_sample": False, **generate_kwargs})
    # peft wants a name per expanded row with num_return_sequences (it expands them itself
    # for beams); hf_paged takes either
    copies = generate_kwargs.get("num_return_sequences", 1)
    expected = stock.generate(input_ids=ids, adapter_names=[n for n in names
                                                            for _ in range(copies)], **kwargs)
    with engine_with(base, adapters) as engine:
        assert torch.equal(engine.generate(ids, adapter_names=names, **kwargs), expected)


def test_model_call_per_row_adapters(dense):
    base, adapters, stock = dense
    ids, mask = left_padded([6, 12, 9], 1024, seed=3)
    names = ["all", "qv", "__base__"]
    expected = stock(input_ids=ids, attention_mask=mask, adapter_names=names).logits
    with engine_with(base, adapters) as engine:
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        logits = engine.forward(ids, mask, positions,
                                adapters=[None if n == "__base__" else n for n in names])
    keep = mask.bool()
    # another summation order through every layer, over hidden states the scaled-up adapters
    # make much larger than the logits: hundreds of float32 steps of the largest logit
    torch.testing.assert_close(logits[keep], expected[keep], rtol=FLOAT32_RTOL,
                               atol=512 * torch.finfo(torch.float32).eps
                               * float(expected.abs().max()))


def test_moe_base(moe_checkpoints, tmp_path):
    """Adapters on a Qwen3-MoE base's attention (and its dense layer's MLP where peft puts
    one there: under transformers 5 it moves MLP targets onto the experts)."""
    base = moe_checkpoints["e6_k3_raw_dense0"]
    adapters = {"attn": save_adapter(base, str(tmp_path / "attn"), 7, **ADAPTERS["attn"])}
    stock = stock_peft(base, adapters)
    ids, mask = left_padded([7, 13], 1024, seed=4)
    kwargs = dict(attention_mask=mask, max_new_tokens=NEW, do_sample=False,
                  adapter_names=["attn", "__base__"])
    expected = stock.generate(input_ids=ids, **kwargs)
    with engine_with(base, adapters) as engine:
        assert torch.equal(engine.generate(ids, **kwargs), expected)


def test_kernels_give_the_twins_tokens(dense, monkeypatch):
    """The engine on the Triton kernels (interpreter): the LoRA shrink and expand, with the
    attention and projections, give the plain-torch twins' tokens."""
    base, adapters, _ = dense
    ids, mask = left_padded([5, 9], 1024, seed=5)
    kwargs = dict(attention_mask=mask, max_new_tokens=4, adapter_names=["all", "qv"])
    outs = []
    for on_triton in (True, False):
        monkeypatch.setattr(kernels, "_TRITON_ON_CPU", on_triton)
        with engine_with(base, adapters,
                         attention_backend="triton" if on_triton else "sdpa") as engine:
            outs.append(engine.generate(ids, **kwargs))
    assert torch.equal(*outs)


# Each graph kind as eager stand-ins, the position of "adapters" in its graphs' keys, and the
# fewest replays a generate of NEW tokens makes of each kind's graphs.
GRAPHS = {
    "decode": (lambda engine: with_eager_decode_graphs(engine, max_bs=4, adapters=True), 2,
               NEW - 1),
    "prefill": (lambda engine: with_eager_prefill_graphs(engine, 64, 4, adapters=True), 1, NEW),
}


@pytest.mark.parametrize("kind", list(GRAPHS))
def test_graphs_add_the_adapters(dense, kind):
    """The decode and prefill graphs over their padded inputs (each replay recomputed eagerly,
    as test_graph_inputs does): a batch mixing adapters and the base replays the graphs that
    add the deltas, each row's adapter in the graph's inputs (a prefill's padding tokens on no
    adapter), and gives peft's tokens; the base model's steps keep the plain graphs."""
    base, adapters, stock = dense
    stand_ins, adapters_key, fewest = GRAPHS[kind]
    ids, mask = left_padded([4, 11, 7], 1024, seed=9)
    kwargs = dict(attention_mask=mask, max_new_tokens=NEW, do_sample=False)
    names = ["all", "__base__", "qv"]
    expected = stock.generate(input_ids=ids, adapter_names=names, **kwargs)
    with engine_with(base, adapters) as engine:
        replays = stand_ins(engine)
        assert torch.equal(engine.generate(ids, adapter_names=names, **kwargs), expected)
        assert sum(r.replays for r in replays if r.key[adapters_key]) >= fewest
        plain = stock.generate(input_ids=ids, adapter_names=["__base__"] * 3, **kwargs)
        assert torch.equal(engine.generate(ids, **kwargs), plain)
        assert sum(r.replays for r in replays if not r.key[adapters_key]) >= fewest


def test_prefix_cache_is_keyed_by_adapter(dense):
    """The same prompt on two adapters and on the base: each computes its own blocks (an
    adapter changes every layer's keys and values) and gets its own tokens; the same prompt on
    the same adapter again hits its blocks."""
    base, adapters, stock = dense
    prompt = torch.randint(3, 1024, (40,), generator=torch.Generator().manual_seed(6)).tolist()
    with engine_with(base, adapters, block_size=16) as engine:
        runs = []
        for name in ("qv", "all", None, "qv"):
            seq = engine.add_request(prompt, SamplingParams(max_new_tokens=NEW, adapter=name))
            engine.run([seq])
            runs.append((name, seq.num_cached_tokens, seq.output_token_ids))
    assert [cached for _, cached, _ in runs] == [0, 0, 0, 32]
    for name, _, tokens in runs:
        want = stock.generate(input_ids=torch.tensor([prompt]), max_new_tokens=NEW,
                              do_sample=False, adapter_names=[name or "__base__"])
        assert tokens == want[0, len(prompt):].tolist(), name


def test_adapters_load_and_unload_while_requests_run(dense):
    base, adapters, stock = dense
    prompts = [torch.randint(3, 1024, (n,), generator=torch.Generator().manual_seed(n))
               .tolist() for n in (9, 15)]

    def expected(prompt, name):
        out = stock.generate(input_ids=torch.tensor([prompt]), max_new_tokens=NEW,
                             do_sample=False, adapter_names=[name])
        return out[0, len(prompt):].tolist()

    with engine_with(base, {"qv": adapters["qv"]}, max_loras=2, max_lora_rank=8) as engine:
        hf_config = engine.hf_config
        first = engine.add_request(prompts[0], SamplingParams(max_new_tokens=NEW, adapter="qv"))
        for _ in range(3):
            engine.step()
        engine.add_lora("all", read_adapter(adapters["all"], "all", hf_config, torch.float32))
        second = engine.add_request(prompts[1],
                                    SamplingParams(max_new_tokens=NEW, adapter="all"))
        with pytest.raises(ValueError, match="adapter 'qv' is in use by 1"):
            engine.remove_lora("qv")
        with pytest.raises(ValueError, match="max_loras=2"):
            engine.add_lora("attn", read_adapter(adapters["attn"], "attn", hf_config,
                                                 torch.float32))
        engine.run([first, second])
        assert first.output_token_ids == expected(prompts[0], "qv")
        assert second.output_token_ids == expected(prompts[1], "all")
        assert engine.stats()["num_loras"] == 2 and engine.stats()["lora_bytes"] > 0
        engine.remove_lora("qv")
        with pytest.raises(ValueError, match="adapter 'qv' is not loaded"):
            engine.add_request(prompts[0], SamplingParams(max_new_tokens=NEW, adapter="qv"))
        # attn has rank 16, above max_lora_rank=8: refused by name, the slots untouched
        with pytest.raises(ValueError, match="max_lora_rank=8"):
            engine.add_lora("attn", read_adapter(adapters["attn"], "attn", hf_config,
                                                 torch.float32))
        again = engine.add_request(prompts[1], SamplingParams(max_new_tokens=NEW, adapter="all"))
        engine.run([again])
        assert again.output_token_ids == expected(prompts[1], "all")


def test_enable_lora_allocates_the_slots_at_start_up(dense):
    """enable_lora: the slots exist (their memory counted) before any adapter, the base model
    keeps its tokens, and an adapter loaded later fills a slot in place."""
    base, adapters, stock = dense
    ids, mask = left_padded([6, 10], 1024, seed=10)
    kwargs = dict(attention_mask=mask, max_new_tokens=NEW, do_sample=False)
    with engine_with(base, {}, enable_lora=True) as engine:
        allocated = engine.stats()["lora_bytes"]
        assert allocated > 0 and engine.stats()["num_loras"] == 0
        plain = stock.generate(input_ids=ids, adapter_names=["__base__"] * 2, **kwargs)
        assert torch.equal(engine.generate(ids, **kwargs), plain)
        engine.add_lora("qv", read_adapter(adapters["qv"], "qv", engine.hf_config,
                                           torch.float32))
        assert engine.stats()["lora_bytes"] == allocated
        expected = stock.generate(input_ids=ids, adapter_names=["qv"] * 2, **kwargs)
        assert torch.equal(engine.generate(ids, adapter_names=["qv"] * 2, **kwargs), expected)
