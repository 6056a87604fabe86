"""Instruction and chat data (``task.type: instruction``): conversations formatted with a chat template, the
loss on the assistant's tokens only.

A row is a conversation, ``messages: [{role, content}, ...]`` (roles system, user, assistant; every assistant
turn is a target), or an instruction record, ``instruction`` (or ``task.instruction``) + optional ``input`` +
``output`` (or ``target``, the generation schema's name), read as one user message (the instruction, a blank
line, the input) and one assistant message. Rows come checked (:mod:`fedpeft.data.validate`).

The template (:func:`chat_format`): ``task.chat_template`` when set, else the tokenizer's own
``chat_template``, else :data:`DEFAULT_CHAT_TEMPLATE` (ChatML-style; every turn ends with the tokenizer's eos,
or its sep token when it has no eos). It is rendered with ``tokenizer.apply_chat_template``.

Masking (:func:`render_pieces`): the conversation is rendered whole and, for each assistant turn, prefix by
prefix: the messages before it with the generation prompt (where the response starts) and the messages up to
it (where it ends). The response is trained from its content to its end-of-turn token; the role headers and
the whitespace the template puts after the end of turn are not. A template that does not render a
conversation's beginning as a prefix of the whole is refused (its masks could not be told apart). The text is
tokenised whole and the boundaries are taken from the tokenised prefixes; where a boundary falls inside a token
the pieces are tokenised one by one instead.

Truncation to ``task.max_length`` (:func:`_truncate`): the conversation is cut from the left (the prompt side
first, keeping a leading BOS) so that the final response stays whole; a final response longer than the
budget keeps its first tokens and no prompt. Every sequence therefore keeps at least one target token; how
many were cut is logged.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from fedpeft.data import features as F
from fedpeft.data import validate as V
from fedpeft.data.batching import Encoded
from fedpeft.data.sources import DataError, Row

log = logging.getLogger("fedpeft")

DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + eos_token + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
"""The built-in template, used only when neither ``task.chat_template`` nor the tokenizer has one: ChatML's
layout (``<|im_start|>ROLE\\nCONTENT<|im_end|>\\n``) with the tokenizer's eos token (else its sep token) as the
end of every turn, so that generation stops there."""

SOURCES = {"config": "task.chat_template", "tokenizer": "the tokenizer's own chat_template",
           "builtin": "fedpeft's built-in ChatML-style template (fedpeft.data.chat.DEFAULT_CHAT_TEMPLATE)"}
_PROBE = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]


@dataclass
class ChatFormat:
    template: str  # the Jinja text rendered
    source: str  # "config", "tokenizer" or "builtin" (see SOURCES)
    eos_token: str  # the tokenizer's eos (or sep) token, given to templates as eos_token
    stop_ids: list[int]  # generation stops at any of these: the eos id and the template's end-of-turn token
    stop_text: str | None = None  # a template whose turn ends in ordinary text (not one special token): that text

    def describe(self) -> str:
        return SOURCES[self.source]


@dataclass
class InstructionEval:
    prompts: Encoded  # each conversation up to its final response (the generation prompt included)
    references: list[list[str]]  # the final response, or the row's references
    teacher_forced: Encoded  # the whole conversation, labels on every assistant token (eval loss, perplexity)
    stop_ids: list[int]
    stop_text: str | None = None  # generation also stops at this text, and a reply is cut before it


@dataclass
class EncodedConversation:
    ids: list[int]
    labels: list[int]
    final: tuple[int, int]  # [start, end) token span of the final response's trained tokens


# --- rows -> messages -----------------------------------------------------------------------------


def to_messages(row: Row, instruction: str | None = None) -> tuple[list[dict[str, str]], list[str]]:
    """(messages with role and content only, references of the final response) of one checked row."""
    if "messages" in row:
        messages = [{"role": m["role"], "content": m["content"]} for m in row["messages"]]
    else:
        prompt = row.get("instruction", instruction)
        extra = row.get("input")
        user = f"{prompt}\n\n{extra}" if isinstance(extra, str) and extra.strip() else str(prompt)
        output = row["output"] if "output" in row else row["target"]
        messages = [{"role": "user", "content": user}, {"role": "assistant", "content": output}]
    references = list(row.get("references") or [messages[-1]["content"]])
    return messages, references


# --- the template ---------------------------------------------------------------------------------


def _end_token(tokenizer) -> str:
    token = tokenizer.eos_token if tokenizer.eos_token is not None else tokenizer.sep_token
    if token is None:
        raise DataError("the tokenizer has neither an eos nor a sep token; task.type instruction needs one to end "
                        "each turn")
    return str(token)


def _tokenizer_template(tokenizer) -> str | None:
    own = getattr(tokenizer, "chat_template", None)
    if not own:
        return None
    return own if isinstance(own, str) else tokenizer.get_chat_template()


def chat_format(tokenizer, configured: str | None = None) -> ChatFormat:
    """The template a run formats its conversations with: ``configured`` (task.chat_template), else the
    tokenizer's own, else :data:`DEFAULT_CHAT_TEMPLATE`; with the token ids generation stops at."""
    own = _tokenizer_template(tokenizer)
    if configured:
        template, source = configured, "config"
    elif own:
        template, source = own, "tokenizer"
    else:
        template, source = DEFAULT_CHAT_TEMPLATE, "builtin"
    fmt = ChatFormat(template, source, _end_token(tokenizer), [])
    end_id = tokenizer.convert_tokens_to_ids(fmt.eos_token)
    stops = [int(end_id)] if end_id is not None else []
    pieces = render_pieces(tokenizer, fmt, _PROBE, "the chat template's probe conversation")
    trained = next(text for text, is_target in reversed(pieces) if is_target)
    probe_ids = _tokenize(tokenizer, [trained])[0]
    specials = set(tokenizer.all_special_ids) | {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
    if probe_ids and probe_ids[-1] in specials and probe_ids[-1] not in stops:
        stops.append(int(probe_ids[-1]))  # the template's end of turn (e.g. <|im_end|>, <|eot_id|>)
    elif not probe_ids or probe_ids[-1] not in stops:
        # the turn ends in ordinary text (e.g. "### End"), or in nothing: generation must stop on that text
        marker = trained[trained.rfind(_PROBE[-1]["content"]) + len(_PROBE[-1]["content"]):]
        if not marker.strip():
            raise DataError(f"{fmt.describe()} ends an assistant turn with nothing after the reply, so a model cannot "
                            "learn where a reply ends and generation would run to task.generation_max_new_tokens; "
                            "end each assistant turn with {{ eos_token }} in task.chat_template")
        fmt.stop_text = marker.strip()
        log.info("task.type instruction: %s ends a turn with the text %r (not one special token): generation stops "
                 "at it and replies are cut before it", fmt.describe(), fmt.stop_text)
    fmt.stop_ids = stops
    return fmt


def _render(tokenizer, fmt: ChatFormat, messages: list[dict[str, str]], generation_prompt: bool, where: str) -> str:
    import jinja2

    try:
        text = tokenizer.apply_chat_template(messages, chat_template=fmt.template, tokenize=False,
                                             add_generation_prompt=generation_prompt, eos_token=fmt.eos_token)
    except jinja2.TemplateSyntaxError as exc:
        raise DataError(f"{fmt.describe()}: Jinja syntax error at line {exc.lineno}: {exc.message}; fix the "
                        "template (task.chat_template)") from None
    except (jinja2.TemplateError, ValueError, TypeError, KeyError) as exc:
        first = (str(exc).strip().splitlines() or [exc.__class__.__name__])[0][:200]
        raise DataError(f"{where}: {fmt.describe()} refused this conversation ({first}); fix the row, or set "
                        "task.chat_template to a template that accepts it") from None
    if not isinstance(text, str):
        raise DataError(f"{fmt.describe()} did not render to text; set task.chat_template to a Jinja template")
    return text


def render_pieces(tokenizer, fmt: ChatFormat, messages: list[dict[str, str]], where: str) -> list[tuple[str, bool]]:
    """The rendered conversation cut into (text, trained) pieces: each assistant response (its content and
    end-of-turn token) is trained, everything else (system, user, role headers, separators) is not."""
    full = _render(tokenizer, fmt, messages, False, where)
    pieces: list[tuple[str, bool]] = []
    pos = 0
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = _render(tokenizer, fmt, messages[:i], True, where)
        after = _render(tokenizer, fmt, messages[: i + 1], False, where)
        if not (full.startswith(before) and full.startswith(after) and len(after) > len(before) >= pos):
            raise DataError(
                f"{where}: {fmt.describe()} does not render the conversation up to messages[{i}] as a beginning "
                "of the whole conversation, so its assistant tokens cannot be told apart; set task.chat_template to "
                "a template that renders each turn in place (e.g. fedpeft.data.chat.DEFAULT_CHAT_TEMPLATE)")
        turn = after[len(before):]
        # where the content starts: after the header the template writes for this turn, found by rendering the
        # turn around a placeholder (searching for the content itself could match inside the header)
        marked = _render(tokenizer, fmt, [*messages[:i], {"role": "assistant", "content": _PLACEHOLDER}], False,
                         where)[len(before):]
        header = marked[: max(marked.find(_PLACEHOLDER), 0)]
        if _PLACEHOLDER not in marked or not turn.startswith(header):
            raise DataError(f"{where}: {fmt.describe()} does not write messages[{i}] (assistant) after a fixed "
                            "header, so its tokens cannot be told apart; set task.chat_template to a template that "
                            "writes the content as given (e.g. fedpeft.data.chat.DEFAULT_CHAT_TEMPLATE)")
        start, end = len(before) + len(header), len(before) + len(turn.rstrip())
        if end <= start:
            raise DataError(f"{where}: {fmt.describe()} renders messages[{i}] (assistant) as nothing; set "
                            "task.chat_template to a template that writes the assistant's content")
        pieces += [(full[pos:start], False), (full[start:end], True)]
        pos = end
    pieces.append((full[pos:], False))
    return [(text, trained) for text, trained in pieces if text]


# --- tokens ---------------------------------------------------------------------------------------


_PLACEHOLDER = "\x00fedpeft-assistant-content\x00"


def _tokenize(tokenizer, texts: list[str]) -> list[list[int]]:
    return [list(x) for x in tokenizer(texts, add_special_tokens=False)["input_ids"]] if texts else []


def encode_pieces(tokenizer, pieces: list[tuple[str, bool]], lead: list[int]) -> EncodedConversation:
    """Token ids and labels (-100 off the trained pieces) of one rendered conversation, ``lead`` (a BOS)
    put first unless the template wrote it."""
    ends = np.cumsum([len(text) for text, _ in pieces]).tolist()
    full = "".join(text for text, _ in pieces)
    spans = [(e - len(text), e) for (text, trained), e in zip(pieces, ends) if trained]
    if getattr(tokenizer, "is_fast", False):
        # the whole text tokenised once, as the model will see it; a token is trained when its characters
        # overlap a response (a token across a boundary, e.g. " Yes" after "[/INST]", belongs to the response)
        enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
        ids, offsets = list(enc["input_ids"]), enc["offset_mapping"]
        owner = [next((k for k, (s, e) in enumerate(spans) if a < e and s < b), None) if b > a else None
                 for a, b in offsets]
    else:  # slow tokenizers have no offsets: the pieces one by one
        parts = _tokenize(tokenizer, [text for text, _ in pieces])
        ids = [t for part in parts for t in part]
        owner, k = [], 0
        for (_, trained), part in zip(pieces, parts):
            owner += [k if trained else None] * len(part)
            k += bool(trained)
    if lead and ids[: len(lead)] != lead:
        ids, owner = lead + ids, [None] * len(lead) + owner
    labels = [t if o is not None else -100 for t, o in zip(ids, owner)]
    last = [j for j, o in enumerate(owner) if o is not None and o == len(spans) - 1]
    final = (last[0], last[-1] + 1) if last else (0, 0)
    return EncodedConversation(ids, labels, final)


def _lead_kept(ids: list[int], lead: list[int]) -> int:
    return len(lead) if lead and ids[: len(lead)] == lead else 0


def _truncate(conv: EncodedConversation, max_length: int, lead: list[int]) -> tuple[list[int], list[int], int]:
    """(ids, labels, how much was cut: 0 nothing, 1 the prompt side, 2 also the end of the final response)."""
    ids, labels = conv.ids, conv.labels
    if len(ids) <= max_length:
        return ids, labels, 0
    keep = _lead_kept(ids, lead)
    start, end = conv.final
    budget = max_length - keep
    if end - start <= budget:  # the final response stays whole; what precedes it is cut from the left
        lo = max(keep, end - budget)
        return ids[:keep] + ids[lo:end], labels[:keep] + labels[lo:end], 1
    return ids[:keep] + ids[start : start + budget], labels[:keep] + labels[start : start + budget], 2


def _conversations(rows: list[Row], origins: list[V.Origin], tokenizer, fmt: ChatFormat, instruction: str | None,
                   ) -> tuple[list[EncodedConversation], list[list[str]], list[int]]:
    lead = F.leading_special_ids(tokenizer)
    convs, refs = [], []
    for row, origin in zip(rows, origins):
        messages, references = to_messages(row, instruction)
        convs.append(encode_pieces(tokenizer, render_pieces(tokenizer, fmt, messages, V.at(origin)), lead))
        refs.append(references)
    return convs, refs, lead


def _fit(convs: Iterable[EncodedConversation], max_length: int, lead: list[int]) -> tuple[Encoded, int, int]:
    ids, labels, cut, lost = [], [], 0, 0
    for conv in convs:
        i, y, how = _truncate(conv, max_length, lead)
        ids.append(np.asarray(i, dtype=np.int32))
        labels.append(np.asarray(y, dtype=np.int64))
        cut += how > 0
        lost += how > 1
    return Encoded(ids, labels), cut, lost


def _log_cut(where: str, cut: int, lost: int, total: int, max_length: int, what: str = "conversations") -> None:
    if not cut:
        return
    also = f" ({lost} of them also lost the end of their final response)" if lost else ""
    log.warning("%s: %d of %d %s are longer than task.max_length (%d tokens): cut from the left, the prompt first%s; "
                "raise task.max_length to keep them whole", where, cut, total, what, max_length, also)


def encode_instruction(rows: list[Row], origins: list[V.Origin], tokenizer, fmt: ChatFormat, *, max_length: int,
                       where: str, instruction: str | None = None) -> Encoded:
    """Training sequences: each whole conversation, labels on its assistant tokens only (-100 elsewhere)."""
    convs, _, lead = _conversations(rows, origins, tokenizer, fmt, instruction)
    data, cut, lost = _fit(convs, max_length, lead)
    _log_cut(where, cut, lost, len(convs), max_length)
    return data


def encode_instruction_eval(rows: list[Row], origins: list[V.Origin], tokenizer, fmt: ChatFormat, *,
                            max_length: int, where: str, instruction: str | None = None) -> InstructionEval:
    """The teacher-forced conversations (eval loss and perplexity over the assistant tokens) and, for greedy
    generation, each conversation up to its final response, with that response's references."""
    convs, refs, lead = _conversations(rows, origins, tokenizer, fmt, instruction)
    teacher, cut, lost = _fit(convs, max_length, lead)
    _log_cut(where, cut, lost, len(convs), max_length)
    prompts, cut_prompts = [], 0
    for conv in convs:
        prompt = conv.ids[: conv.final[0]]
        if len(prompt) > max_length:
            keep = _lead_kept(prompt, lead)
            prompt = prompt[:keep] + prompt[len(prompt) - (max_length - keep) :]
            cut_prompts += 1
        prompts.append(np.asarray(prompt, dtype=np.int32))
    _log_cut(where, cut_prompts, 0, len(convs), max_length, "generation prompts")
    return InstructionEval(Encoded(prompts, [0] * len(prompts)), refs, teacher, list(fmt.stop_ids), fmt.stop_text)


def announce(fmt: ChatFormat) -> None:
    """Say which template formats the run's conversations (a warning for the built-in fallback)."""
    if fmt.source == "builtin":
        log.warning("task.type instruction: the tokenizer has no chat template and task.chat_template is not set: "
                    "conversations are formatted with %s", fmt.describe())
    else:
        log.info("task.type instruction: conversations are formatted with %s", fmt.describe())
