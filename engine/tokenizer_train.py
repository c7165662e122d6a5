"""Training a byte-level BPE tokenizer locally, for checkpoints made on machines with no model hub.

Ids 0, 1, 2 are `<unk>`, `<s>` (BOS) and `</s>` (EOS), Llama's convention and what `make_tokenizer`
assumes. The tokenizer covers exactly `vocab_size` ids: what the corpus cannot fill with merges is padded
with reserved special tokens (`<|reserved_N|>`, as Llama 3 does), so every id a model can sample decodes
(to nothing, as special tokens are skipped) in kvpilot, transformers and vLLM alike. The post-processor
prepends BOS, so `AutoTokenizer` (vLLM's prompt path) and kvpilot's engine encode a prompt the same way.
"""

from __future__ import annotations

from importlib import resources
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tokenizers import Tokenizer

UNK, BOS, EOS = "<unk>", "<s>", "</s>"
SPECIAL_TOKENS = (UNK, BOS, EOS)
BOS_ID, EOS_ID = 1, 2
MIN_VOCAB = 256 + len(SPECIAL_TOKENS)  # the byte alphabet and the specials
MAX_CORPUS_BYTES = 64 * 2**20


class TokenizerTrainError(ValueError):
    """The corpus or the vocabulary size cannot make a tokenizer."""


def builtin_corpus() -> str:
    """A few kilobytes of English, numbers, code and metrics text shipped with the package."""
    return resources.files("engine").joinpath("tokenizer_corpus.txt").read_text(encoding="utf-8")


def train_bpe(vocab_size: int, corpus: str) -> Tokenizer:
    """A byte-level BPE tokenizer of exactly `vocab_size` ids, trained on `corpus` (deterministic)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    if vocab_size < MIN_VOCAB:
        raise TokenizerTrainError(f"vocab size {vocab_size} is below the minimum {MIN_VOCAB} (256 bytes + specials)")
    if len(corpus.encode("utf-8")) > MAX_CORPUS_BYTES:
        raise TokenizerTrainError(f"corpus is larger than {MAX_CORPUS_BYTES // 2**20} MiB")
    if not corpus.strip():
        raise TokenizerTrainError("corpus is empty")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        special_tokens=[AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus.splitlines(keepends=True), trainer=trainer)
    for token, want in zip(SPECIAL_TOKENS, range(len(SPECIAL_TOKENS)), strict=True):
        got = tok.token_to_id(token)
        if got != want:  # the trainer puts specials first; a change there would break BOS/EOS silently
            raise TokenizerTrainError(f"special token {token} got id {got}, expected {want}")
    learned = tok.get_vocab_size()
    if learned < vocab_size:
        tok.add_special_tokens(
            [AddedToken(f"<|reserved_{i}|>", special=True, normalized=False) for i in range(vocab_size - learned)]
        )
    tok.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, BOS_ID)]
            ),
        ]
    )
    if tok.get_vocab_size() != vocab_size:
        raise TokenizerTrainError(f"tokenizer has {tok.get_vocab_size()} ids, expected {vocab_size}")
    return tok


def learned_size(tok: Tokenizer) -> int:
    """Ids that are bytes, merges or the three specials (not reserved padding)."""
    return tok.get_vocab_size(with_added_tokens=False) + len(SPECIAL_TOKENS)
