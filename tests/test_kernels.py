"""The fused CPU kernels against the torch code they replace: nn.GRU (packed where lengths differ)
and Bahdanau's step loop. Same outputs and gradients to float rounding, for both GRU directions,
ragged batches and given initial states."""

import copy
import os
import platform
import shutil
import subprocess
import sys

import filelock
import pytest
import torch

from copytask.data.batches import Batch, length_mask, make_batch, task_batch
from copytask.data.vocab import total_vocab
from copytask.kernels import build, ops
from copytask.models.recurrent import Seq2Seq

from .conftest import pythonpath, run_cli


def run(layer, x, hx, lengths):
    """-> states, final, and the gradients of x, hx and every parameter under a fixed random loss."""
    for tensor in (x, hx, *layer.parameters()):
        if tensor is not None:
            tensor.grad = None
    states, final = layer(x, hx, lengths=lengths)
    weights = torch.Generator().manual_seed(7)
    loss = (states * torch.randn(states.shape, generator=weights)).sum() + (
        final * torch.randn(final.shape, generator=weights)
    ).sum()
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
    fused = ops.GRU(6, 5, bidirectional, fused=True)
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
    assert ops.runs_fused(fused) and not ops.runs_fused(plain)


def test_without_kernel_torch_runs(monkeypatch):
    """No compiler: the same module runs torch's nn.GRU, bit for bit what fused=False gives."""
    torch.manual_seed(0)
    layer = ops.GRU(6, 5, bidirectional=True)
    x, lengths = torch.randn(3, 5, 6), torch.tensor([5, 2, 4])
    with torch.no_grad():
        reference = copy.deepcopy(layer)
        reference.fused = False
        want = reference(x, lengths=lengths)
        monkeypatch.setattr(ops, "kernel", lambda: None)
        got = layer(x, lengths=lengths)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert not ops.runs_fused(Seq2Seq(total_vocab(9), "plain"))


