"""CPU speed of the default model: turnkv against llama.cpp on the same GGUF, prompt and threads.

For each engine (turnkv with ``--weights packed`` and ``dequant``, llama.cpp through
llama-cpp-python), each thread count and with/without a busy neighbour (a process spinning on one
core), one fresh process measures: resident memory added by loading the model, the greedy answer to
the default prompt, decode tokens/s after that short prompt and after a ~2K-token context, and
prefill tokens/s of that context, and the CPU time (all threads) per decoded token, which other
processes on the machine disturb less than wall time. Both engines get the same token ids.
Resident memory: turnkv's is the weights (the KV cache comes later, per conversation);
llama.cpp's includes the KV cache and compute buffers it allocates for ``n_ctx`` at load.

    python bench/cpu.py                       # threads 1,2; neighbour off,on
    python bench/cpu.py --threads 2 --neighbour off --engines turnkv-packed,llama.cpp
    python bench/cpu.py --engines turnkv-packed,turnkv-packed@float32,llama.cpp   # KV dtype A/B

``turnkv-WEIGHTS@KV`` sets ``--kv-dtype`` (default ``auto``: bfloat16 on a CPU); a ``+torch`` suffix
(``turnkv-packed+torch``) turns turnkv's C kernels off (``TURNKV_CPU_KERNEL=off``: decode attention
as torch ops, packed matmuls through torch's int4 kernel), to A/B them in one run. A ``:ISA`` suffix
picks the C kernels' variant (``TURNKV_CPU_ISA``: ``turnkv-packed:avx2`` runs the AVX2 build on an
AVX-512 CPU) and, on ``llama.cpp:avx2``, the llama.cpp built without AVX-512
(``--build-llama-cpp avx2``, its own venv beside the default one):

    python bench/cpu.py --threads 1,2 --neighbour off --engines turnkv-packed:avx2,llama.cpp:avx2,turnkv-packed,llama.cpp

Every row names the kernels it ran (turnkv's variant, llama.cpp's instruction sets) and the table
this CPU's model and vector extensions.

llama.cpp runs from its own virtual environment (never a project dependency), by default
``~/.cache/turnkv-bench/llamacpp-venv``; build it once with ``--build-llama-cpp avx512`` (the sdist,
AVX-512 on and AMX off: on this VM's CPU llama.cpp's AMX int8 path crashes).
``--build-llama-cpp avx2`` builds
it without AVX-512 (and without its tools, tests and llava: ~5 min on 2 cores). Without it the
llama.cpp rows are skipped with a message. Prints a table, writes
``bench/out/cpu.json`` and ``.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LLAMA_VENV = Path.home() / ".cache" / "turnkv-bench" / "llamacpp-venv"
LLAMA_CPP = "llama-cpp-python==0.3.36"
_LLAMA_LEAN = (  # the library alone: no tools, tests, examples or llava (~5 min on 2 cores)
    " -DGGML_NATIVE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_BF16=OFF -DLLAVA_BUILD=OFF"
    " -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF"
)
LLAMA_CMAKE = {  # AMX off: on the Zen 4 VM's CPU llama.cpp's AMX int8 path crashes
    "avx512": "-DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON "
    "-DGGML_AVX512_BF16=ON" + _LLAMA_LEAN,
    "avx2": "-DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX512=OFF "
    "-DGGML_AVX512_VNNI=OFF -DGGML_AVX512_BF16=OFF -DGGML_AVX_VNNI=OFF" + _LLAMA_LEAN,
}
PROMPT = "What is the capital of France? Answer in one sentence."
FILLER = (
    "The history of cartography is the story of how people have tried to describe the shape of the "
    "world, from clay tablets and portolan charts to satellite surveys and digital maps. "
)


# ---- children: one engine, one setting, one process ------------------------------------------
def _rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def _child_turnkv(opts: dict) -> dict:
    from turnkv.threads import prepare_env

    prepare_env()
    import torch

    from turnkv.config import EngineConfig
    from turnkv.engine.sampling import SamplingParams
    from turnkv.engine.turn import GenEvent, TurnRequest
    from turnkv.runtime import build, load_engine
    from turnkv.threads import set_threads

    set_threads(opts["threads"])
    torch.zeros(8, 8) @ torch.zeros(8, 8)  # torch's own start-up is not the model's memory
    before = _rss_mib()
    cfg = EngineConfig(  # a fixed thread count
        device="cpu", weights=opts["weights"], kv_dtype=opts["kv_dtype"], threads=opts["threads"]
    )
    eng = load_engine(cfg, progress=False)
    rss = _rss_mib() - before
    tok = eng.tokenizer
    answer_ids = tok.apply_chat_template([{"role": "user", "content": PROMPT}])
    runs = iter(range(1 << 30))

    def turn(ids: list[int], n: int, params: SamplingParams):
        """One turn through the scheduler, in a namespace of its own (nothing banked is reused)."""
        req = TurnRequest(list(ids), params, max_tokens=n, namespace=f"run{next(runs)}")
        return [e for e in rt.run_turn(req, bank) if isinstance(e, GenEvent)]

    rt = build(cfg, "bench", engine=eng)
    bank = rt.new_bank("1G")
    answer = "".join(e.text for e in turn(answer_ids, 24, SamplingParams()))

    def run(ids: list[int], n: int | None = None) -> tuple[float, float, float, float]:
        stats = None
        c0 = time.process_time()
        for ev in turn(ids, n or opts["gen"], SamplingParams(ignore_eos=True)):
            stats = ev.stats or stats
        return stats.prefill_s, stats.decode_tok_s, len(ids) / stats.prefill_s, time.process_time() - c0

    def decode_cpu_ms(ids: list[int]) -> float:
        """CPU time (all threads) per decoded token: a figure that busy neighbours disturb less."""
        one = run(ids, 1)[3]
        return (run(ids)[3] - one) / (opts["gen"] - 1) * 1e3

    run(answer_ids)  # warm-up: first calls pay for oneDNN/kernel set-up
    short = run(answer_ids)
    long_ids = _long_prompt(tok.encode, answer_ids, opts["context"])
    long = run(long_ids)
    row = _row(opts, rss, answer, short, long, len(long_ids), eng.loaded.weights)
    row["kv_dtype"] = eng.info.kv_dtype
    from turnkv import cbuild
    from turnkv.models import cpu_int4

    row["kernels"] = cbuild.variant() if cpu_int4.status() == "ok" else f"torch ({cpu_int4.status()})"
    row["decode_cpu_ms_per_token"] = decode_cpu_ms(answer_ids)
    return row


def _long_prompt(encode, prompt_ids: list[int], context: int) -> list[int]:
    filler = encode(FILLER)
    body = (filler * (context // len(filler) + 1))[: context - len(prompt_ids)]
    return body + prompt_ids


def _child_llama(opts: dict) -> dict:
    import numpy as np
    from llama_cpp import Llama

    from turnkv.threads import available_cores

    ids = opts["prompt_ids"]
    threads = opts["threads"] or available_cores()  # auto: every core, as turnkv's count
    before = _rss_mib()
    llm = Llama(
        opts["gguf"],
        n_ctx=opts["context"] + opts["gen"] + 64,
        n_threads=threads,
        n_threads_batch=threads,
        n_batch=512,
        verbose=False,
    )
    rss = _rss_mib() - before
    vocab = llm.n_vocab()

    def greedy(prompt: list[int], n: int, stop: bool = False) -> tuple[list[int], float, float]:
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(prompt)
        t1 = time.perf_counter()
        out = []
        for _ in range(n):
            # llama-cpp-python 0.3.36 keeps no scores without logits_all: read the last row
            last = np.ctypeslib.as_array(llm._ctx.get_logits_ith(-1), shape=(vocab,))
            nxt = int(np.argmax(last))
            if stop and nxt == llm.token_eos():
                break
            out.append(nxt)
            llm.eval([nxt])
        t2 = time.perf_counter()
        return out, t1 - t0, (len(out) - 1) / (t2 - t1) if len(out) > 1 else 0.0

    answer_toks, _, _ = greedy(ids, 24, stop=True)
    answer = llm.detokenize(answer_toks).decode("utf-8", "replace")
    greedy(ids, 4)  # warm-up
    c0 = time.process_time()
    _, pre_s, tps = greedy(ids, opts["gen"])
    short = (pre_s, tps, len(ids) / pre_s)
    c1 = time.process_time()
    greedy(ids, 1)
    one = time.process_time() - c1
    long_ids = opts["long_ids"]
    _, pre_s, tps = greedy(long_ids, opts["gen"])
    long = (pre_s, tps, len(long_ids) / pre_s)
    row = _row(opts, rss, answer, short, long, len(long_ids), "gguf")
    import llama_cpp

    info = llama_cpp.llama_print_system_info().decode()  # "CPU : SSE3 = 1 | AVX2 = 1 | ..."
    on = [f.split("=")[0].strip() for f in info.split("|") if f.strip().endswith("= 1")]
    row["kernels"] = " ".join(f.lower() for f in on if f.strip().startswith(("AVX", "AMX")))
    row["decode_cpu_ms_per_token"] = (c1 - c0 - one) / (opts["gen"] - 1) * 1e3
    return row


def _row(opts, rss, answer, short, long, long_len, weights) -> dict:
    return {
        "engine": opts["engine"],
        "threads": opts["threads"],
        "neighbour": opts["neighbour"],
        "weights": weights,
        "rss_mib": rss,
        "answer": answer.strip(),
        "decode_short_tok_s": short[1],
        "decode_long_tok_s": long[1],
        "long_context": long_len,
        "prefill_tok_s": long[2],
        "prefill_s": long[0],
    }


# ---- parent -----------------------------------------------------------------------------------
def _spawn(python: str, opts: dict, neighbour: bool) -> dict:
    hog = None
    if neighbour:  # keeps one core busy for the whole child
        # it spins until its parent is gone: a killed bench leaves no busy core behind
        spin = f"import os\nwhile os.getppid() == {os.getpid()}: pass"
        hog = subprocess.Popen([sys.executable, "-c", spin])
        time.sleep(0.5)
    try:
        env = dict(
            os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
        )
        if opts.get("cpu_kernel") == "torch":  # the CPU decode attention as torch ops (cpu_native)
            env["TURNKV_CPU_KERNEL"] = "off"
        if opts["engine"].startswith("turnkv"):
            env["TURNKV_CPU_ISA"] = opts["isa"]
        out = subprocess.run(
            [python, __file__, "--child", json.dumps(opts)], env=env, capture_output=True, text=True
        )
    finally:
        if hog is not None:
            hog.kill()
            hog.wait()
    if out.returncode != 0:
        raise RuntimeError(f"{opts['engine']} child failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def llama_venv(base: Path, isa: str) -> Path:
    """The venv of llama.cpp's ``isa`` build: ``base`` for avx512, ``base`` with ``-avx2`` else."""
    return base if isa == "avx512" else base.with_name(base.name.replace("-venv", f"-{isa}-venv"))


