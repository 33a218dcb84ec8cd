"""SearchQA: the upstream formats, exact match, the expert, bad input, corpora and caching."""

import json
import subprocess
import sys

import pytest

from environments import make, task_splits
from environments.searchqa import build_questions, env as searchqa
from environments.searchqa.env import SearchQAEnv
from environments.searchqa.retrieval import BM25Retriever, Passage, format_information

pytest.importorskip("bm25s")


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
  return str(tmp_path_factory.mktemp("searchqa-cache"))


@pytest.fixture(scope="module")
def env(cache_dir):
  with make("searchqa", cache_dir=cache_dir) as environment:  # builds corpus + index cold
    yield environment


@pytest.fixture(scope="module")
def flashrag(tmp_path_factory):
  """A tiny corpus and question file in FlashRAG's formats."""
  root = tmp_path_factory.mktemp("flashrag")
  corpus = root / "corpus.jsonl"
  lines = [{"id": "0", "contents": "\"Eiffel Tower\"\nThe Eiffel Tower is a tower in Paris.\n"
                                   "It was built for the 1889 World's Fair."},
           {"id": "1", "contents": "\"Paris\"\nParis is the capital of France."},
           {"id": "2", "title": "Gustave Eiffel", "text": "Gustave Eiffel was an engineer."},
           {"id": "3", "contents": "\"Berlin\"\nBerlin is the capital of Germany."}]
  corpus.write_text("".join(json.dumps(line) + "\n" for line in lines) + "\n")
  (root / "nq").mkdir()
  questions = root / "nq" / "test.jsonl"
  questions.write_text(
      json.dumps({"id": "test_0", "question": " who designed the eiffel tower ",
                  "golden_answers": ["Gustave Eiffel", "Eiffel"]}) + "\n" +
      json.dumps({"id": "test_1", "question": "capital of germany?", "answer": "Berlin",
                  "source": "custom"}) + "\n")
  return str(corpus), str(questions)


# ----- formats ------------------------------------------------------------------------------------


def test_information_block_format():
  passages = [Passage('"Eiffel Tower"', "A tower.\nIn Paris."), Passage("Paris", "A city.")]
  assert format_information(passages) == (
      '<information>Doc 1(Title: "Eiffel Tower") A tower.\nIn Paris.\n'
      "Doc 2(Title: Paris) A city.</information>")
  assert format_information([]) == "<information></information>"


def test_search_observation_exact(flashrag, tmp_path):
  corpus, questions = flashrag
  with SearchQAEnv(corpus_path=corpus, questions_path=questions, cache_dir=str(tmp_path)) as e:
    e.reset(options={"task_id": 0})
    observation, reward, terminated, _, _ = e.step("<search>Eiffel tower engineer</search>")
  # Two passages share a term with the query; the title of a {"title", "text"} line is as given.
  assert observation == (
      '<information>Doc 1(Title: "Eiffel Tower") The Eiffel Tower is a tower in Paris.\n'
      "It was built for the 1889 World's Fair.\n"
      "Doc 2(Title: Gustave Eiffel) Gustave Eiffel was an engineer.</information>")
  assert (reward, terminated) == (0.0, False)


def test_search_on_default_corpus(env):
  env.reset(options={"task_id": 0})
  observation = env.step("<search>inventor of the telephone</search>")[0]
  assert observation.startswith('<information>Doc 1(Title: "Alexander Graham Bell") '
                                "Alexander Graham Bell was a ")
  assert observation.endswith("</information>")
  assert [line.split(")")[0] for line in observation.split("\nDoc ")[1:]] == [
      '2(Title: "Telephone"', '3(Title: "Lee de Forest"']


def test_first_observation_and_info(env):
  observation, info = env.reset(options={"task_id": 0})
  assert observation.startswith("You must reason inside <think>...</think> first. If you do ")
  assert observation.endswith("Follow this process every time.\n\n Question: What is one of "
                              "the group of lakes in North America in North America?")
  assert info["instruction"] == searchqa.INSTRUCTION and info["source"] == "wiki_2hop"
  assert SearchQAEnv.acknowledgement == "Ok."


# ----- exact match and rewards --------------------------------------------------------------------


