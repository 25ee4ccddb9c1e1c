"""An offline default training corpus built from CPython's own documentation.

Pre-training examples need real text, but this project must run on machines
without internet access.  Every Python installation already carries a few
megabytes of good English prose about programming: the documentation that
ships with CPython itself.  This module turns it into a JSON-lines corpus with
one ``{"text": ...}`` object per document.

Where the text comes from
-------------------------
* ``pydoc_data.topics.topics``: the interactive ``help()`` topics (language
  reference sections such as "assignment", "for", "exceptions", ...), one
  document per topic.
* The docstrings of a fixed, sorted list of standard-library modules
  (``STDLIB_MODULES``): the module docstring is one document, every public
  class (its own docstring plus the docstrings of its public methods and
  properties) is one document, and every public function is one document.

Both are part of the Python documentation, which is distributed under the
Python Software Foundation License (PSF License Agreement, see
https://docs.python.org/3/license.html).  The corpus is derived from that
text, so it carries the same license; it is not covered by this project's
own license.

Determinism
-----------
The documentation differs between Python versions, so the cache file name
contains the Python minor version and ``CORPUS_VERSION`` (bump the latter
whenever the extraction rules below change).  For a given Python build the
output is byte-identical on every run: the module list is fixed, names are
visited in sorted order, duplicate docstrings are kept only at their first
occurrence, and memory addresses that can leak into generated docstrings are
masked.  Modules that fail to import are skipped, and modules whose content
depends on optional third-party C libraries (ssl, hashlib, sqlite3, lzma, ...)
are deliberately left out so that two machines with the same Python version
build the same corpus.

Concurrency
-----------
Several ranks of a job usually start at the same moment and may all find the
cache file missing.  Each one builds the corpus into its own temporary file in
the cache directory and publishes it with ``os.replace``, which is atomic on
POSIX.  Readers therefore see either no file or a complete one, and since all
builders produce identical bytes it does not matter whose rename lands last.
"""

from __future__ import annotations

import importlib
import inspect
import json
import os
import re
import sys
import tempfile
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path

__all__ = [
    "CORPUS_VERSION",
    "STDLIB_MODULES",
    "build_embedded_documents",
    "default_cache_dir",
    "embedded_corpus_filename",
    "ensure_embedded_corpus",
]

# Bump when the extraction rules or the module list change, so that stale
# cache files from an older rule set are never picked up.
CORPUS_VERSION = "v1"

# Documents shorter than this (in characters) are mostly one-line stubs such
# as "Return self." that add nothing but BOS/EOS noise to the token stream.
MIN_DOC_CHARS = 200

# Standard-library modules whose docstrings form the bulk of the corpus.
# Requirements for an entry: it exists on Linux for CPython 3.10-3.13 (a
# module that is missing on some version is skipped, never an error), it has
# no import side effects (no GUI, no terminal handling, no browser), and its
# docstrings do not depend on optional system libraries.  Kept sorted so the
# visiting order is obvious.
STDLIB_MODULES: tuple[str, ...] = (
    "abc",
    "argparse",
    "ast",
    "asyncio",
    "base64",
    "bdb",
    "bisect",
    "builtins",
    "calendar",
    "cmd",
    "code",
    "codecs",
    "collections",
    "collections.abc",
    "colorsys",
    "concurrent.futures",
    "configparser",
    "contextlib",
    "copy",
    "csv",
    "dataclasses",
    "datetime",
    "decimal",
    "difflib",
    "dis",
    "doctest",
    "email.message",
    "email.utils",
    "enum",
    "filecmp",
    "fileinput",
    "fnmatch",
    "fractions",
    "ftplib",
    "functools",
    "gettext",
    "glob",
    "graphlib",
    "gzip",
    "heapq",
    "hmac",
    "html.parser",
    "http.client",
    "http.cookies",
    "http.server",
    "imaplib",
    "importlib",
    "importlib.metadata",
    "inspect",
    "io",
    "ipaddress",
    "itertools",
    "json",
    "keyword",
    "linecache",
    "locale",
    "logging",
    "logging.handlers",
    "mailbox",
    "math",
    "mimetypes",
    "multiprocessing",
    "numbers",
    "operator",
    "optparse",
    "os",
    "pathlib",
    "pdb",
    "pickle",
    "pickletools",
    "pkgutil",
    "platform",
    "plistlib",
    "poplib",
    "pprint",
    "profile",
    "pstats",
    "queue",
    "quopri",
    "random",
    "re",
    "reprlib",
    "sched",
    "secrets",
    "selectors",
    "shelve",
    "shlex",
    "shutil",
    "smtplib",
    "socket",
    "socketserver",
    "statistics",
    "string",
    "struct",
    "subprocess",
    "tarfile",
    "tempfile",
    "textwrap",
    "threading",
    "timeit",
    "tokenize",
    "trace",
    "traceback",
    "types",
    "typing",
    "unittest",
    "unittest.mock",
    "urllib.parse",
    "urllib.request",
    "uuid",
    "warnings",
    "wave",
    "weakref",
    "xml.dom.minidom",
    "xml.etree.ElementTree",
    "xml.sax",
    "zipfile",
    "zlib",
)

# Generated docstrings (dataclasses, enums, ...) can contain reprs such as
# "<object object at 0x7f3a...>", which change from run to run.
_ADDRESS_RE = re.compile(r" at 0x[0-9a-fA-F]+")

_BUILD_LOCK = threading.Lock()


