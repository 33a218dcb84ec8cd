"""Evaluation metrics (golden values) and table rendering."""

import os

import numpy as np
import pytest

from agentgym_jax import settings as settings_lib
from agentgym_jax.evaluate import eval_metrics as em
from agentgym_jax.evaluate import report


def test_avg_and_pass_at_n_golden():
  # 3 tasks x 2 samples; task 0 passes once, task 1 never (score 0 and a negative SciWorld
  # failure score), task 2 twice.
  scores = np.array([[1.0, 0.0], [0.0, -1.0], [0.5, 0.25]])
  assert em.avg_at_n(scores) == pytest.approx((1.0 + 0.0 + 0.0 - 1.0 + 0.5 + 0.25) / 6)
  passed = em.passed_from(scores, None, "score>0")
  assert passed.tolist() == [[True, False], [False, False], [True, True]]
  assert em.pass_at_n(passed) == pytest.approx(2 / 3)


def test_pass_at_k_golden_and_consistency():
  passed = np.array([[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 0, 0]], dtype=bool)
  # k=1: the per-task pass fraction c/n -> (1/4 + 2/4 + 0) / 3.
  assert em.pass_at_k(passed, 1) == pytest.approx(0.25)
  # k=2: 1 - C(n-c, 2)/C(4, 2): task 0 -> 1 - 3/6, task 1 -> 1 - 1/6, task 2 -> 0.
  assert em.pass_at_k(passed, 2) == pytest.approx((0.5 + 5 / 6 + 0.0) / 3)
  # k = n is exactly Pass@n.
  assert em.pass_at_k(passed, 4) == pytest.approx(em.pass_at_n(passed))
  with pytest.raises(ValueError, match="1 <= k <= n"):
    em.pass_at_k(passed, 5)


def test_passed_from_success_criterion():
  scores = np.array([30.0, 100.0, 0.0])  # SciWorld-like progress scores
  success = np.array([False, True, False])
  assert em.passed_from(scores, success, "success").tolist() == [False, True, False]
  assert em.passed_from(scores, success, "score>0").tolist() == [True, True, False]
  with pytest.raises(ValueError, match="needs the per-episode success"):
    em.passed_from(scores, None, "success")
  with pytest.raises(ValueError, match="Unknown pass criterion"):
    em.passed_from(scores, success, "score>=0")


def test_to_task_matrix_groups_interleaved_episodes():
  order, matrix = em.to_task_matrix([7, 3, 7, 3], [1.0, 2.0, 3.0, 4.0])
  assert order == [7, 3]
  np.testing.assert_array_equal(matrix, [[1.0, 3.0], [2.0, 4.0]])
  with pytest.raises(ValueError, match="different sample counts"):
    em.to_task_matrix([1, 1, 2], [0.0, 0.0, 0.0])
  with pytest.raises(ValueError, match="3 task ids but 2 values"):
    em.to_task_matrix([1, 2, 3], [0.0, 0.0])


def test_bad_shapes_raise():
  with pytest.raises(ValueError, match=r"\[tasks, samples\]"):
    em.avg_at_n(np.zeros(3))
  with pytest.raises(ValueError, match=r"\[tasks, samples\]"):
    em.pass_at_n(np.zeros((0, 2)))


