"""experiments/smollm2/actions.py: action verbs per BabyAI level group, golden counts by hand."""

import json

import pytest

from experiments.smollm2 import actions


def _episode(category, replies, success):
  messages = [{"role": "user", "content": "instruction"},
              {"role": "assistant", "content": "OK. I'll follow your instructions."}]
  for reply in replies:
    messages += [{"role": "user", "content": "observation"},
                 {"role": "assistant", "content": reply}]
  return {"category": category, "success": success, "messages": messages}


EPISODES = [
    _episode("PickupLoc", ["Thought:\nx\n\nAction:\ngo to red ball 1",
                           "Action: pickup blue key 1"], False),
    _episode("PickupDistDebug", ["Action:\npickup red ball 1"], True),
    _episode("GoToRedBall", ["I am lost.", "Action: turn left"], False),
    _episode("GoToObjS6", ["Action: go to grey box 1"], True),
]


def test_actions_skip_the_scripted_reply_and_keep_unparsed_turns():
  assert actions.actions(EPISODES[0]) == ["go to red ball 1", "pickup blue key 1"]
  assert actions.actions(EPISODES[2]) == ["", "turn left"]


def test_summary_counts_by_hand():
  groups = actions.summarize(EPISODES)
  assert set(groups) == {"GoTo", "Pickup"}
  pickup, goto = groups["Pickup"], groups["GoTo"]
  assert (pickup["episodes"], pickup["successes"], pickup["uses_verb"]) == (2, 1, 2)
  assert dict(pickup["first"]) == {"go": 1, "pickup": 1}
  # A reply without an action is no action: the first one taken is "turn".
  assert (goto["episodes"], goto["successes"], goto["uses_verb"]) == (2, 1, 1)
  assert dict(goto["first"]) == {"turn": 1, "go": 1}
  table = actions.table({"bc": groups})
  assert "| bc | Pickup | 2 | 1 | go 1, pickup 1 | 2 (\"pickup\") |" in table


def test_cli_reads_directories_and_rejects_bad_arguments(tmp_path, capsys):
  with open(tmp_path / "episodes_test.jsonl", "w", encoding="utf-8") as f:
    f.writelines(json.dumps(e) + "\n" for e in EPISODES)
  actions.main([f"run={tmp_path}"])
  assert "| run | GoTo | 2 | 1 |" in capsys.readouterr().out
  with pytest.raises(SystemExit, match="LABEL=DIR"):
    actions.main([str(tmp_path)])
  with pytest.raises(SystemExit, match="No .*episodes_test.jsonl"):
    actions.main([f"run={tmp_path / 'missing'}"])
