#!/usr/bin/env python3
"""Generate text in-process with luced's runtime (no daemon): measures the runtime alone.

    python tools/generate.py --model PATH (--prompt TEXT [--chat] | --prompt-ids 1,2,3)
        [--max-tokens N] [--temperature T] [--seed S] [--dtype float32|bfloat16]
        [--threads N] [--weights auto|int4|int8|dequant] [--json]

--prompt-ids feeds token ids as they are (no tokenizer, no BOS). Without --json the text
streams to stdout; with --json one object is printed: {"tokens" (the generated ids),
"text", "prompt_tokens", "ttft_s", "decode_tok_s", "finish_reason", "load_s"}.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time

from luced.serve.options import OPTION_BY_NAME

T_START = time.perf_counter()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", help="GGUF file (default: the bundled SmolLM2-135M-Instruct)")
    given = p.add_mutually_exclusive_group(required=True)
    given.add_argument("--prompt", help="prompt text")
    given.add_argument("--prompt-ids", type=_ids, help="prompt token ids, comma-separated")
    p.add_argument("--chat", action="store_true", help="apply the chat template (one user turn)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's)")
    weights = OPTION_BY_NAME["weights"]
    p.add_argument(
        "--weights",
        default=weights.default,  # luced serve's, so that the two agree out of the box
        choices=weights.choices,
        help=f"how weight matrices are held, as luced serve --weights (default: {weights.default})",
    )
    p.add_argument("--ignore-eos", action="store_true", help="generate max-tokens tokens")
    p.add_argument("--json", action="store_true", help="print one JSON object at the end")
    return p.parse_args(argv)


def _ids(text: str) -> list[int]:
    try:
        ids = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"want comma-separated token ids, got {text!r}") from None
    if not ids or min(ids) < 0:
        raise argparse.ArgumentTypeError(f"want one or more ids >= 0, got {text!r}")
    return ids


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO if not args.json else logging.WARNING, stream=sys.stderr)
    import torch

    from luced.runtime.generate import generate
    from luced.runtime.model import Model
    from luced.sampling_params import SamplingParams
    from luced.serve.bundled import default_model_path
    from luced.text.chat_template import ChatTemplate
    from luced.text.detokenize import IncrementalDetokenizer
    from luced.text.tokenizer import Tokenizer

    if args.threads:
        torch.set_num_threads(args.threads)
    path = args.model or str(default_model_path())
    model = Model.load(path, dtype=args.dtype, weights=args.weights)
    tokenizer = Tokenizer.from_gguf(path)
    if args.prompt_ids is not None:
        prompt = args.prompt_ids
        if max(prompt) >= model.cfg.vocab:
            sys.exit(f"--prompt-ids: ids must be < the vocabulary size {model.cfg.vocab}")
    elif args.chat:
        template = ChatTemplate.from_gguf(path, model.cfg.arch)
        text = template.render([{"role": "user", "content": args.prompt}])
        # As transformers' apply_chat_template: the template writes any BOS itself.
        prompt = tokenizer.encode(text, add_bos=False, allow_special=True)
    else:
        prompt = tokenizer.encode(args.prompt)
    load_s = time.perf_counter() - T_START

    params = SamplingParams(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed
    )
    detok = IncrementalDetokenizer(tokenizer)

    def stream(token: int) -> None:
        sys.stdout.write(detok.push(token))
        sys.stdout.flush()

    result = generate(
        model,
        prompt,
        params,
        args.max_tokens,
        eos_ids=() if args.ignore_eos else tokenizer.eos_ids,
        on_token=None if args.json else stream,
    )
    if args.json:
        out = {
            "tokens": result.tokens,
            "text": tokenizer.decode(result.tokens),
            "prompt_tokens": result.prompt_tokens,
            "ttft_s": round(result.ttft_s, 4),
            "decode_tok_s": round(result.decode_tok_s, 2),
            "finish_reason": result.finish_reason,
            "load_s": round(load_s, 3),
        }
        print(json.dumps(out, ensure_ascii=False))
    else:
        sys.stdout.write(detok.flush() + "\n")
        print(
            f"[{result.prompt_tokens} prompt tokens, {len(result.tokens)} generated, "
            f"TTFT {result.ttft_s:.3f} s, {result.decode_tok_s:.1f} tok/s]",
            file=sys.stderr,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
