"""The offline GPT-OSS tokenizer: the ids openai-harmony renders, token for token, for our prompts and answers."""

import pytest

import gpt_oss_tokenizer
import rewards
import strategies

pytest.importorskip("bpe_openai")  # both in requirements-cpu.txt; a GPU set without them skips this file
pytest.importorskip("openai_harmony")
from openai_harmony import (  # noqa: E402
    Conversation,
    DeveloperContent,
    Message,
    ReasoningEffort,
    RenderConversationConfig,
    Role,
    SystemContent,
)

BOARDS = {"default": rewards.RewardSettings(), "notebook": rewards.RewardSettings(**rewards.NOTEBOOK)}


@pytest.fixture(scope="session")
def tokenizer():
    return gpt_oss_tokenizer.load()  # the cached build (~1 s), or a fresh one (~5 s) the first time


@pytest.fixture(scope="session")
def encoding():
    return gpt_oss_tokenizer.harmony_encoding()


def template_ids(tokenizer, messages, **kwargs) -> list[int]:
    return tokenizer.apply_chat_template(messages, return_dict=True, **kwargs)["input_ids"]


def system(effort: str = "medium", date: str | None = None) -> Message:
    content = SystemContent.new().with_reasoning_effort(ReasoningEffort(effort.capitalize()))
    if date:
        content = content.with_conversation_start_date(date)
    return Message.from_role_and_content(Role.SYSTEM, content)


def user(text: str) -> Message:
    return Message.from_role_and_content(Role.USER, text)


@pytest.mark.parametrize("effort", gpt_oss_tokenizer.EFFORTS)
@pytest.mark.parametrize("board", BOARDS)
def test_our_prompts_render_as_openai_harmony_renders_them(tokenizer, encoding, board, effort):
    prompt = rewards.build_prompt(BOARDS[board])
    ours = template_ids(tokenizer, [{"role": "user", "content": prompt}], add_generation_prompt=True,
                        reasoning_effort=effort)  # fmt: skip
    expected = encoding.render_conversation_for_completion(Conversation.from_messages([system(effort), user(prompt)]),
                                                           Role.ASSISTANT)  # fmt: skip
    assert ours == expected


def test_the_default_effort_is_medium_and_the_date_is_left_out_unless_given(tokenizer, encoding):
    """openai-harmony's defaults; GPT-OSS's own template would write today's date, which no test could pin."""
    chat = [{"role": "user", "content": "Hello"}]
    plain = encoding.render_conversation_for_completion(Conversation.from_messages([system(), user("Hello")]),
                                                        Role.ASSISTANT)  # fmt: skip
    assert template_ids(tokenizer, chat, add_generation_prompt=True) == plain
    dated = Conversation.from_messages([system("low", "2026-11-24"), user("Hello")])
    assert template_ids(tokenizer, chat, add_generation_prompt=True, reasoning_effort="low",
                        conversation_start_date="2026-11-24") == encoding.render_conversation_for_completion(
        dated, Role.ASSISTANT)  # fmt: skip


@pytest.mark.parametrize("role", ["system", "developer"])
def test_a_system_or_developer_message_becomes_the_developer_instructions(tokenizer, encoding, role):
    instructions = DeveloperContent.new().with_instructions("Answer with code only.")
    conversation = Conversation.from_messages(
        [system("high"), Message.from_role_and_content(Role.DEVELOPER, instructions), user("Write 2048.")]
    )
    chat = [{"role": role, "content": "Answer with code only."}, {"role": "user", "content": "Write 2048."}]
    assert template_ids(tokenizer, chat, add_generation_prompt=True, reasoning_effort="high") == (
        encoding.render_conversation_for_completion(conversation, Role.ASSISTANT)
    )


def test_an_answer_renders_as_harmony_trains_on_it(tokenizer, encoding):
    """The prompt then `answer_text` (what the model writes), or the template's last assistant message, are
    openai-harmony's training rendering of the same conversation with the analysis kept."""
    prompt, final = "Write a strategy.", "```python\n" + strategies.source("greedy_compact") + "```"
    analysis = "The board is 3x3; a greedy move keeps the most empty cells."
    answer = [
        Message.from_role_and_content(Role.ASSISTANT, analysis).with_channel("analysis"),
        Message.from_role_and_content(Role.ASSISTANT, final).with_channel("final"),
    ]
    expected = encoding.render_conversation_for_training(
        Conversation.from_messages([system("low"), user(prompt), *answer]),
        RenderConversationConfig(auto_drop_analysis=False),
    )
    chat = [{"role": "user", "content": prompt}]
    head = template_ids(tokenizer, chat, add_generation_prompt=True, reasoning_effort="low")
    text = gpt_oss_tokenizer.answer_text(final, analysis)
    assert head + tokenizer.encode(text, add_special_tokens=False) == expected
    whole = chat + [{"role": "assistant", "content": final, "thinking": analysis}]
    assert template_ids(tokenizer, whole, reasoning_effort="low") == expected


