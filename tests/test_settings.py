"""The one door from the config to typed settings (agentgym_jax/settings.py): each function
maps every field of its part of the config, and the command lines' start-up checks end in one
line. (That nothing below the trainer takes the config is tests/test_layout.py's check.)"""

import dataclasses

import ml_collections
import pytest

from agentgym_jax import settings
from agentgym_jax.policies import PolicySettings
from agentgym_jax.rollout import RolloutSettings, SamplingConfig, envs
from agentgym_jax.rollout.demonstrations import ExpertSettings
from agentgym_jax.train import config as base


def test_rollout_settings_map_every_field():
  config = base.base_config()
  config.rollout.temperature, config.rollout.top_p, config.rollout.top_k = 0.7, 0.9, 40
  config.rollout.max_reply_tokens, config.rollout.max_context = 33, 1234
  config.rollout.replicas, config.rollout.history_turns = 3, 5
  config.rollout.overlap_env = True
  config.rollout.compact = False
  config.data.group_size = 6
  config.env.system_prompt, config.env.invalid_action_reward = "Be brief.", -0.25
  config.schedule.kind, config.schedule.horizons = "scaling_inter", (7, 11)
  rollout = settings.rollout(config)
  assert rollout == RolloutSettings(
      sampling=SamplingConfig(temperature=0.7, top_p=0.9, top_k=40, max_reply_tokens=33),
      group_size=6, max_turns=7, max_context=1234, system_prompt="Be brief.", replicas=3,
      history_turns=5, overlap_env=True, invalid_action_reward=-0.25, compact=False)
  # Only what the config does not set keeps its default; an empty system prompt is None.
  config.env.system_prompt = ""
  assert settings.rollout(config).system_prompt is None
  defaults = RolloutSettings()
  assert (rollout.acknowledgement, rollout.max_chunk, rollout.grow_cache) == (
      defaults.acknowledgement, defaults.max_chunk, defaults.grow_cache)


def test_env_settings_map_every_field_and_each_mixture_member_its_own():
  config = base.base_config()
  config.env.name, config.env.kwargs = "remote", ml_collections.ConfigDict(
      {"env_name": "babyai", "nested": {"a": 1}})
  config.env.categories, config.env.system_prompt = ("x",), "Hi."
  config.env.num_workers, config.env.timeout_s, config.env.urls = 3, 7.5, ("http://a:1",)
  config.data.split, config.data.categories = "test", ("x",)
  env = settings.env(config)
  assert env == envs.EnvSettings(
      name="remote", kwargs={"env_name": "babyai", "nested": {"a": 1}}, categories=("x",),
      system_prompt="Hi.", num_workers=3, timeout_s=7.5, urls=("http://a:1",),
      train_split="test", train_categories=("x",))
  assert type(env.kwargs["nested"]) is dict  # plain values, for the worker processes
  config = base.base_config()
  config.env.name = envs.MIX
  config.env.mix = ml_collections.ConfigDict({
      "a": envs.member("keypad", 0.25, kwargs={"codes": "7"}, max_turns=2),
      "b": envs.member("textcraft", 0.75, categories=("depth1",), system_prompt="Craft.")})
  env = settings.env(config)
  assert [(m.label, m.index, m.ratio, m.max_turns) for m in env.mix] == [
      ("a", 0, 0.25, 2), ("b", 1, 0.75, 0)]
  a, b = (m.env for m in env.mix)
  assert a == dataclasses.replace(env, name="keypad", kwargs={"codes": "7"}, mix=())
  assert (b.name, b.categories, b.system_prompt) == ("textcraft", ("depth1",), "Craft.")


def test_policy_expert_and_evaluation_settings_map_every_field():
  config = base.base_config()
  config.model.source, config.model.path, config.model.dtype = "hf", "/m", "bfloat16"
  config.model.remat, config.model.attention, config.model.layer_loop = True, "xla", "scan"
  config.model.lora_rank, config.model.lora_alpha = 8, 4.0
  config.tokenizer.spec, config.tokenizer.bpe_tasks = "bpe:300", 5
  config.init_from, config.seed = "/bc", 3
  assert settings.policy(config) == PolicySettings(
      source="hf", path="/m", arch=dict(config.model.arch), dtype="bfloat16", remat=True,
      attention="xla", layer_loop="scan", lora_rank=8, lora_alpha=4.0, tokenizer="bpe:300",
      bpe_tasks=5, init_from="/bc", seed=3)
  config.schedule.kind, config.schedule.horizons = "scaling_inter", (4, 9)
  config.rollout.max_context, config.rollout.max_reply_tokens = 300, 20
  config.bc.noise, config.bc.drop_thought = 0.1, 0.2
  assert settings.expert(config) == ExpertSettings(
      max_turns=9, max_context=300, max_reply_tokens=20, noise=0.1, drop_thought=0.2, seed=3)
  config.eval.split, config.eval.num_tasks, config.eval.group_size = "dev", 7, 4
  config.eval.temperature = 0.5
  config.data.batch_tasks, config.data.group_size = 5, 2
  evaluation = settings.evaluation(config, num_tasks=None, max_turns=2)
  assert evaluation == settings.EvalSettings(
      split="dev", num_tasks=7, num_samples=4, max_turns=2, temperature=0.5,
      max_reply_tokens=20, rollout=settings.rollout(config), rows=10, seed=3)
  config.eval.rows = 48
  assert settings.evaluation(config).rows == 48
  config.eval.rows = -1
  with pytest.raises(ValueError, match=r"eval.rows must be >= 0"):
    settings.evaluation(config)


def test_the_start_up_checks_exit_with_one_line():
  config = base.base_config()
  config.env.name = "minecraft"
  with pytest.raises(SystemExit, match=r"^FATAL: config.env: Unknown environment "
                                       r"config.env.name='minecraft'[^\n]*$"):
    settings.checked_env(config)
  config = base.base_config()
  config.algo.estimator = "grpoo"
  with pytest.raises(SystemExit, match=r"^FATAL: algo.estimator 'grpoo' is not one of"):
    settings.checked_algorithm(config)
