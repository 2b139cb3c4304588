"""Text <-> token ids, the chat template, and incremental detokenization.

``Tokenizer`` wraps a ``tokenizers.Tokenizer`` (the Rust backend transformers uses) and adds what
a server needs: the jinja chat template, the set of ids that end a turn, whether a raw prompt
starts with BOS, and ``StreamDecoder`` for streaming text that never splits a character.

Sources: a Hugging Face folder (``tokenizer.json`` + ``tokenizer_config.json`` /
``chat_template.jinja``), a GGUF vocabulary (see ``gguf_vocab``), a saved cache folder
(``save``/``load``, so a GGUF vocabulary is converted once), or ``byte_level`` for random models.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterable
from datetime import datetime
from pathlib import Path

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as Backend

_META = "turnkv_tokenizer.json"

CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


class ChatTemplateError(ValueError):
    """The template failed to render (or the model has none); the message says why."""


def _raise(message: str) -> None:
    raise ChatTemplateError(message)


def _tojson(value, indent=None, ensure_ascii=False, sort_keys=False):
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys)


def _compile(template: str) -> jinja2.Template:
    # The settings transformers renders with, so templates written for it render the same here.
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


def _text_content(content) -> str | None:
    """A message's content as one string: parts ``{"type": "text", "text": ...}`` are joined."""
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if isinstance(part, str):
                texts.append(part)
            elif isinstance(part, dict) and part.get("type", "text") == "text":
                texts.append(str(part.get("text", "")))
            else:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ChatTemplateError(f"unsupported content part {kind!r}: only text parts are supported")
        return "".join(texts)
    raise ChatTemplateError(
        f"message content must be a string or a list of text parts, not {type(content).__name__}"
    )


SHIPPED_TEMPLATES = Path(__file__).resolve().parent / "chat_format" / "templates"


def chat_template_text(spec: str) -> str:
    """The template ``--chat-template`` names: a shipped one (``chatml-tools``) or a file's text;
    raises ``ValueError`` saying what exists."""
    shipped = SHIPPED_TEMPLATES / f"{spec}.jinja"
    if "/" not in spec and shipped.is_file():
        return shipped.read_text()
    path = Path(spec).expanduser()
    if not path.is_file():
        names = ", ".join(sorted(p.stem for p in SHIPPED_TEMPLATES.glob("*.jinja")))
        raise ValueError(f"{spec!r} is neither a file nor a shipped template ({names})")
    try:
        return path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read {spec!r}: {exc}") from None


def check_chat_template(template: str) -> str:
    """``template`` itself once it compiles; else :class:`ChatTemplateError` saying where not."""
    try:
        _compile(template)
    except jinja2.TemplateError as exc:
        raise ChatTemplateError(f"does not compile as a Jinja template: {exc}") from exc
    return template


