"""HTML of the viewer's pages: the run page, one trajectory page per episode file, and the
page of a sweep (its runs' curves as mean and band, links to each run's page).

Pages are static: every episode is rendered here, and the page's script (static/viewer.js)
only hides the episodes that the filters exclude. Agent tokens are coloured by advantage
(green positive, red negative, shade by size relative to the page's largest |advantage|);
prompt and observation text, which carries loss mask 0, is shown greyed as masked.
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from typing import Any


def page(title: str, body: str, script: bool = False) -> str:
  """A whole HTML document around `body`, linking the site's stylesheet (and script)."""
  js = '<script src="viewer.js"></script>\n' if script else ""
  return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
          f'<title>{html.escape(title)}</title><link rel="stylesheet" href="viewer.css">'
          f'</head>\n<body>\n{body}\n{js}</body></html>\n')


def table(header: Sequence[str] | None, rows: Sequence[Sequence[Any]], cls: str = "") -> str:
  def cell(x: Any) -> str:
    return f"{x:.3f}" if isinstance(x, float) else html.escape(str(x))
  head = ("<tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in header) + "</tr>"
          if header else "")
  body = "".join("<tr>" + "".join(f"<td>{cell(x)}</td>" for x in row) + "</tr>" for row in rows)
  return f'<table class="{cls}">{head}{body}</table>'


# ----- run page ---------------------------------------------------------------------------------


def run_page(name: str, facts: dict[str, Any], charts: Sequence[str],
             evals_in_training: Sequence[dict[str, Any]], reports: Sequence[dict[str, Any]],
             episode_pages: Sequence[dict[str, Any]]) -> str:
  """The run page: facts, training curves, evaluation tables, links to the episode pages.

  Args:
    name: the run's name (its workdir).
    facts: label -> value shown at the top (environment, algorithm, commit, ...).
    charts: SVG charts (`charts.curves`).
    evals_in_training: metrics.jsonl lines with "eval/" metrics.
    reports: eval_<split>.json reports of `python -m agentgym_jax.evaluate`, each with an
      added "path" (relative to the workdir).
    episode_pages: {"href", "label", "episodes", "success"} per trajectory page.
  """
  parts = [f"<h1>Run {html.escape(name)}</h1>",
           table(None, list(facts.items()), "facts"),
           "<h2>Training curves</h2>",
           '<div class="charts">' + "\n".join(charts) + "</div>" if charts
           else "<p>No metrics.jsonl in this directory.</p>"]
  if evals_in_training:
    # The counts go in the heading: they are the same at every evaluation.
    counts = ("eval/num_tasks", "eval/n")
    names = sorted({k for r in evals_in_training for k in r
                    if k.startswith("eval/") and k not in counts})
    tasks, n = (int(evals_in_training[-1].get(k, 0)) for k in counts)
    parts += [f"<h2>Held-out evaluation during training <small>({tasks} tasks, {n} sampled per "
              "task)</small></h2>",
              table(["step"] + [n.removeprefix("eval/") for n in names],
                    [[r["step"]] + [r.get(n, "") for n in names] for r in evals_in_training],
                    "evals")]
  for report in reports:
    columns = list(report["metrics"])
    metrics = [m for m in report["metrics"][columns[-1]] if m not in ("n", "num_tasks")]
    parts += [f"<h2>Evaluation: {html.escape(report['label'])}, {html.escape(report['split'])}"
              f" split <small>({html.escape(report['path'])})</small></h2>",
              table(["metric"] + columns,
                    [[m] + [report["metrics"][c].get(m, "") for c in columns] for m in metrics]
                    + [["tasks"] + [report["metrics"][c].get("num_tasks", "") for c in columns]],
                    "report")]
  parts.append("<h2>Episodes</h2>")
  if episode_pages:
    rows = "".join(f'<tr><td><a href="{html.escape(p["href"])}">{html.escape(p["label"])}</a>'
                   f'</td><td>{p["episodes"]}</td><td>{p["success"]:.3f}</td></tr>'
                   for p in episode_pages)
    parts.append('<table class="pages"><tr><th>page</th><th>episodes</th>'
                 f"<th>success rate</th></tr>{rows}</table>")
  else:
    parts.append("<p>No saved episodes (trajectories/step_N.jsonl or episodes_*.jsonl).</p>")
  return page(f"Run {name}", "\n".join(parts))


