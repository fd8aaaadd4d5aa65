"""The fused CPU kernels against the torch code they replace: nn.GRU (packed where lengths differ)
and Bahdanau's step loop. Same outputs and gradients to float rounding, for both GRU directions,
ragged batches and given initial states."""

import copy
import os

import pytest
import torch

from copytask import kernels
from copytask.data import length_mask, make_batch, total_vocab
from copytask.model import Seq2Seq

from .conftest import run_cli


@pytest.fixture
def kernel():
    """The compiled kernel. CI must build it; elsewhere a machine without a C++ compiler skips."""
    built = kernels.kernel()
    if built is None:
        if os.environ.get("CI"):
            pytest.fail("the fused CPU kernels did not build (see the warning above)")
        pytest.skip("the fused CPU kernels do not build on this machine")
    return built


def run(layer, x, hx, lengths):
    """-> states, final, and the gradients of x, hx and every parameter under a fixed random loss."""
    for tensor in (x, hx, *layer.parameters()):
        if tensor is not None:
            tensor.grad = None
    states, final = layer(x, hx, lengths=lengths)
    weights = torch.Generator().manual_seed(7)
    loss = (states * torch.randn(states.shape, generator=weights)).sum() + (final * torch.randn(final.shape, generator=weights)).sum()
    loss.backward()
    grads = [x.grad] + ([hx.grad] if hx is not None else []) + [p.grad for p in layer.parameters()]
    return [states.detach(), final.detach(), *[g.clone() for g in grads]]


def assert_same_training_step(fused: Seq2Seq, other: Seq2Seq, batch, through_weights: bool = False):
    """One forward and backward of each model on the batch: logits, weights and every parameter's
    gradient agree to float rounding. -> the fused model's weights. `through_weights` adds a loss
    term on the attention weights, so that a gradient reaches them too."""
    outputs = []
    for model in (fused, other):
        logits, weights = model(batch.src, batch.src_lengths, batch.tgt_in)
        loss = logits.square().mean()
        if through_weights:
            loss = loss + (weights * torch.linspace(0, 1, weights.size(-1))).sum()
        loss.backward()
        outputs.append((logits, weights))
    for a, b in zip(*outputs):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    for (name, a), b in zip(fused.named_parameters(), other.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-5, rtol=1e-4, msg=name)
    return outputs[0][1]


@pytest.mark.parametrize("bidirectional", [True, False])
@pytest.mark.parametrize("ragged", [False, True])
@pytest.mark.parametrize("initial", [False, True])
def test_fused_equals_torch(kernel, bidirectional, ragged, initial):
    torch.manual_seed(0)
    fused = kernels.GRU(6, 5, bidirectional, fused=True)
    reference = copy.deepcopy(fused)
    reference.fused = False
    B, T, D = 4, 7, 2 if bidirectional else 1
    x = torch.randn(B, T, 6, requires_grad=True)
    hx = torch.randn(D, B, 5, requires_grad=True) if initial else None
    lengths = torch.tensor([7, 3, 1, 5]) if ragged else torch.full((B,), T)
    got, want = run(fused, x, hx, lengths), run(reference, x, hx, lengths)
    for a, b in zip(got, want, strict=True):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    if ragged:
        assert got[0][1, 3:].abs().max() == 0  # past a sequence's length: zero states, as packing gives


def test_seq2seq_fused_equals_torch(kernel):
    """The whole model, every kernel off against every kernel on: logits and every gradient."""
    torch.manual_seed(0)
    fused = Seq2Seq(total_vocab(9), "luong", "general", fused=True)
    plain = copy.deepcopy(fused)
    for module in plain.modules():
        if hasattr(module, "fused"):
            module.fused = False
    batch = make_batch("copy", 8, 12, 9, torch.Generator().manual_seed(0), min_length=4)
    assert_same_training_step(fused, plain, batch)
    assert kernels.runs_fused(fused) and not kernels.runs_fused(plain)


def test_without_kernel_torch_runs(monkeypatch):
    """No compiler: the same module runs torch's nn.GRU, bit for bit what fused=False gives."""
    torch.manual_seed(0)
    layer = kernels.GRU(6, 5, bidirectional=True)
    x, lengths = torch.randn(3, 5, 6), torch.tensor([5, 2, 4])
    with torch.no_grad():
        reference = copy.deepcopy(layer)
        reference.fused = False
        want = reference(x, lengths=lengths)
        monkeypatch.setattr(kernels, "kernel", lambda: None)
        got = layer(x, lengths=lengths)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert not kernels.runs_fused(Seq2Seq(total_vocab(9), "plain"))


