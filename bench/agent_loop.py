"""A scripted tool-calling agent loop through the three APIs agents speak: how much each turn reuses.

A coding agent's session is a loop: the model calls a tool, the client appends the call and the
tool's output (here a fake tool answering about ``--tool-tokens`` tokens each turn) and asks
again. Every turn's prompt is the previous turn's prompt plus the answer plus the tool output, so a
server that keeps the conversation's KV should prefill only the new rows. This script drives
``--turns`` such turns through each API and reports, per turn, prompt tokens, cached tokens
(``cached_tokens`` / ``cache_read_input_tokens``), the rows the turn prefilled and TTFT (first
streamed token of text or tool arguments), and per API the cached fraction from turn 2 on:

- ``chat``: ``/v1/chat/completions`` with the whole history resent (the ``openai`` SDK);
- ``responses``: ``/v1/responses`` chained with ``previous_response_id`` (only the tool output is
  sent; the server holds the rest);
- ``messages``: ``/v1/messages`` with ``tool_use`` / ``tool_result`` blocks resent (the
  ``anthropic`` SDK).

The tool choice is forced to one ``read_file`` call a turn (by name, whatever other tools the
prefix defines; parallel calls off: the loop answers one call, and a client that sends back fewer
calls than the model wrote changes the history after the first one), so every turn is a tool call
whatever the weights; answers are greedy. ``read_file`` by name rather than any tool: the default
model, free to choose, picks ``todo_write`` and lists todos until ``--max-tokens`` cuts the call,
and a cut call's arguments are not JSON (the ``anthropic`` SDK sends back its own partial parse of
them, which differs from the text generated). Each API's system prompt names the API, so no loop
reuses another's rows (their conversations differ from the first tokens on).

Every request opens with the same agent prefix (``bench/agent_prefix.py``): a system prompt and
tool definitions (read_file, edit_file, bash, grep, ...) of about ``--prefix-tokens`` tokens, sent
through each API's own tools field, as a real agent's thousands of fixed tokens; ``--prefix-tokens
0`` is the short mode (one sentence, read_file alone). Token counts are the served model's (its
``/tokenize``), so ``--tool-tokens`` means the same on any tokenizer.

    python bench/agent_loop.py             # default model (--chat-template chatml-tools), CPU, in process:
                                           # a 3,000-token prefix, 150-token tool outputs (20 turns fit 8,192)
    python bench/agent_loop.py --url http://127.0.0.1:8000      # a running turnkv serve
    python bench/agent_loop.py --model random:llama3-8b --device cuda --bank-bytes 40G \
        --prefix-tokens 10000 --tool-tokens 500         # random weights (byte tokenizer), an H200

Prints a table, writes ``bench/out/agent_loop.json`` and ``bench/out/agent_loop.png``.
"""

from __future__ import annotations

from turnkv.threads import prepare_env

prepare_env()

import argparse
import random
import socket
import statistics
import threading
import time

from agent_prefix import agent_prefix
from report import save

TASK = "Find where the session bank evicts entries and summarise the policy."
WORDS = (
    "def return self bank entry evict budget bytes lease snapshot segment prefix tokens namespace "
    "admit refuse order least recently used session protect insert lookup tree radix block"
).split()


def tool_output(turn: int, words: int) -> str:
    """Deterministic fake file text of about ``words`` words (``calibrate`` finds how many make
    ``--tool-tokens`` tokens of the served tokenizer)."""
    rng = random.Random(turn)
    lines = []
    while sum(len(line.split()) for line in lines) < words:
        lines.append("    " + " ".join(rng.choice(WORDS) for _ in range(10)))
    return f"# file {turn}\n" + "\n".join(lines)


