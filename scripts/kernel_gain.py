"""What each fused CPU kernel buys where users run it: a training step of every model whose preset uses
the kernel, and the Transformer's greedy evaluation.

    python scripts/kernel_gain.py [--rounds 7] [--warmup 2] [--lengths 5 10 20 40 80] [--eval-lengths 5 10 20 40 80]

docs/bench.md (Speed levers) gives its figures and the rule a kernel is kept by.

The lengths are those the presets sweep (the default sweep, capacity, attention_zoo, architectures: 5-80;
budget and extrapolation stay within them), each model in its default config (batch 64), so every setup
timed is one a preset trains. For every (model, length) it times `training.loop.train_step` with all
kernels on and with ONE kernel switched off at its call site (torch's ops for that part, the other
kernels still on), one thread, every variant once per round (the order rotated each round), several
steps per timing; gain = median over rounds of (off / on) within the round. Before timing, each
variant's kernel calls are counted: the switched-off kernel is never called, and every other kernel
the on variant calls is called too; its loss and gradients are compared with the model's fused=False
(all-torch) numbers. The summary gives each kernel's median gain over the lengths, with its range.

Switches (per model instance, no source edited):
- GRU:               every kernels.GRU module's `fused` = False (torch's nn.GRU);
- bahdanau_decode:   BahdanauDecoder.fused = False (the per-step torch loop; the encoder's GRU stays fused);
- additive_scores:   the Luong concat decoder's Attention.fused = False (chunked torch additive score);
- transformer_layer: model.fused = False: the layers' ops in Python with torch's attention. The layer
                     kernel calls the attention kernel from C++, and with the default `model.dropout=0` no
                     training step calls the attention kernel from Python, so the two are measured together,
                     as they run;
- attention_step:    greedy evaluation (models.greedy.evaluate, 512 sequences) with model.fused = False except in
                     `encode` (the encoder keeps kernels.transformer_layer), so only the decoder steps' attention
                     changes (kernels.attention_step vs torch's cached attention).
"""

from __future__ import annotations

import argparse
import copy
import csv
import os
import statistics
import sys
import time
import types
from collections import Counter

import torch

from copytask.api import compose
from copytask.data.splits import sample_batch
from copytask.data.vocab import PAD
from copytask.kernels import ops as kernels
from copytask.kernels import transformer_ops
from copytask.models.build import build_model
from copytask.models.greedy import evaluate
from copytask.training.loop import train_step
from copytask.training.optimizer import adam

KERNEL_FUNCTIONS = (
    "gru_forward",
    "bahdanau_decode",
    "additive_scores",
    "attention",
    "attention_step",
    "transformer_layer",
)


def count_calls() -> tuple[Counter, callable]:
    """Wrap the kernels' Python entry points (looked up as module attributes at every call) with counters."""
    calls: Counter = Counter()
    modules = {name: kernels if hasattr(kernels, name) else transformer_ops for name in KERNEL_FUNCTIONS}
    originals = {name: getattr(module, name) for name, module in modules.items()}

    def wrap(name, fn):
        def counted(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)

        return counted

    for name, fn in originals.items():
        setattr(modules[name], name, wrap(name, fn))

    def restore():
        for name, fn in originals.items():
            setattr(modules[name], name, fn)

    return calls, restore


# ---- switches: each takes a model (a deep copy) and switches one kernel off at its call site ----


def gru_off(model):
    for module in model.modules():
        if isinstance(module, kernels.GRU):
            module.fused = False


def bahdanau_off(model):
    model.decoder.fused = False


def additive_off(model):
    model.decoder.attention.fused = False


def transformer_off(model):
    model.fused = False  # the layers' ops in Python and torch's batched attention products


def attention_step_off(model):
    """Greedy decoding's steps in torch's cached attention; the encoder still in kernels.transformer_layer."""
    model.fused = False
    encode = type(model).encode

    def fused_encode(self, *args, **kwargs):
        self.fused = True
        try:
            return encode(self, *args, **kwargs)
        finally:
            self.fused = False

    model.encode = types.MethodType(fused_encode, model)