@pytest.fixture
def fresh_build_root(monkeypatch, tmp_path):
    """An empty build folder, and kernel() forgetting the loaded build until the test ends."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    build.kernel.cache_clear()
    yield tmp_path
    build.kernel.cache_clear()  # the next caller loads the real kernel again


def test_failed_build_warns_and_falls_back(monkeypatch, fresh_build_root):
    def no_compiler(*args, **kwargs):
        raise RuntimeError("Error building extension 'copytask_kernels': c++: not found")

    monkeypatch.setattr("torch.utils.cpp_extension.load", no_compiler)
    with pytest.warns(UserWarning, match="could not build the fused CPU kernels .*c\\+\\+: not found"):
        assert ops.kernel() is None


def test_a_failed_compile_is_named_by_the_compilers_first_error(monkeypatch, fresh_build_root):
    def compile_error(*args, **kwargs):
        raise RuntimeError(
            "Error building extension 'copytask_kernels_avx2_355de488': [1/7] clang++ -MMD -MF additive.o.d -O3\n"
            "FAILED: attention.o\nclang++ -MMD -MF attention.o.d -O3 -c attention.cpp -o attention.o\n"
            "attention.cpp:405:35: error: reference to local binding 'D' declared in enclosing function\n"
            "attention.cpp:406:35: error: reference to local binding 'T' declared in enclosing function\n"
        )

    monkeypatch.setattr("torch.utils.cpp_extension.load", compile_error)
    with pytest.warns(UserWarning, match=r"could not build the fused CPU kernels \(attention.cpp:405:35: error: ref"):
        assert ops.kernel() is None


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("clang++") is None, reason="needs clang++ (Debian's clang)")
def test_the_kernels_build_with_clang(monkeypatch, fresh_build_root):
    """Not only with g++, which takes what C++17 does not (a structured binding captured by a lambda)."""
    monkeypatch.setenv("CXX", "clang++")
    built = ops.kernel()
    assert built is not None, "the kernels did not build with clang++ (the warning above says why)"
    states, final, _, _ = built.gru_forward(
        torch.ones(1, 1, 3), torch.zeros(1, 1), torch.zeros(3, 1), torch.zeros(3), torch.empty(0), False
    )
    assert torch.equal(states[0], final)


def test_a_failed_build_is_remembered_until_the_toolchain_changes(monkeypatch, fresh_build_root):
    attempts = []

    def no_compiler(*args, **kwargs):
        attempts.append(1)
        raise RuntimeError("c++: not found")

    monkeypatch.setattr("torch.utils.cpp_extension.load", no_compiler)
    with pytest.warns(UserWarning, match="could not build"):
        assert ops.kernel() is None
    build.kernel.cache_clear()  # the next process
    with pytest.warns(UserWarning, match=r"did not build on this machine \(c\+\+: not found\).*copytask build"):
        assert ops.kernel() is None
    assert len(attempts) == 1  # not tried (and not announced as a compile) again

    build.kernel.cache_clear()
    monkeypatch.setattr(build, "toolchain", lambda: '{"cxx": "/usr/bin/c++ (installed now)"}')
    with pytest.warns(UserWarning, match="could not build"):
        assert ops.kernel() is None
    assert len(attempts) == 2  # a new toolchain: tried again
    build.retry_build()
    with pytest.warns(UserWarning, match="could not build"):
        assert ops.kernel() is None
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


@pytest.mark.parametrize("sequences", [1, 3])
@pytest.mark.parametrize("source", [0, 5], ids=["empty source", "first step only"])
def test_bahdanau_decode_of_a_one_step_target_equals_the_step_loop(kernel, source, sequences):
    """A target of one step (tgt_in one column: an empty source's, or a library caller's first step)
    is one block of the kernel's buffers; for one sequence its contexts were a view of the saved GRU
    inputs, which a custom op may not return. The same numbers as the step loop, gradients too."""
    torch.manual_seed(0)
    fused = Seq2Seq(total_vocab(9), "bahdanau", "additive", attention_size=16, fused=True)
    loop = copy.deepcopy(fused)
    loop.decoder.fused = False
    symbols = torch.randint(3, total_vocab(9), (sequences, source), generator=torch.Generator().manual_seed(0))
    whole = task_batch("copy", symbols, torch.full((sequences,), source), 9)
    batch = Batch(whole.src, whole.src_lengths, whole.tgt_in[:, :1], whole.tgt_out[:, :1])
    weights = assert_same_training_step(fused, loop, batch, through_weights=True)
    assert weights.shape == (sequences, 1, source)


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
    name, flags = build.build_name_and_flags()
    assert ("-mavx2" in flags) == avx2 and name.startswith("copytask_kernels_avx2_") == avx2


# The kernels' refusals, made in a child process: a refusal is a C++ exception, and one that crashed
# the process (a worker's segmentation fault on the GPU machine, issue 64) must fail a test naming
# it, not take a pytest worker down. faulthandler prints the child's stack if it does crash.
REFUSALS = """
import faulthandler, sys
import torch
faulthandler.enable()
if sys.argv[1] == "cuda":
    torch.zeros(1, device="cuda")  # CUDA initialised in the process, as in a GPU run
from copytask.kernels import ops
kernel = ops.kernel()
gi, h0, w_hh, b_hh, none = torch.randn(5, 3, 12), torch.zeros(3, 4), torch.randn(12, 4), torch.zeros(12), torch.empty(0)
B, T, S, A, H, E = 2, 3, 5, 4, 6, 7
embedded, s0, keys, values = torch.randn(T, B, E), torch.randn(B, H), torch.randn(B, S, A), torch.randn(B, S, H - 1)
cell = [torch.randn(3 * H, E + H), torch.randn(3 * H), torch.randn(3 * H, H), torch.randn(3 * H)]
states, final, gates, before = kernel.gru_forward(gi, h0, w_hh, b_hh, none, False)
calls = [
    lambda: kernel.gru_forward(gi.transpose(0, 1), h0, w_hh, b_hh, none, False),  # strided
    lambda: kernel.additive_forward(torch.randn(2, 3, 4, dtype=torch.float64), torch.randn(2, 5, 4), torch.randn(4)),
    lambda: kernel.gru_forward(gi, h0, w_hh, b_hh, torch.ones(2, 2), False),
    lambda: kernel.gru_backward(states[:4].contiguous(), final, gates, before, w_hh, none, False),
    lambda: kernel.additive_forward(torch.randn(2, 3, 4), torch.randn(1, 5, 4), torch.randn(4)),
    lambda: kernel.bahdanau_forward(embedded, s0, keys, values, none, torch.randn(A, H), torch.randn(A), *cell),
]
for call in calls:
    try:
        call()
        print("no error")
    except RuntimeError as error:
        print(str(error).splitlines()[0])
