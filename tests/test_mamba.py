"""model=mamba (Gu and Dao, 2023): the block against a plain step-by-step recurrence written from the paper's
equations here, the training forward against the decoder fed one token at a time, greedy decoding against the
teacher-forced argmax, padding, the hand-over of the state, the C++ scan against torch's loop, sizes, configs
and refusals, and a tiny run through the real CLI."""

from __future__ import annotations

import math

import pandas as pd
import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

import copytask
from copytask import store
from copytask.config.checks import validate
from copytask.console import ConfigError
from copytask.data.batches import make_batch
from copytask.data.splits import sample_batch
from copytask.data.vocab import BOS, total_vocab
from copytask.families.memory import parameter_count
from copytask.kernels import mamba_ops
from copytask.models.build import build_model, check_buildable
from copytask.models.mamba import DT_MAX, DT_MIN, LayerState, MambaBlock, MambaLayer, MambaSeq2Seq, selective_scan
from copytask.models.recurrent import count_parameters
from copytask.training import loop
from copytask.training.loop import train_step

from .conftest import TINY, built_kernels, run_cli
from .test_device import HostTraffic

SMALL = ["model=mamba", "model.d_model=8", "model.d_state=3", "model.layers=2"]
TINY_MAMBA = [*TINY, *SMALL]
# the fused path needs the kernels; torch's loop runs everywhere
PATHS = [pytest.param(True, id="kernel"), pytest.param(False, id="torch")]
# Mamba's selective SSM, and the LTI one of model.selective=false (issue 82)
SELECTIVITY = [pytest.param(True, id="selective"), pytest.param(False, id="lti")]


def needs_kernel(fused: bool) -> None:
    """The kernels, where a test runs their path (`fused`): in CI a machine that does not build them fails it."""
    if fused:
        built_kernels()


def small_model(
    fused: bool = True, layers: int = 2, d_conv: int = 4, seed: int = 0, selective: bool = True
) -> MambaSeq2Seq:
    """A small model with every parameter moved off its initialisation (D = 1, A = -(n + 1), zero-initialised
    biases would hide a term the equations have and the code lacks)."""
    torch.manual_seed(seed)
    model = MambaSeq2Seq(
        total_vocab(6), d_model=8, layers=layers, d_state=3, d_conv=d_conv, expand=2, fused=fused, selective=selective
    )
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.3 * torch.randn_like(parameter))
    return model.eval()


def rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x / torch.sqrt(x.square().mean() + 1e-5) * weight


def reference_layer(layer: MambaLayer, hidden: torch.Tensor, ssm: torch.Tensor, window: list[torch.Tensor]):
    """The paper's equations one step at a time, for one sequence: hidden (T, d), the SSM state h (E, N), the
    last K - 1 inputs of the convolution (oldest first) -> outputs (T, d), h and the window after the last step.
    Section 3.4 (figure 3), Algorithm 2 and eq. 4 (A_bar = exp(Δ A), B_bar = Δ B):

        u = RMSNorm(hidden_t);  x, z = W_in u  (x, z each E)
        x' = SiLU(b_conv + sum_k w_k x_{t - K + 1 + k})          (causal, depthwise: per channel)
        Δ = softplus(W_Δ (W_x x')[:R] + b_Δ);  B = (W_x x')[R:R + N];  C = (W_x x')[R + N:]
        h[e, n] = exp(Δ[e] A[e, n]) h[e, n] + Δ[e] B[n] x'[e],  A = -exp(A_log)
        y[e] = sum_n C[n] h[e, n] + D[e] x'[e]
        output_t = hidden_t + W_out (y * SiLU(z))"""
    block = layer.block
    E, N, K, R = block.d_inner, block.d_state, block.d_conv, block.dt_rank
    A = -torch.exp(block.A_log)
    window, outputs = list(window), []
    for hidden_t in hidden:
        projected = block.in_proj.weight @ rms_norm(hidden_t, layer.norm.weight)
        x, z = projected[:E], projected[E:]
        window.append(x)
        recent = window[len(window) - K :]  # x_{t - K + 1} .. x_t
        x = F.silu(block.conv1d.bias + sum(block.conv1d.weight[:, 0, k] * recent[k] for k in range(K)))
        selection = block.x_proj.weight @ x
        delta = F.softplus(block.dt_proj.weight @ selection[:R] + block.dt_proj.bias)
        B, C = selection[R : R + N], selection[R + N :]
        ssm = torch.stack(
            [
                torch.stack([torch.exp(delta[e] * A[e, n]) * ssm[e, n] + delta[e] * B[n] * x[e] for n in range(N)])
                for e in range(E)
            ]
        )
        y = torch.stack([sum(C[n] * ssm[e, n] for n in range(N)) + block.D[e] * x[e] for e in range(E)])
        outputs.append(hidden_t + block.out_proj.weight @ (y * F.silu(z)))
    return torch.stack(outputs), ssm, window[len(window) - (K - 1) :]