def build_llama_cpp(venv: Path, isa: str) -> None:
    """Make ``venv`` and build llama-cpp-python into it from the sdist (``LLAMA_CMAKE[isa]``; no AMX)."""
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "--no-binary", "llama-cpp-python"]
    env = dict(os.environ, CMAKE_ARGS=LLAMA_CMAKE[isa], CMAKE_BUILD_PARALLEL_LEVEL=str(os.cpu_count() or 1))
    subprocess.run([*pip, LLAMA_CPP, "numpy"], check=True, env=env)
    print(f"built llama.cpp ({isa}) into {venv} in {time.perf_counter() - t0:.0f} s")


def _llama_python(venv: Path) -> str | None:
    py = venv / "bin" / "python"
    if not py.exists():
        return None
    ok = subprocess.run([str(py), "-c", "import llama_cpp"], capture_output=True)
    return str(py) if ok.returncode == 0 else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--engines", default="turnkv-packed,turnkv-dequant,llama.cpp")
    ap.add_argument(
        "--threads",
        default="1,2,auto",
        help="counts, or auto: turnkv's --threads 0 (measured per step) against llama.cpp on every core",
    )
    ap.add_argument("--neighbour", default="off,on", help="off, on or off,on: a busy process on one core")
    ap.add_argument("--gen", type=int, default=64, help="tokens decoded per measurement")
    ap.add_argument("--context", type=int, default=2048, help="tokens of the long context")
    ap.add_argument("--llama-venv", type=Path, default=LLAMA_VENV)
    ap.add_argument(
        "--build-llama-cpp",
        choices=sorted(LLAMA_CMAKE),
        help="build llama-cpp-python for these instruction sets into --llama-venv (avx2: its -avx2 sibling)",
    )
    ap.add_argument("--tag", default="cpu")
    args = ap.parse_args()
    if args.child:
        opts = json.loads(args.child)
        row = _child_llama(opts) if opts["engine"].startswith("llama.cpp") else _child_turnkv(opts)
        print(json.dumps(row))
        return
    run_parent(args)


