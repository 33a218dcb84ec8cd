"""ChatTokenizer: turn-by-turn encoding equals whole-conversation encoding, masks, golden ids."""

import pytest
import transformers

from agentgym_jax.tokenization import CHATML_TEMPLATE, QWEN_DEFAULT_SYSTEM, ChatTokenizer

CORPUS = [
    "You are in the middle of a room. Looking quickly around you, you see a cabinet 1.",
    "Thought:\nI should get the planks first.\n\nAction:\nget 2 oak planks",
    "Crafting commands: craft 4 oak planks using 1 oak log. Inventory: [stick] (2)",
    "Ça va? Größe 42 — naïve café, 東京 🙂\ttabs and  double  spaces",
] * 20

# Agent replies and observations with the usual hazards: digits, unicode, inner newlines,
# leading spaces, trailing newlines, an empty observation.
CONVERSATIONS = [
    [("Thought:\nThe log is nearby.\n\nAction:\nget 1 oak log", "Got 1 oak log."),
     ("Action: craft 4 oak planks using 1 oak log", "Crafted 4 minecraft:oak_planks\n"),
     ("Action:  inventory ", "Inventory: [oak planks] (4)")],
    [(" a reply with a leading space", ""),
     ("Größe 42 — naïve café, 東京 🙂", "   spaces first and last   "),
     ("x", "Obs with <angle> brackets & \"quotes\"")],
]


@pytest.fixture(scope="module", params=["bpe", "qwen2.5", "smollm2"])
def tok(request):
  if request.param == "bpe":
    return ChatTokenizer.train_bpe(CORPUS, vocab_size=400)
  if request.param == "qwen2.5":
    return ChatTokenizer.qwen2_5()
  return ChatTokenizer.smollm2()


def _messages(turns, system=None):
  messages = [] if system is None else [{"role": "system", "content": system}]
  messages += [{"role": "user", "content": "Solve the task."},
               {"role": "assistant", "content": "OK."},
               {"role": "user", "content": "You are in a room."}]
  for reply, observation in turns:
    messages += [{"role": "assistant", "content": reply},
                 {"role": "user", "content": observation}]
  return messages


@pytest.mark.parametrize("conversation", CONVERSATIONS)
@pytest.mark.parametrize("system", [None, "Be brief."])
def test_turn_by_turn_equals_whole(tok, conversation, system):
  messages = _messages(conversation, system)
  opening = len(messages) - 2 * len(conversation)
  ids = tok.encode_opening(messages[:opening])
  mask = [False] * len(ids)
  for reply, observation in conversation:
    reply_ids = tok.encode_reply(reply)
    ids += reply_ids
    mask += [True] * len(reply_ids)
    chunk = tok.encode_observation(observation)
    ids += chunk
    mask += [False] * len(chunk)

  whole, whole_mask = tok.encode_conversation(messages, add_generation_prompt=True)
  assert ids == whole
  # The whole-conversation mask also covers the opening's acknowledgement; past the opening
  # it must agree with the pieces.
  start = len(tok.encode_opening(messages[:opening]))
  assert whole_mask[start:] == mask[start:]
  assert ids == tok.encode_text(tok.render(messages, add_generation_prompt=True))


def test_mask_covers_exactly_content_and_end_of_turn(tok):
  messages = _messages(CONVERSATIONS[0])
  ids, mask = tok.encode_conversation(messages)
  runs, current = [], []
  for token, masked in zip(ids, mask):
    if masked:
      current.append(token)
    elif current:
      runs.append(current)
      current = []
  replies = [m["content"] for m in messages if m["role"] == "assistant"]
  assert [tok.decode(r) for r in runs] == [r + tok.end_of_turn for r in replies]
  assert all(r[-1] == tok.end_of_turn_ids[0] for r in runs)


def test_observation_chunk_starts_after_end_of_turn(tok):
  chunk = tok.encode_observation("Got 1 oak log.")
  assert tok.decode(chunk) == ("\n<|im_start|>user\nGot 1 oak log.<|im_end|>\n"
                               "<|im_start|>assistant\n")
  # "\n" is the first token of the chunk: the sampled <|im_end|> never absorbs it.
  assert tok.decode(chunk[:1]) == "\n"
  assert tok.end_of_turn == "<|im_end|>"