@pytest.mark.parametrize("fused", PATHS)
@pytest.mark.parametrize("d_conv", [4, 1])
def test_a_layer_computes_the_papers_recurrence_step_by_step(fused, d_conv):
    """From a state and window not zero, the layer's scan over a whole sequence and its one-step mode both
    give the reference's outputs, state and window; torch's loop in float64 to 1e-12, the kernel (float32)
    to float rounding."""
    needs_kernel(fused)
    model = small_model(d_conv=d_conv)
    layer = model.decoder_layers[0]
    if not fused:
        layer = layer.double()
    dtype, generator = layer.norm.weight.dtype, torch.Generator().manual_seed(1)
    E, N = layer.block.d_inner, layer.block.d_state
    hidden = torch.randn(2, 5, 8, generator=generator).to(dtype)
    ssm, window = torch.randn(2, E, N, generator=generator), torch.randn(2, d_conv - 1, E, generator=generator)
    state = LayerState(ssm.to(dtype), window.to(dtype))
    tolerance = {"atol": 1e-12, "rtol": 1e-12} if dtype == torch.float64 else {"atol": 1e-5, "rtol": 1e-4}
    with torch.no_grad():
        output, after = layer(hidden, state, fused=fused)
        steps, stepped = [], state
        for t in range(hidden.size(1)):
            out_t, stepped = layer.step(hidden[:, t], stepped)
            steps.append(out_t)
        for i in range(2):
            want, ssm, window = reference_layer(layer, hidden[i], state.ssm[i], list(state.window[i]))
            window = torch.stack(window) if window else state.window[i]
            torch.testing.assert_close(output[i], want, **tolerance)
            torch.testing.assert_close(torch.stack(steps, 1)[i], want, **tolerance)
            for got in (after, stepped):
                torch.testing.assert_close(got.ssm[i], ssm, **tolerance)
                torch.testing.assert_close(got.window[i], window, **tolerance)


def test_the_scan_is_algorithm_2():
    """`selective_scan` against the recurrence written per channel and state, in float64."""
    generator = torch.Generator().manual_seed(0)
    Bs, T, E, N = 2, 4, 3, 2
    u, delta = (
        torch.randn(Bs, T, E, generator=generator, dtype=torch.float64),
        torch.rand(Bs, T, E, generator=generator, dtype=torch.float64),
    )
    A = -torch.rand(E, N, generator=generator, dtype=torch.float64)
    B, C = (torch.randn(Bs, T, N, generator=generator, dtype=torch.float64) for _ in range(2))
    h0 = torch.randn(Bs, E, N, generator=generator, dtype=torch.float64)
    y, final = selective_scan(u, delta, A, B, C, h0)
    for b in range(Bs):
        h = h0[b].clone()
        for t in range(T):
            for e in range(E):
                for n in range(N):
                    h[e, n] = math.exp(delta[b, t, e] * A[e, n]) * h[e, n] + delta[b, t, e] * B[b, t, n] * u[b, t, e]
                assert y[b, t, e].item() == pytest.approx(sum(C[b, t, n] * h[e, n] for n in range(N)).item(), abs=1e-12)
        torch.testing.assert_close(final[b], h, atol=1e-12, rtol=1e-12)


def block_inputs(batch: int = 3, steps: int = 6, channels: int = 10, states: int = 4, seed: int = 0) -> dict:
    """What the block hands its scan, where the model's lie: dt (Δ before its softplus) past both of softplus's
    ends (-30, 25), A < 0, and a mask with padded steps."""
    generator = torch.Generator().manual_seed(seed)
    dt = torch.randn(batch, steps, channels, generator=generator) * 4
    dt[0, 0, :2], dt[1, 0, :2] = torch.tensor([-30.0, 25.0]), torch.tensor([20.5, 0.0])
    mask = torch.ones(batch, steps, dtype=torch.bool)
    mask[0, -2:] = False
    return {
        "u": torch.randn(batch, steps, channels, generator=generator),
        "dt": dt,
        "A": -torch.rand(channels, states, generator=generator) * 8,
        "B": torch.randn(batch, steps, states, generator=generator),
        "C": torch.randn(batch, steps, states, generator=generator),
        "h0": torch.randn(batch, channels, states, generator=generator),
        "mask": mask,
        "D": torch.randn(channels, generator=generator),
        "z": torch.randn(batch, steps, channels, generator=generator) * 3,
    }