def test_summarize_reproduces_paper_textcraft_row():
  # Paper Table 3, AgentGym-RL-7B on TextCraft: depth 1/2/3/4 have 31/41/25/3 test tasks and
  # 31/40/18/0 of them were solved -> 100 / 97.56 / 72.00 / 0 and Overall 89.00, where Overall
  # is over all 100 tasks, not the mean of the columns.
  sizes = {"Depth 1": (31, 31), "Depth 2": (41, 40), "Depth 3": (25, 18), "Depth 4": (3, 0)}
  task_ids, scores, categories = [], [], {}
  for name, (total, solved) in sizes.items():
    for i in range(total):
      task_id = len(categories)
      categories[task_id] = name
      task_ids.append(task_id)
      scores.append(1.0 if i < solved else 0.0)
  passed = em.passed_from(np.array(scores), None, "score>0")
  summary = em.summarize(task_ids, scores, passed, categories,
                         category_order=["Depth 1", "Depth 2", "Depth 3", "Depth 4"])
  assert list(summary) == ["Depth 1", "Depth 2", "Depth 3", "Depth 4", "Overall"]
  got = {k: round(100 * v["pass"], 2) for k, v in summary.items()}
  assert got == {"Depth 1": 100.0, "Depth 2": 97.56, "Depth 3": 72.0, "Depth 4": 0.0,
                 "Overall": 89.0}
  assert summary["Depth 2"]["num_tasks"] == 41 and summary["Overall"]["n"] == 1

  table = report.markdown_table(report.summary_rows("AgentGym-RL-7B", summary, ("pass",)), list(summary))
  assert table.splitlines() == [
      "| Model | Depth 1 | Depth 2 | Depth 3 | Depth 4 | Overall |",
      "|---|---|---|---|---|---|",
      "| AgentGym-RL-7B (Pass@1) | 100.00 | 97.56 | 72.00 | 0.00 | 89.00 |",
  ]


def test_summarize_category_order_unknown_and_pass_at_k():
  # Two samples per task; the "b" category is not in the requested order, "z" is never seen.
  task_ids = [0, 0, 1, 1, 2, 2]
  scores = [1.0, 0.0, 0.0, 0.0, 1.0, 1.0]
  passed = [s > 0 for s in scores]
  summary = em.summarize(task_ids, scores, passed, {0: "a", 1: "b", 2: "a"},
                         category_order=["z", "a"], ks=(1, 2))
  assert list(summary) == ["a", "b", "Overall"]
  assert summary["a"]["avg"] == pytest.approx(0.75)
  assert summary["a"]["pass"] == pytest.approx(1.0)
  assert summary["a"]["pass@1"] == pytest.approx(0.75)
  assert summary["Overall"]["pass@2"] == pytest.approx(2 / 3)
  assert summary["b"]["num_tasks"] == 1


def test_summarize_without_categories_has_only_overall():
  summary = em.summarize([0, 1], [1.0, 0.0], [True, False])
  assert list(summary) == ["Overall"]
  assert summary["Overall"]["pass"] == pytest.approx(0.5)


def test_summarize_treats_a_none_category_as_other():
  # An environment without info["category"] maps its tasks to None; the table must still render.
  summary = em.summarize([0, 1], [1.0, 0.0], [True, False], categories={0: None, 1: "a"})
  assert list(summary) == ["a", "other", em.OVERALL]
  assert summary["other"]["avg"] == 1.0 and summary["a"]["avg"] == 0.0
  avg = {column: metrics["avg"] for column, metrics in summary.items()}
  table = report.markdown_table([("m", avg)], list(summary))
  assert table.splitlines()[0] == "| Model | a | other | Overall |"
  assert table.splitlines()[2] == "| m | 0.00 | 100.00 | 50.00 |"


def test_markdown_table_missing_values_and_avg_row():
  summary = {"x": {"pass": 0.5, "avg": 0.25, "n": 4}, "Overall": {"pass": 0.5, "avg": 0.25, "n": 4}}
  rows = report.summary_rows("m", summary)
  assert [label for label, _ in rows] == ["m (Pass@4)", "m (Avg@4)"]
  table = report.markdown_table(rows + [("other", {"x": 0.1})], ["x", "Overall"], digits=1)
  assert table.splitlines()[2:] == [
      "| m (Pass@4) | 50.0 | 50.0 |",
      "| m (Avg@4) | 25.0 | 25.0 |",
      "| other | 10.0 | - |",
  ]


# ----- the driver over a fake pool: outcomes do not depend on what the model says ---------------


