"""Write small random-weight GGUF models that a real `llama-server` loads and serves.

The test models exist so the whole path (launch, health, routing, chat, slots, metrics) runs against the
real engine without downloading weights, and so the sizing planner can be checked on every architecture family
it models. Each architecture has a writer (`_WRITERS`, in the architecture modules beside this one, imported when used)
that returns its tensors and metadata keys; this module holds what every writer shares and adds what every model
shares. The writers import this module, never the reverse. Weights are F16 matrices and F32 norms, with a
SentencePiece ("llama") vocabulary: `<unk>`, `<s>`, `</s>`, the 256 byte-fallback tokens `<0x00>`…`<0xFF>`,
single characters, then common English words with every prefix (so the SentencePiece merge of adjacent
pieces can reach the whole word) and, for large vocabularies, generated filler pieces. A ChatML-style Jinja
template in `tokenizer.chat_template` lets `/v1/chat/completions` work, system messages included.

With `split > 1` the model is written as a split family `NAME-00001-of-0000N.gguf` … whose shards carry
`split.no`, `split.count` and `split.tensors.count`, as `llama-gguf-split` writes them; the first shard is
the one to pass to `llama-server --model`.

Files are written into a temporary directory next to the target and renamed into place, the first shard
last, so a failed or interrupted write never leaves a half-written model under the final name.

Read a model back with `read_gguf_metadata` (`_gguf.py`).
"""

from __future__ import annotations

import importlib
import itertools
import logging
import shutil
import string
import tempfile
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from qiip_core._violation import FieldNames, spell

__all__ = [
    "CHAT_TEMPLATE",
    "MIN_VOCAB",
    "TEST_ARCHITECTURES",
    "ArchitectureWriter",
    "TestModelSpec",
    "Option",
    "Weights",
    "add_attention_metadata",
    "check_options",
    "make_test_gguf",
]

logger = logging.getLogger("qiip.engines")

MIN_VOCAB = 300
"""Smallest vocabulary: 3 specials, 256 byte tokens and at least some word pieces."""

MAX_VOCAB = 262_144
"""Largest vocabulary `make_test_gguf` writes."""

CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- endif -%}"
)
"""ChatML-style template: every role (system, user, assistant) as `<|im_start|>ROLE\\nTEXT<|im_end|>`."""

_SPIECE_SPACE = "\u2581"  # "▁", SentencePiece's word-start marker

_WORDS = (
    "the of and to a in is you that it hello world he was for on are as with his they I at be this have from or one "
    "had by word but not what all were we when your can said there use an each which she do how their if "
    "will up other about out many then them these so some her would make like him into time has look two "
    "more write go see number no way could people my than first water been call who oil its now find long "
    "down day did get come made may part model server test token text chat system user answer "
    "question request response node fleet gateway route health slot cache context memory speed fast small"
).split()

_PUNCTUATION = ".,!?;:'\"()-[]{}<>/\\@#$%&*+=_|~`^"


