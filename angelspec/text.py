"""Text in and out of the target's tokens, one way for the CLI, the Python API and the server.

The rule for user text: it is text. A user who writes `<|im_start|>system` gets the tokens of
those characters, never the control token, so no prompt can forge a conversation turn. Only the
chat template itself contributes control tokens.
"""
from __future__ import annotations

MARK = "\x00angelspec-user-text\x00"  # stands for the user's text while the template is rendered


def encode_chat(tok, prompt: str, chat: bool = True) -> list[int]:
    """Token ids of a user prompt, wrapped in the tokenizer's chat template when it has one (and
    `chat`); special-token strings inside the prompt are encoded as ordinary text."""
    if not isinstance(prompt, str) or not prompt.strip():
        raise ValueError("prompt is empty: give some text to respond to")
    if not any(t.content in prompt for t in tok.added_tokens_decoder.values()):
        if chat and tok.chat_template:  # the template's own tokenization, as the data step saw it
            return list(tok.apply_chat_template([{"role": "user", "content": prompt}],
                                                tokenize=True, add_generation_prompt=True))
        return list(tok.encode(prompt, add_special_tokens=False))
    # the prompt holds a control token's text: encode it on its own, as text, inside the template
    user = list(tok.encode(prompt, add_special_tokens=False, split_special_tokens=True))
    if not (chat and tok.chat_template):
        return user
    rendered = tok.apply_chat_template([{"role": "user", "content": MARK}], tokenize=False,
                                       add_generation_prompt=True)
    if rendered.count(MARK) != 1:  # a template that rewrites the content: no safe split
        raise ValueError("the prompt holds a control token's text and this tokenizer's chat "
                         "template rewrites the user's text; remove the control token text")
    before, after = rendered.split(MARK)
    return (tok.encode(before, add_special_tokens=False) + user
            + tok.encode(after, add_special_tokens=False))


def encode_stop_words(tok, words) -> list[int]:
    """Stop words (strings) -> their token ids; each must be exactly one token."""
    ids = []
    for w in words:
        if not isinstance(w, str):
            raise ValueError(f"stop_words must be strings, got {type(w).__name__}")
        if not w:
            continue
        wid = tok.encode(w, add_special_tokens=False)
        if len(wid) != 1:
            raise ValueError(f"stop word {w[:40]!r} is {len(wid)} tokens; stop words must be "
                             "single tokens")
        ids.append(wid[0])
    return ids


def decode_whole(tok, ids: list[int]) -> str | None:
    """The text of `ids`, or None while it ends inside a multi-byte character: a byte-level
    tokenizer may split one character over several tokens, and streamed text must never show half
    of one, so the caller holds those tokens back until the character is complete."""
    text = tok.decode(ids, skip_special_tokens=True)
    return None if text.endswith("\ufffd") else text

