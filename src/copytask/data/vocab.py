"""Token ids and how people read and write them: the one mapping between tokens and symbols.

Token ids: PAD=0, BOS=1, EOS=2, then `vocab_size` content symbols 3 .. 3 + vocab_size - 1, written
as the letters a, b, c, ... (as numbers 0, 1, 2, ... past 26 symbols); the specials by name. A task whose
sources hold noise (selective copying, `tasks`) has one more special, the noise token, written `_`: its id
is one past the content symbols (`noise_token`), so that a vocabulary without it keeps its ids and its
size, and copy's runs their numbers. It is never a content symbol and never a target. Light on purpose (no
torch), so the command line refuses a bad sequence at once.
"""

from __future__ import annotations

PAD, BOS, EOS = 0, 1, 2
NUM_SPECIAL = 3
SPECIAL_SYMBOLS = {PAD: "·", BOS: "<s>", EOS: "</s>"}
NOISE_SYMBOL = "_"  # how the noise token is written and read (`noise_token`)
LETTERS = 26  # up to this many content symbols are letters


def total_vocab(vocab_size: int, noise: bool = False) -> int:
    """Embedding / output size: content symbols plus PAD, BOS, EOS, and the noise token where the task's
    sources hold noise (`noise`)."""
    return vocab_size + NUM_SPECIAL + noise


def noise_token(vocab_size: int) -> int:
    """The noise token's id over `vocab_size` content symbols: one past them (see the module)."""
    return NUM_SPECIAL + vocab_size


def content_symbols(vocab_size: int) -> list[str]:
    """The content symbols in token order: `a b c ...`, or `0 1 2 ...` past LETTERS symbols."""
    if vocab_size <= LETTERS:
        return [chr(ord("a") + index) for index in range(vocab_size)]
    return [str(index) for index in range(vocab_size)]


def symbol(token: int, vocab_size: int) -> str:
    """One token as people read it: its content symbol, or a special by name (the noise token `_`)."""
    if token in SPECIAL_SYMBOLS:
        return SPECIAL_SYMBOLS[token]
    if token == noise_token(vocab_size):
        return NOISE_SYMBOL
    return content_symbols(vocab_size)[token - NUM_SPECIAL]


def parse_symbols(text: str, vocab_size: int, noise: bool = False) -> list[int]:
    """A sequence written by hand -> its token ids: symbols separated by spaces (`g d d c`), or, for
    letters, also written together (`gddc`); with `noise` (a task whose sources hold it) also the noise
    token `_` (`_ g _ d`, `_g_d`). ValueError naming the first unknown symbol and the vocabulary, or
    saying that there is no symbol at all."""
    symbols = content_symbols(vocab_size) + ([NOISE_SYMBOL] if noise else [])
    words = text.split()
    if len(words) == 1 and vocab_size <= LETTERS:
        words = list(words[0])
    if not words:
        raise ValueError("no symbols given: write a sequence such as 'a b c' (or 'abc')")
    tokens = {name: NUM_SPECIAL + index for index, name in enumerate(symbols)}  # the noise token: one past them
    unknown = next((word for word in words if word not in tokens), None)
    if unknown is not None:
        raise ValueError(f"unknown symbol {unknown!r}: this run's vocabulary is {' '.join(symbols)}")
    return [tokens[word] for word in words]
