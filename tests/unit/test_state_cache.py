"""A hybrid model's state on the device side, on CPU: the pools and their fork copies, which
modules hold them, the KV sizing that leaves their memory aside, and the step's slots through
the preparer, the tensor-parallel wire and a decode graph's padded inputs."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch import nn

from hf_paged.config import EngineConfig
from hf_paged.modeling.paged_model import PagedModel
from hf_paged.modeling.tp import SINGLE
from hf_paged.step import StepInputs
from hf_paged.worker import channel, state_cache
from hf_paged.worker.channel import STEP, StepChannel
from hf_paged.worker.decode_graphs import DecodeGraphs
from hf_paged.worker.inputs import StepPreparer, device_metadata
from hf_paged.worker.startup import Startup, compile_layers
from hf_paged.worker.state_cache import StateCache, _waves
from tests.unit.test_step_inputs import plan

SHAPES = {"conv_state": ((6, 4), None), "recurrent_state": ((2, 3, 5), torch.float32)}


def pools(num_slots=4, layers=2) -> StateCache:
    cache = StateCache([nn.Module() for _ in range(layers)], SHAPES, torch.bfloat16,
                       torch.device("cpu"))
    cache.allocate(num_slots)
    for module in cache.modules:  # each slot holds its own number
        for name in cache.shapes:
            pool = getattr(module, name)
            pool.copy_(torch.arange(num_slots).view(-1, *[1] * (pool.dim() - 1)))
    return cache


def slot_values(cache: StateCache) -> list[list[int]]:
    return [[int(getattr(m, name)[slot].flatten()[0]) for slot in range(cache.num_slots)]
            for m in cache.modules for name in cache.shapes]


def test_pools_of_the_family_shapes_on_every_linear_layer():
    cache = pools(num_slots=3)
    for module in cache.modules:
        assert module.conv_state.shape == (3, 6, 4) and module.conv_state.dtype == torch.bfloat16
        assert module.recurrent_state.shape == (3, 2, 3, 5)
        assert module.recurrent_state.dtype == torch.float32
    assert cache.slot_bytes() == 2 * (6 * 4 * 2 + 2 * 3 * 5 * 4)
    cache.close()
    assert cache.modules[0].conv_state.numel() == 0 and cache.num_slots == 0


def test_slot_copies_have_the_effect_of_their_order():
    cache = pools(num_slots=5)
    # 0 -> 1 reads slot 0 before 3 -> 0 rewrites it; 1 -> 2 then reads the new slot 1.
    cache.copy_slots([(0, 1), (3, 0), (1, 2), (4, 3)])
    assert slot_values(cache) == [[3, 0, 0, 4, 4]] * 4
    assert _waves([(0, 1), (3, 0), (1, 2), (4, 3)]) == [[(0, 1), (3, 0)], [(1, 2), (4, 3)]]
    assert _waves([(0, 1), (2, 1)]) == [[(0, 1)], [(2, 1)]]  # one destination twice


class Layer(nn.Module):
    def __init__(self, kind: str):
        super().__init__()
        setattr(self, kind, nn.Module())


def fake_model(kinds: list[str], model_type="qwen3") -> PagedModel:
    inner = SimpleNamespace(embed_tokens=None, layers=nn.ModuleList(Layer(k) for k in kinds),
                            norm=None, rotary_emb=None)
    return PagedModel(SimpleNamespace(config=SimpleNamespace(model_type=model_type),
                                      model=inner, lm_head=None))


def test_the_kv_cache_on_full_attention_layers_the_states_on_linear_ones(monkeypatch):
    model = fake_model(["linear_attn", "linear_attn", "self_attn", "linear_attn", "self_attn"])
    layers = model.layers
    assert model.attention_layers == [layers[2].self_attn, layers[4].self_attn]
    assert model.state_modules == [layers[i].linear_attn for i in (0, 1, 3)]
    assert state_cache.state_cache_for(model, 1, torch.float32, torch.device("cpu")) is None

    def state_shapes(config, tp_size):
        return {"conv_state": ((12 // tp_size, 4), None)}

    family = SimpleNamespace(linear_layer_ids=lambda config: (0, 1, 3), state_shapes=state_shapes)
    monkeypatch.setattr(state_cache, "family_for", lambda config: family)
    cache = state_cache.state_cache_for(model, 2, torch.float16, torch.device("cpu"))
    assert cache.modules == model.state_modules and cache.slot_bytes() == 3 * 6 * 4 * 2
    family.linear_layer_ids = lambda config: (0, 1)
    with pytest.raises(ValueError, match="names 2 linear-attention layers but the model has 3"):
        state_cache.state_cache_for(model, 2, torch.float16, torch.device("cpu"))


def test_cpu_sizing_leaves_the_state_pools_their_memory():
    config = EngineConfig(cpu_kv_cache_gib=1 / 1024, max_num_seqs=4)  # 1 MiB
    kv = SimpleNamespace(device=torch.device("cpu"), block_bytes=lambda: 1024)
    states = SimpleNamespace(slot_bytes=lambda: 64 * 1024)

    def blocks(states, num_slots):
        return Startup(None, kv, None, config, 1 << 20, SINGLE, [], states,
                       num_slots)._num_blocks()

    assert blocks(None, 0) == 1024
    assert blocks(states, 4) == 1024 - 256  # four 64 KiB slots
    with pytest.raises(ValueError, match="no memory is left for the KV cache"):
        blocks(states, 16)


def test_kernels_compile_ahead_over_a_layer_of_each_kind():
    model = fake_model(["linear_attn", "linear_attn", "linear_attn", "self_attn", "self_attn"])
    assert compile_layers(model.layers) == [model.layers[i] for i in (0, 1, 3)]
    plain = fake_model(["self_attn"] * 4)
    assert compile_layers(plain.layers) == list(plain.layers[:2])
    mixed = fake_model(["self_attn", "linear_attn", "self_attn"])
    assert compile_layers(mixed.layers) == list(mixed.layers[:2])


def hybrid_inputs() -> StepInputs:
    step = plan([0, 4], [6, 1], [[1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11]], [[3, 5], [9, 2]])
    step.state_slots, step.has_initial_state = [2, 0], [False, True]
    step.state_copies = [(1, 2), (0, 3)]
    return StepPreparer(4, 8, cascade=False).prepare(step, graph_bs=0)


def test_the_preparer_passes_the_slots_on_and_an_eager_step_reads_them_on_the_device():
    inputs = hybrid_inputs()
    assert inputs.state_slots == [2, 0] and inputs.has_initial_state == [False, True]
    assert inputs.state_copies == [(1, 2), (0, 3)]
    meta = device_metadata(inputs, torch.device("cpu"))
    assert meta.state_slots.dtype == torch.int32 and meta.state_slots.tolist() == [2, 0]
    assert meta.has_initial_state.dtype == torch.bool
    assert meta.has_initial_state.tolist() == [False, True]
    inputs.state_slots = inputs.has_initial_state = []
    meta = device_metadata(inputs, torch.device("cpu"))
    assert meta.state_slots is None and meta.has_initial_state is None


class Wire:
    """A broadcast's stand-in: what rank 0 sends, the other rank receives, in order."""

    def __init__(self):
        self.sent: list[torch.Tensor] = []

    def send(self, x: torch.Tensor) -> None:
        self.sent.append(x.clone())

    def recv(self, x: torch.Tensor) -> None:
        x.copy_(self.sent.pop(0))


