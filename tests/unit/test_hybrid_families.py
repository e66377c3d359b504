"""The hybrid families' (Qwen3-Next, Qwen3.5, Qwen3.5-MoE) loading and splitting: every
checkpoint key accounted for (a missing, mis-shaped or extra one named), the state dict in
transformers' layout (stock ``from_pretrained`` of it gives the checkpoint's weights back), the
interface the worker reads (linear layer ids, state shapes per rank), splits the ranks cannot
make refused naming both numbers, and a model split over two ranks (threads summing their
shares) computing what the whole model computes."""

from __future__ import annotations

import logging
import threading

import pytest
import torch
import transformers
from safetensors.torch import save_file

from hf_paged import families
from hf_paged.families.build import build_model
from hf_paged.families.vision_language import causal_lm_config
from hf_paged.integrations.state_dict import transformers_state_dict
from hf_paged.modeling.tp import SINGLE, TensorParallel
from tests.conftest import HYBRID_CONFIGS
from tests.hybrid_steps import HybridSteps
from tests.parity.test_hybrid_families import prompts
from tests.unit.test_loading_errors import drop, rewrite

LINEAR = "model.layers.0.linear_attn."


def config_of(name: str, **override) -> transformers.PretrainedConfig:
    return transformers.AutoConfig.for_model(**{**HYBRID_CONFIGS[name], **override})


def build(path: str, tp: TensorParallel = SINGLE):
    config = causal_lm_config(transformers.AutoConfig.from_pretrained(path))
    return build_model(config, path, torch.float32, torch.device("cpu"), "sdpa", 256, tp)


@pytest.mark.parametrize("name, layers", [("next_dense1", (0, 1, 2)),
                                          ("next_tied_attention_first", (1, 2, 4)),
                                          ("qwen3.5_tied", (0, 2))])