def test_normalize_and_exact_match():
  assert searchqa.normalize_answer("  The Eiffel-Tower!  ") == "eiffeltower"
  assert searchqa.normalize_answer("An apple, a day") == "apple day"
  assert searchqa.exact_match(" the Peace of Westphalia. ", ["Peace of Westphalia"])
  assert not searchqa.exact_match("Westphalia", ["Peace of Westphalia"])
  assert searchqa.exact_match("MERCURY", build_questions.answers_for("Mercury (planet)"))
  assert build_questions.answers_for("Mercury (planet)") == ["Mercury (planet)", "Mercury"]


@pytest.mark.parametrize("reward_mode", ["normalized", "paper"])
def test_wrong_then_right_answer(flashrag, tmp_path, reward_mode):
  corpus, questions = flashrag
  with SearchQAEnv(reward_mode, corpus_path=corpus, questions_path=questions,
                   cache_dir=str(tmp_path)) as e:
    e.reset(options={"task_id": 0})
    assert e.step("<answer>Paris</answer>")[:4] == (searchqa.INCORRECT, 0.0, False, False)
    # The last <answer> counts; the first tag decides that this is an answer.
    observation, reward, terminated, _, info = e.step(
        "<answer>Paris</answer> no, wait: <answer> eiffel </answer>")
    assert (observation, reward, terminated) == (searchqa.CORRECT, 1.0, True)
    assert info["success"] and info["score"] == 1.0 and info["source"] == "nq"


# ----- expert -------------------------------------------------------------------------------------


def test_expert_solves_every_test_question(env):
  test_ids = task_splits("searchqa")["test"]
  assert len(test_ids) > 250
  for task_id in test_ids + task_splits("searchqa")["train"][::10]:
    env.reset(options={"task_id": task_id})
    search = env.expert_action()
    observation, reward, terminated, _, _ = env.step(search)
    gold_title = env.questions[task_id]["gold_title"]
    assert f'(Title: "{gold_title}")' in observation and not terminated, task_id
    _, reward, terminated, _, info = env.step(env.expert_action())
    assert (reward, terminated, info["success"]) == (1.0, True, True), task_id


def test_expert_without_gold_title_searches_the_question(flashrag, tmp_path):
  corpus, questions = flashrag
  with SearchQAEnv(corpus_path=corpus, questions_path=questions, cache_dir=str(tmp_path)) as e:
    _, info = e.reset(options={"task_id": 1})
    assert info["source"] == "custom"
    assert e.expert_action() == "<search>capital of germany?</search>"
    assert e.step(e.expert_action())[0].startswith('<information>Doc 1(Title: "Berlin")')
    assert e.step(e.expert_action())[1:3] == (1.0, True)


# ----- parsing and bad input ----------------------------------------------------------------------


def test_parse_action():
  parse = SearchQAEnv.parse_action
  assert parse("<think>hm</think>\n<search> capital of France </search>") == (
      "<search>capital of France</search>")
  assert parse("<search>a</search> <search>b</search>") == "<search>a</search>"
  assert parse("<search>q</search><answer>x</answer>") == "<search>q</search>"  # first tag
  assert parse("<answer>x</answer><search>q</search><answer> y </answer>") == "<answer>y</answer>"
  assert parse("<search>unclosed <answer>x</answer>") == "<answer>x</answer>"
  assert parse("Action: look around") == ""
  huge = parse("<search>" + "word " * 20000 + "</search>")
  assert huge.startswith("<search>word word") and huge.endswith("word</search>")
  assert len(huge) <= searchqa.MAX_CONTENT_CHARS + len("<search></search>")
  for action in ["<search>capital of France</search>", "<answer>Paris</answer>",
                 "<search>Śāriputra</search>", "<answer>1889</answer>"]:
    assert parse(SearchQAEnv.format_action(action)) == action


@pytest.mark.parametrize("response, expected", [
    ("", searchqa.INVALID),
    ("<search></search>", searchqa.EMPTY_QUERY),
    ("<search>zzqxv qqzzv</search>", searchqa.NO_MATCH),
    ("<search>" + "telephone " * 10000 + "</search>", "<information>Doc 1"),  # 100 KB
    ("x" * 100_000, searchqa.INVALID),
    ("Thought: hm\nAction: go to kitchen\nAction: look around", searchqa.INVALID),
    ("Thought: left first.\nAction: turn left", searchqa.INVALID),  # a BabyAI action
    ("<answer>Sorry ☃ 答案</answer>", searchqa.INCORRECT),
    ("<search>Śāriputra 打开</search>", '<information>Doc 1(Title: "Śāriputra")'),
])
def test_bad_responses_leave_a_live_env(env, response, expected):
  env.reset(options={"task_id": 0})
  observation, reward, terminated, truncated, info = env.step(env.parse_action(response))
  assert observation.startswith(expected)
  assert (reward, terminated, truncated, info["success"]) == (0.0, False, False, False)
  # A reply without a tag or query is refused; "error" would mark the episode as failed.
  assert info["invalid_action"] == (expected in (searchqa.INVALID, searchqa.EMPTY_QUERY))
  assert "error" not in info
  assert env.step("<search>Lake Erie</search>")[0].startswith("<information>Doc 1")


