"""A GGUF's matrices -> ``QuantWeight``s swapped into the model (the loader's side of
``turnkv.models.quant``): which fused matrices can stay packed, their planes, the load-time
self-check, and the report the loader keeps (``LoadedModel.weights``). What it packed is kept on
disk and taken from there by a later load of the same file and settings (``pack_cache``)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from turnkv.models import pack_cache
from turnkv.models.quant import (
    GROUP,
    PACKED_TYPES,
    WEIGHT_MODES,
    Plane,
    QuantWeight,
    kernel_missing,
    packed_kernel,
    planes_from_blocks,
)
from turnkv.models.quant_check import self_check

log = logging.getLogger(__name__)


@dataclass
class PackReport:
    """What ``pack_gguf`` did: ``used`` is ``packed`` (every Q4_0/Q4_1/Q8_0 matrix), ``mixed``
    (some kept dequantized: another type in the same fused matrix, or a failed self-check) or
    ``dequant``; ``packed_names`` are the checkpoint names the loader must not fill again."""

    used: str = "dequant"
    reason: str = ""
    packed_names: frozenset[str] = frozenset()
    packed_bytes: int = 0
    worst_ratio: float = 0.0  # largest |packed - dequantized| / error_bound seen by the self-check
    matmul: str = ""  # the packed matrices' kernel: "c" (cpu_int4) or "torch-int4"; "" none packed
    cache: str = ""  # the packed-weights cache: "hit", "miss" (packed now, stored), "off"; "" no packing


def _concat(planes_per_part: list[list[Plane]], cols: int) -> list[Plane]:
    """Row-concatenate parts' planes; a part with fewer planes gets leading zero planes."""
    count = max(len(p) for p in planes_per_part)
    out = []
    for i in range(count):
        col = []
        for parts in planes_per_part:
            rows = parts[0].u.shape[0]
            j = i - (count - len(parts))
            col.append(parts[j] if j >= 0 else Plane.zeros(rows, cols))
        out.append(Plane(*(torch.cat([getattr(p, f) for p in col]) for f in ("u", "scale", "zero"))))
    return out


def pack_gguf(
    model,
    entries,
    data,
    mode: str,
    device: torch.device,
    path=None,
    fingerprint: str = "",
    dtype: torch.dtype | None = None,
) -> PackReport:
    """Pack the matrices of a GGUF load whose every part is Q4_0/Q4_1/Q8_0 into ``QuantWeight``s
    and swap them into ``model`` (``model.hf_place`` / ``model.replace_weight``).

    ``entries``: ``(hf_name, TensorEntry, unpermute_heads)``; ``data`` the file's bytes; ``path``
    the file, mapped again for the embedding's blocks (None: they are copied, and nothing is
    cached). ``mode``: ``auto`` packs on CPU what passes the self-check; ``packed`` packs or raises
    ValueError saying why not; ``dequant`` packs nothing. The embedding keeps its GGUF blocks for
    lookups (exact), plus planes when it is tied. With a ``path``, the result is taken from the
    packed-weights cache when it holds this file (``fingerprint``: its content fingerprint) and
    settings (``dtype``: the model's), else stored there (``pack_cache``).
    """
    from turnkv.models import gguf as gg

    if mode not in WEIGHT_MODES:
        raise ValueError(f"unknown weights mode {mode!r} (use {', '.join(WEIGHT_MODES)})")
    if mode == "dequant":
        return PackReport(reason="--weights dequant")
    why_not = (
        kernel_missing() if device.type == "cpu" else f"packed weights run on CPU, the device is {device}"
    )
    groups: dict[tuple[int, str], list] = {}
    for name, entry, heads in entries:
        try:
            owner, attr, rows = model.hf_place(name)
        except KeyError:
            continue  # the loader reports it
        if len(entry.shape) == 2:
            groups.setdefault((id(owner), attr), []).append(
                (rows.start if rows else 0, name, entry, heads, owner)
            )
    packable = {
        key: sorted(parts, key=lambda p: p[0])
        for key, parts in groups.items()
        if all(p[2].type_name in PACKED_TYPES and p[2].shape[1] % GROUP == 0 for p in parts)
        and sum(p[2].shape[0] for p in parts) == getattr(parts[0][4], key[1]).shape[0]
    }
    if not packable:
        why_not = why_not or "no matrix is all Q4_0/Q4_1/Q8_0"
    if why_not:
        if mode == "packed":
            raise ValueError(f"--weights packed: {why_not} (use --weights auto or dequant)")
        return PackReport(reason=why_not)
    facts = None
    if path is not None and pack_cache.enabled():
        facts = pack_cache.facts(Path(path), fingerprint, mode, dtype or torch.float32, device, entries)
        cached = pack_cache.read(facts)
        report = _restore(model, packable, cached, path) if cached is not None else None
        if report is not None:
            return report
    done, nbytes, worst, failed = set(), 0, 0.0, []
    stored: list[tuple[list[str], QuantWeight]] = []
    kinds_checked: dict[tuple, tuple[bool, float]] = {}
    kinds_layout: dict[tuple, bool] = {}
    tied = model.lm_head is None
    for (_, attr), parts in packable.items():
        owner = parts[0][4]
        raws = [gg.raw_rows(data, e, heads) for _, _, e, heads, _ in parts]
        cols = parts[0][2].shape[1]
        rows = sum(r.shape[0] for r in raws)
        is_embed = owner is model and attr == "embed"
        needs_mm = not is_embed or tied
        planes = _concat(
            [planes_from_blocks(r, p[2].type_name) for r, p in zip(raws, parts, strict=True)], cols
        )
        blocks = None
        if is_embed:  # its own map: only looked-up rows become resident, and they stay file-backed
            blocks = gg.map_rows(path, parts[0][2]) if path is not None else raws[0].clone()
        qw = QuantWeight((rows, cols), planes if needs_mm else None, blocks, parts[0][2].type_name)
        if needs_mm:
            # The checks test the kernel, the packed layout and the block mapping, which depend on
            # the matrix's part types and shape, not on its values: one matrix of each kind
            # (checking every matrix would cost seconds of CPU at load).
            kind = (tuple(p[2].type_name for p in parts), tuple(r.shape[0] for r in raws), cols)
            if owner is not model:  # layers; the head's windows are narrow (logits of a few rows)
                layout = kinds_layout.get(kind)
                kinds_layout[kind] = qw.check_layout(planes) if layout is None else layout
                qw.wide_ok = kinds_layout[kind]
            if kind not in kinds_checked:
                kinds_checked[kind] = _check_parts(qw, planes, raws, [p[2].type_name for p in parts])
            ok, ratio = kinds_checked[kind]
            worst = max(worst, ratio)
            if not ok:
                failed.append(f"{parts[0][1]} (error {ratio:.2f}x its bound)")
                continue
        model.replace_weight(owner, attr, qw)
        done.update(p[1] for p in parts)
        nbytes += qw.nbytes()
        stored.append(([p[1] for p in parts], qw))
    if failed and mode == "packed":
        raise ValueError(f"--weights packed: the self-check failed for {', '.join(failed[:3])}")
    left = sum(1 for key, parts in groups.items() if key not in packable or parts[0][1] not in done)
    used = "packed" if not left else ("mixed" if done else "dequant")
    reason = f"self-check failed for {', '.join(failed[:3])}" if failed else "self-check ok"
    report = PackReport(used, reason, frozenset(done), nbytes, worst, packed_kernel() if done else "")
    report.cache = "off" if facts is None else "miss"
    if facts is not None:
        _store(facts, report, stored)
    _trim_heap()
    log.info("weights %s: %d tensors packed, %.1f MiB (%s)", used, len(done), nbytes / 2**20, reason)
    return report