class Tokenizer:
    """Encode, decode and chat-template one model's text.

    Invariants: ``encode`` never adds special tokens unless asked; ``eos_token_ids`` is non-empty
    for any real model; ``prompt_text`` starts with BOS exactly when the model was trained so.
    """

    def __init__(
        self,
        backend: Backend,
        *,
        chat_template: str | None,
        bos_token_id: int | None,
        eos_token_ids: Iterable[int],
        add_bos: bool,
        eos_token_id: int | None = None,
    ):
        self.backend = backend
        self.chat_template = chat_template
        self.bos_token_id = bos_token_id
        self.eos_token_ids: set[int] = {int(i) for i in eos_token_ids}
        # The one a template calls ``eos_token`` (Llama 3 instruct: <|eot_id|>, not <|end_of_text|>).
        self.eos_token_id = (
            eos_token_id if eos_token_id is not None else min(self.eos_token_ids, default=None)
        )
        if self.eos_token_id is not None:
            self.eos_token_ids.add(self.eos_token_id)
        self.add_bos = add_bos and bos_token_id is not None
        self._template = _compile(chat_template) if chat_template else None
        self._special_ids: set[int] | None = None  # ``token_bytes``'s, made on first use

    # ---- basic ---------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        """Ids the tokenizer knows, added tokens included (may differ from the model's logit width)."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def token_str(self, token_id: int | None) -> str:
        return "" if token_id is None else (self.backend.id_to_token(token_id) or "")

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (a piece of a character, for a byte-level token that
        splits one; a special token's own text): byte-level BPE pieces map back through GPT-2's
        byte table, SentencePiece byte tokens (``<0x0A>``) are their byte, ``▁`` a space."""
        piece = self.token_str(token_id)
        if type(self.backend.decoder).__name__ == "ByteLevel" and token_id not in self._specials():
            try:
                return bytes(_byte_of(c) for c in piece)
            except (IndexError, ValueError):  # not a byte-level piece (an added token)
                return piece.encode()
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            return bytes([int(piece[3:5], 16)])
        return piece.replace("\u2581", " ").encode()

    def _specials(self) -> set[int]:
        if self._special_ids is None:  # once: the added tokens are fixed after loading
            self._special_ids = {i for i, t in self.backend.get_added_tokens_decoder().items() if t.special}
        return self._special_ids

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Ids of ``text``. Special-token strings in the text (``<|im_start|>``) map to their ids.

        ``encode_batch`` releases the GIL; ``encode`` holds it, stalling every other Python thread
        (the event loop, the engine's): bench/tokenize_stall.py measures it (docs/BENCHMARKS.md,
        'Tokenizing large prompts (issue 7)')."""
        ids = self.backend.encode_batch([text], add_special_tokens=False)[0].ids
        if add_special_tokens and self.add_bos and (not ids or ids[0] != self.bos_token_id):
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def prompt_text(self, prompt: str) -> list[int]:
        """Ids for a raw ``/v1/completions`` prompt: BOS first if the model wants one."""
        return self.encode(prompt, add_special_tokens=True)

    # ---- chat ----------------------------------------------------------------------------
    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True, **extra) -> str:
        """The chat template's text for ``messages`` (role/content; content a string or text parts)."""
        if self._template is None:
            raise ChatTemplateError("this model has no chat template; use /v1/completions with a raw prompt")
        msgs = []
        for msg in messages:
            if not isinstance(msg, dict) or "role" not in msg:
                raise ChatTemplateError("each message needs a 'role' (and usually 'content')")
            msgs.append({**msg, "content": _text_content(msg.get("content"))})
        try:
            return self._template.render(
                messages=msgs,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.token_str(self.bos_token_id),
                eos_token=self.token_str(self.eos_token_id),
                **extra,
            )
        except ChatTemplateError:
            raise
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"chat template failed: {exc}") from exc

    def with_chat_template(self, template: str) -> Tokenizer:
        """A tokenizer like this one that renders chats with ``template`` instead of the model's own
        (``--chat-template``; the loaded model's stays as it is); raises :class:`ChatTemplateError`
        when it does not compile."""
        other = copy.copy(self)
        other._template = _compile(check_chat_template(template))
        other.chat_template = template
        return other

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, **extra
    ) -> list[int]:
        """Render the template and tokenize it; the template writes its own BOS if it wants one."""
        return self.encode(self.render_chat(messages, add_generation_prompt, **extra))

    # ---- persistence ---------------------------------------------------------------------
    def save(self, folder: str | Path) -> None:
        """Write ``tokenizer.json`` plus a small json of what the backend does not hold."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        self.backend.save(str(folder / "tokenizer.json"))
        meta = {
            "chat_template": self.chat_template,
            "bos_token_id": self.bos_token_id,
            "eos_token_ids": sorted(self.eos_token_ids),
            "eos_token_id": self.eos_token_id,
            "add_bos": self.add_bos,
        }
        (folder / _META).write_text(json.dumps(meta))

    @classmethod
    def load(cls, folder: str | Path) -> Tokenizer:
        """Read what ``save`` wrote. Raises FileNotFoundError/ValueError if it is missing or broken."""
        folder = Path(folder)
        meta = json.loads((folder / _META).read_text())
        backend = Backend.from_file(str(folder / "tokenizer.json"))
        return cls(
            backend,
            chat_template=meta["chat_template"],
            bos_token_id=meta["bos_token_id"],
            eos_token_ids=meta["eos_token_ids"],
            eos_token_id=meta.get("eos_token_id"),
            add_bos=meta["add_bos"],
        )

    @classmethod
    def from_hf_folder(cls, folder: str | Path, extra_eos_ids: Iterable[int] = ()) -> Tokenizer:
        """A Hugging Face folder: ``tokenizer.json`` and, if present, ``tokenizer_config.json``,
        ``chat_template.jinja``, ``generation_config.json`` (whose eos ids are added)."""
        folder = Path(folder)
        backend = Backend.from_file(str(folder / "tokenizer.json"))
        cfg = _read_json(folder / "tokenizer_config.json")
        template = cfg.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template}
            template = named.get("default") or next(iter(named.values()), None)
        if (folder / "chat_template.jinja").is_file():
            template = (folder / "chat_template.jinja").read_text()

        def token_id(key: str) -> int | None:
            tok = cfg.get(key)
            tok = tok.get("content") if isinstance(tok, dict) else tok
            return backend.token_to_id(tok) if isinstance(tok, str) else None

        eos = set(extra_eos_ids)
        gen_eos = _read_json(folder / "generation_config.json").get("eos_token_id")
        eos.update(gen_eos if isinstance(gen_eos, list) else [gen_eos] if gen_eos is not None else [])
        if token_id("eos_token") is not None:
            eos.add(token_id("eos_token"))
        bos = token_id("bos_token")
        # The backend's post-processor says whether this model starts a text with BOS (Llama 3
        # does, Qwen does not); the config flag covers tokenizers exported without one.
        probe = backend.encode("a", add_special_tokens=True).ids
        plain = backend.encode("a", add_special_tokens=False).ids
        adds = bos is not None and len(probe) > len(plain) and probe[0] == bos
        return cls(
            backend,
            chat_template=template,
            bos_token_id=bos,
            eos_token_ids=eos,
            eos_token_id=token_id("eos_token"),
            add_bos=adds or bool(cfg.get("add_bos_token", False)),
        )


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


class StreamDecoder:
    """Incremental detokenizer: ``push`` returns only text that can no longer change.

    It decodes a sliding window: ``prefix`` tokens already emitted (context, so merges and
    leading-space rules see what came before) plus the tokens not yet emitted. New text is
    released when the window's text grows and does not end in U+FFFD (an unfinished UTF-8
    character). ``flush`` releases whatever is held at the end. Invariant: the concatenation of
    every ``push`` and the final ``flush`` equals ``tokenizer.decode(all ids)``.
    """

    def __init__(self, tok: Tokenizer, skip_special_tokens: bool = True):
        self.tok = tok
        self.skip = skip_special_tokens
        self.ids: list[int] = []
        self._prefix = 0  # window start
        self._read = 0  # tokens before this index are emitted
        self._prefix_text = ""  # decode(ids[_prefix:_read])

    def push(self, token_id: int) -> str:
        self.ids.append(int(token_id))
        text = self.tok.decode(self.ids[self._prefix :], self.skip)
        if len(text) <= len(self._prefix_text) or text.endswith("\ufffd"):
            return ""
        new = text[len(self._prefix_text) :]
        # Slide: what was emitted before becomes the window's context.
        self._prefix, self._read = self._read, len(self.ids)
        self._prefix_text = self.tok.decode(self.ids[self._prefix : self._read], self.skip)
        return new

    def flush(self) -> str:
        """Whatever is still held (e.g. a trailing incomplete character, as U+FFFD)."""
        text = self.tok.decode(self.ids[self._prefix :], self.skip)
        out = text[len(self._prefix_text) :]
        self._prefix = self._read = len(self.ids)
        self._prefix_text = ""
        return out


# ---- building a backend from a GGUF vocabulary --------------------------------------------
# How each llama.cpp pre-tokenizer type (GGUF ``tokenizer.ggml.pre``) splits text before BPE.
_GPT2 = "gpt2"  # the GPT-2 regex only
_DIGITS_GPT2 = "digits+gpt2"  # every digit alone, then the GPT-2 regex (SmolLM, StarCoder)
_LLAMA3_RE = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_RE = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
GGUF_PRE_TOKENIZERS: dict[str, str] = {
    "default": _GPT2,
    "gpt-2": _GPT2,
    "gpt2": _GPT2,
    "mpt": _GPT2,
    "olmo": _GPT2,
    "smollm": _DIGITS_GPT2,
    "starcoder": _DIGITS_GPT2,
    "refact": _DIGITS_GPT2,
    "codeshell": _DIGITS_GPT2,
    "llama-bpe": _LLAMA3_RE,
    "llama3": _LLAMA3_RE,
    "llama-v3": _LLAMA3_RE,
    "smaug-bpe": _LLAMA3_RE,
    "falcon3": _LLAMA3_RE,
    "qwen2": _QWEN2_RE,
    "deepseek-r1-qwen": _QWEN2_RE,
    "stablelm2": _QWEN2_RE,
}
_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types


def gguf_backend(
    model: str, pre: str | None, tokens: list[str], token_types: list[int], merges: list[str]
) -> Backend:
    """A byte-level BPE backend from a GGUF vocabulary (``tokenizer.ggml.model == "gpt2"``).

    Control tokens become special added tokens, user-defined ones plain added tokens, as
    llama.cpp matches both whole. Raises ValueError naming what is supported otherwise.
    """
    from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers

    if model != "gpt2":
        raise ValueError(
            f"GGUF tokenizer model {model!r} is not supported (supported: 'gpt2' byte-level BPE)"
        )
    split = GGUF_PRE_TOKENIZERS.get(pre or "default")
    if split is None:
        raise ValueError(
            f"GGUF pre-tokenizer {pre!r} is not supported (supported: {', '.join(sorted(GGUF_PRE_TOKENIZERS))})"
        )
    vocab = {tok: i for i, tok in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    # Llama 3's vocabulary takes a whole pre-token that is itself in the vocabulary as is.
    backend = Backend(models.BPE(vocab=vocab, merges=pairs, ignore_merges=split == _LLAMA3_RE))
    if split == _GPT2:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    elif split == _DIGITS_GPT2:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    else:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    backend.decoder = decoders.ByteLevel()
    types = list(token_types) or [1] * len(tokens)
    special = [
        AddedToken(t, special=True, normalized=False)
        for t, k in zip(tokens, types, strict=True)
        if k == _CONTROL
    ]
    plain = [
        AddedToken(t, special=False, normalized=False)
        for t, k in zip(tokens, types, strict=True)
        if k == _USER_DEFINED
    ]
    backend.add_special_tokens(special)
    backend.add_tokens(plain)
    return backend


def byte_level(vocab_size: int | None = None) -> Tokenizer:
    """A trivial tokenizer for random-weight models: one token per byte, ChatML specials, no merges.

    Ids 0-255 are bytes, 256 ``<|endoftext|>`` (BOS and EOS), 257 ``<|im_start|>``, 258 ``<|im_end|>``.
    """
    from tokenizers import AddedToken, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet(), key=lambda c: _byte_of(c))
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    vocab = {c: i for i, c in enumerate(alphabet)}
    vocab.update({s: 256 + i for i, s in enumerate(specials)})
    backend = Backend(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    return Tokenizer(
        backend, chat_template=CHATML_TEMPLATE, bos_token_id=256, eos_token_ids={256, 258}, add_bos=False
    )


def _byte_of(char: str) -> int:
    """The byte GPT-2's byte-to-unicode table maps to ``char``."""
    code = ord(char)
    if 33 <= code <= 126 or 161 <= code <= 172 or 174 <= code <= 255:
        return code
    # The other 68 bytes (controls, space, DEL, NBSP, soft hyphen) sit at 256+ in byte order.
    rest = [b for b in range(256) if not (33 <= b <= 126 or 161 <= b <= 172 or 174 <= b <= 255)]
    return rest[code - 256]
