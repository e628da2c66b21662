"""Tokenizers for generation.

* A checkpoint with ``tokenizer.json`` uses it through the ``tokenizers`` library; its chat template
  (``chat_template`` in ``tokenizer_config.json``, or ``chat_template.jinja``) is applied with jinja2
  unless ``raw`` is asked for. A corrupt file raises ValueError naming it (a broken template when it is
  applied).
* A random-weight preset has no tokenizer: the **byte-level fallback** maps each UTF-8 byte b to
  id b (ids 0..255; the preset's vocabulary must hold at least 256 ids) and decodes ids >= 256 as
  ``<id>``. It exists so the CLI runs end to end on presets; the text is meaningless.
"""

from __future__ import annotations

from pathlib import Path

from m3jax.config import read_json_object


class ByteTokenizer:
    name = "byte-level fallback"
    chat_template = None

    def __init__(self, vocab_size: int):
        if vocab_size < 256:
            raise ValueError(f"byte-level fallback tokenizer needs vocab_size >= 256, got {vocab_size}")
        self.vocab_size = vocab_size

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        out, buf = [], bytearray()
        for i in ids:
            if i < 256:
                buf.append(i)
            else:
                out.append(buf.decode("utf-8", errors="replace"))
                buf = bytearray()
                out.append(f"<{i}>")
        out.append(buf.decode("utf-8", errors="replace"))
        return "".join(out)


class HFTokenizer:
    """``tokenizer.json`` (+ optional chat template) from a checkpoint directory."""

    def __init__(self, directory: Path):
        from tokenizers import Tokenizer

        self.name = str(directory / "tokenizer.json")
        try:
            self.tok = Tokenizer.from_file(self.name)
        except Exception as e:  # the tokenizers library raises a bare Exception ("key must be a string ...")
            raise ValueError(f"{self.name}: not a valid tokenizers file ({e})") from e
        cfg_path = directory / "tokenizer_config.json"
        self.config = read_json_object(cfg_path) if cfg_path.exists() else {}
        template_file = directory / "chat_template.jinja"
        if template_file.exists():
            try:
                self.chat_template, self.chat_template_source = template_file.read_text(), str(template_file)
            except UnicodeDecodeError as e:
                raise ValueError(f"{template_file}: not UTF-8 text ({e})") from e
        else:
            self.chat_template_source = f"{cfg_path} (chat_template)"
            self.chat_template = _named_template(self.config.get("chat_template"), self.chat_template_source)

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=False)

    def token_str(self, key: str) -> str | None:
        v = self.config.get(key)
        return v.get("content") if isinstance(v, dict) else v

    def apply_chat_template(self, prompt: str) -> str:
        import jinja2

        env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
        try:
            template = env.from_string(self.chat_template)
            return template.render(
                messages=[{"role": "user", "content": prompt}],
                add_generation_prompt=True,
                bos_token=self.token_str("bos_token") or "",
                eos_token=self.token_str("eos_token") or "",
            )
        except jinja2.TemplateSyntaxError as e:
            raise ValueError(f"{self.chat_template_source}: invalid chat template (line {e.lineno}: {e})") from e
        except jinja2.TemplateError as e:  # e.g. an undefined variable or function met while rendering
            raise ValueError(f"{self.chat_template_source}: applying the chat template failed ({e})") from e


def _named_template(value, source: str) -> str | None:
    """A ``tokenizer_config.json`` ``chat_template``: a string, or (as transformers writes several) a list
    of ``{"name", "template"}`` objects, of which the one named "default" is the chat template."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(t, dict) and isinstance(t.get("name"), str)
                                       and isinstance(t.get("template"), str) for t in value):
        default = [t["template"] for t in value if t["name"] == "default"]
        if default:
            return default[0]
        raise ValueError(f"{source}: no template named 'default' among {[t['name'] for t in value]}")
    raise ValueError(f"{source}: expected a string or a list of {{'name', 'template'}} objects, "
                     f"got {type(value).__name__}")


# Files that say a checkpoint has a tokenizer of its own (m3jax reads only tokenizer.json of them).
TOKENIZER_SIGNS = ("tokenizer_config.json", "tokenizer.model", "vocab.json")


def load_tokenizer(checkpoint: Path | None, vocab_size: int, byte_fallback: bool = False):
    """The checkpoint's ``tokenizer.json``, else byte-level ids. A checkpoint that has tokenizer files
    but no ``tokenizer.json`` (a save cut short, a copy that missed it, a sentencepiece-only repo) is
    refused: its ids are not bytes, and byte-level text would be garbage; ``byte_fallback`` runs it so."""
    if checkpoint is not None and (Path(checkpoint) / "tokenizer.json").exists():
        return HFTokenizer(Path(checkpoint))
    signs = [n for n in TOKENIZER_SIGNS if checkpoint is not None and (Path(checkpoint) / n).exists()]
    if signs and not byte_fallback:
        raise ValueError(f"{checkpoint} has {signs} but no tokenizer.json: the model was trained with a tokenizer "
                         "that m3jax cannot read from these files; copy its tokenizer.json there, or pass "
                         "--byte-tokenizer to run on byte-level ids anyway")
    return ByteTokenizer(vocab_size)
