"""``turnkv serve``: bind, listen, load and warm up, announce, serve under uvicorn, shut down within a bound.

The listening socket is bound *before* the model loads, so a port in use or a host that cannot be
bound fails in one line within a second rather than after the load. uvicorn serves at once: until
the model is loaded and warm (``Runtime.warm_up``) a ``server.warming.WarmGate`` answers
``/health`` with 503 ``warming`` and every other route with 503 and ``Retry-After``; then the
app serves and "serving on ... ready in" is printed. A load that fails stops the server and
the CLI prints its one line. On SIGTERM or Ctrl-C the server stops accepting, logs how many turns
it waits for, and lets them run for ``--shutdown-timeout`` seconds; then it cancels them: each stops
at its next token, banks what it computed, and its answer ends normally with ``finish_reason``
"cancelled". uvicorn's own graceful-shutdown timeout is ``GRACE_S`` later, a last resort for a turn
that does not reach a token boundary in time (a long prefill).
"""

from __future__ import annotations

import errno
import socket
import sys
import threading
import time

import uvicorn

from turnkv.config import EngineConfig
from turnkv.server.protocol import MAX_HEADER_BYTES, deadline_protocol

GRACE_S = 5.0  # after cancelling the turns, how long uvicorn still waits before cancelling tasks
KEEP_ALIVE_S = 5  # uvicorn's default, stated: an idle keep-alive connection is closed after it


class BindError(ValueError):
    """The listening socket could not be bound (one line for the CLI)."""