def run_parent(args: argparse.Namespace) -> None:
    from report import cpu_name, save

    from turnkv.models.load import default_model_path

    if args.build_llama_cpp:
        build_llama_cpp(llama_venv(args.llama_venv, args.build_llama_cpp), args.build_llama_cpp)
    gguf = default_model_path()
    engines, llama_py = [], {}
    for engine in args.engines.split(","):
        if engine.startswith("llama.cpp"):
            isa = engine.partition(":")[2] or "avx512"
            venv = llama_venv(args.llama_venv, isa)
            if (py := _llama_python(venv)) is None:
                print(f"{engine} skipped: no llama-cpp-python in {venv} (build it: --build-llama-cpp {isa})")
                continue
            llama_py[engine] = py
        engines.append(engine)
    ids, long_ids = _prompt_ids(args.context)
    load = os.getloadavg()
    print(
        f"# {gguf.name}, {len(ids)}-token prompt, {len(long_ids)}-token context, load average {load[0]:.2f}, "
        f"CPU {cpu_name()}"
    )
    rows = []
    for threads in [0 if t == "auto" else int(t) for t in args.threads.split(",")]:
        for neighbour in [n == "on" for n in args.neighbour.split(",")]:
            for engine in engines:
                engine_spec, _, isa = engine.partition(":")
                spec, _, kernel = engine_spec.partition("+")
                weights, _, kv = spec.removeprefix("turnkv-").partition("@")
                opts = {
                    "engine": engine,
                    "threads": threads,
                    "neighbour": neighbour,
                    "gen": args.gen,
                    "context": args.context,
                    "weights": weights,
                    "kv_dtype": kv or "auto",
                    "cpu_kernel": kernel or "auto",
                    "isa": isa or "native",
                    "gguf": str(gguf),
                    "prompt_ids": ids,
                    "long_ids": long_ids,
                }
                python = llama_py.get(engine, sys.executable)
                row = _spawn(python, opts, neighbour)
                rows.append(row)
                _print_row(row)
    results = {"gguf": gguf.name, "gguf_mib": gguf.stat().st_size / 2**20, "rows": rows, "cpu": cpu_name()}
    results["load_average_start"] = load
    results["load_average_end"] = os.getloadavg()
    _ratios(rows)
    print(markdown(rows, results["cpu"]))
    save(results, args.tag, _plot)