"""


@pytest.mark.slow
@pytest.mark.parametrize("process", ["cpu", "cuda"], ids=["cpu-only process", "after CUDA's initialisation"])
def test_kernels_refuse_what_they_cannot_read_without_crashing(kernel, process):
    """They read raw float pointers by sizes taken from a few tensors: a strided or float64 tensor, or
    one of another shape, is an error that names it, never garbage, a read past its end or a crash."""
    if process == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    child = subprocess.run(
        [sys.executable, "-c", REFUSALS, process],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": pythonpath()},
        timeout=300,
    )
    compiler = subprocess.run([os.environ.get("CXX", "c++"), "--version"], capture_output=True, text=True)
    assert child.returncode == 0, (
        f"a refusal ended the process with status {child.returncode} (kernels built by "
        f"{compiler.stdout.splitlines()[:1]}):\n{child.stdout}{child.stderr[-3000:]}"
    )
    assert child.stdout.splitlines() == [
        "gru_forward expects contiguous float32 CPU tensors, got one of shape [3, 5, 12], Float, on cpu",
        "additive_forward expects contiguous float32 CPU tensors, got one of shape [2, 3, 4], Double, on cpu",
        "gru_forward: mask must have shape [5, 3], got [2, 2]",
        "gru_backward: grad_states must have shape [5, 3, 4], got [4, 3, 4]",
        "additive_forward: keys must have shape [2, 5, 4], got [1, 5, 4]",
        "bahdanau_forward: values must have shape [2, 5, 6], got [2, 5, 5]",
    ]


def assert_same_non_finite(got, want):
    """NaN and inf exactly where torch has them, the finite rest equal to float rounding."""
    assert torch.equal(got.isnan(), want.isnan()), f"NaN at {got.isnan().sum()} places, torch at {want.isnan().sum()}"
    assert torch.equal(got.isinf(), want.isinf()), f"inf at {got.isinf().sum()} places, torch at {want.isinf().sum()}"
    finite = want.isfinite()
    torch.testing.assert_close(got[finite], want[finite], atol=1e-5, rtol=1e-4)


def test_gru_propagates_non_finite_as_torch(kernel):
    """A diverging input must reach the output as torch's would, not be clamped into a finite
    number; a bad value at a padded position stays out, as packing leaves it out."""
    torch.manual_seed(0)
    fused = ops.GRU(6, 5, bidirectional=True)
    reference = copy.deepcopy(fused)
    reference.fused = False
    x, lengths = torch.randn(4, 7, 6), torch.tensor([7, 4, 7, 7])
    x[0, 2, 1] = float("nan")
    x[1, 5] = float("nan")  # padding
    x[2, 3, 0] = float("inf")
    with torch.no_grad():
        got, want = fused(x, lengths=lengths), reference(x, lengths=lengths)
    assert want[0][0].isnan().any() and want[0][1].isfinite().all()
    for a, b in zip(got, want, strict=True):
        assert_same_non_finite(a, b)


@pytest.mark.parametrize("attention", ["bahdanau", "luong"])
def test_attention_kernels_propagate_non_finite_as_torch(kernel, attention):
    """Bahdanau's decoder kernel and Luong concat's score kernel: a non-finite decoder input
    (one target symbol's embedding NaN, another's inf) gives non-finite logits and weights
    where torch's ops do."""
    torch.manual_seed(0)
    fused = Seq2Seq(total_vocab(9), attention, "additive", attention_size=16)
    plain = copy.deepcopy(fused)
    for module in plain.modules():
        if hasattr(module, "fused"):
            module.fused = False
    batch = make_batch("copy", 4, 6, 9, torch.Generator().manual_seed(0))
    with torch.no_grad():
        for model in (fused, plain):
            model.decoder.embedding.weight[batch.tgt_in[0, 3]] = float("nan")
            model.decoder.embedding.weight[batch.tgt_in[1, 2]] = float("inf")
        got, want = fused(batch.src, batch.src_lengths, batch.tgt_in), plain(batch.src, batch.src_lengths, batch.tgt_in)
    assert want[0].isnan().any() and want[1].isnan().any()
    for a, b in zip(got, want, strict=True):
        assert_same_non_finite(a, b)


