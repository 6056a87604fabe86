"""The per-layer view of prefix-tuning parameters matches what peft feeds each layer."""

import numpy as np
import pytest
import torch
from test_tuners import method_options

from fedpeft.models import registry
from fedpeft.tuners.prefix_layers import prefix_layout
from fedpeft.tuners.tuned import apply_tuner


@pytest.mark.parametrize("name", ["tiny-bert", "tiny-llama"])  # tiny-llama has grouped key/value heads
def test_a_layers_columns_are_that_layers_key_and_value_prefix(name):
    tok = registry.load_tokenizer(name)
    tuned = apply_tuner(registry.load_model(name, "classification", num_labels=2, tokenizer=tok),
                        method_options("prefix_tuning", num_virtual_tokens=3), "classification")
    layout = prefix_layout(tuned)
    state = tuned.state()
    prefix = state[layout.name]
    assert layout.num_layers == 2 and layout.width * 2 == prefix.shape[1]
    tuned.module.eval()  # no prefix dropout

    def prompts():
        with torch.no_grad():
            cache = tuned.module.get_prompt(batch_size=1)
        return [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]

    before = prompts()
    blocks = layout.split(prefix)
    tuned.load_state({**state, layout.name: layout.merge(prefix, {1: blocks[1] + 1.0})})
    after = prompts()
    assert torch.equal(before[0][0], after[0][0]) and torch.equal(before[0][1], after[0][1])
    assert not torch.equal(before[1][0], after[1][0]) and not torch.equal(before[1][1], after[1][1])
    np.testing.assert_array_equal(layout.merge(prefix, layout.split(prefix)), prefix)


def test_other_methods_are_refused():
    tok = registry.load_tokenizer("tiny-bert")
    tuned = apply_tuner(registry.load_model("tiny-bert", "classification", num_labels=2, tokenizer=tok),
                        method_options("lora", r=2), "classification")
    with pytest.raises(ValueError, match="prefix_tuning"):
        prefix_layout(tuned)