def test_an_earlier_answer_is_its_final_message_alone(tokenizer, encoding):
    earlier = [
        Message.from_role_and_content(Role.ASSISTANT, "hmm").with_channel("analysis"),
        Message.from_role_and_content(Role.ASSISTANT, "W").with_channel("final"),
    ]
    conversation = Conversation.from_messages([system(), user("A move?"), *earlier, user("Another?")])
    chat = [{"role": "user", "content": "A move?"}, {"role": "assistant", "content": "W", "thinking": "hmm"},
            {"role": "user", "content": "Another?"}]  # fmt: skip
    assert template_ids(tokenizer, chat, add_generation_prompt=True) == encoding.render_conversation_for_completion(
        conversation, Role.ASSISTANT
    )


def test_vocabulary_and_special_tokens(tokenizer, encoding):
    assert len(tokenizer) == gpt_oss_tokenizer.VOCAB_SIZE == 201088
    named = {"<|startoftext|>": 199998, "<|endoftext|>": 199999, "<|return|>": 200002, "<|constrain|>": 200003,
             "<|channel|>": 200005, "<|start|>": 200006, "<|end|>": 200007, "<|message|>": 200008, "<|call|>": 200012,
             "<|reserved_200013|>": 200013, "<|reserved_201087|>": 201087}  # fmt: skip
    for name, token_id in named.items():
        assert tokenizer.convert_tokens_to_ids(name) == token_id == encoding.encode(name, allowed_special="all")[0]
    assert gpt_oss_tokenizer.special_tokens(encoding) == {
        i: tokenizer.convert_ids_to_tokens(i) for i in range(199998, 201088)
    }
    assert (tokenizer.eos_token, tokenizer.pad_token, tokenizer.bos_token) == (
        "<|return|>", "<|endoftext|>", "<|startoftext|>",
    )  # fmt: skip
    assert tokenizer.encode("<|return|>", add_special_tokens=False) == [200002]
    assert tokenizer.encode("hi", add_special_tokens=True) == tokenizer.encode("hi", add_special_tokens=False)


TEXTS = [
    "Hello, world! It's 2048 o'clock; don't   stop.\n\n\t  ",
    "def strategy(board):\n    return 'W'  # 12345678 9\r\n\r\n",
    "Ünïcödé: naïve café, 東京, Привет мир, مرحبا, emoji 🎲🧩, zero\u200bwidth",
    "CamelCaseWords and ALLCAPS, snake_case_words, x**2+y//3 >= 1e-9 ... ''' \"\"\"",
]


def test_plain_text_encodes_as_o200k_does(tokenizer, encoding):
    texts = TEXTS + [strategies.source(name) for name in ("expectimax", "corner", "expectimax_compact")]
    texts.append(rewards.build_prompt(BOARDS["notebook"]))
    for text in texts:
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert ids == encoding.encode(text, disallowed_special=())
        assert tokenizer.decode(ids) == text


# --- the token budget, measured with this tokenizer -------------------------------------------------------------


def preset(name: str):
    """(script args, reward settings, GRPO config) of a preset as train_2048 parses it (on a CPU)."""
    import options

    script, settings, grpo, _ = options.parse_args(
        ["--config", str(options.HERE / "configs" / f"{name}.yaml"), "--use_cpu", "true", "--bf16", "false"]
    )
    return script, settings, grpo


@pytest.mark.parametrize("name", ["gpt-oss-20b", "gpt-oss-20b-bf16", "gpt-oss-20b-bf16-wide"])
def test_every_gpt_oss_preset_holds_the_prompt_an_analysis_and_a_search_answer(tokenizer, name):
    """The budget, like the reward, is measured against what it must hold: gpt-oss's analysis (250 tokens) and a
    compact depth-2 expectimax as a whole final answer, after the prompt as the model sees it. (notebook.yaml keeps
    the notebook's own 586 tokens: it reproduces that run, and train_2048 warns about it at start.)"""
    script, settings, grpo = preset(name)
    analysis, answer = rewards.completion_need(tokenizer)
    prompt = rewards.prompt_tokens(tokenizer, settings, grpo.chat_template_kwargs["reasoning_effort"])
    assert analysis >= rewards.ANALYSIS_TOKENS and 400 < answer < 600, (analysis, answer)
    assert grpo.max_completion_length >= 1.25 * (analysis + answer), (grpo.max_completion_length, analysis, answer)
    assert script.max_seq_length >= prompt + grpo.max_completion_length, (script.max_seq_length, prompt)


def test_a_budget_that_cannot_hold_the_answer_warns_once_at_start_with_the_numbers(tokenizer):
    script, settings, grpo = preset("notebook")
    lines = rewards.budget_warnings(tokenizer, settings, grpo.max_completion_length, "low", script.max_seq_length)
    assert len(lines) == 2, lines  # 586 tokens hold no search answer; 768 do not hold the prompt and 586 more
    assert lines[0].startswith("max_completion_length 586 cannot hold a board-reading answer: 256 tokens of analysis")
    assert lines[1].startswith("max_seq_length 768 cannot hold the prompt (")
    assert rewards.budget_warnings(tokenizer, settings, grpo.max_completion_length, "low")[1:] == []  # no Unsloth
    script, settings, grpo = preset("gpt-oss-20b")
    assert rewards.budget_warnings(tokenizer, settings, grpo.max_completion_length, "low", script.max_seq_length) == []