def all_off(model):
    for module in model.modules():
        if hasattr(module, "fused"):
            module.fused = False


PRESET_LENGTHS = [5, 10, 20, 40, 80]  # every preset's lengths (configs/config.yaml, configs/experiment/)
MODELS = {  # name -> overrides
    "none": ["attention=none"],
    "bahdanau": ["attention=bahdanau"],
    "luong_general": ["attention=luong_general"],
    "luong_concat": ["attention=luong_concat"],
    "transformer": ["model=transformer"],
}
# (kernel, model, off-variant switch): against all kernels on
COMPARISONS = [
    ("GRU", "none", gru_off),
    ("GRU", "bahdanau", gru_off),
    ("GRU", "luong_general", gru_off),
    ("bahdanau_decode", "bahdanau", bahdanau_off),
    ("additive_scores", "luong_concat", additive_off),
    ("transformer_layer", "transformer", transformer_off),
]
# greedy evaluation: (kernel, model, off-variant switch); the GRU kernel also runs a greedy step's T=1
# recurrence in the plain and Luong decoders
EVAL_COMPARISONS = [
    ("attention_step", "transformer", attention_step_off),
    ("GRU", "none", gru_off),
    ("GRU", "luong_general", gru_off),
]
# the kernel calls a switched-off variant must not make
FORBIDDEN = {
    gru_off: "gru_forward",
    bahdanau_off: "bahdanau_decode",
    additive_off: "additive_scores",
    transformer_off: ("transformer_layer", "attention"),
    attention_step_off: "attention_step",
}


def grads_of(model, batch):
    """Loss and flat gradient of one forward/backward on `batch` (no optimiser step), in a copy."""
    model = copy.deepcopy(model)
    logits, _ = model(batch.src, batch.src_lengths, batch.tgt_in)
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch.tgt_out.flatten(), ignore_index=PAD)
    loss.backward()
    return loss.detach(), torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])


def check(name, model, reference, batch, forbidden, calls, expected=None):
    """Kernel calls of one forward/backward of `model` and its numbers against `reference` (fused=False):
    SystemExit where it calls a `forbidden` kernel, leaves out one of the kernels `expected` (the on
    variant's calls) other than those, or its gradients differ. -> the calls made."""
    calls.clear()
    loss, grad = grads_of(model, batch)
    made = dict(calls)
    ref_loss, ref_grad = grads_of(reference, batch)
    forbidden = (forbidden,) if isinstance(forbidden, str) else (forbidden or ())
    bad = [k for k in forbidden if made.get(k)]
    missing = [k for k in (expected or {}) if k not in forbidden and not made.get(k)]
    rel = ((grad - ref_grad).norm() / ref_grad.norm()).item()
    print(
        f"  check {name:32s} kernel calls {made}  |loss-ref| {abs(loss - ref_loss).item():.1e}  "
        f"grad rel.diff vs fused=False {rel:.1e}"
        + (f"  FAILED: called {bad}" if bad else "")
        + (f"  FAILED: did not call {missing}" if missing else ""),
        flush=True,
    )
    if bad or missing or rel > 1e-3:
        raise SystemExit(f"check failed for {name}")
    return made


def group_gains(rows: list[dict]) -> dict[tuple[str, str, str], list[float]]:
    """Each (kernel, model, what)'s gains, one per length."""
    gains: dict[tuple[str, str, str], list[float]] = {}
    for row in rows:
        gains.setdefault((row["kernel"], row["model"], row["what"]), []).append(row["gain"])
    return gains