def default_cache_dir() -> str:
    """Directory for generated data: ``$TORCHTITAN_CACHE`` or ``~/.cache/torchtitan_hsdp``."""
    env = os.environ.get("TORCHTITAN_CACHE")
    if env:
        return os.path.expanduser(env)
    return os.path.join(os.path.expanduser("~"), ".cache", "torchtitan_hsdp")


def embedded_corpus_filename() -> str:
    """Cache file name; it encodes everything the corpus content depends on."""
    name = f"embedded_corpus_py{sys.version_info.major}{sys.version_info.minor}_{CORPUS_VERSION}"
    # `python -OO` strips docstrings, which would silently give a much smaller
    # corpus; keep that variant apart instead of overwriting the normal one.
    if sys.flags.optimize >= 2:
        name += "_OO"
    return name + ".jsonl"


def _clean(text: str | None) -> str:
    """Dedent and strip a docstring (or return "" for anything that is not text)."""
    if not isinstance(text, str):
        return ""
    return _ADDRESS_RE.sub(" at 0x...", inspect.cleandoc(text)).strip()


def _own_doc(obj: object) -> str:
    # getattr rather than inspect.getdoc: getdoc walks the MRO and would hand
    # back the base class text for every undocumented subclass.
    try:
        return _clean(getattr(obj, "__doc__", None))
    except Exception:
        return ""


def _topic_documents(seen: set[str]) -> Iterator[str]:
    try:
        from pydoc_data.topics import topics
    except ImportError:
        # Some distributions split pydoc_data into a separate package; the
        # docstrings alone are still a usable corpus.
        return
    for key in sorted(topics):
        text = _clean(topics[key])
        # Some topics share one text (e.g. "if" and "elif"); keep the first.
        if text and text not in seen:
            seen.add(text)
            yield text


def _is_public_member(value: object) -> bool:
    return inspect.isroutine(value) or isinstance(value, (property, classmethod, staticmethod))


def _class_document(qualname: str, cls: type, seen: set[str]) -> str:
    parts: list[str] = []
    doc = _own_doc(cls)
    if doc and doc not in seen:
        seen.add(doc)
        parts.append(doc)
    # Only the class's own namespace: inherited members are documented where
    # they are defined.
    try:
        members = sorted(vars(cls).items())
    except TypeError:
        members = []
    for name, value in members:
        if name.startswith("_") or not _is_public_member(value):
            continue
        if isinstance(value, (classmethod, staticmethod)):
            value = value.__func__
        member_doc = _own_doc(value)
        if member_doc and member_doc not in seen:
            seen.add(member_doc)
            parts.append(f"{cls.__name__}.{name}\n\n{member_doc}")
    if not parts:
        return ""
    return f"class {qualname}\n\n" + "\n\n".join(parts)


def _module_documents(module_name: str, seen: set[str]) -> Iterator[str]:
    try:
        module = importlib.import_module(module_name)
    except Exception:
        return
    doc = _own_doc(module)
    if doc and doc not in seen:
        seen.add(doc)
        yield f"Module {module_name}\n\n{doc}"
    for name in sorted(dir(module)):
        if name.startswith("_"):
            continue
        try:
            value = getattr(module, name)
        except Exception:
            continue
        qualname = f"{module_name}.{name}"
        if inspect.isclass(value):
            text = _class_document(qualname, value, seen)
            if text:
                yield text
        elif inspect.isroutine(value):
            func_doc = _own_doc(value)
            if func_doc and func_doc not in seen:
                seen.add(func_doc)
                yield f"{qualname}\n\n{func_doc}"


def build_embedded_documents() -> list[str]:
    """Return the corpus documents in their canonical order (topics first)."""
    documents: list[str] = []
    seen: set[str] = set()
    # Importing and poking at modules raises assorted DeprecationWarnings
    # (e.g. typing.io); they are noise here.  catch_warnings() swaps global
    # state, so builds in concurrent threads of one process are serialized.
    with _BUILD_LOCK, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        documents.extend(_topic_documents(seen))
        for module_name in STDLIB_MODULES:
            documents.extend(_module_documents(module_name, seen))
    return [doc for doc in documents if len(doc) >= MIN_DOC_CHARS]


def _write_atomically(path: Path, documents: list[str]) -> None:
    # The temporary file must live in the destination directory: os.replace
    # is only atomic within one file system.
    fd, tmp_name = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="\n") as f:
            for doc in documents:
                # sort_keys/ensure_ascii pin the exact bytes written.
                f.write(json.dumps({"text": doc}, ensure_ascii=False, sort_keys=True))
                f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        # mkstemp creates the file as 0600; the cache may be shared by users.
        os.chmod(tmp_name, 0o644)
        os.replace(tmp_name, path)
    except BaseException:
        try:
            os.unlink(tmp_name)
        except FileNotFoundError:
            pass
        raise


def ensure_embedded_corpus(cache_dir: str | None = None) -> str:
    """Return the path of the embedded corpus, building it on first use.

    Args:
        cache_dir: where to keep the JSON-lines file; defaults to
            ``default_cache_dir()`` (``$TORCHTITAN_CACHE`` or
            ``~/.cache/torchtitan_hsdp``).

    Safe to call from many processes at once (see the module docstring).
    """
    directory = Path(cache_dir if cache_dir is not None else default_cache_dir()).expanduser()
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / embedded_corpus_filename()
    if not path.is_file():
        documents = build_embedded_documents()
        if not documents:
            raise RuntimeError(
                "The embedded corpus came out empty: this Python installation has neither "
                "pydoc_data nor docstrings (was it started with -OO?)."
            )
        _write_atomically(path, documents)
    return str(path)