def _prompt_ids(context: int) -> tuple[list[int], list[int]]:
    from turnkv.models import gguf as gg
    from turnkv.models.load import default_model_path, file_fingerprint

    path = default_model_path()
    _, tok, _ = gg.cached_header(path, file_fingerprint(path))
    ids = tok.apply_chat_template([{"role": "user", "content": PROMPT}])
    return ids, _long_prompt(tok.encode, ids, context)


def _print_row(r: dict) -> None:
    print(
        f"{r['engine']:>15} [{r.get('kernels', '?')}] t={r['threads'] or 'auto'} nb={'on ' if r['neighbour'] else 'off'} | "
        f"decode {r['decode_short_tok_s']:6.1f} tok/s short, {r['decode_long_tok_s']:6.1f} at "
        f"{r['long_context']} | prefill {r['prefill_tok_s']:7.1f} tok/s | RSS +{r['rss_mib']:.0f} MiB "
        f"| decode CPU {r['decode_cpu_ms_per_token']:.1f} ms/token "
        f"| {r['answer'][:40]!r}",
        flush=True,
    )


def _ratios(rows: list[dict]) -> None:
    """Each turnkv row against llama.cpp in the same cell, built for the same instruction sets
    where the run has that build (``turnkv-packed:avx2`` against ``llama.cpp:avx2``)."""
    ref = {
        (r["engine"], r["threads"], r["neighbour"]): r for r in rows if r["engine"].startswith("llama.cpp")
    }
    for r in rows:
        if r["engine"].startswith("llama.cpp"):
            continue
        isa = "avx2" if r["engine"].endswith(":avx2") else ""
        cell = (r["threads"], r["neighbour"])
        base = ref.get((f"llama.cpp:{isa}".rstrip(":"), *cell))
        base = base or next((v for k, v in ref.items() if k[1:] == cell), None)
        if base is None:
            continue
        r["against"] = base["engine"]
        r["vs_llama_cpp"] = {
            k: r[k] / base[k] for k in ("decode_short_tok_s", "decode_long_tok_s", "prefill_tok_s")
        }
        v = r["vs_llama_cpp"]
        print(
            f"{r['engine']:>15} t={r['threads'] or 'auto'} nb={'on ' if r['neighbour'] else 'off'} / {r['against']}: "
            f"decode {v['decode_short_tok_s']:.2f}x short, {v['decode_long_tok_s']:.2f}x long; "
            f"prefill {v['prefill_tok_s']:.2f}x"
        )


