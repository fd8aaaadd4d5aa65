"""Batches of a task drawn on the fly, and masks.

Token ids (PAD, BOS, EOS, then the content symbols, and the noise token where a task has it) are
`vocab`'s. A source is `L` tokens its task draws (`tasks`; PAD after its length); the target is the
source symbols its task copies, followed by EOS, as long as the source (copy, reverse) or shorter
(selective copying: its content symbols). The decoder reads `BOS + target` and predicts `target + EOS`,
so `T_dec` is the longest target's length + 1 (`T_enc + 1` where the target is as long as the source).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .tasks import get_task, target_positions
from .vocab import BOS, EOS, PAD


def length_mask(lengths: Tensor, max_length: int) -> Tensor:
    """(B,) lengths -> (B, max_length) True on the first `length` positions of each row."""
    return torch.arange(max_length, device=lengths.device)[None, :] < lengths[:, None]


@dataclass
class Batch:
    src: Tensor  # (B, T_enc) the task's source tokens, PAD past each length
    src_lengths: Tensor  # (B,) number of real source symbols
    tgt_in: Tensor  # (B, T_dec) BOS + target, PAD past each target's length
    tgt_out: Tensor  # (B, T_dec) target + EOS, PAD past each target's length

    @property
    def src_mask(self) -> Tensor:
        """(B, T_enc) True on real source positions."""
        return length_mask(self.src_lengths, self.src.size(1))

    @property
    def tgt_lengths(self) -> Tensor:
        """(B,) content symbols of each target (its EOS not counted): `src_lengths` where the target is as
        long as the source."""
        return self.target_mask.sum(1) - 1

    @property
    def content_mask(self) -> Tensor:
        """(B, T_dec) True on target positions holding a content symbol (EOS excluded)."""
        return length_mask(self.tgt_lengths, self.tgt_out.size(1))

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
        """The rows of `batches` in one batch, each padded with PAD to `width` source positions and to the
        widest of their targets."""
        t_dec = max(b.tgt_out.size(1) for b in batches)

        def padded(t: Tensor, size: int) -> Tensor:
            return torch.nn.functional.pad(t, (0, size - t.size(1)), value=PAD)

        return Batch(
            torch.cat([padded(b.src, width) for b in batches]),
            torch.cat([b.src_lengths for b in batches]),
            torch.cat([padded(b.tgt_in, t_dec) for b in batches]),
            torch.cat([padded(b.tgt_out, t_dec) for b in batches]),
        )

    def select(self, index: Tensor | slice) -> Batch:
        """A sub-batch (rows `index`), trimmed to its own longest source and longest target."""
        lengths, tgt_out = self.src_lengths[index], self.tgt_out[index]
        t_enc, t_dec = int(lengths.max()), int((tgt_out != PAD).sum(1).max())
        return Batch(self.src[index, :t_enc], lengths, self.tgt_in[index, :t_dec], tgt_out[:, :t_dec])


def make_batch(
    task: str,
    batch_size: int,
    length: int,
    vocab_size: int,
    generator: torch.Generator,
    min_length: int | None = None,
    copied: int | None = None,
) -> Batch:
    """Draw `batch_size` sources as `task` draws them (`tasks.Sources`; `copied`: task.copied, for a task
    that reads it), over `vocab_size` content symbols.

    With `min_length`, each sequence's length is drawn uniformly from [min_length, length]
    and the batch is padded to `length`; otherwise every sequence has exactly `length` symbols.
    """
    sources = get_task(task).sources  # an unknown task is refused before anything is drawn
    device = generator.device  # the batch is drawn where its generator lives
    if min_length is None:
        lengths = torch.full((batch_size,), length, dtype=torch.long, device=device)
    else:
        lengths = torch.randint(min_length, length + 1, (batch_size,), generator=generator, device=device)
    return task_batch(task, sources.draw(lengths, length, vocab_size, copied, generator), lengths, vocab_size)


def task_batch(task: str, symbols: Tensor, lengths: Tensor, vocab_size: int) -> Batch:
    """The batch of the given sources: `symbols` (B, L) token ids (anything past each row's length is
    ignored), `lengths` (B,), over `vocab_size` content symbols -> sources padded with PAD, and their
    `task`'s targets (`tasks.target_positions`), each as wide as the longest."""
    device = symbols.device
    valid = torch.arange(symbols.size(1), device=device)[None, :] < lengths[:, None]  # (B, L)
    src = symbols.masked_fill(~valid, PAD)
    source_index, target_lengths = target_positions(task, src, lengths, vocab_size)  # (B, T), (B,)
    in_target = torch.arange(source_index.size(1), device=device)[None, :] < target_lengths[:, None]  # (B, T)
    target = src.gather(1, source_index).masked_fill(~in_target, PAD)
    pad_column = torch.full((len(src), 1), PAD, dtype=torch.long, device=device)
    tgt_out = torch.cat([target, pad_column], dim=1).scatter(1, target_lengths[:, None], EOS)
    tgt_in = torch.cat([torch.full((len(src), 1), BOS, dtype=torch.long, device=device), target], dim=1)
    return Batch(src, lengths, tgt_in, tgt_out)


# Row t of the attention weights (B, T_dec, T_enc) serves output token t (Bahdanau and Luong alike),
# so the position it should read is the one its task copies.


def copied_positions(task: str, batch: Batch, vocab_size: int, steps: int | None = None) -> Tensor:
    """The source position whose symbol each output step of `batch` must produce (`tasks`: t for copy,
    length - 1 - t for reverse, the t-th content symbol's for selective copying) -> (B, steps) (None: the
    batch's T_dec); meaningful only for t < the target's length (0 past it)."""
    positions, _ = target_positions(task, batch.src, batch.src_lengths, vocab_size)
    steps = batch.tgt_out.size(1) if steps is None else steps
    return torch.nn.functional.pad(positions, (0, max(0, steps - positions.size(1))))[:, :steps]


def copied_source_positions(task: str, source: list[int], vocab_size: int) -> list[int]:
    """The copied source position of each content output step of one `source` (its tokens, without
    padding) (`tasks.target_positions`): what the heatmaps mark."""
    src, lengths = torch.tensor([source], dtype=torch.long), torch.tensor([len(source)])
    positions, target_lengths = target_positions(task, src, lengths, vocab_size)
    return positions[0, : int(target_lengths[0])].tolist()