def torchs_block(u, dt, A, B, C, h0, mask=None, D=None, z=None):
    """What `MambaBlock.forward` computes with torch's ops around `selective_scan` (its fused path's reference)."""
    delta = F.softplus(dt) if mask is None else F.softplus(dt) * mask[..., None]
    y, final = selective_scan(u, delta, A, B, C, h0)
    return (y if D is None else (y + u * D) * F.silu(z)), final


@pytest.mark.parametrize("gradients", ["output and h_T", "output only", "h_T only"])
@pytest.mark.parametrize("gated", [True, False], ids=["gated", "no readout"])
@pytest.mark.parametrize("masked", [True, False], ids=["padded", "no mask"])
def test_the_scan_kernel_computes_the_blocks_torch_ops_forward_and_backward(gradients, gated, masked):
    needs_kernel(True)
    results = []
    for scan in (mamba_ops.selective_scan, torchs_block):
        inputs = {
            name: t.clone().requires_grad_(t.is_floating_point())
            for name, t in block_inputs().items()
            if (gated or name not in ("D", "z")) and (masked or name != "mask")
        }
        out, final = scan(**inputs)
        weights, loss = torch.Generator().manual_seed(5), 0.0
        if gradients != "h_T only":
            loss = loss + (out * torch.randn(out.shape, generator=weights)).sum()
        if gradients != "output only":
            loss = loss + (final * torch.randn(final.shape, generator=weights)).sum()
        loss.backward()
        grads = {f"grad {name}": t.grad for name, t in inputs.items() if t.requires_grad}
        results.append({"output": out.detach(), "h_T": final.detach()} | grads)
    got, want = results
    for name in want:  # a gradient torch's autograd has no path for is None there, zero in the kernel
        expected = torch.zeros_like(got[name]) if want[name] is None else want[name]
        torch.testing.assert_close(got[name], expected, atol=1e-5, rtol=1e-4, msg=name)


def test_the_convolution_kernel_computes_torchs_ops_forward_and_backward():
    needs_kernel(True)
    block = small_model().decoder_layers[0].block
    inputs = torch.randn(3, 3 + 7, block.d_inner, generator=torch.Generator().manual_seed(0))
    results = []
    for convolve in (
        lambda x: mamba_ops.causal_conv_silu(x, block.conv1d.weight, block.conv1d.bias),
        lambda x: F.silu(block._convolve(x)),
    ):
        x = inputs.clone().requires_grad_()
        block.zero_grad()
        out = convolve(x)
        out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(1)))
        results.append([out.detach(), x.grad, block.conv1d.weight.grad.clone(), block.conv1d.bias.grad.clone()])
    for name, got, want in zip(["output", "grad inputs", "grad weight", "grad bias"], *results, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4, msg=name)


def kernel_scan(dt: torch.Tensor, A: torch.Tensor, B: float) -> torch.Tensor:
    """One step of one sequence, x = 1, h0 = 1, C = 0 -> h_1 = exp(softplus(dt) A) + softplus(dt) B, per channel
    (dt and A (E,): each channel its own)."""
    E = dt.numel()
    _, final = mamba_ops.selective_scan(
        torch.ones(1, 1, E),
        dt[None, None],
        A[:, None],
        torch.full((1, 1, 1), B),
        torch.zeros(1, 1, 1),
        torch.ones(1, E, 1),
    )
    return final[0, :, 0]


def test_the_kernels_exp_and_softplus_are_torchs_over_their_range():
    """The kernel's exp and softplus are polynomials (so that they vectorise), checked against torch's through the
    scan: exp(Δ A) with Δ = softplus(25) = 25, over exponents from -120 (0 in float) to 0, -inf and NaN (to 2e-6
    relative where float's exp is a normal number, 0 below); softplus(dt) with A = 0, B = 1, over dt from -40 to 40
    (to 1e-6 relative, dt itself above 20 as torch), -inf and NaN (+inf: Δ A is NaN there, in torch too)."""
    needs_kernel(True)
    tiny = torch.finfo(torch.float32).tiny
    exponents = torch.cat([torch.linspace(-120, 0, 4001), torch.tensor([-float("inf"), float("nan")])])
    got, want = kernel_scan(torch.full_like(exponents, 25.0), exponents / 25, 0.0), torch.exp(exponents / 25 * 25)
    assert torch.equal(got.isnan(), want.isnan())
    normal = want >= tiny
    torch.testing.assert_close(got[normal], want[normal], rtol=2e-6, atol=0)
    assert (got[want < tiny] == 0).all()
    dt = torch.cat([torch.linspace(-40, 40, 4001), torch.tensor([20.0, 20.001, -float("inf"), float("nan")])])
    got, want = kernel_scan(dt, torch.zeros_like(dt), 1.0) - 1, F.softplus(dt)  # h_1 = exp(0) + softplus(dt)
    assert torch.equal(got.isnan(), want.isnan())
    torch.testing.assert_close(got, want, rtol=1e-6, atol=2e-7, equal_nan=True)


