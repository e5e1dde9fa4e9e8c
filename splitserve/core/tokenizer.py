"""Tokenizer of a checkpoint: tokenizer.json, chat template and EOS ids, without
loading transformers (the router imports this, and it must start fast)."""

from __future__ import annotations

import functools
from pathlib import Path

from tokenizers import Encoding
from tokenizers import Tokenizer as HFTokenizer

from splitserve.core import bounded_json
from splitserve.core.chat_content import mark_strings, special_pattern, split_marked
from splitserve.core.chat_template import SPECIAL_TOKEN_NAMES, ChatTemplateError, render
from splitserve.core.model_config import CheckpointError

__all__ = ["ChatTemplateError", "IncrementalDetokenizer", "Tokenizer"]

def _token_text(value) -> str | None:
    """tokenizer_config stores special tokens as a string or as an AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value


def _byte_level_chars() -> dict[int, str]:
    """GPT-2's byte -> character table: how byte-level BPE vocabularies (Llama 3, Qwen, GPT)
    write a raw byte as a token."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + i) for i, b in enumerate(others)}}


def _read_json(path: Path) -> dict:
    """A JSON object from tokenizer_config.json or generation_config.json, bounded in depth and
    size (core/bounded_json.py); CheckpointError (one line) otherwise."""
    try:
        value = bounded_json.load_file(path, max_bytes=bounded_json.MAX_TOKENIZER_BYTES)
    except (OSError, ValueError) as exc:  # ValueError: JSONDecodeError (bounds included), UnicodeDecodeError
        raise CheckpointError(f"{path}: not valid JSON ({exc})") from exc
    if not isinstance(value, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    return value


class Tokenizer:
    def __init__(self, model_dir: str | Path, config_eos_ids: tuple[int, ...] = ()):
        root = Path(model_dir)
        path = root / "tokenizer.json"
        if not path.is_file():
            raise CheckpointError(f"{path}: not found (only fast tokenizers, tokenizer.json, are supported)")
        try:
            self._tok = HFTokenizer.from_file(str(path))
        except Exception as exc:  # the Rust side raises plain Exception
            raise CheckpointError(f"{path}: cannot be loaded by `tokenizers` ({exc})") from exc
        cfg_path = root / "tokenizer_config.json"
        cfg = _read_json(cfg_path) if cfg_path.is_file() else {}
        self.bos_token = _token_text(cfg.get("bos_token"))
        self.eos_token = _token_text(cfg.get("eos_token"))
        self.special_tokens = {name: _token_text(cfg[name]) for name in SPECIAL_TOKEN_NAMES
                               if _token_text(cfg.get(name)) is not None}  # what templates see, as in transformers
        self.chat_template = self._load_chat_template(root, cfg)
        self.eos_token_ids = self._eos_ids(root, cfg_path, config_eos_ids)
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)

    @staticmethod
    def _load_chat_template(root: Path, cfg: dict) -> str | None:
        jinja_file = root / "chat_template.jinja"
        if jinja_file.is_file():
            return jinja_file.read_text()
        template = cfg.get("chat_template")
        if isinstance(template, list):  # named templates: use "default"
            named = {t.get("name"): t.get("template") for t in template}
            template = named.get("default") or next(iter(named.values()), None)
        return template

    def _eos_ids(self, root: Path, cfg_path: Path, config_eos_ids: tuple[int, ...]) -> tuple[int, ...]:
        gen_path = root / "generation_config.json"
        if gen_path.is_file():
            eos = _read_json(gen_path).get("eos_token_id")
            if eos is not None:
                return tuple(eos) if isinstance(eos, list) else (int(eos),)
        if config_eos_ids:
            return tuple(config_eos_ids)
        if self.eos_token is not None:
            tid = self._tok.token_to_id(self.eos_token)
            if tid is None:
                raise CheckpointError(f"{cfg_path}: eos_token {self.eos_token!r} is not in tokenizer.json")
            return (tid,)
        return ()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_bounded(self, text: str, max_tokens: int, add_special_tokens: bool = True) -> tuple[int, list[int] | None]:
        """(token count, ids), with ids None when the count is over `max_tokens`. For long
        texts, off the event loop: `encode_batch` releases the GIL while it tokenizes (plain
        `encode` holds it throughout), and a text too long for the context never becomes a
        Python list of ids."""
        encoding = self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0]
        n = len(encoding)
        return n, (encoding.ids if n <= max_tokens else None)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    @functools.cached_property
    def continuation_byte_ids(self) -> tuple[int, ...] | None:
        """Token ids of the raw bytes 0x80 and 0xA0 where this tokenizer decodes the way
        byte-level BPE does: all output bytes through one lossy UTF-8 decode (one U+FFFD per
        invalid stretch, one for a character cut off at the end). Checked on a sample, not
        assumed; None for other tokenizers (SentencePiece's byte fallback replaces every byte
        of an invalid run, so a later byte can change earlier text there)."""
        table = _byte_level_chars()
        ids = [self._tok.token_to_id(table[b]) for b in (0x80, 0xA0, 0xE4)]
        if None in ids:
            return None
        cont, cont_a0, lead = ids

        def decode(seq):
            return self._tok.decode(seq, skip_special_tokens=False)
        if (decode([cont, lead, cont, cont]) != "\ufffd\u4000" or decode([lead, cont]) != "\ufffd"
                or decode([cont, cont_a0]) != "\ufffd\ufffd"):
            return None
        return cont, cont_a0

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None, template_kwargs: dict | None = None) -> str:
        """Render messages (and tool definitions) with the checkpoint's template, exactly as
        transformers does (core/chat_template.py)."""
        if not self.chat_template:
            raise ChatTemplateError("this model has no chat template; use /v1/completions with a prompt")
        return render(self.chat_template, messages, add_generation_prompt, tools, self.special_tokens,
                      template_kwargs)

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None,
                    template_kwargs: dict | None = None, content_as_text: bool = True) -> list[int]:
        # The template writes the special tokens itself (as transformers does).
        text, nonce = self.render_chat(messages, add_generation_prompt, tools, template_kwargs, content_as_text)
        return self.encode_rendered(text, nonce, add_special_tokens=False)

    # ---- control tokens in chat content (core/chat_content.py) --------------------------
    @functools.cached_property
    def special_texts(self) -> list[str]:
        """The text of every special added token (the model's control tokens)."""
        return [t.content for t in self._tok.get_added_tokens_decoder().values() if t.special]

    @functools.cached_property
    def _special_marks(self):
        return special_pattern(self.special_texts), {t: i for i, t in enumerate(self.special_texts)}

    @functools.cached_property
    def _as_text(self) -> HFTokenizer:
        """This tokenizer with special tokens' text tokenized as ordinary text."""
        tok = HFTokenizer.from_str(self._tok.to_str())
        tok.encode_special_tokens = True
        return tok

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None,
                    template_kwargs: dict | None = None, content_as_text: bool = True) -> tuple[str, str | None]:
        """(the rendered prompt, a nonce for encode_rendered): with `content_as_text`,
        control-token text in the client's strings is marked so it stays text."""
        nonce = None
        pattern, index = self._special_marks
        if content_as_text and pattern is not None:
            marked, nonce = mark_strings([*messages, *(tools or ())], pattern, index)
            if nonce is not None:
                messages, tools = marked[: len(messages)], (marked[len(messages):] if tools else tools)
        return self.apply_chat_template(messages, add_generation_prompt, tools, template_kwargs), nonce

    def encode_rendered(self, text: str, nonce: str | None, add_special_tokens: bool = False) -> list[int]:
        """Token ids of render_chat's text: in one piece, or split at its markers."""
        if nonce is None:
            return self.encode(text, add_special_tokens)
        pieces = [self._tok.encode(piece, add_special_tokens=False) if special is None
                  else self._as_text.encode(self.special_texts[special], add_special_tokens=False)
                  for piece, special in split_marked(text, nonce)]
        merged = Encoding.merge(pieces)
        return (self._tok.post_process(merged) if add_special_tokens else merged).ids


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas.

    A token can end in the middle of a multi-byte character, so text that ends in U+FFFD
    is held back until it decodes cleanly, as vLLM does; decoding from a window that starts
    a few tokens back keeps tokenizers that treat the first token specially (leading spaces)
    right. With byte-level vocabularies, replacement characters that no later byte can
    change (a stray continuation byte, a character broken off) are not held back: a model
    emitting invalid bytes would otherwise stream nothing at all until its end.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []
        self.text = ""
        self._prefix_offset = 0
        self._read_offset = 0
        self._window_sent = 0  # characters of the window after its prefix already handed out

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_id: int) -> str:
        """Append one token; return the newly stable text (may be empty)."""
        self.token_ids.append(token_id)
        prefix = self._decode(self.token_ids[self._prefix_offset : self._read_offset])
        full = self._decode(self.token_ids[self._prefix_offset :])
        if len(full) <= len(prefix):
            return ""
        sent = len(prefix) + self._window_sent
        if not full.endswith("\ufffd") or self._replacements_final(full):
            delta = full[sent:]
            self._prefix_offset, self._read_offset, self._window_sent = self._read_offset, len(self.token_ids), 0
        elif self.tokenizer.continuation_byte_ids is not None:
            # the last U+FFFD is a character still being written: everything before it is final
            delta = full[sent:-1]
            self._window_sent += len(delta)
            self._move_window_past(full[:-1])
        else:
            delta = ""
        self.text += delta
        return delta

    def _move_window_past(self, sent_text: str) -> None:
        """Start the next window after the last token whose text is all sent, where the held
        character's bytes are tokens of their own (at most 3): a model that keeps writing
        broken characters would otherwise decode an ever longer window at every token."""
        n = len(self.token_ids)
        for boundary in range(n - 1, max(self._read_offset, n - 4), -1):
            if self._decode(self.token_ids[self._prefix_offset : boundary]) == sent_text:
                self._prefix_offset, self._read_offset, self._window_sent = self._read_offset, boundary, 0
                return

    def _replacements_final(self, full: str) -> bool:
        """Whether the U+FFFD `full` ends with stays whatever bytes come next: no continuation
        byte appended to the window joins its last bytes into a character (0x80 and 0xA0
        together cover the second bytes every UTF-8 lead byte accepts)."""
        probes = self.tokenizer.continuation_byte_ids
        if probes is None:
            return False
        window = self.token_ids[self._prefix_offset :]
        return all(self._decode([*window, p]) == full + "\ufffd" for p in probes)

    def flush(self) -> str:
        """At the end of generation: whatever is left, even an incomplete character."""
        prefix = self._decode(self.token_ids[self._prefix_offset : self._read_offset])
        full = self._decode(self.token_ids[self._prefix_offset :])
        delta = full[len(prefix) + self._window_sent :] if len(full) > len(prefix) else ""
        self._prefix_offset = self._read_offset = len(self.token_ids)
        self._window_sent = 0
        self.text += delta
        return delta