class _FakePool:
  """Episodes end after one step; task t scores 1 on its k-th sample where k = t % 3 ... so the
  metrics are known in advance. Categories come from reset info as the real envs send them."""

  CATEGORIES = {0: "depth1", 1: "depth1", 2: "depth2", 3: "depth3"}

  def __init__(self):
    self.slots = []
    self.resets = 0

  def reset(self, task_ids):
    self.resets += 1
    self.slots = list(task_ids)
    self.seen = {}
    from environments.workers import StepOutcome
    return [StepOutcome(f"Task {t}.", 0.0, False, False,
                        {"instruction": "Craft it.", "category": self.CATEGORIES[t]})
            for t in task_ids]

  def step(self, slots, responses):
    from environments.workers import StepOutcome
    outs = []
    for slot in slots:
      task = self.slots[slot]
      k = sum(1 for s in range(slot) if self.slots[s] == task)  # sample index within the task
      # task 0: both samples pass; task 1: second only; task 2: none; task 3: first only.
      score = float({0: (1, 1), 1: (0, 1), 2: (0, 0), 3: (1, 0)}[task][k])
      outs.append(StepOutcome("Done.", score, True, False, {"success": score > 0,
                                                            "score": score}))
    return outs


@pytest.fixture(scope="module")
def tiny_policy():
  from flax import nnx
  from agentgym_jax.models import Decoder, ModelConfig
  from agentgym_jax.tokenization import ChatTokenizer
  tok = ChatTokenizer.train_bpe(["Craft it. Task 0. Done. Thought: Action: craft"] * 4,
                                vocab_size=300)
  cfg = ModelConfig(vocab_size=tok.vocab_size, hidden_size=32, intermediate_size=64,
                    num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16)
  graphdef, state = nnx.split(Decoder(cfg, rngs=nnx.Rngs(0)))
  return graphdef, state, tok


def _textcraft_config(num_samples=2, rows_per_step=4):
  from agentgym_jax.train import config as base
  c = base.base_config()
  c.env.name = "textcraft"  # its first four test tasks are 0, 1, 2, 3
  c.data.batch_tasks, c.data.group_size = rows_per_step, 1
  c.eval.group_size, c.eval.num_tasks, c.eval.temperature = num_samples, 4, 0.0
  c.schedule.horizons = (3,)
  c.rollout.max_reply_tokens, c.rollout.max_context = 4, 256
  return c


def test_evaluate_golden_over_fake_pool(tiny_policy, tmp_path):
  from agentgym_jax import evaluate
  graphdef, state, tok = tiny_policy
  pool = _FakePool()
  config = _textcraft_config()
  settings = settings_lib.evaluation(config, ks=(1, 2, 4))
  assert (settings.split, settings.num_tasks, settings.num_samples, settings.max_turns,
          settings.temperature, settings.max_reply_tokens) == ("test", 4, 2, 3, 0.0, 4)
  result = evaluate.evaluate(settings_lib.env(config), settings, graphdef, state, tok, pool,
                             rng=evaluate.eval_key(0),
                             episodes_path=str(tmp_path / "ep.jsonl"))
  assert pool.resets == 2  # two chunks of 2 tasks (one compiled shape)
  s = result.summary
  assert list(s) == ["Depth 1", "Depth 2", "Depth 3", "Overall"]
  assert s["Depth 1"]["pass"] == 1.0 and s["Depth 1"]["avg"] == pytest.approx(0.75)
  assert s["Depth 2"]["pass"] == 0.0
  assert s["Overall"]["pass"] == pytest.approx(0.75)
  assert s["Overall"]["avg"] == pytest.approx(4 / 8)
  assert s["Overall"]["pass@1"] == pytest.approx(0.5)
  assert "pass@4" not in s["Overall"]  # k > n is skipped
  assert s["Overall"]["avg_raw"] == pytest.approx(0.5)
  assert result.categories == {0: "depth1", 1: "depth1", 2: "depth2", 3: "depth3"}
  assert len((tmp_path / "ep.jsonl").read_text().splitlines()) == 8

  assert result.settings["env"] == "textcraft" and result.settings["num_tasks"] == 4
  json_path, md_path = evaluate.write_report(result, str(tmp_path / "out"), "tiny", "test")
  import json
  report = json.load(open(json_path))
  assert report["metrics"]["Overall"]["pass"] == pytest.approx(0.75)
  assert [t["scores"] for t in report["tasks"]] == [[1.0, 1.0], [0.0, 1.0], [0.0, 0.0],
                                                    [1.0, 0.0]]
  table = open(md_path).read()
  assert "| tiny (Pass@2) | 100.00 | 0.00 | 100.00 | 75.00 |" in table