def bind_socket(host: str, port: int) -> socket.socket:
    """A bound (not yet listening) TCP socket for ``host:port``; raises :class:`BindError`."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError) as e:
        raise BindError(f"--host {host!r} does not resolve: {e}") from None
    family, kind, proto, _, addr = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: restart past TIME_WAIT
    try:
        sock.bind(addr)
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise BindError(f"port {port} on {host} is already in use; pick another with --port") from None
        raise BindError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.set_inheritable(True)
    return sock


def uvicorn_config(app, cfg: EngineConfig, **kw) -> uvicorn.Config:
    """uvicorn's settings for ``app`` under ``cfg`` (``kw``: e.g. a test's host and port): h11 with
    the header and drain deadlines (``server.protocol``; also when httptools is installed, which
    uvicorn would pick and which has neither), idle keep-alive connections closed after
    ``KEEP_ALIVE_S``, headers capped at ``MAX_HEADER_BYTES`` (400 past it)."""
    return uvicorn.Config(
        app,
        log_level="warning",
        access_log=False,  # turnkv's own access log has the token counts (server.access)
        timeout_graceful_shutdown=cfg.shutdown_timeout + GRACE_S,
        http=deadline_protocol(cfg.header_timeout, cfg.body_timeout),
        timeout_keep_alive=KEEP_ALIVE_S,
        h11_max_incomplete_event_size=MAX_HEADER_BYTES,
        **kw,
    )


def serve(cfg: EngineConfig) -> None:
    """Bind ``cfg.host:cfg.port``, listen at once (``/health`` says ``loading``, then ``warming``),
    load the model and warm it up on a thread (``start``), then serve it until stopped."""
    from turnkv.bank.ram_budget import ram_budget
    from turnkv.engine.warmup import WarmProgress
    from turnkv.server.warming import WarmGate

    # a --ram-bytes the machine cannot hold fails in one line, before listening (the one early
    # check; build() meets the same ValueError in bank.ram_budget.open_ram when called directly)
    ram_budget(cfg)
    sock = bind_socket(cfg.host, cfg.port)
    try:
        progress = WarmProgress()
        gate = WarmGate(progress, cfg.model)
        server = _Uvicorn(uvicorn_config(gate, cfg), gate, cfg.shutdown_timeout)
        port = sock.getsockname()[1]
        failure: list[BaseException] = []

        def run() -> None:
            try:
                start(cfg, gate, progress, port)
            except BaseException as exc:  # the CLI prints it as one line once uvicorn has stopped
                progress.state, progress.error = "failed", f"{type(exc).__name__}: {exc}"
                failure.append(exc)
                server.should_exit = True

        print(
            f"turnkv: listening on http://{cfg.host}:{port} (GET /health: 503 until the model is loaded and warm)",
            file=sys.stderr,
            flush=True,
        )
        threading.Thread(target=run, name="turnkv-start", daemon=True).start()
        server.run(sockets=[sock])
        if failure:
            raise failure[0]
    finally:
        sock.close()


def start(cfg: EngineConfig, gate, progress, port: int) -> None:
    """Load, self-check and warm up (``Runtime.warm_up``), then open ``gate`` to the app and print
    the startup line: where it serves, and what the time to ready went to."""
    from turnkv.runtime import build
    from turnkv.server.app import Server, create_app, shutdown

    t0 = time.perf_counter()
    rt = build(cfg, "serve")
    loaded = time.perf_counter() - t0
    report = rt.warm_up(progress)
    app = create_app(rt)
    srv: Server = app.state.server
    gate.srv = srv
    gate.open(app, lambda: shutdown(srv))
    ready = time.perf_counter() - t0
    check = rt.engine.selfcheck_s
    warm = f"warm-up {report.seconds:.1f} s ({report.turns} turns, {report.steps} steps)"
    if report.note:
        warm = f"warm-up {report.note}"
    if rt.probe is not None:  # --max-batch-tokens auto's measurement (before the warm-up)
        took = "kept from an earlier start" if rt.probe.cached else f"{rt.probe.seconds:.1f} s"
        warm = f"budget probe {took} (ceiling {rt.step_budget().ceiling} rows), {warm}"
    if report.ram_s is not None:  # the RAM tier's pool, pinned beside the load, waited for first
        pinned = srv.bank.tier.ram.pool.pool_bytes / 2**30
        took = "" if report.ram_pin_s is None else f" in {report.ram_pin_s:.1f} s beside the load,"
        warm = f"RAM pool {pinned:.1f} GiB pinned{took} {report.ram_s:.1f} s waited, {warm}"
    print(
        f"turnkv: serving {rt.engine.info.model_name} on http://{cfg.host}:{port}/v1 ({_facts(cfg, rt, srv)})"
        f"\nturnkv: ready in {ready:.1f} s: load {loaded - check:.1f} s, self-check {check:.1f} s, {warm}",
        file=sys.stderr,
        flush=True,
    )


def _facts(cfg: EngineConfig, rt, srv) -> str:
    from turnkv.bank.disk import disk_dir, rank_dir
    from turnkv.bank.tiers import tier_health

    engine = rt.engine
    info, tier = engine.info, srv.bank.tier
    tp = engine.tp  # each rank's bank and tier hold its 1/size of every row, budgets per rank
    where = disk_dir(cfg.disk_dir) if tp is None else rank_dir(cfg.disk_dir, tp.size, "*")
    where = cfg.disk_store or where
    tiers = tier_health(tier)
    disk = "no disk tier"
    if tiers["disk"]["enabled"]:
        disk = f"disk {where} ({tiers['disk']['budget_bytes'] / 2**30:.1f} GiB{' each' if tp else ''})"
    ram = tiers["ram"]
    ram_text = f"RAM {ram['budget_bytes'] / 2**30:.1f} GiB" if ram["enabled"] else "no RAM tier"
    disk = f"{ram_text}, {disk}"
    if tp is not None:
        disk = f"tensor parallel {tp.size} (budgets per rank), {disk}"
    return (
        f"kv {cfg.kv_layout}, bank budget {srv.bank.budget_bytes / 2**20:.0f} MiB, {disk}, "
        f"attention {info.verdict.route}: {info.verdict.verdict}, cuda graphs {info.graphs}"
    )


class _Uvicorn(uvicorn.Server):
    """uvicorn's server, saying on the first stop signal what it waits for and for how long."""

    def __init__(self, config: uvicorn.Config, gate, timeout: float) -> None:
        super().__init__(config)
        self.gate = gate  # its ``srv`` once the app is open
        self.timeout = timeout

    def handle_exit(self, sig, frame) -> None:
        self.srv = getattr(self.gate, "srv", None)
        if not self.should_exit and self.srv is not None:
            running = self.srv.worker.running + self.srv.worker.waiting
            timeout = self.timeout
            timer = threading.Timer(timeout, self.srv.worker.cancel_all)
            timer.daemon = True
            timer.start()
            print(
                f"turnkv: shutting down: waiting for {running} running turn{'' if running == 1 else 's'} "
                f"(at most {timeout:g} s, --shutdown-timeout)",
                file=sys.stderr,
                flush=True,
            )
        super().handle_exit(sig, frame)
