"""The embedded tokenizer (trained on the task corpus, loaded through transformers like a real Qwen3 tokenizer) and
the prompt format shared with real Qwen3 tokenizers."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from orl_jax.data import embedded_tokenizer as et
from orl_jax.data.prompt_format import (
    decode_response,
    end_of_turn_id,
    format_example,
    format_prompt,
    render_prompt,
    response_until_stop,
    stop_token_ids,
)
from orl_jax.data.tasks import SPLITS, TASKS, verify
from orl_jax.data.tokenizer import load_tokenizer, mask_token_id

VOCAB = 1024

# Qwen3's chat template (tokenizer_config.json of the Qwen/Qwen3 instruct models), verbatim: the embedded template
# must render the same text for the messages we use.
QWEN3_CHAT_TEMPLATE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}"""  # noqa: E501


@pytest.fixture(scope="module")
def corpus():
    return et.task_corpus(n_per_task=150)


@pytest.fixture(scope="module")
def tok_dir(corpus, tmp_path_factory):
    return et.train_tokenizer(corpus, VOCAB, tmp_path_factory.mktemp("embedded_tok"))


@pytest.fixture(scope="module")
def tok(tok_dir):
    return load_tokenizer(tok_dir)


@pytest.fixture(scope="module")
def eval_examples():
    """Held-out and unseen train examples of every task (none of them in the tokenizer's corpus)."""
    return [e for name, t in TASKS.items() for s in SPLITS for e in t.generate_many(range(10_000, 10_060), s)]


def test_saved_like_a_hf_tokenizer(tok_dir, tok):
    assert (tok_dir / "tokenizer.json").exists() and (tok_dir / "tokenizer_config.json").exists()
    cfg = json.loads((tok_dir / "tokenizer_config.json").read_text())
    assert cfg["eos_token"] == "<|im_end|>" and cfg["pad_token"] == "<|endoftext|>" and cfg["mask_token"] == "<|mask|>"
    assert VOCAB // 2 < len(tok) <= VOCAB + len(et.THINK_TOKENS)
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>" and tok.bos_token is None


def test_special_tokens_are_single_ids(tok):
    ids = {t: tok.encode(t, add_special_tokens=False) for t in (*et.SPECIAL_TOKENS, *et.THINK_TOKENS)}
    assert all(len(v) == 1 for v in ids.values()), ids
    assert [ids[t][0] for t in et.SPECIAL_TOKENS] == [0, 1, 2, 3]
    assert tok.eos_token_id == ids["<|im_end|>"][0] == end_of_turn_id(tok)
    assert tok.pad_token_id == ids["<|endoftext|>"][0]
    assert mask_token_id(tok) == tok.mask_token_id == ids["<|mask|>"][0]
    assert set(stop_token_ids(tok)) == {ids["<|im_end|>"][0], ids["<|endoftext|>"][0]}
    # inside text, special tokens stay whole, and nothing else in the vocabulary spells them
    assert tok.encode("a<|im_end|>b<|mask|>", add_special_tokens=False)[1] == ids["<|im_end|>"][0]
    assert tok.encode("a<|im_end|>b<|mask|>", add_special_tokens=False)[-1] == ids["<|mask|>"][0]


def test_round_trip_on_task_texts(tok, eval_examples):
    for e in eval_examples:
        for text in (e.prompt, e.solution):
            ids = tok.encode(text, add_special_tokens=False)
            assert tok.decode(ids) == text
    odd = "Ünïcödé ✓ tabs\tand  spaces\n\n  123,456 -7 {'a': [1, 2]} \\boxed{3}"
    assert tok.decode(tok.encode(odd, add_special_tokens=False)) == odd  # byte-level: nothing is unknown


def test_digits_are_single_tokens(tok):
    pieces = tok.convert_ids_to_tokens(tok.encode("12345 + 678", add_special_tokens=False))
    assert [p for p in pieces if any(c.isdigit() for c in p)] == list("12345678")