def test_the_scan_kernel_refuses_a_positive_a_its_exp_is_not_for():
    needs_kernel(True)
    with pytest.raises(RuntimeError, match=r"A must be <= 0 \(-exp\(A_log\)\)"):
        kernel_scan(torch.zeros(3), torch.tensor([-1.0, 0.5, -2.0]), 1.0)


def test_under_autocast_to_bfloat16_the_kernels_run_in_float32():
    """As torch's float32 ops do under CPU autocast: the same logits and gradients as the torch path's, to
    bfloat16's precision."""
    needs_kernel(True)
    batch = make_batch("copy", 4, 6, 6, torch.Generator().manual_seed(0), min_length=2)
    outputs = []
    for fused in (True, False):
        model = small_model(fused)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits, _ = model(batch.src, batch.src_lengths, batch.tgt_in)
        logits.float().square().mean().backward()
        outputs.append((logits.float(), [p.grad for p in model.parameters()]))
    (fused_logits, fused_grads), (plain_logits, plain_grads) = outputs
    torch.testing.assert_close(fused_logits, plain_logits, atol=0.05, rtol=0.05)
    for got, want in zip(fused_grads, plain_grads, strict=True):
        torch.testing.assert_close(got, want, atol=0.05, rtol=0.1)


@pytest.mark.slow
def test_the_ops_are_registered_as_torch_asks():
    needs_kernel(True)
    inputs = block_inputs(batch=2, steps=3, channels=5, states=2)
    inputs["mask"] = inputs["mask"].float()
    args = [inputs[name] for name in ("u", "dt", "mask", "A", "B", "C", "h0", "D", "z")]
    torch.library.opcheck(
        mamba_ops.selective_scan_forward, [t.requires_grad_(name != "mask") for name, t in zip("udmABChDz", args)]
    )
    generator = torch.Generator().manual_seed(0)
    conv = [torch.randn(2, 3 + 5, 6, generator=generator), torch.randn(4, 6, generator=generator), torch.randn(6)]
    torch.library.opcheck(mamba_ops.causal_conv_forward, [t.requires_grad_() for t in conv])