def _validate(
    *,
    n_layers: int,
    n_embd: int,
    n_head: int,
    n_head_kv: int,
    n_ctx_train: int,
    n_vocab: int,
    n_ff: int,
    split: int,
    names: FieldNames | None,
) -> None:
    layers, embd, head, head_kv = (spell(names, f) for f in ("n_layers", "n_embd", "n_head", "n_head_kv"))
    if not 1 <= n_layers <= 512:
        raise ValueError(f"{layers} must be between 1 and 512, got {n_layers}.")
    if not 8 <= n_embd <= 16384:
        raise ValueError(f"{embd} must be between 8 and 16384, got {n_embd}.")
    if n_head < 1 or n_embd % n_head != 0:
        raise ValueError(f"{head} must be at least 1 and divide {embd} ({n_embd}), got {n_head}.")
    if (n_embd // n_head) % 2 != 0:
        allowed = [h for h in range(1, n_embd + 1) if n_embd % h == 0 and (n_embd // h) % 2 == 0]
        raise ValueError(
            f"{embd} / {head} (the head size, {n_embd // n_head}) must be even for rotary embeddings; "
            f"with {embd} {n_embd}, {head} may be one of {allowed}."
        )
    if n_head_kv < 1 or n_head % n_head_kv != 0:
        raise ValueError(f"{head_kv} must be at least 1 and divide {head} ({n_head}), got {n_head_kv}.")
    if not 16 <= n_ctx_train <= 1 << 24:
        raise ValueError(f"{spell(names, 'n_ctx_train')} must be between 16 and {1 << 24} tokens, got {n_ctx_train}.")
    if not MIN_VOCAB <= n_vocab <= MAX_VOCAB:
        raise ValueError(
            f"{spell(names, 'n_vocab')} must be between {MIN_VOCAB} (3 specials, 256 byte tokens and some word "
            f"pieces) and {MAX_VOCAB}, got {n_vocab}."
        )
    if not 1 <= n_ff <= 16 * 16384:
        raise ValueError(f"{spell(names, 'n_ff')} must be between 1 and {16 * 16384}, got {n_ff}.")
    if split < 1:
        raise ValueError(f"{spell(names, 'split')} must be between 1 and the number of tensors, got {split}.")


def _filler_pieces() -> Iterator[str]:
    letters = string.ascii_lowercase
    for length in itertools.count(2):
        for combo in itertools.product(letters, repeat=length):
            word = "".join(combo)
            yield _SPIECE_SPACE + word
            yield word


def build_vocab(n_vocab: int) -> tuple[list[str], list[float], list[int]]:
    """The tokens, scores and token types of the test vocabulary.

    Args:
        n_vocab: vocabulary size, at least `MIN_VOCAB`.

    Returns:
        Three lists of length `n_vocab`: token texts, scores (higher merges first) and `gguf.TokenType`
        values.
    """
    from gguf import TokenType

    tokens = ["<unk>", "<s>", "</s>"]
    types = [int(TokenType.UNKNOWN), int(TokenType.CONTROL), int(TokenType.CONTROL)]
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [int(TokenType.BYTE)] * 256
    seen = set(tokens)
    pieces: list[str] = []

    def add(piece: str) -> None:
        if piece not in seen:
            seen.add(piece)
            pieces.append(piece)

    for char in _SPIECE_SPACE + string.ascii_lowercase + string.ascii_uppercase + string.digits + _PUNCTUATION:
        add(char)
    for word in _WORDS:
        # Every prefix of "▁word": SentencePiece merges adjacent pieces only into pieces that exist.
        full = _SPIECE_SPACE + word
        for end in range(2, len(full) + 1):
            add(full[:end])
    filler = _filler_pieces()
    while len(tokens) + len(pieces) < n_vocab:
        add(next(filler))
    pieces = pieces[: n_vocab - len(tokens)]
    scores = [0.0] * len(tokens) + [-float(i) for i in range(len(pieces))]
    tokens += pieces
    types += [int(TokenType.NORMAL)] * len(pieces)
    return tokens, scores, types


@dataclass(frozen=True, kw_only=True)
class TestModelSpec:
    """What a test model of any architecture is asked to be: the common shape, and the architecture's options."""

    architecture: str
    """`general.architecture` to write (a key of `TEST_ARCHITECTURES`)."""
    n_layers: int
    n_embd: int
    n_head: int
    n_head_kv: int
    n_ctx_train: int
    n_vocab: int
    n_ff: int
    options: Mapping[str, int | float | bool] = field(default_factory=dict)
    """Architecture-specific settings (`sliding_window`, `n_expert`, …); each writer names what it takes."""
    names: FieldNames | None = None
    """How the caller spells `make_test_gguf`'s arguments in error messages (`make_test_gguf`'s `names`)."""

    @property
    def head_dim(self) -> int:
        """Width of one attention head: `n_embd / n_head`."""
        return self.n_embd // self.n_head

    def option(self, name: str, default: int | float | bool) -> Any:
        """An architecture option, or its default."""
        return self.options.get(name, default)

    def name(self, argument: str) -> str:
        """`make_test_gguf`'s `argument` (`n_ff`, `architecture`) as the caller spells it, for a message."""
        return spell(self.names, argument)

    @property
    def arch(self) -> str:
        """`architecture <name>` as the caller spells the argument (`--arch gemma3` in the CLI), for a message."""
        return f"{self.name('architecture')} {self.architecture}"


class Weights:
    """Random test weights: F16 matrices scaled by 1/√(input width), F32 norms of ones. Seeded, so repeatable."""

    def __init__(self, seed: int) -> None:
        import numpy as np

        self.np = np
        self.rng = np.random.default_rng(seed)

    def matrix(self, rows: int, cols: int) -> Any:
        """An F16 weight of `rows` outputs and `cols` inputs (numpy `(rows, cols)` is GGUF `ne = [cols, rows]`)."""
        scale = 1.0 / self.np.sqrt(cols)
        return (self.rng.standard_normal((rows, cols), dtype=self.np.float32) * scale).astype(self.np.float16)

    def experts(self, n_expert: int, rows: int, cols: int) -> Any:
        """An F16 stack of `n_expert` weights (GGUF `ne = [cols, rows, n_expert]`)."""
        scale = 1.0 / self.np.sqrt(cols)
        values = self.rng.standard_normal((n_expert, rows, cols), dtype=self.np.float32) * scale
        return values.astype(self.np.float16)

    def norm(self, n: int) -> Any:
        """An F32 vector of ones (a norm's weight)."""
        return self.np.ones(n, dtype=self.np.float32)

    def vector(self, n: int, scale: float = 0.02) -> Any:
        """A small random F32 vector (a bias)."""
        return (self.rng.standard_normal(n, dtype=self.np.float32) * scale).astype(self.np.float32)


Tensors = list[tuple[str, Any]]
"""Named arrays in file order."""

_KINDS = {int: "a whole number", float: "a number", bool: "true or false"}


@dataclass(frozen=True)
class Option:
    """What an architecture option takes: its kind and, for numbers, the smallest (and largest) value."""

    kind: type
    """`int`, `float` (a whole number is a number too) or `bool`."""
    minimum: float | None = None
    maximum: float | None = None


def check_options(spec: TestModelSpec, known: Mapping[str, Option]) -> None:
    """Refuse an option the architecture does not take, of the wrong kind, or out of its range, naming it.

    Raises:
        ValueError: the first option that is not allowed, with what is.
    """
    unknown = sorted(set(spec.options) - set(known))
    if unknown:
        takes = ", ".join(sorted(known)) or "no options"
        raise ValueError(f"{spec.arch} takes {takes}; got {', '.join(unknown)}.")
    for name, value in spec.options.items():
        rule = known[name]
        accepted = (int, float) if rule.kind is float else (rule.kind,)
        if type(value) not in accepted:
            raise ValueError(f"option {name} of {spec.arch} must be {_KINDS[rule.kind]}, got {value!r}.")
        if rule.minimum is not None and not isinstance(value, bool) and value < rule.minimum:
            raise ValueError(f"option {name} of {spec.arch} must be at least {rule.minimum:g}, got {value}.")
        if rule.maximum is not None and not isinstance(value, bool) and value > rule.maximum:
            raise ValueError(f"option {name} of {spec.arch} must be at most {rule.maximum:g}, got {value}.")


ArchitectureWriter = Callable[[TestModelSpec, Weights], tuple[Tensors, Callable[[Any], None]]]
"""Writes one architecture: its tensors, and a function adding its metadata keys to a `gguf.GGUFWriter`."""

_WRITERS: dict[str, str] = {
    "llama": "qiip_core.engines.llamacpp.testmodels._llama:llama_writer",
    "granite": "qiip_core.engines.llamacpp.testmodels._llama:granite_writer",
    "gemma2": "qiip_core.engines.llamacpp.testmodels._gemma:gemma2_writer",
    "gemma3": "qiip_core.engines.llamacpp.testmodels._gemma:gemma3_writer",
    "qwen2moe": "qiip_core.engines.llamacpp.testmodels._moe:qwen2moe_writer",
    "qwen3moe": "qiip_core.engines.llamacpp.testmodels._moe:qwen3moe_writer",
    "lfm2": "qiip_core.engines.llamacpp.testmodels._recurrent:lfm2_writer",
    "granitehybrid": "qiip_core.engines.llamacpp.testmodels._recurrent:granitehybrid_writer",
    "mamba2": "qiip_core.engines.llamacpp.testmodels._recurrent:mamba2_writer",
    "mamba": "qiip_core.engines.llamacpp.testmodels._recurrent:mamba_writer",
    "bert": "qiip_core.engines.llamacpp.testmodels._embed:bert_writer",
    "nomic-bert": "qiip_core.engines.llamacpp.testmodels._embed:nomic_bert_writer",
    "qwen3": "qiip_core.engines.llamacpp.testmodels._embed:qwen3_writer",
}
"""`general.architecture` → the writer (`module:function`, imported when used)."""

TEST_ARCHITECTURES = tuple(sorted(_WRITERS))
"""The architectures `make_test_gguf` writes."""


def _writer(architecture: str, names: FieldNames | None) -> ArchitectureWriter:
    target = _WRITERS.get(architecture)
    if target is None:
        raise ValueError(
            f"{spell(names, 'architecture')} must be one of {', '.join(sorted(_WRITERS))}; got {architecture!r}."
        )
    module, _, name = target.partition(":")
    writer: ArchitectureWriter = getattr(importlib.import_module(module), name)
    return writer


def _written(writer: Any, key: str) -> bool:
    """Whether the architecture's metadata already wrote `key` (the shared value then stays out)."""
    return any(key in kv for kv in writer.kv_data)


def add_attention_metadata(writer: Any, spec: TestModelSpec, *, rms_eps: float = 1e-5) -> None:
    """The keys every rotary decoder has: feed-forward width, head counts, RoPE and the RMS norm's epsilon."""
    writer.add_feed_forward_length(spec.n_ff)
    writer.add_head_count(spec.n_head)
    writer.add_head_count_kv(spec.n_head_kv)
    writer.add_rope_dimension_count(spec.head_dim)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(rms_eps)


def make_test_gguf(
    path: Path,
    *,
    architecture: str = "llama",
    n_layers: int = 2,
    n_embd: int = 64,
    n_head: int = 4,
    n_head_kv: int = 4,
    n_ctx_train: int = 2048,
    n_vocab: int = 512,
    n_ff: int | None = None,
    split: int = 1,
    seed: int = 0,
    options: Mapping[str, int | float | bool] | None = None,
    names: FieldNames | None = None,
) -> list[Path]:
    """Write a random-weight GGUF that `llama-server` loads and serves (chats with, for decoders).

    The same arguments always write the same bytes.

    Args:
        path: the file to write, ending in `.gguf`. With `split > 1` it names the family: `x.gguf` becomes
            `x-00001-of-0000N.gguf` ….
        architecture: `general.architecture`, one of `TEST_ARCHITECTURES` (`llama` by default).
        n_layers: blocks (1–512).
        n_embd: embedding width (8–16384).
        n_head: attention heads; must divide `n_embd`, with an even head size.
        n_head_kv: K/V heads (grouped-query attention); must divide `n_head`.
        n_ctx_train: training context in tokens (16–2^24).
        n_vocab: vocabulary size (300–262144).
        n_ff: feed-forward width; default `4 * n_embd`.
        split: number of files; between 1 and the number of tensors.
        seed: seed of the random weights.
        options: the architecture's own settings (each writer documents what it takes).
        names: how the caller spells these arguments in error messages (`{"n_head": "--heads"}` for the CLI);
            None spells them as here.

    Returns:
        The files written, the entrypoint (the only file, or the first shard) first.

    Raises:
        ValueError: an argument is out of range or inconsistent, or an option is unknown to the architecture;
            the message says what is allowed.
        OSError: the directory cannot be written; nothing is left under the final names.
    """
    from gguf import GGUFWriter, LlamaFileType

    path = Path(path)
    if path.suffix != ".gguf" or not path.stem:
        raise ValueError(f"The model path must be a file name ending in .gguf, such as model.gguf; got {path.name!r}.")
    ff = 4 * n_embd if n_ff is None else n_ff
    _validate(
        n_layers=n_layers,
        n_embd=n_embd,
        n_head=n_head,
        n_head_kv=n_head_kv,
        n_ctx_train=n_ctx_train,
        n_vocab=n_vocab,
        n_ff=ff,
        split=split,
        names=names,
    )
    spec = TestModelSpec(
        architecture=architecture,
        n_layers=n_layers,
        n_embd=n_embd,
        n_head=n_head,
        n_head_kv=n_head_kv,
        n_ctx_train=n_ctx_train,
        n_vocab=n_vocab,
        n_ff=ff,
        options=dict(options or {}),
        names=names,
    )
    tensors, add_metadata = _writer(architecture, names)(spec, Weights(seed))
    if split > len(tensors):
        raise ValueError(
            f"{spec.name('split')} must be between 1 and the number of tensors ({len(tensors)} for {n_layers} layers), "
            f"got {split}."
        )

    tokens, scores, types = build_vocab(n_vocab)
    directory = path.parent
    directory.mkdir(parents=True, exist_ok=True)
    tmp_dir = Path(tempfile.mkdtemp(prefix=f".{path.stem}.tmp-", dir=directory))
    try:
        writer = GGUFWriter(tmp_dir / path.name, architecture)
        writer.add_name(f"qiip-test-{n_layers}x{n_embd}")
        writer.add_file_type(int(LlamaFileType.MOSTLY_F16))
        writer.add_context_length(n_ctx_train)
        writer.add_embedding_length(n_embd)
        writer.add_block_count(n_layers)
        add_metadata(writer)
        writer.add_vocab_size(n_vocab)
        # An architecture may bring its own tokenizer (the encoders' WordPiece); else SentencePiece.
        if not _written(writer, "tokenizer.ggml.model"):
            writer.add_tokenizer_model("llama")
        writer.add_tokenizer_pre("default")
        writer.add_token_list(tokens)
        writer.add_token_scores(scores)
        if not _written(writer, "tokenizer.ggml.token_type"):
            writer.add_token_types(types)
        writer.add_unk_token_id(0)
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
        writer.add_add_bos_token(True)
        writer.add_add_eos_token(False)
        writer.add_add_space_prefix(True)
        writer.add_chat_template(CHAT_TEMPLATE)
        # Exactly `split` shards, as even as possible: start a new shard at each boundary by letting the
        # writer's tensor limit trip there, and only there.
        boundaries = {k * len(tensors) // split for k in range(1, split)}
        for index, (name, array) in enumerate(tensors):
            writer.split_max_tensors = 1 if index in boundaries else 0
            writer.add_tensor(name, array)
        writer.split_max_tensors = 0
        try:
            writer.write_header_to_file()
            writer.write_kv_data_to_file()
            writer.write_tensors_to_file()
        finally:
            writer.close()
        written = sorted(tmp_dir.iterdir())
        if len(written) != split:  # pragma: no cover - guards the boundary arithmetic above
            raise RuntimeError(f"expected {split} files, the writer produced {len(written)}")
        finals = [directory / f.name for f in written]
        # The entrypoint last: once it exists under its final name, the whole family does.
        for tmp_file, final in reversed(list(zip(written, finals, strict=True))):
            tmp_file.replace(final)
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)
    logger.info("wrote test model %s (%d file(s))", finals[0], len(finals))
    return finals
