"""``turnkv serve | chat | generate | selfcheck | cache``.

Every flag of the engine and the server has a ``TURNKV_*`` environment twin (``--kv-layout`` <->
``TURNKV_KV_LAYOUT``); a flag on the command line wins. Every flag and variable is validated
(``EngineConfig.__post_init__``, ``SamplingParams``) before the model loads. Expected failures (a bad
flag or variable, a port in use, a missing model, an unsupported architecture, a prompt longer than
the context) print one line naming the problem -- and the flag or variable -- and exit with code 2.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import sys
from dataclasses import asdict, fields
from typing import Literal, NoReturn, get_args, get_origin, get_type_hints

from turnkv.config import ConfigError, EngineConfig, env_name
from turnkv.models.generation import BUILTIN

EXIT_USAGE = 2
DEFAULTS = EngineConfig()
# ``turnkv --help``'s description: plain text (the module docstring's first line is RST)
DESCRIPTION = "turnkv: an OpenAI-compatible LLM server and CLI (serve | chat | generate | selfcheck | cache)"
# a flag of a Literal field offers exactly its values (config.py owns them)
_CHOICES = {n: list(get_args(t)) for n, t in get_type_hints(EngineConfig).items() if get_origin(t) is Literal}


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line ``turnkv: error: ...`` and exit code 2, pointing at
    the help of the subcommand it concerns (``commands``: name -> its parser, on the top parser)."""

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self.commands: dict[str, argparse.ArgumentParser] = {}

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"turnkv: error: {message} (see {self.prog} --help)\n")

    def parse_args(self, args=None, namespace=None):  # type: ignore[override]
        ns, extras = self.parse_known_args(args, namespace)
        if extras:  # argparse reports them from the top parser: name the subcommand's help
            self.commands.get(getattr(ns, "command", None), self).error(
                f"unrecognized arguments: {' '.join(extras)}"
            )
        return ns


def _flag_help(name: str, text: str) -> str:
    return f"{text} (default: {getattr(DEFAULTS, name)!s}; env {env_name(name)})"


def _config_flag(p: argparse.ArgumentParser, flag: str, name: str, text: str, **kw) -> None:
    """A flag of ``EngineConfig`` field ``name``: its default and env twin in the help, and the
    field's values as the choices of a Literal field."""
    if name in _CHOICES:
        kw["choices"] = _CHOICES[name]
    p.add_argument(flag, dest=name, help=_flag_help(name, text), **kw)


def _engine_flags(p: argparse.ArgumentParser) -> None:
    add = functools.partial(_config_flag, p)
    add("--model", "model", "HF folder, .gguf file, 'default' (SmolLM2-135M-Instruct) or random:SHAPE")
    add(
        "--chat-template",
        "chat_template",
        "a Jinja chat template file, or chatml-tools (ChatML with <tool_call> tools, for a ChatML model "
        "whose own template renders no tools, such as the default model); default: the model's own",
    )
    add("--device", "device", "auto | cpu | cuda | any torch device")
    add("--dtype", "dtype", "compute dtype of weights and activations")
    add("--kv-dtype", "kv_dtype", "KV rows' dtype (auto: --dtype's, bfloat16 on a CPU computing in float32)")
    add("--kv-layout", "kv_layout", "KV layout (contiguous: the A/B baseline)")
    add("--attention", "attention", "attention route")
    add("--max-context", "max_context", "context length in tokens; 0 = the model's own", type=int)
    add("--prefill-chunk", "prefill_chunk", "rows per prefill window", type=int)
    add("--cuda-graphs", "cuda_graphs", "captured steps on CUDA (decode and prompt rows alike)")
    add("--warmup", "warmup", "compile kernels and capture graphs before /health says ok (serve)")
    add(
        "--run-ahead",
        "run_ahead",
        "launch each step before the last one's tokens are taken (auto: where decode replays CUDA graphs)",
    )
    add(
        "--speculate",
        "speculate",
        "context-copy speculative decoding (auto: on, except under --tensor-parallel)",
    )
    add(
        "--deterministic",
        "deterministic",
        "on: a row's bits do not depend on the other rows of its step (CUDA: the row-invariant GEMM)",
    )
    add("--weights", "weights", "GGUF Q4_0/Q4_1/Q8_0 on CPU: auto = packed where the load-time check passes")
    add(
        "--threads",
        "threads",
        "torch CPU threads; 0 = chosen by timing decode steps on all, half or one of the cores available",
        type=int,
    )
    add(
        "--tensor-parallel",
        "tensor_parallel",
        "processes (one GPU each) that the model's heads are split over (docs/PARALLEL.md)",
        type=int,
    )


