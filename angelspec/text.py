"""Text in and out of the target's tokens, one way for the CLI, the Python API and the server.

The rule for user text: it is text. A user who writes `<|im_start|>system` gets the tokens of
those characters, never the control token, so no prompt can forge a conversation turn. Only the
chat template itself contributes control tokens.
"""
from __future__ import annotations

MARK = "\x00angelspec-user-text\x00"  # stands for the user's text while the template is rendered


ROLES = ("system", "user", "assistant")


def check_messages(messages) -> list[dict]:
    """A conversation as the chat template takes it: a non-empty list of {"role", "content"}
    turns, roles system/user/assistant, contents strings, at least one with text."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of {role, content} turns")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise ValueError(f"messages[{i}].role must be one of {', '.join(ROLES)}")
        if not isinstance(m.get("content"), str):
            raise ValueError(f"messages[{i}].content must be a string")
    if not any(m["content"].strip() for m in messages):
        raise ValueError("messages are empty: give some text to respond to")
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def encode_chat(tok, prompt: str, chat: bool = True) -> list[int]:
    """Token ids of a user prompt, wrapped in the tokenizer's chat template when it has one (and
    `chat`); special-token strings inside the prompt are encoded as ordinary text."""
    if not isinstance(prompt, str) or not prompt.strip():
        raise ValueError("prompt is empty: give some text to respond to")
    if chat and tok.chat_template:
        return encode_messages(tok, [{"role": "user", "content": prompt}])
    return list(tok.encode(prompt, add_special_tokens=False, split_special_tokens=True))


def encode_messages(tok, messages: list[dict]) -> list[int]:
    """Token ids of a conversation in the tokenizer's chat template, with the generation prompt;
    control-token text inside any turn is encoded as text. Without a template only a single user
    turn is accepted, encoded as its bare text (what a prompt gets)."""
    messages = check_messages(messages)
    if not tok.chat_template:
        if len(messages) == 1 and messages[0]["role"] == "user":
            return encode_chat(tok, messages[0]["content"], chat=False)
        raise ValueError("this model's tokenizer has no chat template: send one user message, or "
                         "a raw prompt to /v1/completions")
    specials = [t.content for t in tok.added_tokens_decoder.values()]
    if not any(s in m["content"] for m in messages for s in specials):
        # the template's own tokenization, as the data step saw it
        return list(tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True))
    # a turn holds a control token's text: render the template around placeholders, then encode
    # each turn on its own, as text
    marks = [f"{MARK}{i}{MARK}" for i in range(len(messages))]
    rendered = tok.apply_chat_template([{"role": m["role"], "content": k} for m, k in zip(messages, marks)],
                                       tokenize=False, add_generation_prompt=True)
    if any(rendered.count(k) != 1 for k in marks):  # a template that rewrites the content: no safe split
        raise ValueError("the prompt holds a control token's text and this tokenizer's chat "
                         "template rewrites the user's text; remove the control token text")
    ids = []
    for m, k in zip(messages, marks):
        before, rendered = rendered.split(k)
        ids += tok.encode(before, add_special_tokens=False)
        ids += tok.encode(m["content"], add_special_tokens=False, split_special_tokens=True)
    return ids + tok.encode(rendered, add_special_tokens=False)


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

