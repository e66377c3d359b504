"""check_lora_config: what an adapter config asks that is not served is refused by name before
any tensor is read; what it reaches is what PEFT itself injects."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from peft import IA3Config, LoraConfig
from peft.utils import get_peft_model_state_dict
from transformers import AutoModelForCausalLM, LlamaConfig

from hf_paged.lora.adapter import PROJECTIONS
from hf_paged.lora.base_modules import base_modules, projection_shape
from hf_paged.lora.checks import check_lora_config
from hf_paged.lora.reading import adapter_from_state, read_adapter
from tests.unit.lora_helpers import base_config, lora_layers, peft_model, plain_moe_matching


def refusal(config, base: str = "gqa_tied") -> str:
    with pytest.raises(ValueError) as error:
        check_lora_config(config, base_config(base))
    message = str(error.value)
    assert "\n" not in message and "served:" in message
    return message


@pytest.mark.parametrize("options, named", [
    (dict(use_dora=True), "use_dora=True is not served (DoRA)"),
    (dict(bias="all"), "bias='all'"),
    (dict(bias="lora_only"), "bias='lora_only'"),
    (dict(lora_bias=True), "lora_bias=True"),
    (dict(modules_to_save=["lm_head"]), "modules_to_save=['lm_head']"),
    (dict(trainable_token_indices=[1, 2]), "trainable_token_indices=[1, 2]"),
    (dict(target_parameters=["mlp.experts.gate_up_proj"]),
     "target_parameters=['mlp.experts.gate_up_proj'] is not served (LoRA on parameters, which "
     "is how PEFT reaches MoE experts: LoRA on MoE experts is not supported)"),
    (dict(use_qalora=True), "use_qalora=True is not served (QALoRA)"),
    (dict(layer_replication=[[0, 1], [0, 2]]), "layer_replication=[[0, 1], [0, 2]]"),
    (dict(fan_in_fan_out=True), "fan_in_fan_out=True"),
    (dict(megatron_config={"tensor_model_parallel_size": 2}), "megatron_config="),
    (dict(alora_invocation_tokens=[5, 6], task_type="CAUSAL_LM"),
     "alora_invocation_tokens=[5, 6] is not served (a LoRA variant)"),
    (dict(init_lora_weights="mica"), "init_lora_weights='mica' is not served (a LoRA variant)"),
    (dict(init_lora_weights="pissa"), "init_lora_weights='pissa' is not served (the adapter is "
     "relative to the base weights"),
    (dict(init_lora_weights="pissa_niter_4"), "init_lora_weights='pissa_niter_4'"),
    (dict(init_lora_weights="olora"), "init_lora_weights='olora'"),
    (dict(init_lora_weights="corda"), "init_lora_weights='corda'"),
    (dict(task_type="SEQ_CLS"), "task_type='SEQ_CLS' is not served (served: CAUSAL_LM or none)"),
])
def test_option_refused_by_name(options, named):
    assert named in refusal(LoraConfig(target_modules=["q_proj"], **options))


def test_other_peft_methods_refused():
    assert "peft_type='IA3'" in refusal(IA3Config(target_modules=["q_proj"],
                                                  feedforward_modules=[]))


def test_option_unknown_to_the_check_refused():
    # a newer PEFT's option must not run as plain LoRA
    @dataclasses.dataclass
    class NewerLoraConfig(LoraConfig):
        use_newer_variant: bool = False

    check_lora_config(NewerLoraConfig(target_modules=["q_proj"]), base_config("gqa_tied"))
    assert ("use_newer_variant=True is not served (an option this version of hf_paged does not "
            "know)") in refusal(NewerLoraConfig(target_modules=["q_proj"], use_newer_variant=True))


def test_base_model_type_refused():
    with pytest.raises(ValueError, match="model_type 'llama' is not supported; served: qwen3, "
                                         "qwen3_moe"):
        check_lora_config(LoraConfig(target_modules=["q_proj"]), LlamaConfig())


@pytest.mark.parametrize("options", [
    dict(lora_dropout=0.1), dict(runtime_config={"ephemeral_gpu_offload": True}),
    dict(base_model_name_or_path="someone/renamed"), dict(task_type=None),
    dict(task_type="CAUSAL_LM"), dict(init_lora_weights="gaussian"),
    dict(init_lora_weights="orthogonal"), dict(init_lora_weights=False),
    dict(init_lora_weights="eva"), dict(inference_mode=True), dict(exclude_modules=["k_proj"]),
    dict(layers_to_transform=[0], layers_pattern="layers"), dict(revision="v2"),
])
def test_option_accepted(options):
    targets = check_lora_config(LoraConfig(target_modules=["q_proj", "k_proj"], **options),
                                base_config("gqa_tied"))
    assert targets


@pytest.mark.parametrize("base, targets, named", [
    ("gqa_tied", ["embed_tokens"], "reaches model.embed_tokens: LoRA on embed_tokens is not "
     "supported"),
    ("gqa_tied", ["q_proj", "lm_head"], "reaches lm_head: LoRA on lm_head is not supported"),
    ("gqa_tied", ["mlp"], "reaches model.layers.0.mlp: LoRA on mlp is not supported"),
    ("gqa_tied", ["q_norm"], "reaches model.layers.0.self_attn.q_norm"),
    ("gqa_tied", r".*norm", "reaches model.layers.0.self_attn.q_norm"),
    ("moe_e8_k2_tied", ["gate"], "reaches model.layers.0.mlp.gate: LoRA on the MoE router "
     "(mlp.gate) is not supported"),
    ("moe_e8_k2_tied", ["q_proj", "gate_proj", "up_proj"], "reaches "
     "model.layers.0.mlp.experts.0.gate_proj: LoRA on MoE experts is not supported"),
    ("moe_e6_k3_raw_dense0", ["down_proj"], "reaches model.layers.1.mlp.experts.0.down_proj: "
     "LoRA on MoE experts is not supported"),
    ("moe_e8_k2_tied", r".*\.experts\..*", "LoRA on MoE experts is not supported"),
    ("moe_e8_k2_tied", ["experts"], "LoRA on MoE experts is not supported"),
    ("gqa_tied", ["qproj"], "target_modules=['qproj']: 'qproj' matches no module of the qwen3 "
     "base model"),
    ("gqa_tied", ["q_proj", "foo"], "'foo' matches no module"),
    ("gqa_tied", r"model\.layer\.\d+\.q_proj", "matches no module"),
    ("moe_e8_k2_tied", ["q_proj", "mlp.gate_proj"], "'mlp.gate_proj' matches no module of the "
     "qwen3_moe base model"),
])
def test_target_refused_by_name(base, targets, named):
    assert named in refusal(LoraConfig(target_modules=targets), base)


def test_all_excluded_refused():
    assert "exclude_modules=['q_proj'] leaves no module of target_modules=['q_proj']" in refusal(
        LoraConfig(target_modules=["q_proj"], exclude_modules=["q_proj"]))


def test_layers_beyond_the_base_match_nothing():
    assert "(layers_to_transform=[7])" in refusal(
        LoraConfig(target_modules=["q_proj"], layers_to_transform=[7]))


# The general rule: the projections check_lora_config finds are those PEFT injects.
SAME_AS_PEFT = [
    ("gqa_tied", dict(target_modules=["q_proj", "v_proj"])),
    ("gqa4_untied", dict(target_modules="all-linear")),
    ("gqa4_untied", dict(target_modules="all-linear", exclude_modules=["k_proj", "up_proj"])),
    ("gqa4_untied", dict(target_modules=list(PROJECTIONS), exclude_modules=["o_proj"])),
    ("gqa4_untied", dict(target_modules=list(PROJECTIONS), exclude_modules=r".*\.1\.mlp\..*")),
    ("mha_untied", dict(target_modules=r"model\.layers\.1\.self_attn\.[qk]_proj")),
    ("mha_untied", dict(target_modules=r".*(up|down)_proj")),
    ("one_kv_head", dict(target_modules=["model.layers.0.self_attn.k_proj", "gate_proj"])),
    ("gqa4_untied", dict(target_modules=["self_attn.v_proj", "mlp.up_proj"],
                         layers_to_transform=[1], layers_pattern="layers")),
    ("moe_e8_k2_tied", dict(target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])),
    ("moe_e4_k1_step2", dict(target_modules=list(PROJECTIONS), layers_to_transform=[0, 2])),
    ("moe_e4_k1_step2", dict(target_modules="all-linear")),
    ("moe_e4_k1_step2", dict(target_modules="all-linear",
                             exclude_modules=r".*\.mlp\.(gate|experts.*)")),
    ("moe_e6_k3_raw_dense0", dict(target_modules=r".*\.0\.mlp\..*_proj|.*v_proj")),
]


@pytest.mark.parametrize("base, lora", SAME_AS_PEFT)
def test_targets_are_those_peft_injects(base, lora, monkeypatch):
    plain_moe_matching(monkeypatch)
    config = base_config(base)
    targets = check_lora_config(LoraConfig(**lora), config)
    assert targets.keys() == lora_layers(peft_model(config, **lora)).keys()
    for (layer, projection), module in targets.items():
        assert module.startswith(f"model.layers.{layer}.") and module.endswith(projection)


def test_all_linear_on_moe_follows_the_tensors():
    """all-linear reached the router and experts in transformers 4 (linears then), not in 5:
    the served projections are taken, and a tensor on the router or an expert is refused."""
    config = base_config("moe_e8_k2_tied")  # every layer sparse
    all_linear = LoraConfig(target_modules="all-linear")
    targets = check_lora_config(all_linear, config)
    assert {p for _, p in targets} == {"q_proj", "k_proj", "v_proj", "o_proj"}
    model = peft_model(config, target_modules="all-linear")  # PEFT's: router and experts too
    state = get_peft_model_state_dict(model)
    attention = {k: v for k, v in state.items() if "self_attn" in k}
    assert adapter_from_state(all_linear, attention, "a", config, torch.float32).weights
    for key in state.keys() - attention.keys():
        with pytest.raises(ValueError, match=f"^adapter tensor {key}: LoRA on (MoE experts|the "
                                             r"MoE router \(mlp.gate\)) is not supported"):
            adapter_from_state(all_linear, {**attention, key: state[key]}, "a", config,
                               torch.float32)


@pytest.mark.parametrize("targets", [["q_proj", "gate_proj", "up_proj", "down_proj"],
                                     "all-linear", ["gate"]])
def test_moe_adapters_peft_puts_on_experts_refused(tmp_path, targets):
    """PEFT under transformers 5 saves expert and router LoRA as target_parameters."""
    config = base_config("moe_e6_k3_raw_dense0")
    peft_model(config, target_modules=targets).save_pretrained(str(tmp_path))
    with pytest.raises(ValueError, match=r"adapter option target_parameters=\[.*\] is not "
                                         r"served .*LoRA on MoE experts is not supported"):
        read_adapter(str(tmp_path), "a", config, torch.float32)


@pytest.mark.parametrize("base", ["gqa4_untied", "moe_e4_k1_step2", "moe_e6_k3_raw_dense0"])
def test_base_modules_are_the_models(base):
    """The names are transformers' own, but for the experts: one linear per expert and
    projection, as the checkpoints (and transformers 4) lay them out."""
    config = base_config(base)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    named = {name: module for name, module in model.named_modules() if name}
    modules = {m.name: m for m in base_modules(config)}
    fused = {name for name in named if ".mlp.experts." in name}  # the fused experts' own
    expert_linears = {name for name in modules if ".mlp.experts." in name}
    assert modules.keys() - expert_linears == named.keys() - fused
    for name, module in named.items():
        if name in modules and ".mlp.gate" not in name:  # the router was a linear in 4
            assert modules[name].linear == isinstance(module, torch.nn.Linear), name
        if modules.get(name) and modules[name].projection:
            layer, projection = modules[name].projection
            assert tuple(module.weight.shape) == projection_shape(config, projection)[::-1]
