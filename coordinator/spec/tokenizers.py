"""A job's tokenizer: which directories hold one, and loading it with clear errors.

transformers 5 "loads" a tokenizer from a directory without any tokenizer files (an
empty one whose EOS id is 0), so a directory is checked for them first, both when a spec
is validated and when the data pipeline loads the tokenizer.
"""

from __future__ import annotations

import os
from typing import Any

from roundpipe.coordinator.spec.errors import DataError, host_shortage

__all__ = ["NO_TOKENIZER_FILES", "TOKENIZER_FILES", "has_tokenizer_files", "load_tokenizer"]

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
"""Files of which a tokenizer directory holds at least one."""

NO_TOKENIZER_FILES = f"holds no tokenizer files (none of {', '.join(TOKENIZER_FILES)})"
"""What is wrong with a directory that fails :func:`has_tokenizer_files`, for messages."""


def has_tokenizer_files(directory: str | os.PathLike[str]) -> bool:
    """Whether ``directory`` holds a tokenizer (one of ``TOKENIZER_FILES``)."""
    return any(os.path.isfile(os.path.join(directory, f)) for f in TOKENIZER_FILES)


def load_tokenizer(path: str | os.PathLike[str]) -> Any:
    """``AutoTokenizer.from_pretrained(path, local_files_only=True)`` with clear errors.

    A directory without tokenizer files is refused: transformers 5 would return an
    empty tokenizer (EOS id 0) instead of failing.
    """
    p = os.fspath(path)
    if not os.path.isdir(p):
        raise DataError(f"tokenizer directory not found: {p}")
    if not has_tokenizer_files(p):
        raise DataError(
            f"cannot load a tokenizer from {p}: it {NO_TOKENIZER_FILES}; set data.tokenizer "
            "to a tokenizer directory"
        )
    from transformers import AutoTokenizer  # lazy: slow import, unneeded for token data

    try:
        return AutoTokenizer.from_pretrained(p, local_files_only=True)
    except Exception as exc:  # transformers raises OSError, ValueError, KeyError, ...
        shortage = host_shortage(exc)
        if shortage is not None:  # out of descriptors (a flood?): the host's, not the job's
            raise shortage from None
        raise DataError(f"cannot load a tokenizer from {p}: {' '.join(str(exc).split())}") from None