@pytest.fixture
def fresh_build_root(monkeypatch, tmp_path):
    """An empty build folder, and kernel() forgetting the loaded build until the test ends."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    kernels.kernel.cache_clear()
    yield tmp_path
    kernels.kernel.cache_clear()  # the next caller loads the real kernel again


def test_failed_build_warns_and_falls_back(monkeypatch, fresh_build_root):
    def no_compiler(*args, **kwargs):
        raise RuntimeError("Error building extension 'copytask_kernels': c++: not found")

    monkeypatch.setattr("torch.utils.cpp_extension.load", no_compiler)
    with pytest.warns(UserWarning, match="could not build the fused CPU kernels .*c\\+\\+: not found"):
        assert kernels.kernel() is None


def test_a_failed_build_is_remembered_until_the_toolchain_changes(monkeypatch, fresh_build_root):
    attempts = []

    def no_compiler(*args, **kwargs):
        attempts.append(1)
        raise RuntimeError("c++: not found")

    monkeypatch.setattr("torch.utils.cpp_extension.load", no_compiler)
    with pytest.warns(UserWarning, match="could not build"):
        assert kernels.kernel() is None
    kernels.kernel.cache_clear()  # the next process
    with pytest.warns(UserWarning, match=r"did not build on this machine \(c\+\+: not found\).*copytask build"):
        assert kernels.kernel() is None
    assert len(attempts) == 1  # not tried (and not announced as a compile) again

    kernels.kernel.cache_clear()
    monkeypatch.setattr(kernels, "toolchain", lambda: '{"cxx": "/usr/bin/c++ (installed now)"}')
    with pytest.warns(UserWarning, match="could not build"):
        assert kernels.kernel() is None
    assert len(attempts) == 2  # a new toolchain: tried again
    kernels.retry_build()
    with pytest.warns(UserWarning, match="could not build"):
        assert kernels.kernel() is None
    assert len(attempts) == 3  # `copytask build` forgets the failure and tries again


@pytest.mark.parametrize("ragged", [False, True])
def test_bahdanau_decode_equals_the_step_loop(kernel, ragged):
    """The kernel's teacher-forced Bahdanau decoder against BahdanauDecoder's step loop: logits,
    weights and every gradient, also one that reaches the weights (the kernel's third output)."""
    torch.manual_seed(0)
    fused = Seq2Seq(total_vocab(9), "bahdanau", "additive", attention_size=16, fused=True)
    loop = copy.deepcopy(fused)
    loop.decoder.fused = False
    batch = make_batch("copy", 8, 12, 9, torch.Generator().manual_seed(0), min_length=4 if ragged else None)
    weights = assert_same_training_step(fused, loop, batch, through_weights=True)
    if ragged:
        padding = ~length_mask(batch.src_lengths, batch.src.size(1))
        assert weights.masked_select(padding[:, None, :]).abs().max() == 0


def test_bahdanau_intervention_takes_the_step_loop(kernel):
    """Counterfactual checks replace the weights inside the loop: the kernel must not skip them."""
    torch.manual_seed(0)
    model = Seq2Seq(total_vocab(9), "bahdanau", "additive", attention_size=16)
    batch = make_batch("copy", 4, 6, 9, torch.Generator().manual_seed(0))
    model.attention.intervention = lambda weights, mask: torch.ones_like(weights) / mask.sum(-1)[:, None, None]
    _, weights = model(batch.src, batch.src_lengths, batch.tgt_in)
    torch.testing.assert_close(weights, torch.full_like(weights, 1 / 6))


@pytest.mark.parametrize("ragged", [False, True])
def test_additive_scores_equal_torch(kernel, ragged):
    """Luong's concat score under teacher forcing: the kernel against the torch pieces."""
    torch.manual_seed(0)
    fused = Seq2Seq(total_vocab(9), "luong", "additive", attention_size=16, fused=True)
    pieces = copy.deepcopy(fused)
    pieces.attention.fused = False
    batch = make_batch("copy", 8, 12, 9, torch.Generator().manual_seed(0), min_length=4 if ragged else None)
    assert_same_training_step(fused, pieces, batch)


@pytest.mark.parametrize("capability, avx2", [("AVX2", True), ("AVX512", True), ("DEFAULT", False), ("NO AVX", False)])
def test_avx2_builds_are_named_apart(monkeypatch, capability, avx2):
    """A build with AVX2 instructions must never be loaded by a CPU without them (shared homes)."""
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    name, flags = kernels.build_name_and_flags()
    assert ("-mavx2" in flags) == avx2 and name.endswith("_avx2") == avx2


def test_kernels_refuse_what_they_cannot_read(kernel):
    """They read raw float pointers: a strided or float64 tensor is an error that says so, never garbage."""
    gi, h0 = torch.randn(5, 3, 12), torch.zeros(3, 4)
    w_hh, b_hh, no_mask = torch.randn(12, 4), torch.zeros(12), torch.empty(0)
    with pytest.raises(RuntimeError, match="gru_forward expects contiguous float32 CPU tensors"):
        kernel.gru_forward(gi.transpose(0, 1), h0, w_hh, b_hh, no_mask, False)
    with pytest.raises(RuntimeError, match="expects contiguous float32 CPU tensors.*Double"):
        kernel.additive_forward(torch.randn(2, 3, 4, dtype=torch.float64), torch.randn(2, 5, 4), torch.randn(4))


def test_build_command_builds_and_says_where(kernel):
    process = run_cli("build")
    assert process.returncode == 0, process.stderr
    assert "the fused CPU kernels are built:" in process.stdout and ".so" in process.stdout
