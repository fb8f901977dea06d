"""The running samples as one decode batch, kept on the device between steps.

Built when the set of running samples changes (a sample joins or finishes), then advanced
in place: every row moves one position on, and the tokens just sampled (still on the
device) are the next step's inputs. A step therefore moves data between host and device
once each way: the sampled tokens and logprobs come back in one transfer, and forced
tool-output tokens, the only inputs the host decides, go out in one (and only on steps
that have them). The sampling path is decided on the host from the rows' parameters.
"""
from __future__ import annotations

import torch

from engine.kernels.kv_layout import KVLayout
from engine.kv_cache import StepBatch
from engine.sampling import row_kinds
from engine.sequence import Sequence


class DecodeBatch:
    """Rows `seqs` (ordered by own run, so lockstep neighbours share attention calls).

    Device tensors, one entry per row: tokens (the next input), positions (its position),
    slots, and the sampling parameters temperature, top_k, top_p, min_p, keys; `kinds` (each
    row's sampling path, engine.sampling.row_kinds), `processed` (each row's logprobs_mode is
    "processed"), `top` (each row's top_logprobs) and `kv_len` (longest sequence of the step) are host values.
    """

    def __init__(self, seqs: list[Sequence], device: torch.device):
        self.seqs = seqs
        dev = device
        ps = [s.request.params for s in seqs]
        pos = [s.position for s in seqs]
        self.layout = KVLayout.for_decode([s.own_start for s in seqs], [s.own_pos0 for s in seqs],
                                          [s.prefix_start for s in seqs], pos, dev,
                                          prompt_len=[len(s.request.prompt_tokens) for s in seqs])
        floats = torch.tensor([[p.temperature for p in ps], [p.top_p for p in ps], [p.min_p for p in ps]],
                              dtype=torch.float32)
        self.kinds = row_kinds(floats[0], torch.tensor([p.top_k for p in ps]), floats[1], floats[2])
        self.processed = [p.logprobs_mode == "processed" for p in ps]
        self.top = [p.top_logprobs for p in ps]  # each row's top_logprobs k (0: none)
        floats = floats.to(dev)
        ints = torch.tensor([[s.last_token for s in seqs], pos, [s.slot for s in seqs],
                             [p.top_k for p in ps], [s.key[0] for s in seqs], [s.key[1] for s in seqs]],
                            dtype=torch.long).to(dev)
        self.tokens, self.positions, self.slots, self.top_k = ints[0], ints[1], ints[2], ints[3]
        self.keys = ints[4:6].t()
        self.temperature, self.top_p, self.min_p = floats[0], floats[1], floats[2]
        self.last_index = torch.zeros(len(seqs), dtype=torch.long, device=dev)
        self.kv_len = max(pos) + 1

    def step_batch(self) -> StepBatch:
        return StepBatch(slots=self.slots, positions=self.positions[:, None], last_index=self.last_index,
                         prefill=False, kv_len=self.kv_len, layout=self.layout)

    def advance(self, sampled: torch.Tensor, forced: list[tuple[int, int]]) -> None:
        """Next step: inputs are `sampled` ((B,) on the device) except the (row, token) pairs
        in `forced`; every row one position on."""
        self.tokens = sampled
        if forced:
            rows, toks = torch.tensor(forced, dtype=torch.long).t().to(self.tokens.device)
            self.tokens = sampled.index_put((rows,), toks)
        self.positions = self.positions + 1
        self.layout.advance()
        self.kv_len += 1
