"""transformers streamers fed from the engine: ``put`` of the prompt batch, then one ``put``
a step with each row's token (``pad`` for rows already finished), then ``end``. In assisted
generation of one row, as transformers streams it, each ``put`` carries the tokens a step
kept, as a ``[1, n]`` tensor."""

from __future__ import annotations

import torch

from hf_paged.engine.sequence import Sequence


class StreamFeeder:
    def __init__(self, streamer, pad: int, chunks: bool = False):
        self.streamer = streamer
        self.pad = pad
        self.chunks = chunks
        self.steps_sent = 0

    def start(self, input_ids: torch.Tensor) -> None:
        self.streamer.put(input_ids.cpu())

    def feed(self, seqs: list[Sequence]) -> None:
        """``put`` every step whose tokens all rows have delivered (or finished before)."""
        if self.chunks:
            [seq] = seqs
            new = seq.output_token_ids[self.steps_sent:]
            if new:
                self.streamer.put(torch.tensor([new], dtype=torch.long))
                self.steps_sent += len(new)
            return
        while True:
            t, tokens = self.steps_sent, []
            for seq in seqs:
                if seq.num_new_tokens > t:
                    tokens.append(seq.token_ids[seq.num_prompt_tokens + t])
                elif seq.is_finished:
                    tokens.append(self.pad)
                else:
                    return
            if all(s.is_finished and s.num_new_tokens <= t for s in seqs):
                return
            self.streamer.put(torch.tensor(tokens, dtype=torch.long))
            self.steps_sent += 1

    def end(self) -> None:
        self.streamer.end()