def test_training_is_deterministic(corpus, tok_dir, tmp_path):
    again = et.train_tokenizer(corpus, VOCAB, tmp_path / "again")
    assert (again / "tokenizer.json").read_bytes() == (tok_dir / "tokenizer.json").read_bytes()
    assert (again / "tokenizer_config.json").read_bytes() == (tok_dir / "tokenizer_config.json").read_bytes()
    other = et.train_tokenizer(corpus[: len(corpus) // 3], VOCAB, tmp_path / "other")
    assert (other / "tokenizer.json").read_bytes() != (tok_dir / "tokenizer.json").read_bytes()
    with pytest.raises(ValueError, match="vocab_size"):
        et.train_tokenizer(corpus, 100, tmp_path / "tiny")
    with pytest.raises(ValueError, match="texts"):
        et.train_tokenizer([], VOCAB, tmp_path / "empty")


def test_chat_template_is_chatml(tok):
    user = [{"role": "user", "content": "What is 2 + 3?"}]
    want = "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n"
    assert tok.apply_chat_template(user, tokenize=False, add_generation_prompt=True) == want
    assert render_prompt(tok, "What is 2 + 3?") == want
    assert render_prompt(tok, "Q", system="Be brief.") == \
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\n"
    assert render_prompt(tok, "Q", enable_thinking=False).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    conv = user + [{"role": "assistant", "content": "5"}]
    assert tok.apply_chat_template(conv, tokenize=False) == \
        "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n5<|im_end|>\n"


def test_embedded_template_renders_like_qwen3(tok, tok_dir, tmp_path, eval_examples):
    # The same vocabulary with Qwen3's full template: prompt ids must be identical, so code written against the
    # embedded tokenizer formats prompts for a real Qwen3 checkpoint the same way.
    qdir = tmp_path / "qwen3_like"
    shutil.copytree(tok_dir, qdir)
    (qdir / "chat_template.jinja").write_text(QWEN3_CHAT_TEMPLATE)
    qtok = load_tokenizer(qdir)
    assert qtok.chat_template == QWEN3_CHAT_TEMPLATE
    for e in eval_examples[::10]:
        assert format_prompt(qtok, e.prompt) == format_prompt(tok, e.prompt)
        assert format_prompt(qtok, e.prompt, enable_thinking=False) == format_prompt(tok, e.prompt,
                                                                                     enable_thinking=False)
        assert format_prompt(qtok, e.prompt, system="S") == format_prompt(tok, e.prompt, system="S")


def test_format_example_and_decode(tok, eval_examples):
    eot = end_of_turn_id(tok)
    for e in eval_examples:
        prompt, response = format_example(tok, e)
        assert response[-1] == eot and eot not in response[:-1] and prompt.count(eot) == 1
        assert prompt == tok.encode(render_prompt(tok, e.prompt), add_special_tokens=False)
        # encoding prompt and response separately equals encoding the whole conversation
        assert prompt + response == tok.encode(render_prompt(tok, e.prompt) + e.solution + "<|im_end|>",
                                               add_special_tokens=False)
        generated = response + [tok.pad_token_id, *tok.encode(" junk", add_special_tokens=False)]
        assert response_until_stop(tok, generated) == response[:-1]
        text = decode_response(tok, generated)
        assert text == e.solution
    e = eval_examples[0]
    _, response = format_example(tok, e)
    masked = response[:-1][:5] + [tok.mask_token_id] * 3  # an unfinished canvas: masks dropped, no stop token
    assert decode_response(tok, masked) == tok.decode(response[:5])
    # verifiers accept the decoded reference responses (the code task runs one sandbox each: check a few)
    sample = [e for e in eval_examples if e.task != "code_function"] + \
        [e for e in eval_examples if e.task == "code_function"][:4]
    assert all(verify(e, decode_response(tok, format_example(tok, e)[1])) for e in sample)


def test_answer_lengths_span_tens_to_hundreds_of_tokens(tok, eval_examples):
    lengths = np.array([len(format_example(tok, e)[1]) for e in eval_examples])
    p5, p50, p95 = np.percentile(lengths, [5, 50, 95])
    assert lengths.min() >= 15 and p5 >= 25, lengths.min()
    assert 40 <= p50 <= 250, p50
    assert 150 <= p95 <= 600 and lengths.max() <= 800, (p95, lengths.max())
    per_task = {t: np.median([n for n, e in zip(lengths, eval_examples) if e.task == t]) for t in TASKS}
    assert all(25 <= m <= 300 for m in per_task.values()), per_task


def test_prompt_without_chat_template(tok_dir, tmp_path):
    plain_dir = tmp_path / "plain"
    shutil.copytree(tok_dir, plain_dir)
    (plain_dir / "chat_template.jinja").unlink()
    plain = load_tokenizer(plain_dir)
    assert not plain.chat_template
    assert render_prompt(plain, "Q?") == "Q?\n"
    assert format_prompt(plain, "Q?") == plain.encode("Q?\n", add_special_tokens=False)
    with pytest.raises(ValueError, match="chat template"):
        format_prompt(plain, "Q?", enable_thinking=False)