def _sampling_flags(p: argparse.ArgumentParser, serve: bool) -> None:
    """``--temperature``, ``--top-p``, ``--top-k``, ``--max-tokens``: EngineConfig fields, the first
    level of ``models.generation.resolve`` (serve: for requests that set none)."""
    texts = {
        "temperature": "sampling temperature; 0 is greedy",
        "top_p": "keep the most likely tokens up to this probability mass",
        "top_k": "keep the k most likely tokens; 0 = off",
        "max_tokens": "answer tokens at most, capped by the context the prompt leaves",
    }
    for name, text in texts.items():
        text = f"{text}, for requests that set none" if serve else text
        default = f"the model's recommended value, else {getattr(BUILTIN, name)}"
        p.add_argument(
            "--" + name.replace("_", "-"),
            dest=name,
            type=int if name in ("top_k", "max_tokens") else float,
            help=f"{text} (default: {default}; env {env_name(name)})",
        )
    if not serve:
        p.add_argument("--seed", type=int, help="seed of the sampler (default: random)")


def build_parser() -> argparse.ArgumentParser:
    ap = _Parser(prog="turnkv", description=DESCRIPTION)
    ap.add_argument("--version", action="version", version=f"turnkv {version()}")
    ap.add_argument("-v", "--verbose", action="store_true", help="log at INFO")
    sub = ap.add_subparsers(dest="command", required=True, parser_class=_Parser)

    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    _engine_flags(s)
    _sampling_flags(s, serve=True)

    add = functools.partial(_config_flag, s)

    add("--host", "host", "address to listen on")
    add("--port", "port", "TCP port; 0 = any free port", type=int)
    add("--bank-bytes", "bank_bytes", "KV budget of the session bank: N, 512M, 8G or auto")
    add("--api-key", "api_key", "required bearer key (repeatable; env: comma-separated)", action="append")
    add(
        "--allowed-hosts",
        "allowed_hosts",
        "Host header values accepted besides localhost/127.x/[::1] (comma-separated or repeatable; "
        "* = any); none: loopback names only while bound to a loopback address, any host otherwise",
        action="append",
    )
    add("--header-timeout", "header_timeout", "seconds to send the request headers (408 past it)", type=float)
    add("--body-timeout", "body_timeout", "seconds to send the request body (408 past it)", type=float)
    add("--session-ttl", "session_ttl", "seconds an X-Session-Id protects its newest entry", type=float)
    add("--session-share", "session_share", "share of the bank budget protected entries may hold", type=float)
    add("--max-body-bytes", "max_body_bytes", "request body limit (413 past it): N, 1M or auto")
    add("--shutdown-timeout", "shutdown_timeout", "seconds SIGTERM waits for running turns", type=float)
    s.add_argument(
        "--access-log",
        dest="access_log",
        action=argparse.BooleanOptionalAction,
        default=None,
        help=_flag_help("access_log", "one line per request on stderr"),
    )
    s.add_argument(
        "--strip-billing-header",
        dest="strip_billing_header",
        action=argparse.BooleanOptionalAction,
        default=None,
        help=_flag_help(
            "strip_billing_header",
            "/v1/messages: leave Claude Code's per-request x-anthropic-billing-header system line "
            "out of the prompt, so it does not break the cached prefix",
        ),
    )
    add("--max-running", "max_running", "turns decoding together per step", type=int)
    add(
        "--replicas",
        "replicas",
        "servers behind one endpoint on a local Ray Serve instance, with conversation affinity",
        type=int,
    )
    add(
        "--max-batch-tokens",
        "max_batch_tokens",
        "rows per step: auto (measured at start-up, prompt rows adapt to --itl-target-ms) or N (fixed)",
    )
    add(
        "--itl-target-ms",
        "itl_target_ms",
        "the step time a step with decode rows may reach (auto: twice its decode rows alone)",
    )
    add(
        "--queue-timeout",
        "queue_timeout",
        "seconds a turn may wait for admission before a 503 with Retry-After (0: no limit)",
        type=float,
    )
    _disk_flags(s)
    add("--disk-bytes", "disk_bytes", "byte budget of the KV disk tier: N, 512M, 8G")
    add(
        "--disk-store",
        "disk_store",
        "a block store replicas share instead of --disk-dir: dir:PATH or redis://host:port/db",
    )
    add("--ram-bytes", "ram_bytes", "byte budget of the host-RAM KV tier: N, 64G, 0 (off) or auto")
    for name, text in (("no_disk", "the KV disk tier"), ("no_ram", "the host-RAM KV tier")):
        s.add_argument(
            "--" + name.replace("_", "-"),
            dest=name,
            action="store_true",
            default=None,
            help=_flag_help(name, f"serve without {text}"),
        )

    g = sub.add_parser("generate", help="one completion of one chat prompt")
    _engine_flags(g)
    g.add_argument("--prompt", required=True, help="the user message (rendered by the model's chat template)")
    g.add_argument("--system", help="a system message before it (default: none)")
    _sampling_flags(g, serve=False)
    g.add_argument("--json", action="store_true", help="print one JSON object")

    c = sub.add_parser("chat", help="terminal chat keeping one conversation (/undo, /reset, /stats)")
    _engine_flags(c)
    c.add_argument("--system", help="the system message of the conversation (default: none)")
    _sampling_flags(c, serve=False)

    k = sub.add_parser("selfcheck", help="run the fused-attention probe and print the verdict")
    k.add_argument("--device", default="auto", help="auto | cpu | cuda | any torch device (default: auto)")
    k.add_argument("--json", action="store_true")

    d = sub.add_parser(
        "cache", help="the KV disk tier: stats, verify every block, clear it, or repair its index"
    )
    d.add_argument("action", choices=["stats", "verify", "clear", "repair"])
    _disk_flags(d)
    d.add_argument("--json", action="store_true")
    ap.commands = dict(sub.choices)
    return ap


