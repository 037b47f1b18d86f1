"""Tokenizers as a plug-in point, and training the SentencePiece model the demo uses.

Owns the ``Tokenizer`` interface, the ``KINDS`` registry (``sentencepiece``: a ``.model`` file;
``hf``: a local ``tokenizer.json`` read with the ``tokenizers`` library), ``load_tokenizer`` and
``train_sentencepiece``.

Invariants:
* A tokenizer's identity is the sha256 of the exact bytes it was loaded from plus the library
  version (``identity()``); shards record it so a changed file or library is caught.
* ``encode_batch`` runs on one thread: tokenization parallelises over processes, and a library
  thread pool inside each would oversubscribe the cores (and ``tokenizers`` warns after a fork).
* ``encode_batch`` returns text tokens only, never BOS/EOS/template tokens: the pipeline appends
  ``eod_id`` after each document itself. ``decode`` drops special/control tokens.
* Every tokenizer has an end-of-document id; a file without one is refused at load.
* Training is deterministic: the same inputs and vocab size give a byte-identical model.

It does not download tokenizers, add tokens to them or convert between kinds.
"""

from __future__ import annotations

import abc
import hashlib
import io
import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, ClassVar

import sentencepiece
import tokenizers

from goodput.data.readers import iter_texts
from goodput.errors import GoodputError
from goodput.io import read_bytes, write_bytes
from goodput.outputs import TOKENIZER_MODEL, check_output_file

# A tokenizer file is megabytes (a 256k-token tokenizer.json: ~35 MB); this is a bound, not a size.
MAX_TOKENIZER_BYTES = 1 << 30
# Tokens an HF tokenizer may use to end a document, tried in this order.
HF_EOD_TOKENS = ("</s>", "<|endoftext|>", "<eos>", "<|end_of_text|>")

# SentencePiece training feeds documents as chunks of whole lines of at most this many characters
# (longer lines are cut): code files exceed any sensible sentence length, and cutting at line ends
# keeps newlines inside the chunks so the model learns pieces such as "):\n".
TRAIN_CHUNK_CHARS = 4096
# At most this many chunks (so at most ~400 MB of text) are read; SentencePiece holds them all in
# memory and one-thread BPE training grows with their size. The first ones in input order are
# taken, so the sample is deterministic.
TRAIN_MAX_SENTENCES = 100_000