@pytest.mark.parametrize("selective", SELECTIVITY)
@pytest.mark.parametrize("fused", PATHS)
def test_the_training_forward_equals_the_decoder_fed_one_token_at_a_time(fused, selective):
    needs_kernel(fused)
    model = small_model(fused, selective=selective)
    batch = make_batch("copy", 5, 7, 6, torch.Generator().manual_seed(2), min_length=2)
    with torch.no_grad():
        logits, weights = model(batch.src, batch.src_lengths, batch.tgt_in)
        decoding = model.decoding(batch.src, batch.src_lengths, batch.tgt_in.size(1))
        stepped = torch.stack([decoding.step(batch.tgt_in[:, t], t)[0] for t in range(batch.tgt_in.size(1))], 1)
    assert weights is None
    torch.testing.assert_close(stepped, logits, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("selective", SELECTIVITY)
@pytest.mark.parametrize("fused", PATHS)
def test_greedy_equals_the_teacher_forced_argmax_on_its_own_outputs(fused, selective):
    needs_kernel(fused)
    model = small_model(fused, selective=selective)
    batch = make_batch("copy", 16, 6, 6, torch.Generator().manual_seed(3), min_length=1)
    tokens, weights = model.greedy(batch.src, batch.src_lengths, steps=7)
    assert weights is None and len(set(tokens.flatten().tolist())) > 2  # not one token everywhere
    tgt_in = torch.cat([torch.full((16, 1), BOS), tokens[:, :-1]], dim=1)
    with torch.no_grad():
        logits, _ = model(batch.src, batch.src_lengths, tgt_in)
    assert torch.equal(logits.argmax(-1), tokens)


@pytest.mark.parametrize("fused", PATHS)
def test_a_mixed_length_batch_gives_each_sequence_what_it_gets_alone(fused):
    """The state handed over is the state after each sequence's last real symbol: padding leaves the SSM state
    (Δ = 0) and the window (read at the sequence's length) as they were, an empty source included."""
    needs_kernel(fused)
    model = small_model(fused)
    batch = make_batch("copy", 6, 9, 6, torch.Generator().manual_seed(1), min_length=1)
    batch.src_lengths[0] = 0  # an empty source: the zero state
    batch.src[0] = 0
    assert len(set(batch.src_lengths.tolist())) > 2
    with torch.no_grad():
        logits, _ = model(batch.src, batch.src_lengths, batch.tgt_in)
        summary = model.summary_state(batch.src, batch.src_lengths)
        tokens, _ = model.greedy(batch.src, batch.src_lengths, steps=10)
        for i in range(len(batch)):
            alone = batch.select([i])
            length = int(alone.src_lengths[0])
            src = alone.src[:, :length]
            alone_logits, _ = model(src, alone.src_lengths, alone.tgt_in[:, : length + 1])
            torch.testing.assert_close(logits[i, : length + 1], alone_logits[0], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(summary[i], model.summary_state(src, alone.src_lengths)[0], atol=1e-6, rtol=0)
            assert torch.equal(tokens[i], model.greedy(src, alone.src_lengths, steps=10)[0][0])
    assert summary[0].abs().max() == 0  # nothing read: the zero state


def test_the_decoder_reads_the_source_only_through_the_state_it_is_handed():
    """Two sources whose encoders end in the same states decode alike: the decoder's logits are a function of the
    summary state alone (here: each decoder layer started from the other source's states)."""
    model = small_model(fused=False)
    batch = make_batch("copy", 2, 5, 6, torch.Generator().manual_seed(4))
    with torch.no_grad():
        states = model.encode(batch.src, batch.src_lengths)
        swapped = [state.select(torch.tensor([1, 0])) for state in states]
        hidden = model.tgt_embedding(batch.tgt_in)
        for layer, state in zip(model.decoder_layers, swapped):
            hidden, _ = layer(hidden, state, fused=False)
        from_swapped = model.out(model.norm(hidden))
        logits, _ = model(batch.src.flip(0), batch.src_lengths.flip(0), batch.tgt_in)
    torch.testing.assert_close(from_swapped, logits)
    assert (logits[0] - logits[1]).abs().max() > 1e-3  # and it does read them: the two sources decode apart


def test_the_summary_state_is_every_encoder_layers_ssm_state_and_window():
    model = small_model(fused=False, layers=3)
    batch = make_batch("copy", 4, 6, 6, torch.Generator().manual_seed(0))
    with torch.no_grad():
        summary = model.summary_state(batch.src, batch.src_lengths)
        states = model.encode(batch.src, batch.src_lengths)
    E, N, K = 16, 3, 4
    assert model.state_floats(6) == model.state_floats(600) == 3 * (E * N + E * (K - 1))
    assert summary.shape == (4, model.state_floats(6))
    torch.testing.assert_close(summary, torch.cat([part.flatten(1) for state in states for part in state], 1))


@pytest.mark.parametrize("selective", SELECTIVITY)
def test_beam_search_reorders_every_layers_state(selective):
    """Row i of every decoder layer's SSM state and window becomes row rows[i], and the next step reads them."""
    model = small_model(fused=False, selective=selective)
    batch = make_batch("copy", 3, 5, 6, torch.Generator().manual_seed(0))
    rows = torch.tensor([2, 2, 0])
    with torch.no_grad():
        decoding = model.decoding(batch.src, batch.src_lengths, 6)
        decoding.step(torch.full((3,), BOS), 0)
        before = list(decoding.states)
        decoding.reorder(rows)
        for old, new in zip(before, decoding.states, strict=True):
            assert torch.equal(new.ssm, old.ssm[rows]) and torch.equal(new.window, old.window[rows])
        tokens = torch.tensor([4, 5, 3])
        reordered = decoding.step(tokens, 1)[0]
        again = model.decoding(batch.src[rows], batch.src_lengths[rows], 6)
        again.step(torch.full((3,), BOS), 0)
        torch.testing.assert_close(reordered, again.step(tokens, 1)[0])


def test_the_papers_initialisation():
    """A = -(n + 1) (S4D-real), D = 1, Δ's bias the softplus inverse of a draw in [DT_MIN, DT_MAX] and Δ's
    projection uniform in +-R^-1/2 (section 3.6 and the paper's code)."""
    torch.manual_seed(0)
    block = MambaBlock(d_model=40, d_inner=80, d_state=16, d_conv=4, dt_rank=3)
    torch.testing.assert_close(-torch.exp(block.A_log), -torch.arange(1, 17.0).repeat(80, 1))
    assert torch.equal(block.D, torch.ones(80))
    dt = F.softplus(block.dt_proj.bias)
    assert DT_MIN * 0.999 <= dt.min() and dt.max() <= DT_MAX * 1.001 and dt.max() / dt.min() > 10  # spread, log scale
    assert block.dt_proj.weight.abs().max() <= 3**-0.5
    encoder_last = MambaBlock(d_model=40, d_inner=80, d_state=16, d_conv=4, dt_rank=3, readout=False)
    assert not hasattr(encoder_last, "out_proj") and encoder_last.in_proj.out_features == 80  # x only


def lti_kernel(block: MambaBlock, length: int) -> torch.Tensor:
    """K_j = C exp(Δ A)^j Δ B for j = 0 .. length - 1, per channel: (length, E), from the block's parameters."""
    delta, A = F.softplus(block.dt_bias), -torch.exp(block.A_log)  # (E,), (E, N)
    powers = torch.exp(delta[:, None] * A)[None] ** torch.arange(length, dtype=A.dtype)[:, None, None]  # (J, E, N)
    return (powers * (delta[:, None] * block.B) * block.C).sum(-1)


def causal_convolution(x: torch.Tensor, kernel: torch.Tensor) -> torch.Tensor:
    """y_t = sum_{j <= t} K_j * x_{t - j}, per channel: x (B, T, E), kernel (T, E) -> (B, T, E), written out."""
    steps = x.size(1)
    return torch.stack([sum(kernel[j] * x[:, t - j] for j in range(t + 1)) for t in range(steps)], 1)


@pytest.mark.parametrize("fused", PATHS)
def test_without_selection_the_ssm_is_a_causal_convolution_with_its_lti_kernel(fused):
    """Issue 82: with Δ, B and C learned (model.selective=false) the SSM is linear and time-invariant: its output
    is the convolution of its input x (after the block's convolution and SiLU) with K_j = C exp(Δ A)^j Δ B, and
    the state it hands over is sum_j exp(Δ A)^j Δ B x_{T-1-j}; the block's output is then its gate and
    projection of that, as the selective block's. In float64 on torch's path, float32 to rounding in the kernel."""
    needs_kernel(fused)
    block = small_model(fused, selective=False).decoder_layers[0].block
    if not fused:
        block = block.double()
    dtype = block.A_log.dtype
    hidden = torch.randn(3, 9, 8, generator=torch.Generator().manual_seed(5), dtype=torch.float64).to(dtype)
    with torch.no_grad():
        output, state = block(hidden, block.initial_state(3, hidden), fused=fused)
        x, z = block.in_proj(hidden).chunk(2, dim=-1)
        window = torch.cat([hidden.new_zeros(3, block.d_conv - 1, block.d_inner), x], 1)
        x = F.silu(F.conv1d(window.transpose(1, 2), block.conv1d.weight, block.conv1d.bias, groups=x.size(-1)))
        x = x.transpose(1, 2)  # (B, T, E)
        kernel = lti_kernel(block, 9)
        y = causal_convolution(x, kernel)
        want = block.out_proj((y + block.D * x) * F.silu(z))
        delta, A = F.softplus(block.dt_bias), -torch.exp(block.A_log)
        decay = torch.exp(delta[:, None] * A)  # (E, N)
        handed = sum(decay**j * (delta[:, None] * block.B) * x[:, 8 - j, :, None] for j in range(9))  # (B, E, N)
    tolerance = {"atol": 1e-12, "rtol": 1e-10} if dtype == torch.float64 else {"atol": 2e-5, "rtol": 1e-4}
    torch.testing.assert_close(output, want, **tolerance)
    torch.testing.assert_close(state.ssm, handed, **tolerance)
    assert kernel.abs().max() > 1e-3 and (kernel[1:] != kernel[:1]).any()  # a kernel that weighs the past


@pytest.mark.parametrize("fused", PATHS)
def test_the_lti_ssm_reads_no_input_for_its_parameters_and_the_selective_one_does(fused):
    """Its Δ, B and C are the same at every position whatever the input (the selective layer's are not), and
    only its own parameters hold them: no projection of x."""
    needs_kernel(fused)
    lti, selective = (small_model(fused, selective=flag).decoder_layers[0].block for flag in (False, True))
    assert not hasattr(lti, "x_proj") and not hasattr(lti, "dt_proj")
    assert lti.dt_bias.shape == (16,) and lti.B.shape == lti.C.shape == (3,)  # Δ per channel; B, C shared
    x = torch.randn(2, 4, 16, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for block, constant in ((lti, True), (selective, False)):
            parts = block._selection(x)
            assert all(torch.equal(part, part[:1, :1].expand_as(part)) for part in parts) == constant


def test_the_default_model_is_near_luong_generals_size_and_counted_without_torch(make_config):
    mamba, luong = (build_model(make_config(option)) for option in ("model=mamba", "attention=luong_general"))
    assert luong and abs(count_parameters(mamba) - count_parameters(luong)) / count_parameters(luong) < 0.1
    for overrides in (
        ["model=mamba"],
        SMALL,
        [*SMALL, "model.layers=1", "model.d_conv=1", "model.expand=3"],
        ["model=mamba_lti"],
        [*SMALL, "model.selective=false", "task=selective_copy", "task.length=12"],  # and the noise token's row
    ):
        cfg = make_config(*overrides)
        assert count_parameters(build_model(cfg)) == parameter_count(cfg)
    lti = make_config("model=mamba_lti")
    # the LTI SSM's Δ (E), B and C (N) in place of x_proj (E x (R + 2N)) and dt_proj (R x E + E), in 4 layers
    assert parameter_count(make_config("model=mamba")) - parameter_count(lti) == 4 * (80 * (3 + 8) + 3 * 80 - 8)
    assert all(p.grad is None for p in mamba.parameters())  # (nothing trained here)


def test_every_parameter_learns(make_config):
    """No parameter the model counts is outside the computation: one training step gives each a gradient."""
    cfg = make_config(*SMALL, "task.length=5")
    model = build_model(cfg)
    batch = make_batch("copy", 4, 5, cfg.task.vocab_size, torch.Generator().manual_seed(0))
    logits, _ = model(batch.src, batch.src_lengths, batch.tgt_in)
    logits.square().mean().backward()
    assert [name for name, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum()] == []


def test_it_builds_on_the_meta_device(make_config):
    cfg = make_config("model=mamba")
    check_buildable(cfg)
    with torch.device("meta"):
        model = build_model(cfg)
    assert all(p.is_meta for p in model.parameters())


@pytest.mark.parametrize("ragged", [False, True], ids=["fixed", "ragged"])
def test_a_step_and_decoding_run_on_the_meta_device_and_read_nothing_on_the_host(make_config, ragged):
    """What runs on meta runs on a GPU without waiting for it: a training step and greedy decoding on meta
    tensors, and a training step as a GPU runs it (torch's loop) with not one host read."""
    cfg = make_config(*TINY_MAMBA, "task.length=6", *(["task.variable_length=true", "task.min_length=2"] * ragged))
    batch = sample_batch(cfg, 4, torch.Generator().manual_seed(0))
    model = build_model(cfg).to("meta")
    meta = batch.to("meta")
    assert train_step(model, torch.optim.Adam(model.parameters()), meta, 1.0).is_meta
    with HostTraffic() as traffic:
        tokens, _ = model.greedy(meta.src, meta.src_lengths, steps=7)
    assert traffic.copies == [] and tokens.is_meta and tokens.shape == (4, 7)
    model = build_model(make_config(*TINY_MAMBA, "train.fused=false"))
    with HostTraffic() as traffic:
        train_step(model, torch.optim.Adam(model.parameters(), fused=True), batch, 1.0)
    assert traffic.reads == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_it_trains_without_a_host_sync_and_computes_what_the_cpu_does(make_config, tmp_path, monkeypatch):
    cuda = [*(arg for arg in TINY_MAMBA if arg != "train.device=cpu"), "task.length=6"]
    step = loop.train_step

    def checked(*args):  # a host read in a step raises
        torch.cuda.set_sync_debug_mode("error")
        try:
            return step(*args)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    losses = {}
    for device in ("cpu", "cuda"):
        if device == "cuda":
            monkeypatch.setattr(loop, "train_step", checked)
        cfg = make_config(*cuda, f"train.device={device}", f"runs_dir={tmp_path / device}")
        assert loop.train(cfg)["device"].startswith(device)
        losses[device] = pd.read_csv(store.run_dir(cfg) / store.HISTORY).loss
    assert (losses["cuda"] - losses["cpu"]).abs().max() < 1e-4


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["model.d_state=0"], "model.d_state must be an integer >= 1, got 0"),
        (["model.d_conv=0"], "model.d_conv must be an integer >= 1, got 0"),
        (["model.expand=0"], "model.expand must be an integer >= 1, got 0"),
        (["model.layers=0"], "model.layers must be an integer >= 1, got 0"),
        (["model.d_model=-1"], "model.d_model must be an integer >= 1, got -1"),
        (["model.d_state=null"], "model.d_state must not be null with model=mamba"),
        (["model.expand=1.5"], "model.expand must be an integer >= 1, got 1.5"),
        (["attention=bahdanau"], "attention=bahdanau (and every attention.* key) is model=gru's decoder; model=mamba"),
        (["model.d_state=100000000"], "the SSM states"),
        (["model.d_model=1000000", "model.expand=100"], "the parameters"),
        (["model.selective=null"], "model.selective must not be null with model=mamba"),
        (["model.selective=maybe"], "model.selective must be true or false, got 'maybe'"),
        (["model=gru", "model.selective=false"], "model.selective=false is model=mamba's"),
        (["model=transformer", "model.selective=true"], "model.selective=true is model=mamba's"),
        (["model=gru", "model.selective=false"], "model=gru has no such choice"),
    ],
)
def test_bad_values_are_refused_in_one_line(overrides, message):
    with pytest.raises(ConfigError) as refused:
        cfg = copytask.compose(["model=mamba", *overrides])
        validate(cfg)
        check_buildable(cfg)
    assert message in str(refused.value) and "\n" not in str(refused.value)