def timed_steps(setup, steps):
    model, optimizer, batch, clip = setup
    started = time.perf_counter()
    for _ in range(steps):
        train_step(model, optimizer, batch, clip)
    return (time.perf_counter() - started) / steps


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lengths", type=int, nargs="+", default=PRESET_LENGTHS)
    parser.add_argument("--eval-lengths", type=int, nargs="+", default=PRESET_LENGTHS)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--block-ms", type=float, default=200.0, help="about this long per timing (steps repeated)")
    parser.add_argument("--csv", default="runs/bench/kernel_gain.csv")
    args = parser.parse_args()

    torch.set_num_threads(1)
    started = time.time()
    print(
        f"machine: {open('/proc/cpuinfo').read().split('model name')[1].split(':')[1].splitlines()[0].strip()}, "
        f"{os.cpu_count()} cores; torch {torch.__version__}, {torch.get_num_threads()} thread(s); "
        f"kernels built: {kernels.kernel() is not None}"
    )
    print(f"load average at start: {os.getloadavg()}")
    print(
        f"rounds {args.rounds} timed after {args.warmup} warm-up; variants interleaved, order rotated per round\n",
        flush=True,
    )
    assert kernels.kernel() is not None, "kernels not built"

    rows = []
    for length in args.lengths:
        calls, restore = count_calls()  # counters during the checks only, not the timing
        # one setup per distinct (model, switch); shared base weights and batch per model
        variants = {}  # key (model, switch name) -> setup
        on_calls = {}  # model -> the kernels its all-on variant calls
        for kernel, model_name, off_switch in COMPARISONS:
            for switch in (None, off_switch):
                key = (model_name, switch.__name__ if switch else "all_on")
                if key in variants:
                    continue
                cfg = compose([*MODELS[model_name], f"task.length={length}"])
                batch = sample_batch(cfg, cfg.train.batch_size, torch.Generator().manual_seed(cfg.seed))
                torch.manual_seed(cfg.seed)
                base = build_model(cfg)
                model = copy.deepcopy(base)
                if switch:
                    switch(model)
                reference = copy.deepcopy(base)
                all_off(reference)
                name = f"L={length} {model_name}/{key[1]}"
                made = check(name, model, reference, batch, FORBIDDEN.get(switch), calls, on_calls.get(model_name))
                on_calls.setdefault(model_name, made)
                variants[key] = (model, adam(model, cfg.train.lr, torch.device("cpu")), batch, cfg.train.clip)
        restore()
        # steps per timing: ~block_ms each, from one probe step per variant
        steps = {}
        for key, setup in variants.items():
            timed_steps(setup, 1)
            steps[key] = max(1, round(args.block_ms / 1e3 / timed_steps(setup, 1)))
        keys = list(variants)
        seconds = {key: [] for key in keys}
        for round_ in range(args.warmup + args.rounds):
            order = keys[round_ % len(keys) :] + keys[: round_ % len(keys)]
            for key in order:
                t = timed_steps(variants[key], steps[key])
                if round_ >= args.warmup:
                    seconds[key].append(t)
        for kernel, model_name, off_switch in COMPARISONS:
            on = seconds[(model_name, "all_on")]
            off = seconds[(model_name, off_switch.__name__)]
            ratios = [b / a for a, b in zip(on, off)]
            row = {
                "kernel": kernel,
                "model": model_name,
                "length": length,
                "what": "train_step",
                "ms_on": 1e3 * statistics.median(on),
                "ms_off": 1e3 * statistics.median(off),
                "gain": statistics.median(ratios),
                "gain_min": min(ratios),
                "gain_max": max(ratios),
            }
            rows.append(row)
            print(
                f"L={length:3d} {kernel:18s} {model_name:14s} on {row['ms_on']:8.2f} ms  off {row['ms_off']:8.2f} ms  "
                f"gain {row['gain']:.3f} (rounds {row['gain_min']:.3f}-{row['gain_max']:.3f})",
                flush=True,
            )
        print(f"  [{time.time() - started:.0f} s elapsed; load {os.getloadavg()[0]:.2f}]\n", flush=True)

    # greedy evaluation of 512 sequences (greedy.evaluate, as a run's evaluations): on vs one kernel off
    for length in args.eval_lengths:
        for kernel, model_name, off_switch in EVAL_COMPARISONS:
            cfg = compose([*MODELS[model_name], f"task.length={length}"])
            torch.manual_seed(cfg.seed)
            base = build_model(cfg)
            # a little training so that the greedy outputs are not all one token
            setup = (
                base,
                adam(base, cfg.train.lr, torch.device("cpu")),
                sample_batch(cfg, 64, torch.Generator().manual_seed(1)),
                cfg.train.clip,
            )
            timed_steps(setup, 20)
            batch = sample_batch(cfg, cfg.train.eval_size, torch.Generator().manual_seed(cfg.train.eval_seed))
            on, off = copy.deepcopy(base), copy.deepcopy(base)
            off_switch(off)
            reference = copy.deepcopy(base)
            all_off(reference)
            results, made = {}, {}
            calls, restore = count_calls()
            for name, model in (("on", on), ("off", off), ("fused=False", reference)):
                calls.clear()
                results[name] = evaluate(model, batch)
                made[name] = dict(calls)
                print(
                    f"  check L={length} {model_name} greedy {name:12s} kernel calls {made[name]}  "
                    f"token_acc {results[name]['token_acc']:.4f}",
                    flush=True,
                )
            restore()
            forbidden = FORBIDDEN[off_switch]
            missing = [k for k in made["on"] if k != forbidden and not made["off"].get(k)]
            if made["off"].get(forbidden) or missing:
                raise SystemExit(f"{off_switch.__name__} calls {forbidden} or leaves out {missing}")
            agree = (results["on"]["tokens"] == results["off"]["tokens"]).float().mean().item()
            print(
                f"  greedy tokens on vs off agree on {agree:.4%} of positions; off vs fused=False "
                f"{(results['off']['tokens'] == results['fused=False']['tokens']).float().mean().item():.4%}"
            )
            times = {"on": [], "off": []}
            for round_ in range(args.warmup + args.rounds):
                for name in ("on", "off") if round_ % 2 == 0 else ("off", "on"):
                    model = on if name == "on" else off
                    t0 = time.perf_counter()
                    evaluate(model, batch)
                    if round_ >= args.warmup:
                        times[name].append(time.perf_counter() - t0)
            ratios = [b / a for a, b in zip(times["on"], times["off"])]
            row = {
                "kernel": kernel,
                "model": model_name,
                "length": length,
                "what": "greedy_eval_512",
                "ms_on": 1e3 * statistics.median(times["on"]),
                "ms_off": 1e3 * statistics.median(times["off"]),
                "gain": statistics.median(ratios),
                "gain_min": min(ratios),
                "gain_max": max(ratios),
            }
            rows.append(row)
            print(
                f"L={length:3d} {kernel:18s} {model_name:14s} greedy eval of 512: "
                f"on {row['ms_on']:8.1f} ms  off {row['ms_off']:8.1f} ms  "
                f"gain {row['gain']:.3f} (rounds {row['gain_min']:.3f}-{row['gain_max']:.3f})",
                flush=True,
            )
        print(f"  [{time.time() - started:.0f} s elapsed; load {os.getloadavg()[0]:.2f}]\n", flush=True)

    print(f"\nload average at end: {os.getloadavg()}; total {time.time() - started:.0f} s\n")
    print("kernel | model | length | what | ms on | ms off | gain (off/on, median of per-round ratios) | round range")
    for r in rows:
        print(
            f"{r['kernel']} | {r['model']} | {r['length']} | {r['what']} | {r['ms_on']:.2f} | {r['ms_off']:.2f} "
            f"| {r['gain']:.3f} | {r['gain_min']:.3f}-{r['gain_max']:.3f}"
        )
    os.makedirs(os.path.dirname(args.csv) or ".", exist_ok=True)
    with open(args.csv, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    print("\nmedian gain over the lengths (range over the lengths); kept if at least 1.10 on the training step:")
    for (kernel, model_name, what), gains in group_gains(rows).items():
        median = statistics.median(gains)
        verdict = ("keep" if median >= 1.10 else "does not pay") if what == "train_step" else ""
        print(f"  {kernel} | {model_name} | {what} | {median:.2f} | {min(gains):.2f}-{max(gains):.2f} | {verdict}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
