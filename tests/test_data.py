import torch

from copytask.data.batches import make_batch
from copytask.data.vocab import BOS, EOS, NUM_SPECIAL, PAD


def test_copy_batch_layout():
    batch = make_batch("copy", 4, 6, 9, torch.Generator().manual_seed(0))
    assert batch.src.shape == (4, 6) and batch.tgt_in.shape == (4, 7) and batch.tgt_out.shape == (4, 7)
    assert ((batch.src >= NUM_SPECIAL) & (batch.src < NUM_SPECIAL + 9)).all()
    assert torch.equal(batch.tgt_out[:, :6], batch.src) and (batch.tgt_out[:, 6] == EOS).all()
    assert (batch.tgt_in[:, 0] == BOS).all() and torch.equal(batch.tgt_in[:, 1:], batch.src)


def test_variable_lengths_are_padded_and_masked():
    batch = make_batch("copy", 64, 10, 5, torch.Generator().manual_seed(1), min_length=3)
    lengths = batch.src_lengths
    assert lengths.min() >= 3 and lengths.max() <= 10 and len(set(lengths.tolist())) > 1
    assert torch.equal(batch.src_mask, batch.src != PAD)
    assert torch.equal(batch.target_mask.sum(1), lengths + 1)  # symbols + EOS
    assert (batch.tgt_out.gather(1, lengths[:, None]) == EOS).all()
    assert torch.equal(batch.content_mask.sum(1), lengths)


def test_reverse_targets_are_reversed_sources():
    batch = make_batch("reverse", 32, 8, 9, torch.Generator().manual_seed(2), min_length=2)
    for src, length, tgt in zip(batch.src, batch.src_lengths, batch.tgt_out):
        assert tgt[:length].tolist() == src[:length].flip(0).tolist()
        assert tgt[length] == EOS


def test_same_seed_same_batches_and_select_trims():
    a = make_batch("copy", 8, 5, 9, torch.Generator().manual_seed(3), min_length=1)
    b = make_batch("copy", 8, 5, 9, torch.Generator().manual_seed(3), min_length=1)
    assert torch.equal(a.src, b.src)
    one = a.select([0])
    length = int(a.src_lengths[0])
    assert one.src.shape == (1, length) and one.tgt_out.shape == (1, length + 1)
