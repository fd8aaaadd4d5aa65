"""Attention: one class per score, each registered under the `attention.score` that names it, over
the mechanics every score shares (the masked softmax, heads, Luong's local window, the
counterfactual hook) in their base class `Attention`.

The decoders decide *which* state is the query (Bahdanau: the state before the step, s_{t-1};
Luong: the state after it, s_t); a score class decides how the query q scores an encoder state h:

    additive    AdditiveAttention    v^T tanh(W q + U h)     Bahdanau's, and Luong's "concat"
    dot         DotAttention         q^T h                   (these four: dot_attention.py)
    scaled_dot  ScaledDotAttention   q^T h / sqrt(d)
    general     GeneralAttention     q^T W h
    multihead   MultiHeadAttention   torch's nn.MultiheadAttention
    linear      LinearAttention      phi(W_q q)^T S / phi(W_q q)^T z, a fixed-size summary of h (linear_attention.py)

An attention type is its class here (a subclass of `Attention` with `@register_attention("<score>")`
that defines `scores`, and `project_keys` where the keys are a projection of the encoder states),
its configs/attention/<name>.yaml (`score: <score>`) and its test: building a model looks the class
up in ATTENTION_TYPES (`make_attention`), and `build.check_buildable` refuses a config the class
cannot compute (docs/models.md). A class of the user's own, in their own module, needs neither: its
import path is its score (`attention.score=my_scores.CosineAttention`, as Hydra's `_target_`).

Contract: query (B, T_dec, d_s), keys from `project_keys`, values (B, T_enc, d_h), mask (B, T_enc),
positions (T_dec,) the query's output steps (local-m only), summary `summarise`'s or None (then computed
in the call) -> context (B, T_dec, d_h), weights (B, T_dec, T_enc) summing to 1 over valid positions
(local-p: at most 1, zero outside the window). With `need_weights=False` (as torch's nn.MultiheadAttention
takes it: a caller that reads only the context) the weights are None, and a score that can read the
source without them (linear attention) never forms them.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import ClassVar, TypeVar

import torch
from torch import Tensor, nn

from ..families import cannot_import
from ..families.gru import LOCAL
from ..kernels import ops

ADDITIVE_CHUNK = 2**19  # elements of the additive score's tanh tensor computed at once on CPU (2 MB)

# Replaces the weights after the softmax, for counterfactual checks: (weights, mask) -> weights,
# weights (B, heads * T_dec, T_enc) with one row per head and step, head-major (row h * T_dec + t),
# mask (B, T_enc). With one head that is simply (B, T_dec, T_enc).
Intervention = Callable[[Tensor, Tensor], Tensor]


def masked_softmax(scores: Tensor, mask: Tensor) -> Tensor:
    """Softmax over the last axis of `scores` (B, ..., T_enc); positions where `mask` (B, T_enc),
    or a mask of the scores' own shape, is False get exactly zero weight, and a row with no valid
    position at all (an empty source) gets zero weights rather than 0/0."""
    if mask.dim() == 2:
        mask = mask.view(mask.size(0), *(1,) * (scores.dim() - 2), mask.size(1))  # broadcast over the middle axes
    weights = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
    return weights.masked_fill(~mask.any(-1, keepdim=True), 0.0)


class Attention(nn.Module):
    """The mechanics every score shares; a subclass defines `scores` (and `project_keys` where its keys
    are a projection of the encoder states) and says, in its class attributes, what it takes.

    - Heads: with `heads` > 1 the query, the keys and the values are split into `heads` equal slices
      along the feature axis (`split`); each head attends with its own slices and the per-head contexts
      are concatenated back to d_h. With one head this is the single-head score. The returned weights
      are the mean over heads; each head's own weights are what the `intervention` hook sees.
    - Luong's local attention: `restrict_to_window` (Luong et al., 2015, section 3.2).
    - `intervention`: replaces the weights after the softmax (counterfactual checks,
      `analysis.head_weights`); None: the weights as computed.

    query_size d_s, key_size d_h; attention_size: the hidden size of a score that has one (additive);
    fused: a score's CPU kernel where it has one and it builds (False: torch's ops)."""

    score: ClassVar[str]  # the `attention.score` that names the class: its import path, or its registered name
    multi_head: ClassVar[bool] = False  # whether heads > 1 split it into per-head scores of slices
    same_sizes: ClassVar[bool] = False  # whether it needs d_s == d_h (a product of the query with h itself)
    local_window: ClassVar[bool] = True  # whether Luong's local window can restrict it (one head)

    def __init__(
        self, query_size: int, key_size: int, attention_size: int | None = None, heads: int = 1, fused: bool = True
    ):
        super().__init__()
        if heads < 1:
            raise ValueError(f"heads must be >= 1, got {heads}")
        if heads > 1 and not self.multi_head:
            multi_head = [score for score, kind in ATTENTION_TYPES.items() if kind.multi_head]
            raise ValueError(f"heads={heads} needs a {', '.join(multi_head)} score, got {self.score!r}")
        if query_size % heads or key_size % heads:
            raise ValueError(f"heads={heads} must divide the state sizes, got d_s={query_size} and d_h={key_size}")
        if self.same_sizes and query_size != key_size:
            raise ValueError(
                f"{self.score} attention needs the decoder state size to equal the encoder state size, "
                f"got d_s={query_size} and d_h={key_size}; use a general or concat score instead"
            )
        self.query_size, self.key_size, self.heads, self.fused = query_size, key_size, heads, fused
        self.local: str | None = None  # Luong's local attention: None (global), "predictive" or "monotonic"
        self.window: int | None = None  # local: D, the window's half-width
        self.intervention: Intervention | None = None

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        cls.score = f"{cls.__module__}.{cls.__qualname__}"  # `register_attention` gives it a short name

    def restrict_to_window(self, local: str, window: int | None) -> None:
        """Luong's local attention (Luong et al., 2015, section 3.2): the score's weights restricted to a
        window [p_t - D, p_t + D] of source positions around an aligned position p_t, D = `window`:
        - "monotonic" (local-m): p_t = t, the output step; the softmax over the window alone.
        - "predictive" (local-p): p_t = S sigmoid(v_p^T tanh(W_p q)) with S the source length; the softmax
          over the window times a Gaussian exp(-(s - p_t)^2 / (2 sigma^2)), sigma = D / 2, as in the paper:
          its weights sum to less than 1 (the Gaussian is not renormalised), and p_t learns through it.
        p_t = t is clamped to the source length on steps past it (padding), so that no window is empty.
        Called once the score's own parameters exist (`make_attention`): W_p and v_p come after them, in
        the seeded initialisation and in the state_dict."""
        if local not in LOCAL:
            raise ValueError(f"unknown local attention {local!r}; choose one of {', '.join(map(str, LOCAL))}")
        if self.heads > 1 or not self.local_window:
            raise ValueError(
                f"local attention needs one head of a single-head score, got {self.score!r} with {self.heads} heads"
            )
        if not window or window < 1:
            raise ValueError(f"local attention needs window >= 1, got {window}")
        self.local, self.window = local, window
        if local == "predictive":
            self.position_proj = nn.Linear(self.query_size, self.query_size, bias=False)  # W_p
            self.position_v = nn.Linear(self.query_size, 1, bias=False)  # v_p

    def project_keys(self, encoder_states: Tensor) -> Tensor:
        """(B, T_enc, d_h) -> the keys `scores` reads, computed once per sequence and reused at every
        decoder step. Here the states themselves; a score that projects them overrides this."""
        return encoder_states

    def summarise(self, keys: Tensor, values: Tensor, mask: Tensor) -> Tensor | None:
        """What the score reads of the whole source at every step, computed once per sequence from keys, values
        and mask: `forward`'s `summary`. None here: a softmax score reads every encoder state itself."""
        return None

    def state_floats(self, length: int) -> int:
        """Floats per sequence the score can read of a source of `length` symbols: every encoder state here."""
        return length * self.key_size

    def scores(self, query: Tensor, keys: Tensor) -> Tensor:
        """The score of every (head, decoder step, source position): query (B, T_dec, d_s), keys from
        `project_keys` (B, T_enc, ...) -> (B, heads, T_dec, T_enc)."""
        raise NotImplementedError(f"{type(self).__name__} defines no scores")

    def read(self, weights: Tensor, values: Tensor) -> Tensor:
        """weights (B, heads, T_dec, T_enc), values (B, T_enc, d_h) -> context (B, T_dec, d_h), the heads'
        contexts side by side."""
        return (weights @ self.split(values)).transpose(1, 2).flatten(2)

    def split(self, x: Tensor) -> Tensor:
        """(B, T, d) -> (B, heads, T, d / heads)."""
        return x.view(x.size(0), x.size(1), self.heads, -1).transpose(1, 2)

    def check_shapes(self, query: Tensor, keys: Tensor, values: Tensor, mask: Tensor) -> None:
        """The contract's shapes, asserted at the module's boundary (see the module's docstring)."""
        batch, _, d_s = query.shape
        t_enc = values.size(1)
        assert d_s == self.query_size, f"query size {d_s} != {self.query_size}"
        assert values.shape == (batch, t_enc, self.key_size), f"values {tuple(values.shape)}"
        assert keys.shape[:2] == (batch, t_enc) and mask.shape == (batch, t_enc), "keys/mask do not match values"

    def forward(
        self,
        query: Tensor,
        keys: Tensor,
        values: Tensor,
        mask: Tensor,
        positions: Tensor | None = None,
        summary: Tensor | None = None,
        need_weights: bool = True,
    ) -> tuple[Tensor, Tensor | None]:
        """query (B, T_dec, d_s), keys (B, T_enc, ...), values (B, T_enc, d_h), mask (B, T_enc), positions
        (T_dec,), summary `summarise`'s or None -> context (B, T_dec, d_h), weights (B, T_dec, T_enc), head mean
        (None without `need_weights`: a softmax score computes them all the same, its context is made of them)."""
        self.check_shapes(query, keys, values, mask)
        batch, t_dec, t_enc = query.size(0), query.size(1), values.size(1)
        scores = self.scores(query, keys)  # (B, heads, T_dec, T_enc)
        if self.local is None:
            # Heads and steps as rows, so the softmax and an intervention act on each head's row alone.
            weights = masked_softmax(scores.flatten(1, 2), mask)  # (B, heads * T_dec, T_enc)
        else:
            weights = self._local(scores[:, 0], query, mask, positions)  # (B, T_dec, T_enc): one head
        if self.intervention is not None:
            weights = self.intervention(weights, mask)
        weights = weights.view(batch, self.heads, t_dec, t_enc)
        return self.read(weights, values), weights.mean(1) if need_weights else None

    def _local(self, scores: Tensor, query: Tensor, mask: Tensor, positions: Tensor | None) -> Tensor:
        """Luong's local attention (`restrict_to_window`): scores (B, T_dec, T_enc), query (B, T_dec, d_s)
        -> weights (B, T_dec, T_enc), zero outside [p_t - D, p_t + D] and on padding."""
        lengths = mask.sum(-1, keepdim=True).to(scores.dtype)  # (B, 1): S
        t_dec = query.size(1)
        if self.local == "monotonic":
            assert positions is not None and positions.shape == (t_dec,), "local-m needs each query's output step"
            aligned = torch.minimum(positions.to(scores.dtype)[None, :], lengths)  # (B, T_dec): p_t = t, at most S
        else:
            aligned = lengths * torch.sigmoid(self.position_v(torch.tanh(self.position_proj(query)))).squeeze(-1)
        source = torch.arange(scores.size(-1), device=scores.device, dtype=scores.dtype)
        distance = source[None, None, :] - aligned[:, :, None]  # (B, T_dec, T_enc): s - p_t
        window = (distance.abs() <= self.window) & mask[:, None, :]
        weights = masked_softmax(scores, window)
        if self.local == "predictive":
            sigma = self.window / 2
            weights = weights * torch.exp(-distance.square() / (2 * sigma**2))
        return weights

    def training_floats(self) -> dict[str, int]:
        """Floats a training step keeps per attention weight (B x T_dec x T_enc) beyond the weights
        themselves, by what keeps them: the score's entries of `families.memory.memory_estimate`. None here."""
        return {}


