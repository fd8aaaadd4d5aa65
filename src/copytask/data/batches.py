"""Batches of a task drawn on the fly, and masks.

Token ids (PAD, BOS, EOS, then the content symbols) are `vocab`'s. A source is `L` content symbols
(PAD after its length); the target is the source symbols its task (`tasks`) copies, followed by
EOS. The decoder reads `BOS + target` and predicts
`target + EOS`, so `T_dec = T_enc + 1`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .tasks import source_positions, task_positions
from .vocab import BOS, EOS, NUM_SPECIAL, PAD, total_vocab


def length_mask(lengths: Tensor, max_length: int) -> Tensor:
    """(B,) lengths -> (B, max_length) True on the first `length` positions of each row."""
    return torch.arange(max_length, device=lengths.device)[None, :] < lengths[:, None]


@dataclass
class Batch:
    src: Tensor  # (B, T_enc) content ids, PAD past each length
    src_lengths: Tensor  # (B,) number of real source symbols
    tgt_in: Tensor  # (B, T_dec) BOS + target, PAD past each length
    tgt_out: Tensor  # (B, T_dec) target + EOS, PAD past each length

    @property
    def src_mask(self) -> Tensor:
        """(B, T_enc) True on real source positions."""
        return length_mask(self.src_lengths, self.src.size(1))

    @property
    def content_mask(self) -> Tensor:
        """(B, T_dec) True on target positions holding a content symbol (EOS excluded)."""
        return length_mask(self.src_lengths, self.tgt_out.size(1))

    @property
    def target_mask(self) -> Tensor:
        """(B, T_dec) True on every real target position (content symbols and EOS)."""
        return self.tgt_out != PAD

    def to(self, device: torch.device | str) -> Batch:
        """The batch on `device`, in one copy: the four tensors (all int64) travel as one buffer,
        from pinned memory without waiting (`non_blocking`) when they go from the CPU to a GPU, where
        four copies from pageable memory would each wait for the GPU to catch up."""
        device = torch.device(device)
        tensors = (self.src, self.src_lengths, self.tgt_in, self.tgt_out)
        if self.src.device.type == device.type and device.index in (None, self.src.device.index):
            return self
        flat = torch.cat([t.flatten() for t in tensors])
        if device.type == "cuda" and flat.device.type == "cpu":
            flat = flat.pin_memory().to(device, non_blocking=True)
        else:
            flat = flat.to(device)
        parts = flat.split([t.numel() for t in tensors])
        return Batch(*(part.view(t.shape) for part, t in zip(parts, tensors)))

    def __len__(self) -> int:
        return self.src.size(0)

    @staticmethod
    def concat(batches: list[Batch], width: int) -> Batch:
        """The rows of `batches` in one batch, each padded with PAD to `width` source positions."""

        def padded(t: Tensor, size: int) -> Tensor:
            return torch.nn.functional.pad(t, (0, size - t.size(1)), value=PAD)

        return Batch(
            torch.cat([padded(b.src, width) for b in batches]),
            torch.cat([b.src_lengths for b in batches]),
            torch.cat([padded(b.tgt_in, width + 1) for b in batches]),
            torch.cat([padded(b.tgt_out, width + 1) for b in batches]),
        )

    def select(self, index: Tensor | slice) -> Batch:
        """A sub-batch (rows `index`), trimmed to its own longest source."""
        lengths = self.src_lengths[index]
        t_enc = int(lengths.max())
        return Batch(
            self.src[index, :t_enc], lengths, self.tgt_in[index, : t_enc + 1], self.tgt_out[index, : t_enc + 1]
        )


def make_batch(
    task: str,
    batch_size: int,
    length: int,
    vocab_size: int,
    generator: torch.Generator,
    min_length: int | None = None,
) -> Batch:
    """Draw `batch_size` sequences of uniform random content symbols.

    With `min_length`, each sequence's length is drawn uniformly from [min_length, length]
    and the batch is padded to `length`; otherwise every sequence has exactly `length` symbols.
    """
    task_positions(task)  # an unknown task is refused before anything is drawn
    device = generator.device  # the batch is drawn where its generator lives
    if min_length is None:
        lengths = torch.full((batch_size,), length, dtype=torch.long, device=device)
    else:
        lengths = torch.randint(min_length, length + 1, (batch_size,), generator=generator, device=device)
    symbols = torch.randint(
        NUM_SPECIAL, total_vocab(vocab_size), (batch_size, length), generator=generator, device=device
    )
    return task_batch(task, symbols, lengths)


def task_batch(task: str, symbols: Tensor, lengths: Tensor) -> Batch:
    """The batch of the given sources: `symbols` (B, L) content ids (anything past each row's length
    is ignored), `lengths` (B,) -> sources padded with PAD, and their `task`'s targets."""
    device = symbols.device
    positions = torch.arange(symbols.size(1), device=device)
    valid = positions[None, :] < lengths[:, None]  # (B, L)
    src = symbols.masked_fill(~valid, PAD)
    source_index = source_positions(task, positions[None, :], lengths[:, None])  # (B, L)
    target = src.gather(1, source_index).masked_fill(~valid, PAD)
    pad_column = torch.full((len(src), 1), PAD, dtype=torch.long, device=device)
    tgt_out = torch.cat([target, pad_column], dim=1).scatter(1, lengths[:, None], EOS)
    tgt_in = torch.cat([torch.full((len(src), 1), BOS, dtype=torch.long, device=device), target], dim=1)
    return Batch(src, lengths, tgt_in, tgt_out)


# Row t of the attention weights (B, T_dec, T_enc) serves output token t (Bahdanau and Luong alike),
# so the position it should read is the one its task copies.


def copied_positions(task: str, lengths: Tensor, steps: int) -> Tensor:
    """(B,) lengths -> (B, steps) the source position whose symbol output step t must produce
    (`tasks`: t for copy, length - 1 - t for reverse); meaningful only for t < length (0 past it)."""
    return source_positions(task, torch.arange(steps, device=lengths.device)[None, :], lengths[:, None])


def copied_source_positions(task: str, length: int) -> list[int]:
    """The copied source position of each content output step of one sequence of `length` symbols
    (`copied_positions`): what the heatmaps mark."""
    return copied_positions(task, torch.tensor([length]), length)[0].tolist()