def test_paper_column_rules():
  from agentgym_jax.evaluate import paper_column
  assert paper_column("sciworld", "test-conductivity-of-unknown-substances") == "Test-Cond"
  assert paper_column("sciworld", "boil") == "Measure"
  assert paper_column("sciworld", "grow-plant") == "grow-plant"  # no rule: its own column
  assert paper_column("babyai", "BabyAI-GoToRedBallGrey-v0") == "GoTo"
  assert paper_column("babyai", "BabyAI-SynthLoc-v0") == "SynthLoc"
  assert paper_column("babyai", "BabyAI-FindObjS7-v0") == "FindObjS7"
  assert paper_column("searchqa", "hotpotqa") == "HotpotQA"
  assert paper_column("textcraft", "depth3") == "Depth 3"
  assert paper_column("unknown_env", "x") == "x"
  assert paper_column("babyai", None) is None


def test_load_policy_with_neither_flag_evaluates_the_config_model():
  from flax import nnx
  from agentgym_jax import sharding
  from agentgym_jax.evaluate import __main__ as evaluate_cli
  from agentgym_jax.train import config as base
  config = base.base_config()
  config.tokenizer.spec = "bpe:300"
  config.tokenizer.bpe_tasks = 2
  mesh = sharding.make_mesh(config.mesh)
  graphdef, state, tok, label = evaluate_cli._load_policy(
      settings_lib.policy(config), settings_lib.env(config), None, None, None, mesh)
  assert label == "random" and tok.vocab_size <= 300
  assert nnx.merge(graphdef, state).cfg.vocab_size == tok.vocab_size


def test_webarena_runlocal_table_has_the_paper_columns_of_the_served_env(tiny_policy, tmp_path):
  """runlocal serves TextCraft behind the remote client: its table has TextCraft's Depth
  columns (from the split file's categories), not one "remote" Overall column."""
  import sys
  from agentgym_jax import evaluate
  from agentgym_jax.rollout import envs
  from environments.server import running_server
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  if root not in sys.path:  # experiment files import `experiments.agentgym_rl.common`
    sys.path.insert(0, root)
  from experiments.agentgym_rl import webarena
  graphdef, state, tok = tiny_policy
  config = webarena.get_config("runlocal")
  with running_server("textcraft") as url:
    config.env.kwargs.url = url
    settings = settings_lib.evaluation(config, num_samples=1, max_turns=1, max_reply_tokens=2)
    env = settings_lib.env(config)
    with envs.make_pool(env) as pool:
      result = evaluate.evaluate(env, settings, graphdef, state, tok, pool,
                                 rng=evaluate.eval_key(0))
  want = [evaluate.paper_column("textcraft", c) for c in sorted(set(result.categories.values()))]
  assert result.settings["env"] == "textcraft"
  assert list(result.summary) == want + ["Overall"] and want[0].startswith("Depth ")
  _, md_path = evaluate.write_report(result, str(tmp_path), "tiny", "test")
  assert f"| Model | {' | '.join(want)} | Overall |" in open(md_path).read()