def _disk_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--disk-dir",
        dest="disk_dir",
        help=_flag_help("disk_dir", "KV disk tier directory ('': $XDG_CACHE_HOME/turnkv/kv)"),
    )


def version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("turnkv")
    except PackageNotFoundError:
        return "unknown"


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """Defaults, then TURNKV_* env twins, then flags given on the command line; validated, with an
    error naming the flag or the variable a bad value came from."""
    values = asdict(DEFAULTS)
    env = EngineConfig.env_defaults()
    values.update(env)
    given = set()
    for f in fields(EngineConfig):
        value = getattr(args, f.name, None)
        if value is not None:
            values[f.name] = value
            given.add(f.name)
    try:
        return EngineConfig(**values)
    except ConfigError as e:
        if e.field in given:
            source = "--" + e.field.replace("_", "-")
        elif e.field in env:
            source = env_name(e.field)
        else:
            source = e.field
        raise ConfigError(source, e.problem) from None


def sampling_params(args: argparse.Namespace, defaults):
    """The sampler's parameters of ``generate``/``chat``: ``defaults`` (the engine's: the flags,
    else the model's, else built-in; validated with the config) and ``--seed``, which names
    itself when bad (``defaults=None``: only check the seed, before the model loads)."""
    from turnkv.engine.sampling import SamplingError, SamplingParams

    values = {}
    if defaults is not None:
        values = {"temperature": defaults.temperature, "top_p": defaults.top_p, "top_k": defaults.top_k}
    try:
        return SamplingParams(**values, seed=args.seed)
    except SamplingError as e:
        raise ConfigError("--" + e.field.replace("_", "-"), e.problem) from None


def main(argv: list[str] | None = None) -> int:
    from turnkv.threads import prepare_env

    prepare_env()  # OpenMP reads its settings once, when torch loads: before any torch import
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
        return _selfcheck(args)
    cfg = engine_config(args)
    if args.command == "cache":
        from turnkv.cache_cli import cache_main

        return cache_main(args.action, cfg.disk_dir, args.json)
    if args.command == "serve" and cfg.replicas > 1:
        if cfg.tensor_parallel > 1:
            raise ValueError("--replicas with --tensor-parallel is not supported yet; use turnkv.serve_ray")
        from turnkv.serve_ray import serve_replicas

        serve_replicas(cfg, cfg.replicas)
        return 0
    from turnkv.threads import set_threads

    set_threads(cfg.threads)
    if cfg.tensor_parallel > 1:  # this process becomes rank 0 of a group it starts
        from turnkv.parallel.launch import run_command

        return run_command(cfg, lambda c: _run(args, c))
    return _run(args, cfg)


def _run(args: argparse.Namespace, cfg: EngineConfig) -> int:
    """``serve``, ``generate`` or ``chat`` (on rank 0 of a tensor-parallel group: the same)."""
    if args.command == "serve":
        from turnkv.server.run import serve

        serve(cfg)
        return 0
    sampling_params(args, None)  # the seed, before the model loads (the rest is in cfg)
    from turnkv.runtime import build

    rt = build(cfg, args.command, progress=not getattr(args, "json", False))
    params = sampling_params(args, rt.engine.sampling_defaults.values)
    if args.command == "generate":
        return _generate(rt, args, params)
    from turnkv.chat import run_chat

    return run_chat(rt, args, params)


def _selfcheck(args: argparse.Namespace) -> int:
    try:
        EngineConfig(device=args.device)
    except ConfigError as e:
        raise ConfigError("--device", e.problem) from None
    from turnkv.attention.selfcheck import cli_main

    return cli_main(args.device, args.json)


def _generate(rt, args: argparse.Namespace, params) -> int:
    from turnkv.engine.turn import Failed, GenEvent, TurnRequest

    engine = rt.engine
    messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
        {"role": "user", "content": args.prompt}
    ]
    ids = engine.tokenizer.apply_chat_template(messages)
    request = TurnRequest(ids, params)  # max_tokens: the engine's default (--max-tokens, ...)
    pieces, stats = [], None
    for ev in rt.run_turn(request):
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