def markdown(rows: list[dict], cpu: str) -> str:
    """The rows as the table docs/BENCHMARKS.md keeps (ratios against llama.cpp where it ran), under
    a line naming the CPU and its vector extensions; each row names the kernels it ran."""
    out = [
        f"CPU: {cpu}",
        "",
        f"| engine | kernels | threads | neighbour | decode short tok/s | decode {rows[0]['long_context'] if rows else '?'}-token "
        "context tok/s | prefill tok/s "
        "| RSS MiB | decode CPU ms/token |",
        "| --- | --- | ---: | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        v = r.get("vs_llama_cpp", {})

        def cell(key: str, v=v, r=r) -> str:
            return f"{r[key]:.1f}" + (f" ({v[key]:.2f}x)" if key in v else "")

        out.append(
            f"| {r['engine']} | {r.get('kernels', '?')} | {r['threads'] or 'auto'} | {'busy core' if r['neighbour'] else 'none'} | "
            f"{cell('decode_short_tok_s')} | {cell('decode_long_tok_s')} | {cell('prefill_tok_s')} | "
            f"{r['rss_mib']:.0f} | {r['decode_cpu_ms_per_token']:.1f} |"
        )
    return "\n".join(out)


def _plot(results: dict, plt, path: Path) -> None:
    rows = results["rows"]
    labels = [
        f"{r['engine']}\n{r.get('kernels', '')}\nt{r['threads'] or 'auto'}{' +nb' if r['neighbour'] else ''}"
        for r in rows
    ]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for ax, key, title in zip(
        axes,
        ("decode_short_tok_s", "decode_long_tok_s", "prefill_tok_s"),
        ("decode, short prompt", "decode, 2K context", "prefill of 2K"),
        strict=True,
    ):
        ax.bar(range(len(rows)), [r[key] for r in rows])
        ax.set_xticks(range(len(rows)), labels, fontsize=6)
        ax.set(title=title, ylabel="tokens/s")
        ax.grid(alpha=0.3, axis="y")
    fig.suptitle(
        f"{results['gguf']}: turnkv vs llama.cpp on {results['cpu']} ({results['date']}, {results['commit']})"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
