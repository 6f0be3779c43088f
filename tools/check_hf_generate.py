"""Runs Hugging Face Llama `generate` (random-init tiny config, greedy) on CPU, on tpu eagerly and on tpu with
default `torch.compile(model.forward)` (Inductor's entry; on XLA:CPU its tpu graphs compile with backend "tpu"),
and compares the generated tokens.

    # transformers in a venv over the same torch (e.g. /tmp/hE/venv-x on the dev machine) and torch_tpu installed:
    python tools/check_hf_generate.py [--new-tokens 8] [--site /path/to/site-packages-with-transformers]

Exits 1 when the token sequences differ. tests/test_inductor_default.py runs the same comparison when
transformers is importable.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import torch

VOCAB = 128


def _model() -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      bos_token_id=0, eos_token_id=VOCAB - 1, pad_token_id=0)
    return LlamaForCausalLM(cfg).eval()


def _generate(model: Any, ids: torch.Tensor, new_tokens: int) -> tuple[list[list[int]], float]:
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False)
    return out.cpu().tolist(), time.perf_counter() - start


def compare(new_tokens: int = 8, warm: bool = True) -> dict[str, Any]:
    """Tokens of each run (lists), seconds of the eager and compiled runs, and how many Dynamo graphs default
    torch.compile sent to the tpu backend; with `warm`, the compiled generate runs twice (the second time warm)."""
    from torch._dynamo.utils import counters

    ids = torch.randint(1, VOCAB - 1, (2, 5), generator=torch.Generator().manual_seed(1))
    base = _model()
    result: dict[str, Any] = {}
    result["cpu"], _ = _generate(base, ids, new_tokens)
    model = _model().to("tpu")
    result["eager"], result["eager_s"] = _generate(model, ids.to("tpu"), new_tokens)
    torch._dynamo.reset()
    before = counters["tpu"]["inductor_to_tpu_backend"]
    model.forward = torch.compile(model.forward)  # default backend (Inductor's entry)
    result["compiled"], result["compiled_first_s"] = _generate(model, ids.to("tpu"), new_tokens)
    if warm:
        result["compiled"], result["compiled_warm_s"] = _generate(model, ids.to("tpu"), new_tokens)
    result["routed_graphs"] = counters["tpu"]["inductor_to_tpu_backend"] - before
    torch._dynamo.reset()
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--new-tokens", type=int, default=8)
    ap.add_argument("--site", help="a site-packages folder with transformers, appended to sys.path")
    ap.add_argument("--json", help="write the result here")
    args = ap.parse_args()
    if args.site:
        sys.path.append(args.site)
    r = compare(args.new_tokens)
    ok = r["compiled"] == r["eager"] == r["cpu"]
    print(json.dumps(r))
    print("OK: compiled generate matches eager and CPU" if ok else "FAIL: token sequences differ")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, indent=1)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