@pytest.mark.slow
def test_run_names_name_mamba_and_leave_the_others(make_config):
    assert store.run_name(make_config()) == "luong_general-copy20-seed0-49c90a6e"  # since commit d3a649a
    name = store.run_name(make_config("model=mamba"))
    assert name.startswith("mamba-copy20-seed0-") and name == store.run_name(make_config("architecture=mamba"))
    # the GRU's keys are not read (and the attention group's), the Transformer's own not either; shared ones are
    assert store.run_name(make_config("model=mamba", "model.hidden_size=8")) == name
    assert store.run_name(make_config("model=mamba", "model.heads=2")) == name
    assert store.run_name(make_config("model=mamba", "model.d_state=8")) != name
    assert store.run_name(make_config("model=mamba", "model.layers=1")) != name
    # the selection ablated is another computation, named as such; true is Mamba's own, the same run
    lti = store.run_name(make_config("model=mamba", "model.selective=false"))
    assert lti.startswith("mamba_lti-copy20-seed0-") and lti == store.run_name(make_config("model=mamba_lti"))
    assert store.run_name(make_config("model=mamba", "model.selective=true")) == name
    transformer = store.run_name(make_config("model=transformer"))
    assert store.run_name(make_config("model=transformer", "model.d_state=8")) == transformer
    assert store.run_name(make_config("model=transformer", "model.layers=1")) != transformer


