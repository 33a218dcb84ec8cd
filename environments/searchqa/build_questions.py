"""Generates SearchQA's default question set from the default (ovos Wikipedia) corpus.

    python -m environments.searchqa.build_questions      # writes data/questions.jsonl, splits.json

Deterministic: it reads only the ovos summaries and the BM25 index of the default corpus, and
orders candidates by SHA-1 of their text, never by a random generator. Every answer is the
title of an article in the corpus. Three sources (the `source` field, used as eval category
like upstream's nq/hotpotqa prefixes):

  * `wiki_desc` (single hop): the article's short description as a question, e.g.
    "What is the class of musical instruments with vibrating strings?" -> "String instrument".
    Only descriptions that are unique in the corpus and at least three words long.
  * `wiki_lead` (single hop): the first clause of the article's lead sentence,
    "<Title> is/was <clause>", as "What/Who is/was <clause>?".
  * `wiki_2hop` (two hops): an article A whose description names another article B
    ("1968 film by Stanley Kubrick"), with B replaced by B's own description:
    "What is the 1968 film by the American filmmaker and photographer (1928–1999)?" ->
    "2001: A Space Odyssey".

A question is kept only if it does not name its answer and search can answer it: for
single-hop questions BM25 must rank the answer's passage first for the question itself; for
two-hop questions B's passage must be in the top 3 for B's description and A's passage in the
top 3 for A's description (the two searches of a solver). The expert's query, the answer's
title, must put the answer's passage in the top 3 as well.

Split: by answer title (SHA-1 of the title mod 8 == 0 -> test), so no answer is both a train
and a test answer.
"""

from __future__ import annotations

import collections
import hashlib
import json
import pathlib
import re
import tempfile

from environments.searchqa.retrieval import BM25Retriever, default_corpus_path, ovos_summaries

MAX_PER_SOURCE = {"wiki_desc": 1200, "wiki_lead": 800, "wiki_2hop": 1000}
TEST_BUCKETS = 8  # one answer title in eight is a test answer
MIN_DESCRIPTION_WORDS = 3
MIN_LEAD_WORDS, MAX_LEAD_WORDS = 6, 25
_YEARS = re.compile(r"\d\s*(?:[–-]|to)\s*(?:c\.\s*)?\d|\bdied\b")  # a finished life or office
_DETERMINERS = ("a", "an", "the", "any", "each", "every", "one", "some")
_LEAD = re.compile(r"^(?P<title>.+?) (?P<verb>is|was|are|were) (?P<rest>.+)$")


def _sha1(text: str) -> str:
  return hashlib.sha1(text.encode("utf-8")).hexdigest()


def answers_for(title: str) -> list[str]:
  """Accepted answers: the title, and the title without a disambiguating "(...)" suffix."""
  short = re.sub(r"\s*\([^)]*\)$", "", title)
  return [title] if short == title or not short else [title, short]


class _Phrasing:
  """Turns descriptions into noun phrases: "Glucose polymer ..." -> "the glucose polymer ..."."""

  def __init__(self, summaries: dict[str, dict[str, str]]):
    # A first word is a common noun if the corpus writes it in lower case more often than
    # capitalised in mid-sentence ("Glucose" -> "glucose"; "European", "Japanese" stay).
    self.lower, self.upper = collections.Counter(), collections.Counter()
    for entry in summaries.values():
      words = entry["extract"].split()
      for previous, word in zip(words, words[1:]):
        if word[:1].islower():
          self.lower[word] += 1
        elif word[:1].isupper() and not previous.endswith((".", "!", "?", ":")):
          self.upper[word] += 1

  def noun_phrase(self, description: str) -> str:
    first, _, rest = description.strip().rstrip(".").partition(" ")
    if first[:1].isupper() and self.lower[first.lower()] > self.upper[first]:
      first = first.lower()
    phrase = (first + " " + rest).strip()
    return phrase if first.lower() in _DETERMINERS else "the " + phrase


def _wh(entry: dict[str, str]) -> str:
  if entry.get("topic") != "People":
    return "What is"
  return "Who was" if _YEARS.search(entry.get("description", "")) else "Who is"


def _first_clause(extract: str) -> str:
  sentence = re.split(r"(?<=[a-z0-9)])\. (?=[A-Z])", extract.strip(), maxsplit=1)[0]
  sentence = sentence.rstrip(".")
  # Cut at the first clause boundary once the clause says enough to be specific.
  for match in re.finditer(r",| who | which | that | whose | and is | and was ", sentence):
    if len(sentence[:match.start()].split()) >= 8:
      return sentence[:match.start()]
  return sentence


def _named_title(text: str, titles: set[str], max_words: int) -> str | None:
  """The longest title that `text` names as a proper noun: whole words, capitalised, not first.

  Proper nouns only, so that a bridge is an entity ("Salvador Dalí", "Soviet Union"), not a
  category word that starts the description ("Chemical element with atomic number 17").
  """
  words = text.split()
  for n in range(min(max_words, len(words) - 1), 0, -1):
    for i in range(1, len(words) - n + 1):
      phrase = " ".join(words[i:i + n]).strip(",;:()")
      # The whole proper noun, not a part of a longer one ("Archipelago" in "Socotra
      # Archipelago").
      inside_name = words[i - 1][:1].isupper() or (
          i + n < len(words) and words[i + n][:1].isupper() and not words[i + n - 1].endswith(","))
      if len(phrase) >= 4 and phrase[0].isupper() and phrase in titles and not inside_name:
        return phrase
  return None


