"""A checkpoint's tokenizer: the one its run pinned, and its files in an exported HF folder.

Owns ``pinned_tokenizer`` (what ``goodput generate`` uses) and ``find_pinned_tokenizer`` (what
``goodput ckpt export-hf`` uses): the checkpoint's ``train_state.json`` names the blend's
fingerprint and its ``config.toml`` the blend cache (``[data] cache``), whose ``blend.json`` in
``data.blend.blend_dir`` pins the tokenizer's path and sha256. A model-only checkpoint, a moved
blend and a moved or changed tokenizer file are refused with the fix, pass --tokenizer.

``write_hf_tokenizer`` writes the files with which ``transformers.AutoTokenizer`` encodes exactly
what goodput's ``encode_batch`` encodes (the export tests check it, offline):

* SentencePiece: the ``.model`` copied as ``tokenizer.model``, with a ``LlamaTokenizer`` config
  that adds no BOS/EOS (goodput adds neither), sets ``legacy: false`` and ``add_prefix_space`` to
  the model's own dummy prefix (else transformers prepends "▁"), and ``split_special_tokens``
  (SentencePiece encodes "</s>" in text as text; transformers would turn it into the token).
  Exact for identity-normalised models such as ``goodput data train-tokenizer`` trains; another
  normaliser gets a warning.
* HF ``tokenizer.json``: copied, less any post-processor (its template tokens are what goodput
  never adds), with a ``PreTrainedTokenizerFast`` config naming the end-of-document token.

It does not convert between kinds or add tokens.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import sentencepiece
import tokenizers

from goodput.checkpoint.load import read_checkpoint
from goodput.config import read_toml
from goodput.data.blend import blend_dir
from goodput.data.manifest import check_run_manifest, read_run_manifest
from goodput.data.tokenizer import Tokenizer, load_tokenizer
from goodput.errors import GoodputError
from goodput.io import json_text, read_json, sha256_file, write_bytes, write_json
from goodput.rundir import CONFIG, TRAIN_STATE

NO_TOKENIZER_FIX = "pass the tokenizer file with --tokenizer"
SENTENCEPIECE_FILE = "tokenizer.model"
TOKENIZERS_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
SPECIAL_TOKENS_FILE = "special_tokens_map.json"
# What an identity-normalising SentencePiece model makes of this, with and without dummy prefix.
NORMALISER_PROBE = ("a  b\n", {"a▁▁b\n", "▁a▁▁b\n"})


def pinned_tokenizer(directory: Path) -> Tokenizer:
    """The tokenizer the blend of ``directory``'s run pins, if its file is where the blend
    says and unchanged."""
    found = find_pinned_tokenizer(directory)
    if isinstance(found, GoodputError):
        raise found
    return found


def find_pinned_tokenizer(directory: Path) -> Tokenizer | GoodputError:
    """As ``pinned_tokenizer``, except that where the run's data pinned no tokenizer (its config
    has no ``[data]`` table, or its shards were not made by ``goodput data tokenize``) the
    error saying so is returned, not raised: a weights-only export is all there is to make."""
    fix = NO_TOKENIZER_FIX
    state = read_json(directory / TRAIN_STATE)
    if isinstance(state, dict) and state.get("model_only") is True:
        raise GoodputError.usage(
            directory, "a model-only checkpoint names no data, hence no tokenizer", fix
        )
    if not isinstance(read_toml(directory / CONFIG).get("data"), dict):
        return GoodputError.usage(directory, "its config names no [data], hence no tokenizer", fix)
    saved, train_state = read_checkpoint(directory)
    fingerprint = train_state["loader"]["fingerprint"]
    blend_file = blend_dir(Path(str(saved["data"].get("cache", ""))), fingerprint) / "blend.json"
    if not blend_file.is_file():
        raise GoodputError(blend_file, "the run's blend manifest is not there (moved?)", fix)
    manifest = read_run_manifest(blend_file)
    check_run_manifest(blend_file, manifest)
    if manifest["fingerprint"] != fingerprint:
        raise GoodputError(blend_file, "is not the blend this checkpoint was trained on", fix)
    return blend_tokenizer(blend_file, manifest, fix)


def blend_tokenizer(
    blend_file: Path, manifest: dict[str, Any], fix: str
) -> Tokenizer | GoodputError:
    """The tokenizer the checked run manifest ``manifest`` (read from ``blend_file``) pins, if
    its file is where the manifest says and unchanged; the error when it pins none."""
    pinned = manifest["tokenizer"]
    if not pinned:
        return GoodputError(
            blend_file,
            "pins no tokenizer (its shards were not made by `goodput data tokenize`)",
            fix,
        )
    tokenizer_file = Path(pinned["path"])
    if not tokenizer_file.is_file():
        raise GoodputError(tokenizer_file, "the tokenizer the blend pins is missing (moved?)", fix)
    # Hashed before it is parsed: a changed file may not parse, and that is not the news.
    if sha256_file(tokenizer_file) != pinned["sha256"]:
        raise GoodputError(
            tokenizer_file, "the tokenizer file changed since the blend pinned it", fix
        )
    return load_tokenizer(tokenizer_file, pinned["kind"])


def write_hf_tokenizer(tokenizer: Tokenizer, folder: Path, max_seq_len: int) -> dict[str, Any]:
    """Write ``tokenizer``'s HF files into ``folder``; return the special-token ids for
    ``config.json`` (``bos_token_id``, ``eos_token_id``)."""
    data = tokenizer.path.read_bytes()
    if hashlib.sha256(data).hexdigest() != tokenizer.sha256:  # the bytes it was loaded from
        raise GoodputError(tokenizer.path, "changed while exporting", "export again")
    writers = {"sentencepiece": _sentencepiece_files, "hf": _tokenizers_files}
    if tokenizer.kind not in writers:
        raise GoodputError.usage(
            tokenizer.path,
            f"a {tokenizer.kind!r} tokenizer has no HF form here",
            f"use one of: {', '.join(sorted(writers))}",
        )
    files, config, special = writers[tokenizer.kind](data, tokenizer)
    tokens = {f"{role}_token": token for role, (token, _) in special.items()}
    for name, content in files.items():
        write_bytes(folder / name, content)
    write_json(
        folder / CONFIG_FILE,
        {
            **config,
            **tokens,
            "clean_up_tokenization_spaces": False,  # decode gives the text back as it was
            "model_max_length": max_seq_len,
        },
    )
    write_json(folder / SPECIAL_TOKENS_FILE, tokens)
    return {f"{role}_token_id": special.get(role, (None, None))[1] for role in ("bos", "eos")}


Special = dict[str, tuple[str, int]]  # role ("bos", "eos", ...) -> (token, id)


def _sentencepiece_files(
    data: bytes, tokenizer: Tokenizer
) -> tuple[dict[str, bytes], dict[str, Any], Special]:
    processor = sentencepiece.SentencePieceProcessor()
    processor.LoadFromSerializedProto(data)
    probe, identity = NORMALISER_PROBE
    normalised = processor.normalize(probe)
    if normalised not in identity:
        print(
            f"warning: {tokenizer.path} normalises text ({probe!r} -> {normalised!r}); "
            "transformers may encode some text differently from goodput"
        )
    ids = {
        "bos": processor.bos_id(),
        "eos": tokenizer.eod_id,
        "unk": processor.unk_id(),
        "pad": processor.pad_id(),
    }
    special = {role: (processor.id_to_piece(i), i) for role, i in ids.items() if i >= 0}
    config = {
        "tokenizer_class": "LlamaTokenizer",
        "add_bos_token": False,
        "add_eos_token": False,
        "legacy": False,
        "add_prefix_space": normalised.startswith("▁"),
        "split_special_tokens": True,
    }
    return {SENTENCEPIECE_FILE: data}, config, special


def _tokenizers_files(
    data: bytes, tokenizer: Tokenizer
) -> tuple[dict[str, bytes], dict[str, Any], Special]:
    spec = json.loads(data)
    if spec.get("post_processor") is not None:
        spec["post_processor"] = None
        text = json_text(spec, where=tokenizer.path, indent=2, ensure_ascii=False)
        data = (text + "\n").encode()
    eod = tokenizers.Tokenizer.from_str(data.decode()).id_to_token(tokenizer.eod_id)
    assert eod is not None, "the loaded tokenizer found its eod id in this file"
    config = {"tokenizer_class": "PreTrainedTokenizerFast"}
    return {TOKENIZERS_FILE: data}, config, {"eos": (eod, tokenizer.eod_id)}