def serve_in_process(model: str, template: str, device: str, bank_bytes: str) -> tuple[str, object]:
    """A server of ``model`` under uvicorn in a thread on a free port."""
    import uvicorn

    from turnkv.config import EngineConfig
    from turnkv.runtime import build
    from turnkv.server.app import create_app
    from turnkv.server.run import uvicorn_config

    cfg = EngineConfig(
        model=model, chat_template=template, device=device, bank_bytes=bank_bytes, no_disk=True
    )
    app = create_app(build(cfg, "serve"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn_config(app, cfg, host="127.0.0.1", port=port))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    return f"http://127.0.0.1:{port}", server


def run_until_full(loop, url: str, model: str, args: argparse.Namespace, rows: list[dict]) -> str | None:
    """Runs one API's loop; a turn whose prompt no longer fits the context (a 400 naming the
    context length) ends it early: the reason is returned and reported, the turns done are kept."""
    try:
        loop(url, model, args, rows)
    except Exception as e:  # the SDKs' BadRequestError; anything else is a real failure
        if "context length" not in str(e):
            raise
        return f"context full at turn {len(rows) + 1}"
    return None


def chat_loop(url: str, model: str, args: argparse.Namespace, rows: list[dict]) -> None:
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="bench", max_retries=0)
    messages: list[dict] = [
        {"role": "system", "content": args.prefix.system.format(api="chat")},
        {"role": "user", "content": TASK},
    ]
    for turn in range(args.turns):
        t0, ttft, usage, calls = time.perf_counter(), None, None, {}
        stream = client.chat.completions.create(
            model=model,
            messages=messages,
            tools=[{"type": "function", "function": t} for t in args.prefix.tools],
            tool_choice={"type": "function", "function": {"name": "read_file"}},
            parallel_tool_calls=False,
            max_tokens=args.max_tokens,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        for chunk in stream:
            for choice in chunk.choices:
                for tc in choice.delta.tool_calls or []:
                    ttft = ttft or time.perf_counter() - t0
                    c = calls.setdefault(tc.index, {"id": tc.id, "name": "", "arguments": ""})
                    c["name"] += tc.function.name or ""
                    c["arguments"] += tc.function.arguments or ""
            if chunk.usage is not None:
                usage = chunk.usage
        call = calls[0]
        messages.append(
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": call["id"],
                        "type": "function",
                        "function": {"name": call["name"], "arguments": call["arguments"]},
                    }
                ],
            }
        )
        messages.append(
            {"role": "tool", "tool_call_id": call["id"], "content": tool_output(turn, args.words)}
        )
        _add(
            rows,
            _row(
                turn,
                usage.prompt_tokens,
                usage.prompt_tokens_details.cached_tokens,
                usage.completion_tokens,
                ttft,
                call["name"],
            ),
        )


def responses_loop(url: str, model: str, args: argparse.Namespace, rows: list[dict]) -> None:
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="bench", max_retries=0)
    tools = [{"type": "function", **t} for t in args.prefix.tools]
    prev, next_input = None, TASK
    for turn in range(args.turns):
        t0, ttft, final = time.perf_counter(), None, None
        with client.responses.stream(
            model=model,
            input=next_input,
            instructions=args.prefix.system.format(api="responses"),
            tools=tools,
            tool_choice={"type": "function", "name": "read_file"},
            parallel_tool_calls=False,
            max_output_tokens=args.max_tokens,
            temperature=0,
            previous_response_id=prev,
        ) as stream:
            for event in stream:
                if event.type in ("response.function_call_arguments.delta", "response.output_text.delta"):
                    ttft = ttft or time.perf_counter() - t0
                elif event.type in ("response.completed", "response.incomplete"):
                    final = event.response  # incomplete: max_output_tokens reached
        call = next(item for item in final.output if item.type == "function_call")
        prev = final.id
        next_input = [
            {
                "type": "function_call_output",
                "call_id": call.call_id,
                "output": tool_output(turn, args.words),
            }
        ]
        usage = final.usage
        _add(
            rows,
            _row(
                turn,
                usage.input_tokens,
                usage.input_tokens_details.cached_tokens,
                usage.output_tokens,
                ttft,
                call.name,
            ),
        )