def test_linear_layers_and_their_state_shapes(name, layers):
    config = config_of(name)
    family = families.family_for(config)
    assert family.linear_layer_ids(config) == layers
    whole, half = family.state_shapes(config, 1), family.state_shapes(config, 2)
    key_dim, value_dim = 2 * 16, config.linear_num_value_heads * 16  # heads x head dims
    assert whole == {"conv_state": ((2 * key_dim + value_dim, 4), None),
                     "recurrent_state": ((config.linear_num_value_heads, 16, 16),
                                         torch.float32)}
    assert half["conv_state"][0] == ((2 * key_dim + value_dim) // 2, 4)
    assert half["recurrent_state"][0] == (config.linear_num_value_heads // 2, 16, 16)


def test_the_paged_model_lists_its_attention_and_state_modules(hybrid_checkpoints):
    model = build(hybrid_checkpoints["next_tied_attention_first"])
    assert model.attention_layers == [model.layers[i].self_attn for i in (0, 3)]
    assert model.state_modules == [model.layers[i].linear_attn for i in (1, 2, 4)]


@pytest.mark.parametrize("override, message", [
    (dict(linear_num_key_heads=3, linear_num_value_heads=6),
     r"linear_num_key_heads \(3\) is not divisible by tensor_parallel_size \(2\)"),
    (dict(linear_num_key_heads=4, linear_num_value_heads=6),
     r"linear_num_value_heads \(6\) is not a multiple of linear_num_key_heads \(4\)"),
    (dict(num_attention_heads=3, num_key_value_heads=1),
     r"num_attention_heads \(3\) is not divisible by tensor_parallel_size \(2\)"),
    (dict(shared_expert_intermediate_size=45),
     r"shared_expert_intermediate_size \(45\) is not divisible by tensor_parallel_size \(2\)"),
])
def test_splits_the_ranks_cannot_make_are_refused_naming_both_numbers(override, message):
    with pytest.raises(ValueError, match=message):
        families.check_model(config_of("next_dense1", **override), 2)


@pytest.mark.parametrize("override, message", [
    (dict(hidden_act="gelu"), "hidden_act 'gelu'"),
    (dict(layer_types=["linear_attention", "sliding_attention", "linear_attention",
                       "full_attention"]), r"layer_types \['sliding_attention'\]"),
    (dict(num_experts_per_tok=9), r"num_experts_per_tok \(9\)"),
    (dict(layer_types=["linear_attention"] * 4), "no 'full_attention' layer"),
])
def test_configs_the_modules_cannot_run_are_refused(override, message):
    with pytest.raises(ValueError, match=message):
        families.check_model(config_of("next_dense1", **override), 1)


def test_fp8_is_refused_where_not_served_naming_the_family():
    """FP8 weights on one rank only (tests/parity/test_hybrid_fp8.py); Qwen3.5's where its
    in_proj_qkv's query and key rows are whole blocks (these shapes: 32 rows, so 16-row
    blocks, not 128-row ones)."""
    from hf_paged.quantization.fp8 import resolve

    scheme = resolve({"quant_method": "fp8", "weight_block_size": [128, 128]}, None)
    families.check_model(config_of("next_dense1"), 1, scheme)
    with pytest.raises(ValueError, match=r"FP8 checkpoints of qwen3_next are not supported by "
                                         r"hf_paged with tensor_parallel_size > 1 \(got 2\)"):
        families.check_model(config_of("next_dense1"), 2, scheme)
    small = resolve({"quant_method": "fp8", "weight_block_size": [16, 16]}, None)
    for name in ("qwen3.5_tied", "qwen3.5_moe"):
        config = config_of(name)
        families.check_model(config, 1, small)
        with pytest.raises(ValueError, match=rf"FP8 checkpoints of {config.model_type}: "
                                             r"in_proj_qkv's query and key rows \(32 each"):
            families.check_model(config, 1, scheme)


@pytest.mark.parametrize("name", ["next_dense1", "qwen3.5_tied"])
def test_missing_and_mis_shaped_keys_are_named(hybrid_checkpoints, tmp_path, name):
    def edit(tensors):
        drop(LINEAR + "A_log", LINEAR + "conv1d.weight")(tensors)
        key = LINEAR + ("in_proj_ba.weight" if name.startswith("next") else "in_proj_b.weight")
        tensors[key] = tensors[key][:-1]

    with pytest.raises(ValueError) as raised:
        build(rewrite(hybrid_checkpoints[name], tmp_path, edit))
    message = str(raised.value)
    assert "missing (2):" in message and "wrong shape (1):" in message
    for key in ("A_log", "conv1d.weight", "in_proj_b"):
        assert LINEAR + key in message


def test_an_extra_key_is_logged_by_name_and_the_rest_loads(hybrid_checkpoints, tmp_path,
                                                           caplog):
    def edit(tensors):
        tensors[LINEAR + "spare.weight"] = torch.zeros(2)

    with caplog.at_level(logging.WARNING):
        build(rewrite(hybrid_checkpoints["qwen3.5_moe"], tmp_path, edit))
    assert LINEAR + "spare.weight" in caplog.text


@pytest.mark.parametrize("name", HYBRID_CONFIGS)
def test_the_state_dict_loads_back_into_stock_transformers(hybrid_checkpoints, tmp_path,
                                                           name):
    path = hybrid_checkpoints[name]
    config = transformers.AutoConfig.from_pretrained(path)
    state = transformers_state_dict(build(path).hf_model.state_dict(), config)
    if config.tie_word_embeddings:
        del state["lm_head.weight"]
    save_file({k: v.contiguous() for k, v in state.items()},
              str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(tmp_path)
    original = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    saved = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    want, got = original.state_dict(), saved.state_dict()
    assert got.keys() == want.keys()
    for key in want:
        assert torch.equal(got[key], want[key]), key


class ThreadSum:
    """An all-reduce between ranks running in threads: each rank's share, summed in rank
    order (the same sum on every rank)."""

    def __init__(self, size: int):
        self.barrier, self.shares = threading.Barrier(size, timeout=120), [None] * size

    def for_rank(self, rank: int):
        def all_reduce(x: torch.Tensor) -> torch.Tensor:
            self.shares[rank] = x.clone()
            self.barrier.wait()
            total = sum(self.shares[1:], self.shares[0].clone())
            self.barrier.wait()  # every rank has read the shares before the next reduction
            return total
        return all_reduce


@pytest.mark.parametrize("name", ["next_dense1", "qwen3.5_one_value_head_a_key"])
def test_two_ranks_compute_what_one_does(hybrid_checkpoints, name):
    """Each rank holds half the heads (and experts' features) with its own state pools: the
    final hidden states of a prefill and a decode step equal the whole model's."""
    assert_two_ranks_compute_what_one_does(hybrid_checkpoints[name])


def test_two_ranks_of_a_vision_language_release(vision_language_checkpoints):
    """Each rank reads its slices of the release's ``model.language_model.*`` tensors."""
    assert_two_ranks_compute_what_one_does(vision_language_checkpoints["qwen3.5_moe_vl_tied"])


def assert_two_ranks_compute_what_one_does(path: str) -> None:
    batch = prompts(2, (9, 3))
    whole = HybridSteps(build(path), len(batch))
    expected = [whole.step(list(enumerate(batch)), hidden=True),
                whole.step([(0, [7]), (1, [8])], hidden=True)]
    reduce, results = ThreadSum(2), {}

    def run(rank: int) -> None:
        tp = TensorParallel(rank, 2, fast_all_reduce=reduce.for_rank(rank))
        steps = HybridSteps(build(path, tp), len(batch), tp_size=2)
        results[rank] = [steps.step(list(enumerate(batch)), hidden=True),
                         steps.step([(0, [7]), (1, [8])], hidden=True)]

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for rank in range(2):
        for got, want in zip(results[rank], expected):
            torch.testing.assert_close(got, want, atol=1e-5 * want.abs().max().item(), rtol=0)