# ---- the packed-weights cache (pack_cache) ----------------------------------------------------
_REPORT = ("used", "reason", "packed_bytes", "worst_ratio", "matmul")


def _store(facts: dict, report: PackReport, stored: list[tuple[list[str], QuantWeight]]) -> None:
    """Write what the loader needs to rebuild ``stored`` (each fused matrix's part names and weight)."""
    meta: dict = {name: getattr(report, name) for name in _REPORT}
    meta["weights"], tensors = [], {}
    for names, qw in stored:
        meta["weights"].append(
            {
                "names": names,
                "shape": list(qw.shape),
                "block_type": qw.block_type,
                "native": qw.native,
                "wide_ok": qw.wide_ok,
                "blocks": qw.blocks is not None,
            }
        )
        for buf in ("packed", "scale_zeros"):
            if getattr(qw, buf) is not None:
                tensors[f"{names[0]}.{buf}"] = getattr(qw, buf)
    pack_cache.write(facts, meta, tensors)


def _restore(model, packable: dict, cached: tuple[dict, dict], path) -> PackReport | None:
    """Swap the cached weights into ``model`` and return the stored report, or None (nothing
    swapped) when they do not fit this model: a fused matrix of other parts or shape."""
    from turnkv.models import gguf as gg

    meta, tensors = cached
    by_first = {parts[0][1]: (attr, parts) for (_, attr), parts in packable.items()}
    swaps = []
    try:
        for w in meta["weights"]:
            attr, parts = by_first[w["names"][0]]
            owner, shape = parts[0][4], tuple(w["shape"])
            if [p[1] for p in parts] != w["names"] or tuple(getattr(owner, attr).shape) != shape:
                raise KeyError(w["names"][0])
            blocks = gg.map_rows(path, parts[0][2]) if w["blocks"] else None
            qw = QuantWeight(shape, None, blocks, w["block_type"])
            qw.native, qw.wide_ok = bool(w["native"]), bool(w["wide_ok"])
            qw.packed = tensors.get(f"{w['names'][0]}.packed")
            qw.scale_zeros = tensors.get(f"{w['names'][0]}.scale_zeros")
            swaps.append((w["names"], owner, attr, qw))
        done = frozenset(n for names, *_ in swaps for n in names)
        report = PackReport(packed_names=done, cache="hit", **{name: meta[name] for name in _REPORT})
    except (KeyError, TypeError) as exc:
        log.warning("packed-weights cache does not fit this model (%s): packing again", exc)
        return None
    for _, owner, attr, qw in swaps:
        model.replace_weight(owner, attr, qw)
    log.info("weights %s: %d tensors packed, from the cache (%s)", report.used, len(done), report.reason)
    return report


def _trim_heap() -> None:
    """Hand freed heap pages back to the OS: packing frees int32 temporaries that glibc
    otherwise keeps resident."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass  # not glibc: nothing to do


def _check_parts(qw: QuantWeight, planes: list[Plane], raws: list[torch.Tensor], types: list[str]):
    """``self_check`` on the first, middle and last row of every part of a fused matrix."""
    from turnkv.models.gguf import dequant_rows

    rows, refs, offset = [], [], 0
    for raw, type_name in zip(raws, types, strict=True):
        idx = torch.unique(torch.tensor([0, raw.shape[0] // 2, raw.shape[0] - 1]))
        rows.append(idx + offset)
        refs.append(dequant_rows(raw[idx], type_name))
        offset += raw.shape[0]
    sel = torch.cat(rows)
    sampled = [Plane(p.u[sel], p.scale[sel], p.zero[sel]) for p in planes]
    return self_check(qw, sampled, torch.cat(refs), sel)