def sweep_page(name: str, charts: Sequence[str], runs: Sequence[dict[str, Any]]) -> str:
  """The page of a sweep: its curves per group of seeds, and a link to each run's own page.

  Args:
    name: the sweep's base workdir.
    charts: SVG charts (`charts.sweep_curves`).
    runs: {"group", "name", "href", "steps", "eval"} per run (eval: its last held-out success,
      or "").
  """
  parts = [f"<h1>Sweep {html.escape(name)}</h1>",
           "<h2>Training curves</h2>",
           "<p>One line per group of runs that differ only by seed (their number in brackets): "
           "the runs' mean at each step all of them logged; the band spans their lowest to their "
           "highest value. <code>python -m agentgym_jax.report</code> gives held-out success "
           "with intervals.</p>",
           '<div class="charts">' + "\n".join(charts) + "</div>",
           "<h2>Runs</h2>",
           table(["group", "run", "steps", "last held-out success"],
                 [[r["group"], r["name"], r["steps"], r["eval"]] for r in runs], "runs")]
  links = "".join(f'<li><a href="{html.escape(r["href"])}">{html.escape(r["name"])}</a></li>'
                  for r in runs)
  parts.append(f'<ul class="runs">{links}</ul>')
  return page(f"Sweep {name}", "\n".join(parts))


# ----- trajectory pages -------------------------------------------------------------------------


def _adv_style(advantage: float, scale: float) -> str:
  strength = min(abs(advantage) / scale, 1.0) if scale > 0 else 0.0
  rgb = "0,150,0" if advantage >= 0 else "210,0,0"
  return f"background:rgba({rgb},{0.1 + 0.6 * strength:.2f})"


def _agent_tokens(seg: dict[str, Any], scale: float) -> str:
  """An agent segment as one span per token, coloured by advantage when it has them."""
  if "pieces" not in seg:
    return f'<span class="text">{html.escape(seg["text"])}</span>'
  spans = []
  for i, piece in enumerate(seg["pieces"]):
    tip = [f"id {seg['tokens'][i]}"] + [
        f"{label} {seg[key][i]:.3f}" for key, label in
        (("logprobs", "log-prob"), ("advantages", "advantage"), ("values", "value"))
        if key in seg]
    if "advantages" in seg:
      style = f' style="{_adv_style(seg["advantages"][i], scale)}"'
      cls = "tok adv"
    else:
      style, cls = "", "tok"
    spans.append(f'<span class="{cls}"{style} title="{html.escape(" · ".join(tip))}">'
                 f"{html.escape(piece)}</span>")
  return "".join(spans)


def _masked(text: str, label: str) -> str:
  return (f'<div class="masked"><span class="label">{html.escape(label)} '
          f'<em>masked</em></span><pre>{html.escape(text)}</pre></div>')


def _agent_turn(turn: int, seg: dict[str, Any], scale: float, action: str | None = None,
                reward: float | None = None) -> str:
  parts = [f'<div class="turn"><span class="label">agent, turn {turn + 1}</span>',
           f'<div class="agent">{_agent_tokens(seg, scale)}</div>']
  if action is not None:
    parts.append(f'<div class="action">action: <code>{html.escape(action)}</code></div>'
                 if action else '<div class="action">action: <em>none parsed</em></div>')
  if reward is not None:
    parts.append(f'<div class="reward">reward {reward:.3f}</div>')
  return "".join(parts) + "</div>"


