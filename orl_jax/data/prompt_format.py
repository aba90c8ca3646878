"""Prompts and responses as token ids, the same way for a real Qwen3 tokenizer and for the embedded one.

A prompt is the tokenizer's chat template applied to one user message with add_generation_prompt=True, rendered to
text and then encoded without extra special tokens (so no tokenizer adds a BOS of its own). For Qwen3 and the
embedded tokenizer that is "<|im_start|>user\\n{question}<|im_end|>\\n<|im_start|>assistant\\n". A tokenizer
without a chat template gets "{question}\\n".

A response is the reference solution followed by the end-of-turn token: <|im_end|> when the tokenizer has it
(Qwen3 instruct and base, the embedded tokenizer), otherwise the tokenizer's eos token. Prompt and response are
encoded separately; because every chat prompt ends in a newline, this equals encoding their concatenation.
"""

from __future__ import annotations

from collections.abc import Sequence

END_OF_TURN = "<|im_end|>"
END_OF_TEXT = "<|endoftext|>"


def _token_id(tokenizer, token: str) -> int | None:
    tid = tokenizer.convert_tokens_to_ids(token)
    if tid is None or tid == getattr(tokenizer, "unk_token_id", None):
        return None
    return int(tid)


def end_of_turn_id(tokenizer) -> int:
    """The id that ends an assistant response: <|im_end|> if the tokenizer has it, else its eos token."""
    tid = _token_id(tokenizer, END_OF_TURN)
    if tid is None:
        tid = getattr(tokenizer, "eos_token_id", None)
    if tid is None:
        raise ValueError(f"tokenizer {type(tokenizer).__name__} has neither {END_OF_TURN} nor an eos token")
    return int(tid)


def stop_token_ids(tokenizer) -> tuple[int, ...]:
    """Ids that end generation: the end-of-turn id, the eos id and <|endoftext|> (Qwen3's generation config stops on
    both <|im_end|> and <|endoftext|>), without duplicates."""
    ids = [end_of_turn_id(tokenizer), getattr(tokenizer, "eos_token_id", None), _token_id(tokenizer, END_OF_TEXT)]
    return tuple(dict.fromkeys(int(i) for i in ids if i is not None))


def render_prompt(tokenizer, question: str, *, system: str | None = None, **template_kwargs) -> str:
    """The prompt text: the chat template over [system?, user] with the generation prompt, or "{question}\\n"."""
    if not isinstance(question, str):
        raise TypeError(f"question must be a str, got {type(question).__name__}")
    if getattr(tokenizer, "chat_template", None):
        messages = ([{"role": "system", "content": system}] if system is not None else [])
        messages.append({"role": "user", "content": question})
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **template_kwargs)
    if template_kwargs:
        raise ValueError(f"template arguments {sorted(template_kwargs)} given but the tokenizer has no chat template")
    return (f"{system}\n\n" if system is not None else "") + f"{question}\n"


def format_prompt(tokenizer, question: str, *, system: str | None = None, **template_kwargs) -> list[int]:
    """Token ids of the prompt for `question` (template_kwargs go to the chat template, e.g. enable_thinking=False)."""
    text = render_prompt(tokenizer, question, system=system, **template_kwargs)
    return list(tokenizer.encode(text, add_special_tokens=False))


def format_example(tokenizer, example, **template_kwargs) -> tuple[list[int], list[int]]:
    """(prompt ids, response ids) for a task Example: the response is its solution followed by the end-of-turn id."""
    prompt = format_prompt(tokenizer, example.prompt, **template_kwargs)
    response = list(tokenizer.encode(example.solution, add_special_tokens=False)) + [end_of_turn_id(tokenizer)]
    return prompt, response


def response_until_stop(tokenizer, ids: Sequence[int]) -> list[int]:
    """The generated ids before the first stop token (all of them if there is none)."""
    stops = set(stop_token_ids(tokenizer))
    out = []
    for t in ids:
        t = int(t)
        if t in stops:
            break
        out.append(t)
    return out


def decode_response(tokenizer, ids: Sequence[int]) -> str:
    """The text of a generated response up to (not including) the first stop token; special tokens left inside the
    response (e.g. unfilled <|mask|> positions) are dropped."""
    return tokenizer.decode(response_until_stop(tokenizer, ids), skip_special_tokens=True)