def messages_loop(url: str, model: str, args: argparse.Namespace, rows: list[dict]) -> None:
    import anthropic

    client = anthropic.Anthropic(base_url=url, api_key="bench", max_retries=0)
    tools = [
        {"name": t["name"], "description": t["description"], "input_schema": t["parameters"]}
        for t in args.prefix.tools
    ]
    messages: list[dict] = [{"role": "user", "content": TASK}]
    for turn in range(args.turns):
        t0, ttft = time.perf_counter(), None
        with client.messages.stream(
            model=model,
            system=args.prefix.system.format(api="messages"),
            messages=messages,
            tools=tools,
            tool_choice={"type": "tool", "name": "read_file", "disable_parallel_tool_use": True},
            max_tokens=args.max_tokens,
            extra_body={"temperature": 0},  # the anthropic 2.x SDK has no sampling arguments
            metadata={"user_id": "agent-messages"},
        ) as stream:
            for event in stream:
                if event.type == "content_block_delta":
                    ttft = ttft or time.perf_counter() - t0
            final = stream.get_final_message()
        use = next(block for block in final.content if block.type == "tool_use")
        messages.append(
            {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in final.content]}
        )
        messages.append(
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": use.id,
                        "content": tool_output(turn, args.words),
                    }
                ],
            }
        )
        u = final.usage
        prompt = u.input_tokens + (u.cache_read_input_tokens or 0)  # Anthropic counts them apart
        _add(rows, _row(turn, prompt, u.cache_read_input_tokens or 0, u.output_tokens, ttft, use.name))


def _add(rows: list[dict], row: dict) -> None:
    """Keeps a turn's row and prints it (a long run shows its progress; the JSON comes at the end)."""
    rows.append(row)
    print(
        f"  turn {row['turn']:>2}: prompt {row['prompt_tokens']:>6} cached {row['cached_tokens']:>6} "
        f"prefilled {row['prefilled']:>5} TTFT {row['ttft_s'] * 1e3:>6.0f}ms {row['tool']}",
        flush=True,
    )


def _row(turn: int, prompt: int, cached: int, completion: int, ttft: float | None, tool: str) -> dict:
    return {
        "turn": turn + 1,
        "tool": tool,
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "completion_tokens": completion,
        "prefilled": prompt - cached,
        "ttft_s": ttft if ttft is not None else float("nan"),
    }


def summary(rows: list[dict]) -> dict:
    """Per API: of the prompt tokens from turn 2 on, the share served from the cache; and of the
    history each turn resends (the previous turn's prompt and answer, which the server has seen),
    the share it reused -- the tool output each turn adds is new, so only this one can reach 100 %."""
    later = rows[1:]
    prompt = sum(r["prompt_tokens"] for r in later)
    history = sum(p["prompt_tokens"] + p["completion_tokens"] for p in rows[:-1])
    reused = sum(
        min(r["cached_tokens"], p["prompt_tokens"] + p["completion_tokens"])
        for p, r in zip(rows[:-1], later, strict=True)
    )
    return {
        "cached_fraction_from_turn_2": sum(r["cached_tokens"] for r in later) / prompt if prompt else 0.0,
        "history_reused_from_turn_2": reused / history if history else 0.0,
        "prefilled_total": sum(r["prefilled"] for r in rows),
        "prefilled_per_turn_from_2": statistics.mean(r["prefilled"] for r in later) if later else 0.0,
        "prompt_total": sum(r["prompt_tokens"] for r in rows),
        "ttft_p50_s": statistics.median(r["ttft_s"] for r in later) if later else float("nan"),
        "last_prompt_tokens": rows[-1]["prompt_tokens"],
    }


def plot(results: dict, plt, path) -> None:
    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    for api, run in results["apis"].items():
        turns = [r["turn"] for r in run["turns"]]
        ax[0].plot(turns, [r["prefilled"] for r in run["turns"]], marker="o", label=api)
        ax[1].plot(turns, [r["ttft_s"] * 1e3 for r in run["turns"]], marker="o", label=api)
    ax[0].set(xlabel="turn", ylabel="prompt rows prefilled", title="rows each turn computed")
    ax[1].set(xlabel="turn", ylabel="TTFT (ms)", title="time to first token")
    for a in ax:
        a.legend()
    fig.tight_layout()
    fig.savefig(path)


KEY = {"Authorization": "Bearer bench"}


def _served_model(url: str) -> str:
    import httpx

    return httpx.get(url + "/v1/models", headers=KEY).json()["data"][0]["id"]