class Tokenizer(abc.ABC):
    """One loaded tokenizer file. Subclasses load it and set the attributes below."""

    kind: ClassVar[str]
    path: Path
    sha256: str
    library: str
    vocab_size: int
    eod_id: int

    @abc.abstractmethod
    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each text, on the calling thread only."""

    @abc.abstractmethod
    def decode(self, ids: Sequence[int]) -> str:
        """The text of ``ids``."""

    def identity(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "path": str(Path(self.path).resolve()),  # verify finds it from any directory
            "sha256": self.sha256,
            "library": self.library,
            "vocab_size": self.vocab_size,
            "eod_id": self.eod_id,
        }


class SentencePieceTokenizer(Tokenizer):
    kind = "sentencepiece"

    def __init__(self, path: Path):
        data = _read_file(path)
        self.path, self.sha256 = path, hashlib.sha256(data).hexdigest()
        self.library = f"sentencepiece=={sentencepiece.__version__}"
        self._processor = sentencepiece.SentencePieceProcessor()
        try:
            self._processor.LoadFromSerializedProto(data)
        except (RuntimeError, OSError) as error:
            raise GoodputError(
                path, f"not a SentencePiece model ({error})", "point at a .model file"
            ) from None
        self.vocab_size = self._processor.get_piece_size()
        self.eod_id = self._processor.eos_id()
        if self.eod_id < 0:
            raise GoodputError(
                path,
                "the model has no end-of-sequence token (eos_id is -1); documents need one to end",
                "retrain it with an eos id, e.g. `goodput data train-tokenizer`",
            )

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self._processor.encode(texts, num_threads=1)

    def decode(self, ids: Sequence[int]) -> str:
        return self._processor.decode(list(ids))


class HFTokenizer(Tokenizer):
    kind = "hf"

    def __init__(self, path: Path):
        data = _read_file(path)
        self.path, self.sha256 = path, hashlib.sha256(data).hexdigest()
        self.library = f"tokenizers=={tokenizers.__version__}"
        try:
            self._tokenizer = tokenizers.Tokenizer.from_buffer(data)
        except Exception as error:  # the library raises bare Exception for bad files
            raise GoodputError(
                path, f"not a tokenizers JSON file ({error})", "point at a tokenizer.json"
            ) from None
        self.vocab_size = self._tokenizer.get_vocab_size(with_added_tokens=True)
        self.eod_id = self._eod_id(path)
        # The library reads this on every batch call and otherwise runs a thread pool over the
        # batch; setting it here (not at import) holds however the process started.
        os.environ["TOKENIZERS_PARALLELISM"] = "false"

    def _eod_id(self, path: Path) -> int:
        for token in HF_EOD_TOKENS:
            token_id = self._tokenizer.token_to_id(token)
            if token_id is not None:
                return int(token_id)
        raise GoodputError(
            path,
            f"no end-of-document token (looked for {', '.join(HF_EOD_TOKENS)})",
            "add one of them to the tokenizer as a special token",
        )

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        # encode_batch_fast skips character offsets, which nothing here uses.
        encodings = self._tokenizer.encode_batch_fast(texts, add_special_tokens=False)
        return [encoding.ids for encoding in encodings]

    def decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=True)


KINDS: dict[str, Callable[[Path], Tokenizer]] = {
    "sentencepiece": SentencePieceTokenizer,
    "hf": HFTokenizer,
}
SUFFIX_KINDS = {".model": "sentencepiece", ".json": "hf"}


def load_tokenizer(path: str | os.PathLike[str], kind: str | None = None) -> Tokenizer:
    """Load the tokenizer at ``path``; ``kind`` defaults to the one its suffix implies."""
    path = Path(path)
    valid = ", ".join(sorted(KINDS))
    if kind is None:
        kind = SUFFIX_KINDS.get(path.suffix)
        if kind is None:
            raise GoodputError(
                path,
                "cannot tell the tokenizer kind from the file name",
                f"use a .model (sentencepiece) or .json (hf) file, or pass --tokenizer-kind "
                f"({valid})",
            )
    if kind not in KINDS:
        raise GoodputError.usage(
            "--tokenizer-kind",
            f"unknown kind {kind!r}",
            f"use one of: {valid}",
        )
    return KINDS[kind](path)


def _read_file(path: Path) -> bytes:
    """The tokenizer file's bytes (both libraries load from memory, so only goodput opens it: a
    regular file, bounded)."""
    try:
        return read_bytes(path, MAX_TOKENIZER_BYTES)
    except GoodputError as error:
        raise GoodputError(
            path, f"cannot read the tokenizer: {error.what}", "check the --tokenizer path"
        ) from None


def train_sentencepiece(
    inputs: list[Path], vocab_size: int, output: Path, text_field: str = "text"
) -> Path:
    """Train a byte-fallback BPE SentencePiece model on ``inputs``; write it to ``output``.

    ``inputs`` are input files as ``readers.list_inputs`` returns them. Any text round-trips
    through the model (identity normalisation, no whitespace folding, unknown characters fall
    back to bytes). Ids: unk 0, bos 1, eos 2, no pad.
    """
    output = check_output_file(Path(output), TOKENIZER_MODEL, "--output", inputs)
    if output.suffix != ".model":
        raise GoodputError.usage(
            output, "a SentencePiece model must end in .model", "rename the output"
        )
    feed = _TrainingFeed(inputs, text_field)
    model = io.BytesIO()
    try:
        sentencepiece.SentencePieceTrainer.train(
            sentence_iterator=iter(feed),
            model_writer=model,
            vocab_size=vocab_size,
            model_type="bpe",  # unigram training took ~30x longer on the demo corpus
            byte_fallback=True,
            normalization_rule_name="identity",
            remove_extra_whitespaces=False,
            add_dummy_prefix=False,
            allow_whitespace_only_pieces=True,  # runs of indentation are common in code
            split_digits=True,
            max_sentence_length=4 * TRAIN_CHUNK_CHARS,  # counted in UTF-8 bytes
            input_sentence_size=TRAIN_MAX_SENTENCES,
            shuffle_input_sentence=False,
            num_threads=1,  # more threads make the merge order depend on scheduling
            minloglevel=2,  # the trainer logs thousands of lines otherwise
            unk_id=0,
            bos_id=1,
            eos_id=2,
            pad_id=-1,  # the pipeline never pads
        )
    except RuntimeError as error:
        raise _training_error(feed, vocab_size, error) from None
    write_bytes(output, model.getvalue())
    return output


class _TrainingFeed:
    """The trainer's sentences: documents cut into chunks, at most ``TRAIN_MAX_SENTENCES``.

    The trainer turns an exception raised inside the iterator into a bare RuntimeError, so the
    reader's ``GoodputError`` is kept here to be raised as itself.
    """

    def __init__(self, inputs: list[Path], text_field: str):
        self.inputs = inputs
        self.text_field = text_field
        self.num_sentences = 0
        self.error: GoodputError | None = None

    def __iter__(self) -> Iterator[str]:
        try:
            for path in self.inputs:
                for text in iter_texts(path, self.text_field):
                    for chunk in _line_chunks(text):
                        yield chunk
                        self.num_sentences += 1
                        if self.num_sentences == TRAIN_MAX_SENTENCES:
                            return
        except GoodputError as error:
            self.error = error
            raise


def _training_error(feed: _TrainingFeed, vocab_size: int, error: RuntimeError) -> GoodputError:
    if feed.error is not None:
        return feed.error
    if feed.num_sentences == 0:
        return GoodputError(
            ", ".join(map(str, feed.inputs)) or "inputs",
            "hold no non-empty documents",
            "train on inputs that contain text (check --text-field)",
        )
    # The library's message starts with its source location and a failed check; the rest is the
    # part a user can act on, e.g. "Vocabulary size too high (5000). Please set it to ... <= 331."
    reason = str(error).rsplit("] ", 1)[-1]
    return GoodputError(
        f"--vocab-size {vocab_size}",
        f"SentencePiece training failed: {reason}",
        "pick a vocab size the inputs support: more text allows a larger one, and byte "
        "fallback alone needs 259 ids plus one per distinct character",
    )


def _line_chunks(text: str) -> Iterator[str]:
    """Cut ``text`` into chunks of whole lines of at most ``TRAIN_CHUNK_CHARS``."""
    chunk: list[str] = []
    num_chars = 0
    for line in text.splitlines(keepends=True):
        for start in range(0, len(line), TRAIN_CHUNK_CHARS):
            piece = line[start : start + TRAIN_CHUNK_CHARS]
            if chunk and num_chars + len(piece) > TRAIN_CHUNK_CHARS:
                yield "".join(chunk)
                chunk, num_chars = [], 0
            chunk.append(piece)
            num_chars += len(piece)
    if chunk:
        yield "".join(chunk)