AttentionType = TypeVar("AttentionType", bound=type[Attention])

ATTENTION_TYPES: dict[str, type[Attention]] = {}  # attention.score -> the class that computes it, in registration order


def register_attention(score: str) -> Callable[[AttentionType], AttentionType]:
    """Class decorator: the class computes the score `attention.score=<score>` names."""

    def register(kind: AttentionType) -> AttentionType:
        if score in ATTENTION_TYPES:
            raise ValueError(f"attention score {score!r} is registered already, by {ATTENTION_TYPES[score].__name__}")
        kind.score = score
        ATTENTION_TYPES[score] = kind
        return kind

    return register


def attention_type(score: str) -> type[Attention]:
    """The class that computes `score`: the one registered under it, or a subclass of `Attention` named by
    its import path `module.Class` (a module of the user's own, found on sys.path: the current folder under
    `python -m copytask`), which is imported here. ValueError, one line, where there is none."""
    if score in ATTENTION_TYPES:
        return ATTENTION_TYPES[score]
    module, _, name = str(score).rpartition(".")
    if not module:
        raise ValueError(
            f"unknown attention score {score!r}; choose one of {', '.join(ATTENTION_TYPES)}, "
            "or name a class of your own by its import path, module.Class"
        )
    try:
        kind = getattr(importlib.import_module(module), name)
    except ImportError as error:
        raise ValueError(cannot_import("attention.score", score, str(error))) from None
    except AttributeError:
        raise ValueError(f"attention.score={score}: module {module!r} has no {name!r}") from None
    if not (isinstance(kind, type) and issubclass(kind, Attention)):
        raise ValueError(f"attention.score={score} is not a subclass of copytask.models.attention.Attention")
    return kind