def _tokens(url: str, body: dict) -> int:
    """The served tokenizer's count of ``body`` (``/tokenize``, as the generation routes prefill)."""
    import httpx

    answer = httpx.post(url + "/tokenize", json=body, headers=KEY, timeout=60)
    answer.raise_for_status()
    return answer.json()["count"]


def prefix_counter(url: str):
    """``agent_prefix``'s count: the first request's prompt tokens for a system text and tools."""

    def count(system: str, tools: list[dict]) -> int:
        messages = [
            {"role": "system", "content": system.format(api="chat")},
            {"role": "user", "content": TASK},
        ]
        return _tokens(
            url, {"messages": messages, "tools": [{"type": "function", "function": t} for t in tools]}
        )

    return count


def words_for(url: str, tokens: int) -> int:
    """How many words of ``tool_output`` make about ``tokens`` tokens of the served tokenizer
    (the default model's BPE: ~1.2 a word; the random models' byte tokenizer: ~6)."""
    sample = tool_output(0, 1000)
    per_word = _tokens(url, {"prompt": sample, "add_special_tokens": False}) / len(sample.split())
    return max(1, round(tokens / per_word))


LOOPS = {"chat": chat_loop, "responses": responses_loop, "messages": messages_loop}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", help="a running turnkv serve (default: serve the default model in process)")
    ap.add_argument(
        "--model", default="default", help="the model to serve in process; with --url, the served name"
    )
    ap.add_argument(
        "--chat-template",
        default="chatml-tools",
        help="served in process: the template (the default model's own renders no tools)",
    )
    ap.add_argument("--device", default="cpu", help="served in process: the device")
    ap.add_argument("--bank-bytes", default="2G", help="served in process: the session bank's budget")
    ap.add_argument("--apis", default="chat,responses,messages")
    ap.add_argument("--turns", type=int, default=20)
    ap.add_argument(
        "--prefix-tokens",
        type=int,
        default=3000,
        help="the fixed agent prefix (system prompt and tool definitions) in tokens; 0: one sentence "
        "and read_file alone",
    )
    ap.add_argument("--tool-tokens", type=int, default=150, help="each fake tool output, in tokens")
    ap.add_argument("--max-tokens", type=int, default=96)
    args = ap.parse_args()
    setup = dict(vars(args))
    url, server = (
        (args.url, None)
        if args.url
        else serve_in_process(args.model, args.chat_template, args.device, args.bank_bytes)
    )
    model = _served_model(url)
    try:
        args.prefix = agent_prefix(args.prefix_tokens, prefix_counter(url))
        args.words = words_for(url, args.tool_tokens)
        results = {
            "args": setup,
            "prefix": {"tokens": args.prefix.tokens, "tools": [t["name"] for t in args.prefix.tools]},
            "tool_output_words": args.words,
            "apis": {},
        }
        print(
            f"prefix: {args.prefix.tokens} tokens, {len(args.prefix.tools)} tools; tool output: "
            f"{args.words} words (~{args.tool_tokens} tokens)",
            flush=True,
        )
        for api in args.apis.split(","):
            print(api, flush=True)
            rows: list[dict] = []
            stopped = run_until_full(LOOPS[api], url, model, args, rows)
            results["apis"][api] = {"turns": rows, "stopped": stopped, **summary(rows)}
    finally:
        if server is not None:
            server.should_exit = True
    print(
        f"{'api':<10} {'turns':>5} {'last prompt':>11} {'cached from turn 2':>18} "
        f"{'history reused':>14} {'prefilled':>9} {'per turn':>8} {'TTFT p50':>9}"
    )
    for api, run in results["apis"].items():
        print(
            f"{api:<10} {len(run['turns']):>5} {run['last_prompt_tokens']:>11} "
            f"{run['cached_fraction_from_turn_2']:>17.1%} {run['history_reused_from_turn_2']:>13.1%} {run['prefilled_total']:>9} {run['prefilled_per_turn_from_2']:>8.0f} "
            f"{run['ttft_p50_s'] * 1e3:>7.0f}ms" + (f"  ({run['stopped']})" if run["stopped"] else "")
        )
    save(results, "agent_loop", plot)


if __name__ == "__main__":
    main()
