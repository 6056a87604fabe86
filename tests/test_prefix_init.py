"""Prefix tuning initialised from a text: the untrained prefixed model is the model with the text prepended."""

import pytest
import torch

from fedpeft.models import registry
from fedpeft.tuners.prefix_tuning.prefix_init import text_token_ids
from fedpeft.tuners.tuned import apply_tuner, method_options

TEXT = "Answer the question with the right choice."


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gpt2"])
def test_prefix_from_text_equals_prepending_the_text(name):
    tok = registry.load_tokenizer(name)
    model = registry.load_model(name, "causal", tokenizer=tok, seed=1)
    model.train()  # as built: the prefix must still come from the deterministic (dropout-free) forward pass
    ids = text_token_ids(tok, TEXT, 6)
    text = torch.tensor([ids])
    x = torch.tensor([[17, 230, 41, 9, 77]])
    tuned = apply_tuner(model, method_options("prefix_tuning", num_virtual_tokens=6, init_text=TEXT), "causal",
                        tokenizer=tok)
    assert model.training  # the mode is left as it was
    model.eval()
    with torch.no_grad():
        expected = model(input_ids=torch.cat([text, x], dim=1)).logits[:, len(ids):]
        got = tuned.module(input_ids=x, attention_mask=torch.ones_like(x)).logits
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    # without the text the prefixes are peft's random values: the output differs
    plain = apply_tuner(registry.load_model(name, "causal", tokenizer=tok, seed=1).eval(),
                        method_options("prefix_tuning", num_virtual_tokens=6), "causal")
    with torch.no_grad():
        assert not torch.allclose(plain.module(input_ids=x, attention_mask=torch.ones_like(x)).logits, expected,
                                  atol=1e-2)


def test_text_is_cut_or_repeated_after_a_leading_bos_only():
    tok = registry.load_tokenizer("tiny-bert")  # adds [CLS] ... [SEP]: [CLS] is kept once, [SEP] never
    words = list(tok(TEXT, add_special_tokens=False)["input_ids"])
    assert text_token_ids(tok, TEXT, 3) == [tok.cls_token_id, *words[:2]]
    assert text_token_ids(tok, TEXT, len(words) + 3) == [tok.cls_token_id, *words, *words[:2]]
    assert tok.sep_token_id not in text_token_ids(tok, TEXT, 3 * len(words))


def test_init_text_is_refused_where_it_cannot_apply():
    tok = registry.load_tokenizer("tiny-bert")
    model = registry.load_model("tiny-bert", "classification", num_labels=2, tokenizer=tok, seed=1)
    with pytest.raises(ValueError, match="key/value cache"):
        apply_tuner(model, method_options("prefix_tuning", num_virtual_tokens=4, init_text=TEXT), "classification",
                    tokenizer=tok)
    llama = registry.load_model("tiny-llama", "causal", tokenizer=registry.load_tokenizer("tiny-llama"), seed=1)
    with pytest.raises(ValueError, match="projection: false"):
        apply_tuner(llama, method_options("prefix_tuning", num_virtual_tokens=4, init_text=TEXT, projection=True),
                    "causal", tokenizer=tok)
    with pytest.raises(ValueError, match="tokenizer"):
        apply_tuner(llama, method_options("prefix_tuning", num_virtual_tokens=4, init_text=TEXT), "causal")
