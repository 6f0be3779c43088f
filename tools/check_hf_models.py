"""Trains Hugging Face GPT-2 and T5 (random-init tiny configs) a few steps on tpu and on CPU, as a user would,
and compares them: the loss per step, the number of unique parameters, weight ties, and that an optimizer
built *before* `model.to(device)` updates the parameters the model uses.

    pip install transformers          # into a venv that has torch==2.13.0 and torch_tpu
    python tools/check_hf_models.py [--steps 5] [--models gpt2,t5] [--json out.json]

Exits 1 when any check fails. tests/test_hf_models.py runs the same comparison when transformers is installed.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import torch

SEQ = 16
BATCH = 2
VOCAB = 128
# Per-step loss tolerance (float32): the same math in another order (XLA vs ATen kernels).
RTOL = 1e-4


def _gpt2() -> tuple[torch.nn.Module, Callable[[torch.Generator], dict[str, torch.Tensor]], list[str]]:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=4,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                     bos_token_id=VOCAB - 1, eos_token_id=VOCAB - 1)
    model = GPT2LMHeadModel(cfg)

    def batch(g: torch.Generator) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
        return {"input_ids": ids, "labels": ids}

    return model, batch, ["transformer.wte.weight", "lm_head.weight"]


def _t5() -> tuple[torch.nn.Module, Callable[[torch.Generator], dict[str, torch.Tensor]], list[str]]:
    from transformers import T5Config, T5ForConditionalGeneration

    cfg = T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2,
                   num_heads=4, relative_attention_num_buckets=8, dropout_rate=0.0,
                   decoder_start_token_id=0, pad_token_id=0)
    model = T5ForConditionalGeneration(cfg)

    def batch(g: torch.Generator) -> dict[str, torch.Tensor]:
        return {"input_ids": torch.randint(1, VOCAB, (BATCH, SEQ), generator=g),
                "labels": torch.randint(1, VOCAB, (BATCH, SEQ // 2), generator=g)}

    return model, batch, ["shared.weight", "encoder.embed_tokens.weight", "decoder.embed_tokens.weight",
                          "lm_head.weight"]


MODELS = {"gpt2": _gpt2, "t5": _t5}


@dataclass
class Run:
    device: str
    losses: list[float] = field(default_factory=list)
    unique_params: int = 0          # distinct Parameter objects over every module slot
    tied: bool = False              # the slots that the config ties hold one Parameter
    optimizer_owns_model: bool = False  # the optimizer built before the move holds the model's parameters
    tied_grad_set: bool = False     # the tied weight got a gradient in every step


def _unique_params(model: torch.nn.Module) -> int:
    return len({id(p) for _, p in model.named_parameters(remove_duplicate=False)})


def train(name: str, device: str, steps: int, seed: int = 0) -> Run:
    torch.manual_seed(seed)
    model, make_batch, tied_names = MODELS[name]()
    model.train()
    # Built before the move, as many scripts do: it must keep updating what the model uses.
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model.to(device)
    params = dict(model.named_parameters(remove_duplicate=False))
    run = Run(device=device, unique_params=_unique_params(model))
    run.tied = all(params[n] is params[tied_names[0]] for n in tied_names)
    model_ids = {id(p) for p in model.parameters()}
    run.optimizer_owns_model = {id(p) for g in opt.param_groups for p in g["params"]} == model_ids
    g = torch.Generator().manual_seed(seed + 1)
    grads_ok = True
    for _ in range(steps):
        batch = {k: v.to(device) for k, v in make_batch(g).items()}
        loss = model(**batch).loss
        loss.backward()
        grads_ok &= params[tied_names[0]].grad is not None
        opt.step()
        opt.zero_grad()
        run.losses.append(float(loss.detach().cpu()))
    run.tied_grad_set = grads_ok
    return run


def compare(name: str, steps: int = 5, device: str = "tpu") -> dict[str, Any]:
    cpu = train(name, "cpu", steps)
    dev = train(name, device, steps)
    loss_ok = all(abs(a - b) <= RTOL * max(1.0, abs(a)) for a, b in zip(cpu.losses, dev.losses))
    checks = {
        "losses match": loss_ok and len(cpu.losses) == len(dev.losses) == steps,
        "unique parameters match": cpu.unique_params == dev.unique_params,
        "ties kept": cpu.tied and dev.tied,
        "optimizer built before the move owns the parameters": dev.optimizer_owns_model,
        "tied weight gets a gradient": cpu.tied_grad_set and dev.tied_grad_set,
    }
    return {"model": name, "cpu": asdict(cpu), device: asdict(dev), "checks": checks, "ok": all(checks.values())}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--models", default="gpt2,t5", help=f"comma-separated, from {sorted(MODELS)}")
    ap.add_argument("--device", default="tpu")
    ap.add_argument("--json", help="also write the results to this file")
    args = ap.parse_args(argv)
    try:
        import transformers
    except ImportError:
        print("check_hf_models: transformers is not installed; `pip install transformers` "
              "(keep torch==2.13.0 pinned in the same command).", file=sys.stderr)
        return 2
    print(f"torch {torch.__version__}, transformers {transformers.__version__}")
    results = []
    for name in args.models.split(","):
        if name not in MODELS:
            ap.error(f"unknown model {name!r}; choose from {sorted(MODELS)}")
        r = compare(name, args.steps, args.device)
        results.append(r)
        cpu, dev = r["cpu"], r[args.device]
        print(f"\n{name}: unique parameters cpu {cpu['unique_params']}, {args.device} {dev['unique_params']}")
        print(f"  step  {'cpu loss':>12}  {args.device + ' loss':>12}  {'|diff|':>9}")
        for i, (a, b) in enumerate(zip(cpu["losses"], dev["losses"]), 1):
            print(f"  {i:4d}  {a:12.6f}  {b:12.6f}  {abs(a - b):9.2e}")
        for check, ok in r["checks"].items():
            print(f"  [{'ok' if ok else 'FAIL'}] {check}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    ok = all(r["ok"] for r in results)
    print("\nall checks passed" if ok else "\nSOME CHECKS FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
