"""Sampling defaults: what a model recommends, and the one rule that fills a request's unset fields.

A field a request leaves unset (absent or ``null``) takes, in order: the server's flag
(``--temperature``, ``--top-p``, ``--top-k``, ``--max-tokens`` or its ``TURNKV_*`` twin), else the
model's recommendation, else the built-in value (``BUILTIN``: the OpenAI API's sampling defaults
and ``DEFAULT_MAX_TOKENS``). ``turnkv generate`` and ``turnkv chat`` have no request: their flags
are the first level. ``SamplingDefaults.over`` is that rule, ``resolve`` applies it once per engine
(flag, model, built-in) and the request schema once per request (request over that).

A model's recommendation comes from (as vLLM reads ``generation_config.json``):

- a Hugging Face folder's ``generation_config.json``: ``temperature``, ``top_p``, ``top_k``,
  ``max_new_tokens``; ``"do_sample": false`` means greedy (temperature 0). ``repetition_penalty``
  and ``min_p`` are not defaults (a request asks for them itself), and a load logs that it ignores
  them;
- a GGUF's ``general.sampling.temp``, ``general.sampling.top_p``, ``general.sampling.top_k`` (the
  other ``general.sampling.*`` keys name samplers turnkv does not have);
- the default model: its model card (SmolLM2-135M-Instruct samples with temperature 0.2, top_p 0.9;
  at the OpenAI default of 1.0 it writes gibberish), unless its GGUF says otherwise.

A value out of range (a negative temperature, a top_p of 0) is ignored with a warning: a model's
file never stops it loading.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import asdict, dataclass, fields
from pathlib import Path

log = logging.getLogger(__name__)

# an unset max_tokens: enough for a long chat answer; a reasoning model's thinking may want more
# (--max-tokens or the request's). Always capped by the context the prompt leaves.
DEFAULT_MAX_TOKENS = 1024
GENERATION_CONFIG = "generation_config.json"
GGUF_PREFIX = "general.sampling."
_GGUF_KEYS = {"temp": "temperature", "top_p": "top_p", "top_k": "top_k"}
_HF_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "max_new_tokens": "max_tokens"}
_NOT_APPLIED = ("repetition_penalty", "min_p")  # HF keys turnkv does not take as defaults


@dataclass(frozen=True)
class SamplingDefaults:
    """Sampling values for turns that set none; None: this level says nothing about that field.

    Invariants (``check``): ``temperature`` finite and >= 0, ``0 < top_p <= 1``, ``top_k >= 0``
    (0: off), ``max_tokens >= 1``.
    """

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    max_tokens: int | None = None

    def over(self, below: SamplingDefaults) -> SamplingDefaults:
        """Each field from ``self`` where set, else from ``below``: the one fallback rule."""
        return SamplingDefaults(
            **{f.name: _first(getattr(self, f.name), getattr(below, f.name)) for f in fields(self)}
        )

    def problems(self) -> dict[str, str]:
        """Field -> what is wrong with its value (empty when every set value is in range)."""
        out = {}
        t, p, k, m = self.temperature, self.top_p, self.top_k, self.max_tokens
        if t is not None and not (isinstance(t, (int, float)) and math.isfinite(t) and t >= 0):
            out["temperature"] = f"must be a finite number >= 0 (got {t!r})"
        if p is not None and not (isinstance(p, (int, float)) and 0 < p <= 1):
            out["top_p"] = f"must be in (0, 1] (got {p!r})"
        if k is not None and not (_is_int(k) and k >= 0):
            out["top_k"] = f"must be an integer >= 0, 0 meaning off (got {k!r})"
        if m is not None and not (_is_int(m) and m >= 1):
            out["max_tokens"] = f"must be an integer >= 1 (got {m!r})"
        return out


BUILTIN = SamplingDefaults(temperature=1.0, top_p=1.0, top_k=0, max_tokens=DEFAULT_MAX_TOKENS)
DEFAULT_MODEL_CARD = SamplingDefaults(temperature=0.2, top_p=0.9)  # SmolLM2-135M-Instruct's card


@dataclass(frozen=True)
class Resolved:
    """The values a turn that sets nothing gets (every field set) and where each came from:
    ``flag`` (a flag or its env twin), ``model`` or ``built-in``."""

    values: SamplingDefaults
    sources: dict[str, str]

    def doc(self) -> dict:
        """As ``/v1/models`` and ``/health`` show it."""
        return {**asdict(self.values), "source": dict(self.sources)}


def resolve(flags: SamplingDefaults, model: SamplingDefaults) -> Resolved:
    """The flag, else the model's value, else the built-in one, per field."""
    values = flags.over(model).over(BUILTIN)
    sources = {}
    for f in fields(SamplingDefaults):
        levels = (("flag", flags), ("model", model), ("built-in", BUILTIN))
        sources[f.name] = next(name for name, level in levels if getattr(level, f.name) is not None)
    return Resolved(values, sources)


