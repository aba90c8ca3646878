"""A small byte-level BPE tokenizer trained on the embedded task corpus, laid out like a real Qwen3 tokenizer.

Same pipeline as Qwen2/Qwen3's tokenizer.json: NFC normalization, the Qwen pre-tokenizer regex (which splits every
digit into its own piece, so numbers are spelled digit by digit) followed by byte-level mapping, a byte-level BPE
model with no unknown token (every byte is in the initial alphabet), byte-level decoding. Special tokens:
<|endoftext|> (pad), <|im_start|>, <|im_end|> (eos: the end of an assistant turn), and <|mask|> for mask-diffusion
models; <think> and </think> are ordinary added tokens as in Qwen3. Saved with transformers'
PreTrainedTokenizerFast (tokenizer.json + tokenizer_config.json + the chat template), so it loads through
`orl_jax.data.tokenizer.load_tokenizer` exactly like a downloaded Qwen3 tokenizer.

Training is deterministic: the same texts in the same order and vocab_size give a byte-identical tokenizer.json.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
MASK_TOKEN = "<|mask|>"
SPECIAL_TOKENS = (PAD_TOKEN, IM_START, IM_END, MASK_TOKEN)  # ids 0..3, in this order
THINK_TOKENS = ("<think>", "</think>")

# Qwen2 / Qwen3 pre-tokenizer pattern (tokenizer.json of Qwen/Qwen3-*): contractions, letter runs with an optional
# leading non-letter, single digits, punctuation runs, newlines, spaces.
QWEN_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

# The structure of Qwen3's ChatML template (system / user / assistant turns, the generation prompt, the optional
# empty think block when enable_thinking=False), without the tool-calling and reasoning-content branches, which
# the embedded tasks never use. For these messages it renders exactly what Qwen3's template renders.
CHAT_TEMPLATE = (
    "{%- if messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}"
    "{%- endif %}"
)
MIN_VOCAB = 256 + len(SPECIAL_TOKENS)


def build_tokenizer(texts: Iterable[str], vocab_size: int):
    """The trained `tokenizers.Tokenizer` (not yet wrapped or saved)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < MIN_VOCAB:
        raise ValueError(f"vocab_size must be an int >= {MIN_VOCAB} (256 bytes + {len(SPECIAL_TOKENS)} special "
                         f"tokens), got {vocab_size!r}")
    tok = Tokenizer(models.BPE(byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, show_progress=False, special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    texts = list(texts)
    if not texts or not all(isinstance(t, str) for t in texts):
        raise ValueError("texts must be a non-empty iterable of str")
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in THINK_TOKENS])
    return tok


def train_tokenizer(texts: Iterable[str], vocab_size: int, out_dir: str | os.PathLike) -> Path:
    """Train on `texts`, save as a Hugging Face tokenizer directory at `out_dir` and return its path."""
    from transformers import PreTrainedTokenizerFast

    out = Path(out_dir)
    tok = build_tokenizer(texts, vocab_size)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=IM_END, pad_token=PAD_TOKEN, mask_token=MASK_TOKEN, bos_token=None,
        unk_token=None, extra_special_tokens=[IM_START], model_max_length=32768, clean_up_tokenization_spaces=False,
        chat_template=CHAT_TEMPLATE,
    )
    out.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(out))
    return out


def task_corpus(n_per_task: int = 400, seed: int = 0, tasks=None) -> list[str]:
    """Training text for the tokenizer: prompt and solution of train-split examples from each task, in a fixed order,
    each led by its chat role name ("user\n", "assistant\n") so the role words get tokens of their own as they
    would in the chat format. Held-out examples are never used, so the tokenizer does not see evaluation text."""
    from orl_jax.data.tasks import TASKS

    names = list(TASKS) if tasks is None else list(tasks)
    texts = []
    for name in names:
        indices = range(seed * n_per_task, (seed + 1) * n_per_task)
        for ex in TASKS[name].generate_many(indices, "train"):
            texts += [f"user\n{ex.prompt}", f"assistant\n{ex.solution}"]
    return texts


def train_task_tokenizer(out_dir: str | os.PathLike, vocab_size: int = 4096, n_per_task: int = 2000) -> Path:
    """The embedded tokenizer for the task suite: train_tokenizer over task_corpus(n_per_task)."""
    return train_tokenizer(task_corpus(n_per_task), vocab_size, out_dir)
