"""hf_paged: paged-KV, continuous-batching generation for Hugging Face Qwen3 checkpoints."""

from hf_paged.config import EngineConfig
from hf_paged.generation.paged_engine import PagedEngine
from hf_paged.integrations.causal_lm import AutoModelForCausalLM, Qwen3ForCausalLM
from hf_paged.integrations.patch import patch_transformers, unpatch_transformers
from hf_paged.sampling_params import SamplingParams, Speculation

from_pretrained = PagedEngine.from_pretrained

__all__ = [
    "AutoModelForCausalLM", "EngineConfig", "PagedEngine", "Qwen3ForCausalLM", "SamplingParams",
    "Speculation", "from_pretrained", "patch_transformers", "unpatch_transformers",
]
__version__ = "0.1.0"