def test_raw_bytes_and_huge_unparsed_input(env):
  env.reset(options={"task_id": 0})
  for raw in [b"\xff\xfe<search>\x80</search>", b"\x00" * 1000, "<answer>" + "y" * 100_000]:
    observation, reward, terminated, _, _ = env.step(raw)
    assert observation in (searchqa.INVALID, searchqa.EMPTY_QUERY, searchqa.NO_MATCH), observation
    assert (reward, terminated) == (0.0, False)
  assert env.step("<answer>Lake Erie</answer>")[1:3] == (1.0, True)


# ----- questions, corpus, cache -------------------------------------------------------------------


def test_shipped_questions(env):
  items = env.questions
  splits = task_splits("searchqa")
  assert 1000 < len(items) < 5000
  assert sorted(splits["train"] + splits["test"]) == list(range(len(items)))
  assert {item["source"] for item in items} == {"wiki_desc", "wiki_lead", "wiki_2hop"}
  for split in ("train", "test"):
    assert {items[i]["source"] for i in splits[split]} == {"wiki_desc", "wiki_lead", "wiki_2hop"}
  test_answers = {items[i]["gold_title"] for i in splits["test"]}
  assert not test_answers & {items[i]["gold_title"] for i in splits["train"]}
  corpus_titles = {env.retriever.passage(i).title for i in range(len(env.retriever))}
  assert len(corpus_titles) == 10033
  assert all(f'"{item["gold_title"]}"' in corpus_titles for item in items)
  assert all(item["question"].endswith("?") for item in items)
  assert not any(build_questions.names_answer(item["question"], item["gold_title"])
                 for item in items)


@pytest.mark.slow
def test_generator_reproduces_shipped_questions(tmp_path):
  from importlib import resources
  shipped = [json.loads(line) for line in resources.files("environments.searchqa").joinpath(
      "data/questions.jsonl").read_text(encoding="utf-8").splitlines()]
  assert build_questions.build(str(tmp_path)) == shipped


def test_index_is_cached(env, cache_dir, monkeypatch):
  def no_rebuild(self):
    raise AssertionError("the cached index should have been loaded")
  monkeypatch.setattr(BM25Retriever, "_build", no_rebuild)
  with make("searchqa", cache_dir=cache_dir) as again:
    assert again.retriever.index_dir == env.retriever.index_dir
    again.reset(options={"task_id": 1})


def test_bad_corpus_and_questions(tmp_path):
  corpus = tmp_path / "bad.jsonl"
  corpus.write_text('{"id": "0", "contents": "\\"A\\"\\ntext"}\n{"id": "1", "body": "x"}\n')
  with pytest.raises(ValueError, match="line 2.*'contents' or 'title' and 'text'"):
    BM25Retriever(str(corpus), str(tmp_path))
  with pytest.raises(FileNotFoundError, match="wiki-18"):
    BM25Retriever(str(tmp_path / "missing.jsonl"), str(tmp_path))
  questions = tmp_path / "q.jsonl"
  questions.write_text('{"query": "no question field"}\n')
  with pytest.raises(ValueError, match="line 1.*'question' and 'golden_answers'"):
    searchqa.load_questions(str(questions))


def test_task_id_out_of_range(flashrag, tmp_path):
  corpus, questions = flashrag
  with SearchQAEnv(corpus_path=corpus, questions_path=questions, cache_dir=str(tmp_path)) as e:
    with pytest.raises(ValueError, match=r"\[0, 2\)"):
      e.reset(options={"task_id": 2})


def test_no_jax_import(cache_dir):
  code = ("import sys; from environments import make\n"
          f"with make('searchqa', cache_dir={cache_dir!r}) as e:\n"
          "  e.reset(options={'task_id': 0}); e.step('<search>Lake Erie</search>')\n"
          "assert 'jax' not in sys.modules, 'searchqa imported jax'\n")
  subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