def nan_at(where: torch.Tensor):
    """A forward hook that makes its module's output NaN at the (B, T) positions `where`."""

    def hook(module, inputs, output):
        return output.masked_fill(where[..., None], float("nan"))

    return hook


def gradients_through_nan(model, batch, module_name: str, where: torch.Tensor) -> list[torch.Tensor]:
    """One forward and backward with `module_name`'s output NaN at `where`, under a loss that weights
    each logit and attention weight by a fixed random number, zero at padded target positions (as
    cross-entropy's ignore_index does): -> the logits and every parameter's gradient."""
    handle = model.get_submodule(module_name).register_forward_hook(nan_at(where))
    logits, weights = model(batch.src, batch.src_lengths, batch.tgt_in)
    handle.remove()
    draws = torch.Generator().manual_seed(3)
    real = batch.target_mask[..., None].float()
    loss = (logits * torch.randn(logits.shape, generator=draws) * real).sum()
    if weights is not None:  # the Transformer's training step returns none
        loss = loss + (weights * torch.randn(weights.shape, generator=draws) * real).sum()
    loss.backward()
    return [logits.detach(), *(p.grad if p.grad is not None else torch.zeros_like(p) for p in model.parameters())]


def transformer_pair(layers_in_one_call: bool = True) -> tuple[torch.nn.Module, torch.nn.Module]:
    """A small Transformer on the kernels (each layer in one call, or its attention alone in the
    kernel), and the same on torch's ops."""
    from copytask.models.transformer import TransformerSeq2Seq

    torch.manual_seed(0)
    fused = TransformerSeq2Seq(total_vocab(9), d_model=16, heads=2, layers=2, ff_size=24)
    plain = copy.deepcopy(fused)
    plain.fused = False
    if not layers_in_one_call:
        fused._layer_fused = lambda x: False
    return fused, plain


def mamba_pair() -> tuple[torch.nn.Module, torch.nn.Module]:
    """A small Mamba model on the kernels (its convolution, its scan with the D skip and the gate), and the same on
    torch's ops."""
    from copytask.models.mamba import MambaSeq2Seq

    torch.manual_seed(0)
    fused = MambaSeq2Seq(total_vocab(9), d_model=8, layers=2, d_state=3)
    plain = copy.deepcopy(fused)
    plain.fused = False
    return fused, plain


def gru_pair(attention: str, score: str):
    """-> a function that builds `small_model`'s two models (on the kernels, on torch's ops)."""
    return lambda: small_model(attention, score)[:2]