@pytest.mark.slow
def test_a_tiny_mamba_run_through_the_cli_decode_with_a_beam_and_analyze(tmp_path):
    runs_dir = tmp_path / "runs"
    trained = run_cli("train", *TINY_MAMBA, f"runs_dir={runs_dir}")
    assert trained.returncode == 0, trained.stderr
    [folder] = store.complete_runs(runs_dir)
    assert folder.name.startswith("mamba-copy5-seed0-")
    metrics = store.read_json(folder / store.METRICS)
    assert metrics["attention"] == "mamba"
    assert metrics["params"] == parameter_count(OmegaConf.load(folder / store.CONFIG))
    assert store.read_json(folder / store.ATTENTION)["samples"][0]["weights"] is None
    for beam in ([], ["--beam", "3"]):
        decoded = run_cli("decode", str(folder), "a b c d e", *beam)
        assert decoded.returncode == 0, decoded.stderr
        assert "mamba, task copy" in decoded.stdout and "no attention (model=mamba): no heatmap" in decoded.stdout
    analysed = run_cli("analyze", f"runs_dir={runs_dir}", "analysis.lengths=[3,5,8]", "train.progress=false")
    assert analysed.returncode == 0, analysed.stderr
    result = store.read_json(folder / store.ANALYSIS)
    assert [row["test_length"] for row in result["length_generalisation"]] == [3, 5, 8]
    assert "counterfactual" not in result  # no attention to replace
    breakdown = result["breakdown"]
    assert [row["width"] for row in breakdown["beam"]] == [1, 4] and len(breakdown["greedy"]["by_position"]) == 5
    assert 0 <= breakdown["teacher_forced"]["token_acc"] <= 1


@pytest.mark.slow
def test_a_sweep_mixing_mamba_with_the_gru_is_analysed_compared_and_reported(tmp_path):
    runs_dir = tmp_path / "runs"
    grid = ["architecture=mamba,luong_general", "~hydra.sweeper.params.attention", "task.length=3", "seed=0"]
    swept = run_cli("sweep", *TINY, "model.d_model=8", "model.d_state=3", *grid, f"runs_dir={runs_dir}")
    assert swept.returncode == 0, swept.stderr
    assert sorted(folder.name.split("-")[0] for folder in store.complete_runs(runs_dir)) == ["luong_general", "mamba"]
    assert all((folder / store.ANALYSIS).is_file() for folder in store.complete_runs(runs_dir))
    compared = run_cli("compare", f"runs_dir={runs_dir}")
    assert compared.returncode == 0, compared.stderr
    assert "mamba" in compared.stdout and "luong_general" in compared.stdout
    report = (runs_dir / "report" / "report.md").read_text()
    assert "- Mamba: 2 layers each side, d_model 8, state size 3, convolution width 4, expansion 2" in report
    assert "- Model: GRU encoder-decoder, hidden size 8" in report  # the GRU's sizes, not Mamba's nulls
