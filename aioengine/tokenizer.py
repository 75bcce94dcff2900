"""The model's tokenizer and display name, without model code.

The engine process (``AsyncEngine``, ``LLM``) tokenizes, renders chat
templates and detokenizes; it imports this module, never the model's forward
pass or the kernels. A GGUF file's tokenizer is built by transformers from the
file's metadata and cached as ``tokenizer.json`` (20x faster to load again).
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
import threading
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)


def is_gguf(model_path: str) -> bool:
    return model_path.endswith(".gguf")


def tokenizer_cache_dir() -> Path:
    """Where GGUF tokenizers are cached: ``$AIOENGINE_CACHE_DIR`` or
    ``$XDG_CACHE_HOME/aioengine`` (``~/.cache/aioengine``), then ``tokenizers/``."""
    root = os.environ.get("AIOENGINE_CACHE_DIR")
    if not root:
        root = os.path.join(
            os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "aioengine"
        )
    return Path(root) / "tokenizers"


def _tokenizer_key(model_path: str) -> str:
    import tokenizers
    import transformers

    st = os.stat(model_path)
    ident = (
        f"{os.path.realpath(model_path)}|{st.st_size}|{st.st_mtime_ns}|"
        f"{transformers.__version__}|{tokenizers.__version__}"
    )
    return hashlib.sha256(ident.encode()).hexdigest()[:16]


_IMPORT_LOCK = threading.Lock()


def load_tokenizer(model_path: str) -> Any:
    """Fast tokenizer (with chat template) of a GGUF file or an HF folder.

    A GGUF file's tokenizer is built by transformers from the file's metadata
    (``AutoTokenizer.from_pretrained(folder, gguf_file=...)``: about 7 s for a 49k
    vocabulary on this machine, most of it transformers parsing the file with
    ``gguf.GGUFReader``), then saved with ``save_pretrained`` under
    ``tokenizer_cache_dir()``, keyed by the file's path, size and mtime and the
    transformers and tokenizers versions; later loads read that ``tokenizer.json``
    (about 0.3 s). Writing the cache is best effort. A cached tokenizer is read with
    ``PreTrainedTokenizerFast`` (the class ``AutoTokenizer`` picks for it), which unlike
    ``AutoTokenizer`` does not import torch: 1.1 s instead of 3.1 s in the engine
    process, while the worker imports torch on the other core.
    """
    # Importing AutoTokenizer imports torch: only where it is needed. transformers'
    # lazy module fails half-way when two threads import from it at once (``cannot
    # import name``), as data-parallel replicas starting side by side do.
    with _IMPORT_LOCK:
        from transformers import PreTrainedTokenizerFast

    if not is_gguf(model_path):
        with _IMPORT_LOCK:
            from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(model_path)
    cached = tokenizer_cache_dir() / _tokenizer_key(model_path)
    if (cached / "tokenizer.json").is_file():
        try:
            return PreTrainedTokenizerFast.from_pretrained(str(cached))
        except Exception as exc:  # a damaged cache entry: rebuild it
            logger.warning("tokenizer cache %s unreadable (%s); rebuilding it", cached, exc)
            shutil.rmtree(cached, ignore_errors=True)
    from transformers import AutoTokenizer

    p = Path(model_path)
    tokenizer = AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=cached.parent))
        tokenizer.save_pretrained(str(tmp))
        try:
            os.rename(tmp, cached)  # atomic; another process may have won the race
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
    except OSError as exc:
        logger.info("tokenizer cache not written (%s)", exc)
    return tokenizer


def model_display_name(model_path: str) -> str:
    """The model's own name: GGUF ``general.name`` with the file stem as fallback,
    or the folder name of an HF checkout."""
    p = Path(model_path)
    if p.suffix == ".gguf":
        name = p.stem
        # Q4_1 and similar quantization suffixes are not part of the model's name.
        base, _, quant = name.rpartition(".")
        return base if base and quant.upper().startswith(("Q", "F", "BF", "IQ")) else name
    return p.resolve().name