def episode_html(record: dict[str, Any], scale: float) -> str:
  """One episode: a header with its outcome, the prompt folded away, then turn by turn the
  agent's tokens, its parsed action, the reward and the observation."""
  success = "1" if record["success"] else "0"
  category = record.get("category")
  attrs = (f'data-task="{record["task_id"]}" data-success="{success}" '
           f'data-category="{html.escape(str(category))}"')
  head = (f'task {record["task_id"]}' + (f" ({html.escape(str(category))})" if category else "")
          + f' · group {record["group_id"]} · '
          + ("<b class=\"ok\">success</b>" if record["success"] else "<b class=\"fail\">fail</b>")
          + f' · reward {record["reward"]:.3f} · {record["num_turns"]} turns'
          + (f' · stopped: {html.escape(record["stop_reason"])}' if record.get("stop_reason")
             else "") + f' · {record["num_tokens"]} tokens')
  segments = record["segments"]
  parts = [f'<section class="episode" {attrs}>', f"<h3>{head}</h3>"]
  prompt = "".join(s["text"] for s in segments if s["role"] == "prompt")
  parts.append(f"<details><summary>Prompt</summary>{_masked(prompt, 'prompt')}</details>")
  agent = {s["turn"]: s for s in segments if s["role"] == "agent"}
  if "turns" in record:
    for turn in record["turns"]:
      t = turn["turn"]
      parts.append(_agent_turn(t, agent.get(t, {"text": turn["agent"]}), scale, turn["action"],
                               turn["reward"]))
      parts.append(_masked(turn["observation"], f"observation {t + 1}"))
  else:  # an older file without per-turn records: its token segments, in order
    for seg in segments:
      if seg["role"] == "agent":
        parts.append(_agent_turn(seg["turn"], seg, scale))
      elif seg["role"] == "observation":
        parts.append(_masked(seg["text"], f"observation {seg['turn'] + 1}"))
  parts.append("</section>")
  return "\n".join(parts)


def trajectory_page(title: str, records: Sequence[dict[str, Any]],
                    siblings: Sequence[tuple[str, str]], current: str) -> str:
  """A page of episodes with filters by task, category and success, and a step selector.

  Args:
    title: the page heading.
    records: the episodes (lines of a step_N.jsonl or episodes_*.jsonl).
    siblings: (href, label) of every trajectory page of the site, for the step selector.
    current: this page's href.
  """
  advantages = [abs(a) for r in records for s in r["segments"] for a in s.get("advantages", ())]
  scale = max(advantages, default=0.0)

  def select(name: str, values: Sequence[str], labels: Sequence[str] | None = None) -> str:
    options = "".join(f'<option value="{html.escape(v)}">{html.escape(label)}</option>'
                      for v, label in zip(values, labels or values))
    return (f'<label>{name} <select id="filter-{name}"><option value="">all</option>'
            f"{options}</select></label>")

  tasks = sorted({r["task_id"] for r in records})
  categories = sorted({str(r.get("category")) for r in records})
  steps = "".join(f'<option value="{html.escape(href)}"'
                  + (" selected" if href == current else "") + f">{html.escape(label)}</option>"
                  for href, label in siblings)
  controls = ('<nav class="filters"><a href="index.html">run page</a> '
              f'<label>step <select id="step">{steps}</select></label> '
              + select("task", [str(t) for t in tasks]) + " "
              + select("category", categories) + " "
              + select("success", ["1", "0"], ["success", "fail"])
              + f' <span class="count">showing <b id="shown">{len(records)}</b> of '
              f'{len(records)} episodes</span></nav>')
  masked = "Greyed text is masked (loss mask 0: not trained on)."
  if scale > 0:
    legend = ('<p class="legend">Agent tokens: <span class="tok adv" style="'
              f'{_adv_style(scale, scale)}">positive</span> / <span class="tok adv" style="'
              f'{_adv_style(-scale, scale)}">negative</span> advantage (largest |advantage| '
              f'on this page: {scale:.3g}); hover a token for its id, log-prob, advantage and '
              f"value. {masked}</p>")
  else:  # evaluation episodes: no update, so no advantages
    legend = f'<p class="legend">No advantages recorded for these episodes. {masked}</p>'
  body = "\n".join([f"<h1>{html.escape(title)}</h1>", controls, legend]
                   + [episode_html(r, scale) for r in records])
  return page(title, body, script=True)