# Each case: the models, the module whose output is made NaN and where (padded source positions: keys
# the attention masks, whose scores get a zero gradient; padded decoder inputs: steps the loss
# ignores), and the kernels it runs forward and backward.
GRU = {"gru_forward", "gru_backward"}
NAN_THROUGH_BACKWARD = {
    "gru": (gru_pair("luong", "general"), "decoder.embedding", "target padding", GRU),
    "bahdanau_decoder": (
        gru_pair("bahdanau", "additive"),
        "decoder.attention.key_proj",
        "source padding",
        GRU | {"bahdanau_forward", "bahdanau_backward"},
    ),
    "additive_score": (
        gru_pair("luong", "additive"),
        "decoder.attention.key_proj",
        "source padding",
        GRU | {"additive_forward", "additive_backward"},
    ),
    "transformer_layer": (transformer_pair, "src_embedding", "source padding", {"transformer_layer"}),
    "transformer_attention": (
        lambda: transformer_pair(layers_in_one_call=False),
        "src_embedding",
        "source padding",
        {"attention_forward", "attention_backward"},
    ),
    "mamba": (
        mamba_pair,
        "tgt_embedding",
        "target padding",
        {"causal_conv_forward", "causal_conv_backward", "selective_scan_forward", "selective_scan_backward"},
    ),
}
FORWARD_ONLY = {"attention_step"}  # a decoding step's, under no_grad (tests/test_transformer.py)


@pytest.mark.parametrize("case", NAN_THROUGH_BACKWARD, ids=list(NAN_THROUGH_BACKWARD))
def test_nan_propagates_through_every_kernels_backward_as_torch(kernel, kernel_calls, case):
    """Issue 70: a NaN in the forward pass reaches the gradients where it does through torch's ops
    (0 * NaN is NaN), even where the upstream gradient is zero, as on padding: no kernel skips a row
    whose gradient is zero. The logits and every parameter's gradient, NaN for NaN."""
    models, module_name, padding, kernels = NAN_THROUGH_BACKWARD[case]
    fused, plain = models()
    batch = make_batch("copy", 4, 6, 9, torch.Generator().manual_seed(0), min_length=3)
    where = ~batch.src_mask if padding == "source padding" else ~batch.target_mask
    assert where.any()
    got = gradients_through_nan(fused, batch, module_name, where)
    assert kernel_calls == kernels
    want = gradients_through_nan(plain, batch, module_name, where)
    assert len(kernel_calls) == len(kernels) and any(g.isnan().any() for g in want[1:]), (
        "torch's gradients carry the NaN"
    )
    for (name, _), a, b in zip([("logits", None), *fused.named_parameters()], got, want, strict=True):
        try:
            assert_same_non_finite(a, b)
        except AssertionError as error:
            raise AssertionError(f"{case}: {name}: {error}") from None


def test_every_kernel_with_a_backward_has_a_nan_case(kernel):
    """A kernel added to csrc/ without a case above fails here."""
    covered = set().union(*(kernels for *_, kernels in NAN_THROUGH_BACKWARD.values()))
    assert covered | FORWARD_ONLY == {name for name in dir(kernel) if not name.startswith("_")}


def small_model(attention: str, score: str) -> tuple[Seq2Seq, Seq2Seq, object]:
    """A model on the ops, the same on torch's ops, and a batch."""
    torch.manual_seed(0)
    fused = Seq2Seq(total_vocab(9), attention, score, attention_size=16)
    plain = copy.deepcopy(fused)
    for module in plain.modules():
        if hasattr(module, "fused"):
            module.fused = False
    return fused, plain, make_batch("copy", 4, 6, 9, torch.Generator().manual_seed(0), min_length=3)


EVERY_KERNEL = [
    ("luong", "general"),
    ("bahdanau", "additive"),
    ("luong", "additive"),
]  # GRU, Bahdanau's decoder, the score


@pytest.mark.parametrize("attention, score", EVERY_KERNEL)
def test_double_backward_raises_instead_of_dropping_the_second_derivative(kernel, attention, score):
    """A gradient penalty needs the second derivative, which the kernels do not have: an error
    that says so, never a silently missing term."""
    fused, plain, batch = small_model(attention, score)
    for model in (plain, fused):
        logits, _ = model(batch.src, batch.src_lengths, batch.tgt_in)
        grads = torch.autograd.grad(logits.square().mean(), list(model.parameters()), create_graph=True)
        penalty = sum(grad.square().sum() for grad in grads)
        if model is plain:
            penalty.backward()  # torch's ops have it
            continue
        with pytest.raises(RuntimeError, match="no second derivative"):
            penalty.backward()