def candidates(summaries: dict[str, dict[str, str]]) -> dict[str, list[dict]]:
  """All template questions per source, before the retrieval checks."""
  phrasing = _Phrasing(summaries)
  description_count = collections.Counter(
      e["description"].strip().lower() for e in summaries.values() if e.get("description"))

  def unique_description(entry) -> bool:
    description = entry.get("description", "").strip()
    return (len(description.split()) >= MIN_DESCRIPTION_WORDS
            and description_count[description.lower()] == 1)

  titles = {t for t in summaries if len(re.sub(r"\W", "", t)) >= 2}
  longest_title = max(len(t.split()) for t in titles)
  out = collections.defaultdict(list)
  for title in sorted(titles):
    entry = summaries[title]
    if unique_description(entry):
      question = f"{_wh(entry)} {phrasing.noun_phrase(entry['description'])}?"
      out["wiki_desc"].append({"question": question, "gold_title": title,
                               "queries": [question]})
      bridge = _named_title(entry["description"], titles - {title}, longest_title)
      if bridge and unique_description(summaries[bridge]):
        phrase = phrasing.noun_phrase(entry["description"].replace(
            bridge, phrasing.noun_phrase(summaries[bridge]["description"]), 1))
        phrase = re.sub(r"\b(the) the ", r"\1 ", phrase, flags=re.IGNORECASE)
        out["wiki_2hop"].append({
            "question": f"{_wh(entry)} {phrase}?", "gold_title": title, "bridge_title": bridge,
            "queries": [summaries[bridge]["description"], entry["description"]]})
    lead = _LEAD.match(_first_clause(entry["extract"]))
    if lead and lead["title"] == title \
        and MIN_LEAD_WORDS <= len(lead["rest"].split()) <= MAX_LEAD_WORDS:
      wh = "Who" if entry.get("topic") == "People" else "What"
      question = f"{wh} {lead['verb']} {lead['rest']}?"
      out["wiki_lead"].append({"question": question, "gold_title": title,
                               "queries": [question]})
  return out


def names_answer(question: str, title: str) -> bool:
  """Whether the question gives its answer away (the title as a whole word or phrase)."""
  return any(re.search(rf"(?<!\w){re.escape(answer)}(?!\w)", question, re.IGNORECASE)
             for answer in answers_for(title))


def _solvable(retriever: BM25Retriever, item: dict, source: str) -> bool:
  def rank(query: str, title: str) -> int:
    titles = [p.title for p in retriever.search(query, k=3)]
    return titles.index(f'"{title}"') + 1 if f'"{title}"' in titles else 99

  gold = item["gold_title"]
  if rank(gold, gold) > 3:  # the expert searches the answer's title
    return False
  if source == "wiki_2hop":
    return rank(item["queries"][0], item["bridge_title"]) <= 3 and rank(
        item["queries"][1], gold) <= 3
  return rank(item["queries"][0], gold) == 1


def build(cache_dir: str | None = None) -> list[dict]:
  """The question set: a list of JSON-able items with ids 0..N-1, sources in a fixed order."""
  summaries = ovos_summaries()
  retriever = BM25Retriever(default_corpus_path(cache_dir), cache_dir)
  items = []
  try:
    for source, pool in sorted(candidates(summaries).items()):
      pool = sorted(pool, key=lambda item: _sha1(source + "\n" + item["question"]))
      kept = []
      for item in pool:
        if len(kept) == MAX_PER_SOURCE[source]:
          break
        if not names_answer(item["question"], item["gold_title"]) and _solvable(
            retriever, item, source):
          kept.append(item)
      for item in sorted(kept, key=lambda item: item["question"]):
        split = "test" if int(_sha1(item["gold_title"]), 16) % TEST_BUCKETS == 0 else "train"
        record = {"id": len(items), "source": source, "split": split,
                  "question": item["question"], "golden_answers": answers_for(item["gold_title"]),
                  "gold_title": item["gold_title"]}
        if "bridge_title" in item:
          record["bridge_title"] = item["bridge_title"]
        items.append(record)
  finally:
    retriever.close()
  return items


def main() -> None:
  data = pathlib.Path(__file__).parent / "data"
  with tempfile.TemporaryDirectory() as cache_dir:  # a fresh index: no stale cache involved
    items = build(cache_dir)
  data.mkdir(exist_ok=True)
  with open(data / "questions.jsonl", "w", encoding="utf-8") as f:
    for item in items:
      f.write(json.dumps(item, ensure_ascii=False) + "\n")
  splits = {split: [item["id"] for item in items if item["split"] == split]
            for split in ("train", "test")}
  (data / "splits.json").write_text(json.dumps(splits) + "\n")
  counts = collections.Counter((item["source"], item["split"]) for item in items)
  print(f"{len(items)} questions -> {data}: {dict(sorted(counts.items()))}")


if __name__ == "__main__":
  main()