def make_attention(
    score: str,
    query_size: int,
    key_size: int,
    attention_size: int | None = None,
    heads: int = 1,
    fused: bool = True,
    local: str | None = None,
    window: int | None = None,
) -> Attention:
    """The attention a config names: `score`'s class, restricted to Luong's local window with `local`
    (None: global attention; "predictive" or "monotonic", the window's half-width `window`)."""
    attention = attention_type(score)(query_size, key_size, attention_size, heads, fused)
    if local is not None:
        attention.restrict_to_window(local, window)
    return attention


# -- the scores ---------------------------------------------------------------------------------


@register_attention("additive")
class AdditiveAttention(Attention):
    """Bahdanau et al. (2015), eq. (6) with the alignment model of appendix A.1.2; Luong et al.'s (2015)
    "concat" (eq. (8), W [s_t; h_i] = W_s s_t + W_h h_i):

        e_{t,i} = v_a^T tanh(W_a q_t + U_a h_i)

    W_a (A, d_s), U_a (A, d_h) with a bias (the score's), v_a (A,), A = attention_size. U_a h_i does not
    depend on t: `project_keys` computes it once per sequence. `energy` is the equation; `scores` runs it
    over every (step, position) pair in a speed path, and `step` for one decoder step (Bahdanau's)."""

    def __init__(
        self, query_size: int, key_size: int, attention_size: int | None = None, heads: int = 1, fused: bool = True
    ):
        super().__init__(query_size, key_size, attention_size, heads, fused)
        if not attention_size or attention_size < 1:
            raise ValueError(f"additive attention needs attention_size >= 1, got {attention_size}")
        self.query_proj = nn.Linear(query_size, attention_size, bias=False)  # W_a
        self.key_proj = nn.Linear(key_size, attention_size)  # U_a (its bias is the score's bias)
        self.v = nn.Linear(attention_size, 1, bias=False)  # v_a

    def project_keys(self, encoder_states: Tensor) -> Tensor:
        """(B, T_enc, d_h) -> U_a h (B, T_enc, A)."""
        return self.key_proj(encoder_states)

    def energy(self, projected_query: Tensor, keys: Tensor) -> Tensor:
        """v_a^T tanh(W_a q + U_a h) over the last axis of two broadcastable (..., A) tensors, W_a q and U_a h."""
        return self.v(fast_tanh(projected_query + keys)).squeeze(-1)

    def scores(self, query: Tensor, keys: Tensor) -> Tensor:
        """query (B, T_dec, d_s), keys U_a h (B, T_enc, A) -> (B, 1, T_dec, T_enc): one head. On CPU in the
        fused kernel where it builds, else `energy` in pieces (`energy_in_pieces`)."""
        projected = self.query_proj(query)  # (B, T_dec, A)
        if self.fused and ops.usable(projected):
            return ops.additive_scores(projected, keys, self.v.weight[0])[:, None]
        return energy_in_pieces(self.energy, projected, keys)[:, None]

    def step(self, query: Tensor, keys: Tensor, values: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
        """One decoder step: query (B, d_s) -> context (B, d_h), weights (B, T_enc). The numbers of
        `forward` on a (B, 1, d_s) query, without the time axis, whose views are a share of a step worth
        saving where Bahdanau's decoder calls this at every step (docs/bench.md)."""
        assert query.shape == (values.size(0), self.query_size), f"query {tuple(query.shape)}"
        scores = self.energy(self.query_proj(query)[:, None, :], keys)  # (B, T_enc)
        weights = masked_softmax(scores, mask)
        if self.intervention is not None:
            weights = self.intervention(weights[:, None], mask)[:, 0]
        return torch.bmm(weights[:, None], values).squeeze(1), weights

    def training_floats(self) -> dict[str, int]:
        """The (B, T_dec, T_enc, A) sum and its tanh, saved for the backward pass."""
        return {"the additive scores (B x T_dec x T_enc x attention.size)": 2 * self.v.in_features}


def energy_in_pieces(energy: Callable[[Tensor, Tensor], Tensor], projected: Tensor, keys: Tensor) -> Tensor:
    """`energy` of every (step, position) pair: projected W_a q (B, T_dec, A), keys U_a h (B, T_enc, A) ->
    (B, T_dec, T_enc). On CPU ADDITIVE_CHUNK elements of the (B, T_dec, T_enc, A) tensor at a time: whole,
    it does not fit in a CPU cache when many decoder steps come at once (Luong concat under teacher
    forcing; docs/bench.md has the timings)."""
    steps = projected.size(1) if projected.is_cuda else max(1, ADDITIVE_CHUNK // keys.numel())
    scores = [energy(part[:, :, None, :], keys[:, None, :, :]) for part in projected.split(steps, dim=1)]
    return torch.cat(scores, dim=1) if len(scores) > 1 else scores[0]


class SigmoidTanh(torch.autograd.Function):
    """tanh computed as 2 sigmoid(2x) - 1, with tanh's backward grad (1 - y^2): on CPU torch's tanh
    kernel is several times slower than its sigmoid, and the additive score's tanh is the largest single
    cost of a Bahdanau training step (docs/bench.md). Equal to tanh within ~1e-7."""

    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:
        y = x.mul(2).sigmoid_().mul_(2).sub_(1)  # one allocation, the rest in place
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        (y,) = ctx.saved_tensors
        return torch.ops.aten.tanh_backward(grad, y)


def fast_tanh(x: Tensor) -> Tensor:
    """tanh; on CPU through SigmoidTanh (on a GPU torch's own tanh is as fast)."""
    return torch.tanh(x) if x.is_cuda else SigmoidTanh.apply(x)