@pytest.mark.parametrize("attention, score", EVERY_KERNEL)
def test_autocast_to_bfloat16_runs_the_kernels_in_float32(kernel, attention, score):
    """Under CPU autocast the kernels take their inputs cast to float32, as torch's float32 ops
    do: the same logits as torch's ops under autocast to bfloat16's precision, and gradients."""
    fused, plain, batch = small_model(attention, score)
    outputs = []
    for model in (fused, plain):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits, weights = model(batch.src, batch.src_lengths, batch.tgt_in)
        logits.float().square().mean().backward()
        outputs.append((logits.float(), weights.float()))
    for a, b in zip(*outputs):
        torch.testing.assert_close(a, b, atol=0.03, rtol=0.03)
    for (name, a), b in zip(fused.named_parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, atol=0.03, rtol=0.1, msg=name)


@pytest.mark.slow
def test_ops_are_registered_as_torch_asks(kernel):
    """torch.library.opcheck: schema, autograd registration, fake tensors (torch.compile) and the
    autograd formula under AOT tracing, for each op on small inputs."""
    torch.manual_seed(0)
    T, B, S, A, H, E = 3, 2, 4, 5, 6, 7
    grad = {"requires_grad": True}
    gru = (
        torch.randn(T, B, 3 * H, **grad),
        torch.randn(B, H, **grad),
        torch.randn(3 * H, H, **grad),
        torch.randn(3 * H, **grad),
        torch.tensor([[1.0, 1.0], [1.0, 1.0], [1.0, 0.0]]),
        True,
    )
    additive = (torch.randn(B, T, A, **grad), torch.randn(B, S, A, **grad), torch.randn(A, **grad))
    bahdanau = (
        torch.randn(T, B, E, **grad),
        torch.randn(B, H, **grad),
        torch.randn(B, S, A, **grad),
        torch.randn(B, S, H, **grad),
        torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0]]),
        torch.randn(A, H, **grad),
        torch.randn(A, **grad),
        torch.randn(3 * H, E + H, **grad),
        torch.randn(3 * H, **grad),
        torch.randn(3 * H, H, **grad),
        torch.randn(3 * H, **grad),
    )
    for op, args in ((ops.gru_forward, gru), (ops.additive_forward, additive), (ops.bahdanau_forward, bahdanau)):
        torch.library.opcheck(op, args)


def test_build_name_keys_everything_the_library_depends_on(monkeypatch, tmp_path):
    """Another torch, other flags, other sources or another CPU architecture: another build folder,
    so no process ever rebuilds or replaces a library that another (another checkout, another venv,
    another kind of node) has loaded."""
    name = build.build_name_and_flags()[0]
    monkeypatch.setattr(torch, "__version__", "2.99.0")
    other_torch = build.build_name_and_flags()[0]
    monkeypatch.undo()
    monkeypatch.setattr(build, "CFLAGS", [*build.CFLAGS, "-g"])
    other_flags = build.build_name_and_flags()[0]
    monkeypatch.undo()
    csrc = tmp_path / "csrc"
    csrc.mkdir()
    for path in build.CSRC.iterdir():
        (csrc / path.name).write_bytes(path.read_bytes() + b"\n" * (path.name == "gru.cpp"))
    monkeypatch.setattr(build, "CSRC", csrc)
    other_sources = build.build_name_and_flags()[0]
    monkeypatch.undo()
    other = "aarch64" if build.platform.machine() != "aarch64" else "x86_64"
    monkeypatch.setattr(build.platform, "machine", lambda: other)
    other_machine = build.build_name_and_flags()[0]  # a cluster's nodes of another kind, sharing a home directory
    assert len({name, other_torch, other_flags, other_sources, other_machine}) == 5


def test_a_build_killed_midway_is_redone_not_waited_for(monkeypatch, fresh_build_root):
    """torch's own lock file, left by a build killed midway, made every later process wait for
    it forever; the half-built library beside it is not to be trusted either."""
    name = build.build_name_and_flags()[0]
    stale = fresh_build_root / name
    stale.mkdir()
    (stale / "lock").touch()
    (stale / f"{name}.so").write_bytes(b"half a library")
    builds = []
    monkeypatch.setattr(
        "torch.utils.cpp_extension.load",
        lambda name, sources, **options: builds.append(options["build_directory"]) or "built",
    )
    assert ops.kernel() == "built"
    assert builds == [str(stale)] and not (stale / "lock").exists()