def from_generation_config(raw: dict, where: str = GENERATION_CONFIG) -> SamplingDefaults:
    """The recommendation of a parsed ``generation_config.json`` (keys it does not set stay None)."""
    if not isinstance(raw, dict):
        log.warning("%s is not a JSON object; no sampling defaults from it", where)
        return SamplingDefaults()
    values = {ours: raw[theirs] for theirs, ours in _HF_KEYS.items() if raw.get(theirs) is not None}
    if raw.get("do_sample") is False:  # greedy, whatever temperature the file also lists
        values = {k: v for k, v in values.items() if k == "max_tokens"} | {"temperature": 0.0}
    ignored = [f"{k} {raw[k]}" for k in _NOT_APPLIED if raw.get(k) not in (None, 0, 1, 0.0, 1.0)]
    if ignored:
        log.info("%s recommends %s, which turnkv's sampler does not apply", where, ", ".join(ignored))
    return _checked(SamplingDefaults(**values), where)


def from_hf_folder(folder: Path) -> SamplingDefaults:
    """The recommendation of ``folder/generation_config.json``; nothing when there is none."""
    path = Path(folder) / GENERATION_CONFIG
    if not path.is_file():
        return SamplingDefaults()
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        log.warning("ignoring unreadable %s: %s", path, exc)
        return SamplingDefaults()
    return from_generation_config(raw, str(path))


def from_gguf(metadata: dict, where: str = "GGUF") -> SamplingDefaults:
    """The recommendation of a GGUF's ``general.sampling.*`` values (``metadata``: key -> value)."""
    values = {}
    for key, ours in _GGUF_KEYS.items():
        v = metadata.get(GGUF_PREFIX + key)
        if v is not None:
            # float32 in the file: 0.7 reads back as 0.699999988
            values[ours] = float(f"{v:.6g}") if isinstance(v, float) else v
    known = {GGUF_PREFIX + k for k in (*_GGUF_KEYS, "sequence")}
    ignored = [f"{k.removeprefix(GGUF_PREFIX)} {v}" for k, v in metadata.items() if k not in known]
    if ignored:
        log.info("%s recommends %s, which turnkv's sampler does not apply", where, ", ".join(ignored))
    return _checked(SamplingDefaults(**values), where)


def _checked(d: SamplingDefaults, where: str) -> SamplingDefaults:
    """``d`` without its out-of-range values (each logged), temperature and top_p as floats."""
    bad = d.problems()
    for name, problem in bad.items():
        log.warning("ignoring %s's recommended %s: it %s", where, name, problem)
    kept = {k: v for k, v in asdict(d).items() if k not in bad and v is not None}
    for name in ("temperature", "top_p"):
        if name in kept:
            kept[name] = float(kept[name])
    return SamplingDefaults(**kept)


def _first(a, b):
    return a if a is not None else b


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)