@pytest.mark.parametrize("inline", [True, False])
@pytest.mark.parametrize("hybrid", [True, False])
def test_the_tensor_parallel_wire_carries_the_slots(hybrid, inline, monkeypatch):
    """The inputs travel with the header, or (``inline`` False: a payload too long for it)
    in a broadcast of their own."""
    if not inline:
        monkeypatch.setattr(channel, "_INLINE", 4)
    wire, sender, receiver = Wire(), StepChannel(None), StepChannel(None)
    sender._broadcast, receiver._broadcast = wire.send, wire.recv
    inputs = hybrid_inputs()
    if not hybrid:
        inputs.state_slots, inputs.has_initial_state, inputs.state_copies = [], [], []
    sender.send(STEP, inputs)
    kind, got = receiver.recv()
    assert kind == STEP and not wire.sent
    assert np.array_equal(got.tables, inputs.tables)
    got.tables = inputs.tables
    assert got == inputs


def test_a_decode_graph_reads_the_slots_from_its_inputs_padding_rows_minus_one():
    seen = {}

    def step(ids, src, positions, meta, *settings):
        seen["meta"] = meta
        return (ids,)

    graphs = DecodeGraphs(step, lambda outputs, n: outputs, False, 4, 2, torch.device("cpu"),
                          16, states=True)
    graphs.clear(4)
    graphs.step(4, False)
    meta = seen["meta"]
    assert meta.state_slots.tolist() == [-1] * 4 and meta.has_initial_state.all()
    graphs.graphs = {(4, False, False): (SimpleNamespace(replay=lambda: None), None)}
    inputs = StepInputs([5, 6, 7], [-1] * 3, [3, 4, 5], [0, 1, 2], [0, 1, 2, 3], [4, 5, 6],
                        np.zeros((3, 2), np.int32), [0, 1, 2], 1, 4, 0, [], 3,
                        state_slots=[3, 0, 2], has_initial_state=[True] * 3)
    graphs.run(inputs, None, 0)
    assert meta.state_slots.tolist() == [3, 0, 2, -1]  # the captured view, refilled
    plain = DecodeGraphs(step, None, False, 4, 2, torch.device("cpu"), 16)
    plain.step(4, False)
    assert seen["meta"].state_slots is None and seen["meta"].has_initial_state is None