def test_a_build_held_too_long_elsewhere_falls_back_to_torch(monkeypatch, fresh_build_root):
    """Another process holding the build's lock past the bound: a warning, then torch's ops."""
    monkeypatch.setattr(build, "BUILD_WAIT_S", 0.2)
    monkeypatch.setattr(
        "torch.utils.cpp_extension.load",
        lambda *args, **options: pytest.fail("built while another process holds the lock"),
    )
    name = build.build_name_and_flags()[0]
    with filelock.FileLock(
        fresh_build_root / f"{name}.lock"
    ):  # a second lock of the same file blocks, in this process too
        with pytest.warns(
            UserWarning, match="another process has held .* building the fused CPU kernels; using torch's ops"
        ):
            assert ops.kernel() is None


@pytest.mark.slow
def test_build_command_says_where(kernel):
    done = run_cli("build")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().endswith(".so") and os.path.exists(done.stdout.split()[-1])


# In a fresh process: torch as PyPI's CUDA build has it on a machine without a GPU (CUDA compiled in,
# no device, a CUDA_HOME), then the kernels loaded as a CPU run loads them.
CUDA_BUILD_WITHOUT_GPU = """
import torch
torch.cuda._is_compiled = lambda: True
torch.cuda.is_available = lambda: False
torch.version.cuda = "12.8"
from copytask.kernels import ops
assert ops.kernel() is not None
"""


@pytest.mark.slow
def test_loading_the_kernels_on_a_cuda_build_without_a_gpu_says_nothing_of_cuda_home(kernel, tmp_path):
    """torch's extension builder logs "No CUDA runtime is found, using CUDA_HOME=..." when it is imported there:
    noise on every CPU run, since the kernels are CPU-only."""
    env = {**os.environ, "CUDA_HOME": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-c", CUDA_BUILD_WITHOUT_GPU], capture_output=True, text=True, env=env, timeout=300
    )
    assert done.returncode == 0, done.stderr
    assert "CUDA_HOME" not in done.stderr and "No CUDA runtime" not in done.stderr, done.stderr


# In a fresh process: the first default model's training step (which loads the ops), then a
# 40 MB block. glibc maps any block over 32 MB by default; a raised mmap threshold would have
# served it from the heap instead.
ALLOCATOR_CHECK = """
import ctypes, torch
from copytask.kernels import ops
from copytask.data.batches import make_batch
from copytask.data.vocab import total_vocab
from copytask.models.recurrent import Seq2Seq

class Mallinfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                     "keepcost")
    ]

mallinfo2 = ctypes.CDLL(None).mallinfo2
mallinfo2.restype = Mallinfo2
model = Seq2Seq(total_vocab(9), "bahdanau", "additive", attention_size=32)
batch = make_batch("copy", 8, 12, 9, torch.Generator().manual_seed(0))
model(batch.src, batch.src_lengths, batch.tgt_in)[0].sum().backward()
assert ops.runs_fused(model)
mapped = mallinfo2().hblkhd
block = torch.empty(40 << 20, dtype=torch.uint8)
print(mallinfo2().hblkhd - mapped)
"""


@pytest.mark.slow
@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's allocator statistics")
def test_the_kernels_leave_the_allocator_alone(kernel):
    """Loading and running the kernels changes no process-wide setting: glibc still maps a large
    block, as it does by default (the library once raised its mmap threshold to 1 GB)."""
    done = subprocess.run(
        [sys.executable, "-c", ALLOCATOR_CHECK],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": pythonpath()},
    )
    assert done.returncode == 0, done.stderr
    assert int(done.stdout) >= 40 << 20, "the 40 MB block came from the heap: the allocator's thresholds were changed"
