"""Fixtures for the client-library tests: an hf_paged model of ``tiny_checkpoint`` and its
stock twin, both loaded here because client libraries edit the models they get (Trainer and
TRL set ``config.use_cache``, say), and accelerate's process state left as the other tests
found it."""

from __future__ import annotations

import pytest
import torch
import transformers

import hf_paged
from tests.conftest import SMALL


@pytest.fixture(scope="module")
def paged_model(tiny_checkpoint):
    return hf_paged.AutoModelForCausalLM.from_pretrained(tiny_checkpoint, **SMALL)


@pytest.fixture(scope="module")
def stock_model(tiny_checkpoint):
    return transformers.AutoModelForCausalLM.from_pretrained(
        tiny_checkpoint, dtype=torch.float32).eval()


@pytest.fixture
def fresh_accelerate_state():
    """TRL and Trainer build an ``Accelerator``, whose state is process-wide: reset it after
    each test so that no test inherits another's settings."""
    yield
    from accelerate.state import AcceleratorState, PartialState

    AcceleratorState._reset_state(reset_partial_state=True)
    PartialState._reset_state()
