"""``turnkv serve | chat | generate | selfcheck``.

Every flag has a ``TURNKV_*`` environment twin (``--kv-layout`` <-> ``TURNKV_KV_LAYOUT``); a flag on
the command line wins. Expected failures (a missing model, an unsupported architecture, a prompt
longer than the context) print one line naming the problem and exit with code 2.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from dataclasses import asdict, fields

from turnkv.config import EngineConfig, parse_size

EXIT_USAGE = 2


def _engine_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="HF folder, .gguf file, 'default' (SmolLM2-135M-Instruct) or random:SHAPE")
    p.add_argument("--device", help="auto | cpu | cuda | any torch device")
    p.add_argument("--dtype", choices=["auto", "bfloat16", "float16", "float32"])
    p.add_argument("--kv-layout", dest="kv_layout", choices=["segmented", "contiguous"])
    p.add_argument("--attention", choices=["auto", "fused", "lse"])
    p.add_argument("--max-context", dest="max_context", type=int, help="tokens; 0 = the model's own")
    p.add_argument("--prefill-chunk", dest="prefill_chunk", type=int, help="rows per prefill window")
    p.add_argument(
        "--cuda-graphs", dest="cuda_graphs", choices=["auto", "off"], help="captured decode steps on CUDA"
    )
    p.add_argument(
        "--speculate", choices=["auto", "off"], help="context-copy speculative decoding (auto: on)"
    )


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="turnkv", description=__doc__.splitlines()[0])
    ap.add_argument("-v", "--verbose", action="store_true")
    sub = ap.add_subparsers(dest="command", required=True)

    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    _engine_flags(s)
    s.add_argument("--host")
    s.add_argument("--port", type=int)
    s.add_argument(
        "--bank-bytes", dest="bank_bytes", help="KV budget of the session bank: N, 512M, 8G or auto"
    )
    s.add_argument("--api-key", dest="api_key", action="append", help="required bearer key (repeatable)")
    s.add_argument("--max-running", dest="max_running", type=int, help="turns decoding together per step")
    s.add_argument(
        "--max-batch-tokens",
        dest="max_batch_tokens",
        type=int,
        help="prefill rows per step (0: --prefill-chunk)",
    )

    g = sub.add_parser("generate", help="one completion of one chat prompt")
    _engine_flags(g)
    g.add_argument("--prompt", required=True)
    g.add_argument("--system")
    g.add_argument("--max-tokens", dest="max_tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", dest="top_p", type=float, default=1.0)
    g.add_argument("--top-k", dest="top_k", type=int, default=0)
    g.add_argument("--seed", type=int)
    g.add_argument("--json", action="store_true", help="print one JSON object")

    c = sub.add_parser("chat", help="terminal chat keeping one conversation (/undo, /reset, /stats)")
    _engine_flags(c)
    c.add_argument("--system")
    c.add_argument("--max-tokens", dest="max_tokens", type=int, default=256)
    c.add_argument("--temperature", type=float, default=0.0)
    c.add_argument("--seed", type=int)

    k = sub.add_parser("selfcheck", help="run the fused-attention probe and print the verdict")
    k.add_argument("--device", default="auto")
    k.add_argument("--json", action="store_true")
    return ap


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """Defaults, then TURNKV_* env twins, then flags given on the command line."""
    values = asdict(EngineConfig())
    values.update(EngineConfig.env_defaults())
    for f in fields(EngineConfig):
        given = getattr(args, f.name, None)
        if given is not None:
            values[f.name] = given
    cfg = EngineConfig(**values)
    if cfg.bank_bytes != "auto":
        parse_size(cfg.bank_bytes)  # fail early on a malformed size
    return cfg


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(message)s"
    )
    try:
        return _dispatch(args)
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # expected failures become one line and exit code 2
        from turnkv.models.load import ModelLoadError

        if isinstance(e, (ModelLoadError, ValueError)):
            print(f"turnkv: error: {e}", file=sys.stderr)
            return EXIT_USAGE
        raise


def _dispatch(args: argparse.Namespace) -> int:
    if args.command == "selfcheck":
        from turnkv.attention.selfcheck import cli_main

        return cli_main(args.device, args.json)
    cfg = engine_config(args)
    if args.command == "serve":
        from turnkv.server.app import serve

        serve(cfg)
        return 0
    from turnkv.engine.engine import Engine

    engine = Engine.from_config(cfg, progress=not getattr(args, "json", False))
    if args.command == "generate":
        return _generate(engine, args)
    from turnkv.chat import run_chat

    return run_chat(engine, args)


def _generate(engine, args: argparse.Namespace) -> int:
    from turnkv.engine.sampling import SamplingParams
    from turnkv.engine.scheduler import run_turn
    from turnkv.engine.turn import Failed, GenEvent, TurnRequest

    messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
        {"role": "user", "content": args.prompt}
    ]
    params = SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
    )
    ids = engine.tokenizer.apply_chat_template(messages)
    request = TurnRequest(ids, params, max_tokens=args.max_tokens)
    pieces, stats = [], None
    for ev in run_turn(engine, engine.new_bank(), request):
        if isinstance(ev, Failed):
            raise ValueError(ev.message)
        if isinstance(ev, GenEvent):
            pieces.append(ev.text)
            if not args.json and ev.text:
                print(ev.text, end="", flush=True)
            stats = ev.stats or stats
    text = "".join(pieces)
    if args.json:
        out = {
            "text": text,
            "prompt_tokens": stats.prompt_tokens,
            "completion_tokens": stats.completion_tokens,
            "stats": asdict(stats),
        }
        print(json.dumps(out))
    else:
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
