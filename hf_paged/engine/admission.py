"""Requests into the engine: each validated, made a ``Sequence`` on its LoRA adapter's slot and
queued; and the adapters themselves, loaded and unloaded beside the running requests."""

from __future__ import annotations

from typing import TYPE_CHECKING

from hf_paged.engine.sequence import Sequence, Status
from hf_paged.engine.validation import check_fork_count, check_request
from hf_paged.sampling_params import SamplingParams

if TYPE_CHECKING:
    from hf_paged.lora.adapter import LoraAdapter


class Admission:
    """``EngineCore``'s requests and adapters (it provides ``adapters``, ``scheduler``,
    ``block_manager``, ``config``, ``device``, ``hf_config``, ``max_model_len`` and
    ``closed``)."""

    def add_request(
        self, prompt_token_ids: list[int], params: SamplingParams, request_id: object = None,
        output_token_ids: list[int] = (),
    ) -> Sequence:
        """Validate and queue one request; it starts at the next ``step``.
        ``output_token_ids``: tokens already generated for it, which it continues from (they
        count against ``max_new_tokens``; the prompt may then be empty)."""
        tokens = [*prompt_token_ids, *output_token_ids]
        self.validate_request(tokens, params)
        seq = Sequence(tokens, params, request_id, self.adapters.resolve(params.adapter))
        seq.num_prompt_tokens = len(prompt_token_ids)
        # Tokens it continues from may already end it (an EOS, its length): then it never runs.
        reason = self.scheduler.finish_reason(seq) if output_token_ids else None
        if reason is None:
            self.scheduler.add(seq)
        else:
            seq.status, seq.finish_reason = Status.FINISHED, reason
        return seq

    def add_requests(self, prompts: list[list[int]],
                     params: SamplingParams | list[SamplingParams]) -> list[Sequence]:
        """Queue one request per prompt (``params``: one for all, or one each), all checked
        before any is queued; they start at the next ``step``."""
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError("params: one SamplingParams per prompt, or a single one for all")
        for prompt, p in zip(prompts, params_list):
            self.validate_request(prompt, p)
        seqs = [Sequence(prompt, p, lora=self.adapters.resolve(p.adapter))
                for prompt, p in zip(prompts, params_list)]
        for seq in seqs:
            self.scheduler.add(seq)
        return seqs

    def validate_request(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError, naming the argument, for a request the engine cannot serve."""
        if self.closed:
            raise RuntimeError("this engine was closed; load the model again to generate")
        memory = "gpu_memory_utilization" if self.device.type == "cuda" else "cpu_kv_cache_gib"
        check_request(prompt_token_ids, params.max_new_tokens, self.hf_config.vocab_size,
                      self.max_model_len, self.block_manager, memory)
        if params.speculation is not None and self.block_manager.state_slots is not None:
            raise ValueError("speculation (prompt_lookup_num_tokens, assistant_model): "
                             f"{self.hf_config.model_type} has linear-attention layers, whose "
                             "state cannot take rejected draft tokens back; speculative "
                             "decoding is not supported on it")
        self.adapters.resolve(params.adapter)

    def add_lora(self, name: str, adapter: LoraAdapter) -> None:
        """Hold LoRA ``adapter`` under ``name`` (``SamplingParams(adapter=name)``) beside the
        running requests; ``remove_lora`` unloads it once no request uses it."""
        self.adapters.add(name, adapter)

    def remove_lora(self, name: str) -> None:
        s = self.scheduler
        self.adapters.remove(name, [*s.running, *s.waiting, *s.parked])

    def add_forked_requests(
        self, prompt_token_ids: list[int], params: SamplingParams, n: int
    ) -> list[Sequence]:
        """Queue ``n`` requests with one prompt, prefilled once: when its last logits are
        computed the requests fork (sharing the prompt's KV blocks) and each samples its own
        first token from those logits, then they go their own ways (as transformers' batch
        expanded by ``num_return_sequences`` does). Returns the ``n`` sequences."""
        check_fork_count(n, self.config.max_num_seqs)
        self.validate_request(prompt_token_ids, params)
        lora = self.adapters.resolve(params.adapter)
        seqs = [Sequence(prompt_token_ids, params, lora=lora) for _ in range(n)]
        self.scheduler.add(seqs[0], seqs[1:])
        return seqs