def test_decode_is_exact(tok):
  text = "Thought: a , b . c ! 'd'  don't \n\n  Größe 東京 🙂"
  assert tok.decode(tok.encode_text(text)) == text


def test_qwen2_5_golden_ids():
  tok = ChatTokenizer.qwen2_5()
  assert tok.encode_text("Hello world!") == [9707, 1879, 0]
  assert tok.end_of_turn_ids == (151645, 151643)
  assert tok.hf.convert_tokens_to_ids(["<|im_start|>", "<|file_sep|>"]) == [151644, 151664]
  assert tok.vocab_size == 151665 and tok.pad_id == 151643
  # Qwen2.5's default system line, as token ids of the real Qwen2.5-Instruct template.
  assert tok.encode_opening([{"role": "user", "content": "hi"}]) == [
      151644, 8948, 198, 2610, 525, 1207, 16948, 11, 3465, 553, 54364, 14817, 13, 1446, 525,
      264, 10950, 17847, 13, 151645, 198, 151644, 872, 198, 6023, 151645, 198, 151644, 77091,
      198]
  custom = tok.render([{"role": "system", "content": "S"}, {"role": "user", "content": "u"}],
                      add_generation_prompt=False)
  assert custom == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nu<|im_end|>\n"
  assert QWEN_DEFAULT_SYSTEM in tok.render([{"role": "user", "content": "u"}], False)


def test_smollm2_vocabulary():
  tok = ChatTokenizer.smollm2()
  assert tok.vocab_size == 49152
  assert tok.hf.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [0, 1, 2]
  assert tok.end_of_turn_ids == (2, 0)
  text = tok.render([{"role": "user", "content": "u"}], add_generation_prompt=True)
  assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")


def test_train_bpe_specials_and_reload(tmp_path):
  tok = ChatTokenizer.train_bpe(CORPUS, vocab_size=300)
  assert tok.hf.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [0, 1, 2]
  assert 259 < tok.vocab_size <= 300
  assert tok.end_of_turn_ids == (2, 0) and tok.pad_id == 0
  # No default system message in the plain ChatML template.
  assert tok.render([{"role": "user", "content": "u"}], True) == (
      "<|im_start|>user\nu<|im_end|>\n<|im_start|>assistant\n")
  tok.save_pretrained(str(tmp_path))
  again = ChatTokenizer.from_pretrained(str(tmp_path))
  messages = _messages(CONVERSATIONS[1])
  assert again.encode_conversation(messages) == tok.encode_conversation(messages)
  # Bytes never seen in training still round-trip (byte-level alphabet).
  assert again.decode(again.encode_text("ÆØÅ ∑ 𝔘")) == "ÆØÅ ∑ 𝔘"


def test_bad_inputs():
  with pytest.raises(ValueError, match="vocab_size"):
    ChatTokenizer.train_bpe(CORPUS, vocab_size=100)
  tok = ChatTokenizer.train_bpe(CORPUS, vocab_size=300)
  with pytest.raises(ValueError, match="must end with a user"):
    tok.encode_opening([{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}])
  with pytest.raises(ValueError, match="start with a system or user"):
    tok.encode_conversation([{"role": "assistant", "content": "a"}])
  hf = tok.hf
  hf.chat_template = None
  with pytest.raises(ValueError, match="no chat template"):
    ChatTokenizer(hf)
  # A template that closes assistant turns with plain text cannot stop a sampled reply.
  hf.chat_template = CHATML_TEMPLATE.replace("<|im_end|>", "END")
  with pytest.raises(ValueError, match="does not start with a special token"):
    ChatTokenizer(hf)


def test_from_pretrained_any_hf_dir(tmp_path):
  tok = ChatTokenizer.train_bpe(CORPUS, vocab_size=300)
  tok.hf.save_pretrained(str(tmp_path))
  hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
  assert ChatTokenizer(hf).encode_observation("o") == tok.encode_observation("o")
