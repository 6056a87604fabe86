"""Images for image classification (issue 39's data side): decoding from the Hugging Face image schema, paths and
ImageFolder directories, the modes a model takes, and the one-line refusals of bad images."""

import io
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import DATA_DIR
from PIL import Image

from fedpeft.data.files import DataError, read_file
from fedpeft.data.images import decode_image, pixel_values, read_image_folder, to_mode


def png(mode: str = "L", size=(6, 4), value=7) -> bytes:
    out = io.BytesIO()
    Image.new(mode, size, value).save(out, format="PNG")
    return out.getvalue()


@pytest.mark.needs_data
def test_mnist_in_the_hub_image_schema_decodes_and_gray_becomes_three_equal_channels():
    rows = read_file(DATA_DIR / "mnist" / "test.parquet")
    assert len(rows) == 10_000 and set(rows[0]) == {"image", "label"} and rows[0]["label"] == 7
    image = decode_image(rows[0]["image"], "row 1")
    assert (image.mode, image.size) == ("L", (28, 28))
    rgb = np.asarray(to_mode(image, 3, "row 1"))
    assert rgb.shape == (28, 28, 3) and (rgb == np.asarray(image)[..., None]).all()
    assert to_mode(image, 1, "row 1") is image


def test_an_image_folder_is_one_row_per_image_labelled_by_its_folder(tmp_path):
    for cls, n in (("cat", 2), ("dog", 1)):
        (tmp_path / cls).mkdir()
        for i in range(n):
            (tmp_path / cls / f"{i}.png").write_bytes(png())
    rows = read_image_folder(tmp_path)
    assert [(r["label"], r["image"].rsplit("/", 2)[-2:]) for r in rows] == [
        ("cat", ["cat", "0.png"]), ("cat", ["cat", "1.png"]), ("dog", ["dog", "0.png"])]
    assert decode_image(rows[2]["image"], "x").size == (6, 4)
    (tmp_path / "bird").mkdir()
    with pytest.raises(DataError, match="class 'bird' has no images; add its images or remove the folder"):
        read_image_folder(tmp_path)
    (tmp_path / "bird" / "notes.txt").write_text("x")
    with pytest.raises(DataError, match=r"notes.txt: not an image file .*\(nothing in a class folder is skipped\)"):
        read_image_folder(tmp_path)
    (tmp_path / "bird" / "notes.txt").unlink()
    (tmp_path / "bird" / "0.png").write_bytes(png())
    (tmp_path / "README").write_text("x")
    with pytest.raises(DataError, match="'README' is not a class folder"):
        read_image_folder(tmp_path)
    with pytest.raises(DataError, match="not a directory"):
        read_image_folder(tmp_path / "README")


def test_bad_images_are_refused_naming_the_row_and_the_fix(tmp_path):
    good = png()
    with pytest.raises(DataError, match=r"^row 3: the image cannot be decoded .*replace the file"):
        decode_image({"bytes": good[: len(good) // 2], "path": None}, "row 3")  # truncated
    with pytest.raises(DataError, match="row 4: the image cannot be decoded"):
        decode_image(b"not an image", "row 4")
    with pytest.raises(DataError, match="row 5: the image has neither bytes nor a path"):
        decode_image({"bytes": None, "path": None}, "row 5")
    with pytest.raises(DataError, match="does not exist"):
        decode_image(str(tmp_path / "missing.png"), "row 6")
    for mode, value, what in (("RGBA", (1, 2, 3, 4), "colour with alpha"), ("I;16", 300, "16-bit grayscale"),
                              ("F", 0.5, "32-bit float")):
        image = Image.new(mode, (2, 2), value)
        with pytest.raises(DataError, match=rf"row 7: image mode {mode} \({what}\): fedpeft reads .*convert"):
            to_mode(image, 3, "row 7")
    with pytest.raises(DataError, match="a colour image for a model of one input channel"):
        to_mode(Image.new("RGB", (2, 2)), 1, "row 8")
    palette = Image.new("P", (2, 2), 1)
    palette.putpalette([0, 0, 0, 10, 20, 30] + [0] * 762)
    assert np.asarray(to_mode(palette, 3, "row 9"))[0, 0].tolist() == [10, 20, 30]  # expanded without loss
    palette.info["transparency"] = 0
    with pytest.raises(DataError, match="a palette image with transparency"):
        to_mode(palette, 3, "row 9")
    assert to_mode(Image.new("1", (2, 2), 1), 1, "row 10").mode == "L"


def test_pixels_are_resized_by_the_image_processor_and_normalised_batch_by_batch():
    from transformers import ViTImageProcessorPil

    from fedpeft.data.batching import ImageEncoded, collate
    from fedpeft.data.images import normalisation

    processor = ViTImageProcessorPil(size={"height": 16, "width": 16}, image_mean=[0.5] * 3, image_std=[0.5] * 3)
    images = [to_mode(Image.new("L", (28, 28), v), 3, "x") for v in (0, 255, 51)]
    pixels = pixel_values(images, processor)
    assert pixels.shape == (3, 3, 16, 16) and pixels.dtype == np.uint8  # 1 byte a value, not 4
    data = ImageEncoded(pixels, [0, 1, 2], 17, *normalisation(processor, 3))
    batch = collate(data, np.array([2, 0, 1]), None)
    expected = processor(images=[images[i] for i in (2, 0, 1)], return_tensors="np")["pixel_values"]
    assert batch["pixel_values"].dtype == torch.float32 and np.allclose(batch["pixel_values"].numpy(), expected,
                                                                          atol=1e-6)
    assert np.allclose(batch["pixel_values"][1].numpy(), -1.0) and batch["labels"].tolist() == [2, 0, 1]
    assert data.subset(np.array([1])).pixels.tolist() == pixels[[1]].tolist() and data.lengths().tolist() == [17] * 3


# --- image classification runs (tiny-vit: a ViT built from its config; no pretrained vision weights offline) ---

IMAGES = ["model.name=tiny-vit", "task.type=image_classification", "task.train_split=test[:80%]",
          "task.eval_split=test[80%:]", "task.split_shuffle_seed=0", "task.max_train_examples=48",
          "eval.max_examples=32", "federation.rounds=1"]


def mnist_config(*overrides: str):
    from helpers import tiny_config

    return tiny_config(*IMAGES, f"task.dataset={DATA_DIR / 'mnist'}", *overrides)


@pytest.mark.needs_data
@pytest.mark.parametrize("method", ["lora", "full", "houlsby", "pfeiffer", "bitfit", "ia3"])
def test_each_method_trains_a_vit_on_mnist_and_sends_only_its_tensors(method, tmp_path):
    from fedpeft.rundir import read_metrics
    from fedpeft.runtime.embedded import EmbeddedRuntime

    rt = EmbeddedRuntime(mnist_config(f"peft.method={method}"), tmp_path / method)
    trainable = set(rt.exp.tuned.params)
    assert rt.exp.data.num_labels == 10 and rt.exp.data.train.pixels.shape[1:] == (3, 32, 32)
    sent = {}
    original = rt.transport.run_client

    def run_client(rnd, cid, payload, *args, **kwargs):
        out = original(rnd, cid, payload, *args, **kwargs)
        sent[cid] = (set(out[0].arrays), out[0].meta)
        return out

    rt.transport.run_client = run_client
    rt.run()
    row = read_metrics(tmp_path / method)[1]
    assert sent and all(names == trainable for names, _ in sent.values())
    assert any("classifier" in n for n in trainable)  # the head is trained and sent with every method
    assert np.isfinite(row["train_loss"]) and 0 <= row["eval_accuracy"] <= 1
    for _, meta in sent.values():  # every image is its 16 patches and the class token
        assert meta["train_tokens"] == 17 * meta["train_examples"] > 0
    rt.close()


@pytest.mark.needs_data
def test_head_pruning_and_label_flipping_attackers_run_on_images(tmp_path):
    from fedpeft.rundir import read_metrics
    from fedpeft.runtime.embedded import run

    run(mnist_config("algorithm={name: headprune, sparsity: 0.5}", "runtime.clients_per_pass=2",
                     "federation.attackers={fraction: 0.5, attack: label_flip}"), tmp_path / "run")
    row = read_metrics(tmp_path / "run")[1]
    assert np.isfinite(row["train_loss"]) and row["agg_importance_s_mean"] > 0  # importance from the attention
    assert row["fused_sub_batches"] > 0  # the clients trained together (tests/test_clients_per_pass.py: as alone)


@pytest.mark.needs_data
@pytest.mark.parametrize("method", ["lora", "houlsby", "pfeiffer", "ia3", "bitfit", "full"])
def test_an_image_run_reloads_to_the_same_score(method, tmp_path, capsys):
    """``fedpeft eval`` scores the saved adapter (a full model for full fine-tuning) as the run did, and
    ``fedpeft.load_adapter`` gives a model and image processing that predict the same classes for the same images."""
    import json

    import fedpeft
    from fedpeft.cli import main
    from fedpeft.data.images import normalisation
    from fedpeft.rundir import read_metrics
    from fedpeft.runtime.embedded import run

    run(mnist_config(f"peft.method={method}", "federation.rounds=2"), tmp_path / "run")
    rows = {r["round"]: r for r in read_metrics(tmp_path / "run")}
    capsys.readouterr()
    assert main(["eval", str(tmp_path / "run"), "--adapter", "last", "--max-examples", "32", "--json"]) == 0
    scored = json.loads(capsys.readouterr().out)
    assert scored["eval_accuracy"] == rows[2]["eval_accuracy"]
    assert scored["eval_loss"] == pytest.approx(rows[2]["eval_loss"], rel=1e-5)
    lines = [json.loads(x) for x in Path(scored["predictions"]).read_text().splitlines()]
    assert len(lines) == 32 and all(x["prediction"] in [str(i) for i in range(10)] for x in lines)
    loaded = fedpeft.load_adapter(tmp_path / "run" / "adapter")
    processing = loaded.tokenizer  # an image run's: the model's image processing
    rows = read_file(DATA_DIR / "mnist" / "test.parquet")
    images = [to_mode(decode_image(rows[x["row"] - 1]["image"], "x"), processing.channels, "x") for x in lines]
    scale, mean, std = normalisation(processing.processor, processing.channels)
    pixels = torch.tensor(pixel_values(images, processing.processor), dtype=torch.float32) * scale
    pixels = (pixels - torch.tensor(mean)[:, None, None]) / torch.tensor(std)[:, None, None]
    with torch.no_grad():
        logits = loaded.model(pixel_values=pixels).logits
    assert logits.argmax(-1).tolist() == [x["prediction_id"] for x in lines]
    loss = torch.nn.functional.cross_entropy(logits, torch.tensor([x["label"] for x in lines]))
    assert float(loss) == pytest.approx(scored["eval_loss"], rel=1e-5)  # the same images, labels and model


@pytest.mark.needs_data
def test_an_image_folder_dataset_runs_and_text_only_methods_are_refused(tmp_path):
    from helpers import tiny_config

    from fedpeft.config import ConfigError
    from fedpeft.models.registry import ModelError
    from fedpeft.rundir import read_metrics
    from fedpeft.runtime.embedded import run

    rows = read_file(DATA_DIR / "mnist" / "test.parquet")[:60]
    for i, row in enumerate(rows):
        folder = tmp_path / "digits" / "train" / f"digit{row['label']}"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"{i}.png").write_bytes(row["image"]["bytes"])
    sets = ["model.name=tiny-vit", "task.type=image_classification", f"task.dataset={tmp_path / 'digits'}",
            "task.train_split=train[:75%]", "task.eval_split=train[75%:]", "task.split_shuffle_seed=0",
            "federation.rounds=1"]
    run(tiny_config(*sets), tmp_path / "run")
    assert "eval_accuracy" in read_metrics(tmp_path / "run")[1]
    with pytest.raises(ConfigError, match="peft.method prompt_tuning cannot adapt a vision transformer"):
        tiny_config(*sets, "peft.method=prompt_tuning")
    with pytest.raises(ModelError, match="task image_classification needs a vision transformer"):
        run(tiny_config(*sets, "model.name=tiny-bert"), tmp_path / "bert")
    bad = tmp_path / "digits" / "train" / "digit7" / "broken.png"
    bad.write_bytes(rows[0]["image"]["bytes"][:40])  # truncated
    with pytest.raises(DataError, match=rf"row \d+ \({bad}\): the image cannot be decoded"):
        run(tiny_config(*sets), tmp_path / "broken")
    bad.unlink()
    (tmp_path / "digits" / "train" / "digit7" / ".DS_Store").write_bytes(b"x")
    with pytest.raises(DataError, match="a hidden file in class folder 'digit7'; remove it"):
        run(tiny_config(*sets), tmp_path / "hidden")
    (tmp_path / "digits" / "train" / "digit7" / ".DS_Store").unlink()
    flat = tmp_path / "digits" / "train"  # class folders directly: one split, train, as HF's imagefolder reads it
    run(tiny_config(*sets[:2], f"task.dataset={flat}", *sets[3:]), tmp_path / "flat-run")
    assert read_metrics(tmp_path / "flat-run")[1]["eval_accuracy"] == read_metrics(tmp_path / "run")[1]["eval_accuracy"]
    with pytest.raises(DataError, match=r"holds class folders directly \(<dataset>/<class>/<image>\), which is one "
                                        r"split, 'train', not 'validation': carve the parts with slices"):
        run(tiny_config(*sets[:2], f"task.dataset={flat}", *sets[3:4], "task.eval_split=validation"),
            tmp_path / "flat-eval")


def test_other_vision_models_and_text_splits_in_folders_are_told_apart():
    from transformers import MobileViTConfig, SwinConfig

    from fedpeft.models.registry import ModelError, model_kind

    with pytest.raises(ModelError, match="vision model type 'mobilevit' has no fedpeft layout yet; supported: vit, "
                                         "deit, beit, swin, convnext"):
        model_kind("image_classification", MobileViTConfig())
    with pytest.raises(ModelError, match="is a vision transformer, which classifies images"):
        model_kind("classification", SwinConfig())


def test_a_text_dataset_with_a_folder_named_like_a_split_keeps_its_error(tmp_path):
    from fedpeft.data.sources import _load_local_split

    (tmp_path / "train.jsonl").write_text('{"text": "a", "label": 0}\n')
    (tmp_path / "raw").mkdir()
    (tmp_path / "raw" / "notes.txt").write_text("x")
    with pytest.raises(DataError, match="has no split 'raw'; available: train"):
        _load_local_split(tmp_path, "raw", "label")


@pytest.mark.needs_data
def test_a_hub_image_dataset_is_read_undecoded_then_decoded_strictly_and_trains(tmp_path, monkeypatch):
    """A Hub id's image column (``datasets.Image``, which decodes to PIL images) is read as stored and decoded by
    fedpeft, like a parquet file's; a truncated image in it is refused with its row. The Hub is served from memory
    (it is unreachable here) with MNIST's own rows in the Hub's features."""
    import datasets

    from fedpeft import hub
    from fedpeft.data.sources import load_rows
    from fedpeft.rundir import read_metrics
    from fedpeft.runtime.embedded import run

    mnist = read_file(DATA_DIR / "mnist" / "test.parquet")[:140]
    digits = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=digits)})
    served = {"train": mnist[:100], "test": mnist[100:]}
    calls = []

    def load_dataset(hub_id, config=None, split=None, **_):
        calls.append((hub_id, split))
        rows = served[split]
        return datasets.Dataset.from_dict({"image": [r["image"] for r in rows], "label": [r["label"] for r in rows]},
                                          features=features)

    monkeypatch.setattr(hub, "hub_unavailable", lambda *a, **k: None)
    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    rows = load_rows("example-org/digits", "train", data_dir=str(tmp_path))
    assert rows[0]["image"]["bytes"] == mnist[0]["image"]["bytes"] and rows[0]["label"] == mnist[0]["label"]
    assert rows[0]["label_text"] == digits[mnist[0]["label"]]  # the ClassLabel's names name the classes
    run(mnist_config("task.dataset=example-org/digits", f"task.data_dir={tmp_path}", "task.train_split=train",
                     "task.eval_split=test", "task.split_shuffle_seed=null"), tmp_path / "run")
    assert ("example-org/digits", "train") in calls and "eval_accuracy" in read_metrics(tmp_path / "run")[1]
    served["train"] = [*mnist[:5], {"image": {"bytes": mnist[5]["image"]["bytes"][:50], "path": None}, "label": 3},
                       *mnist[6:100]]
    with pytest.raises(DataError, match=r"^hub:example-org/digits:train: split 'train' row 6: the image cannot be decoded"):
        run(mnist_config("task.dataset=example-org/digits", f"task.data_dir={tmp_path}", "task.train_split=train",
                         "task.eval_split=test", "task.split_shuffle_seed=null", "task.max_train_examples=null"),
            tmp_path / "broken")


def test_a_hub_image_dataset_offline_is_refused_naming_the_id_and_the_fix(tmp_path, monkeypatch):
    from fedpeft.data.sources import load_rows

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(DataError, match=r"^dataset 'ylecun/mnist': not found locally .*HF_HUB_OFFLINE.* unset "
                                        "HF_HUB_OFFLINE / HF_DATASETS_OFFLINE to load it from the Hub"):
        load_rows("ylecun/mnist", "train", data_dir=str(tmp_path))


def test_a_loader_may_give_pil_images():
    from fedpeft.data.validate import row_problem

    truncated = Image.open(io.BytesIO(png("RGB", (64, 64), (1, 2, 3))[:60]))  # opened lazily, as a loader may
    with pytest.raises(DataError, match=r"^row 2: the image cannot be decoded .*replace the file"):
        decode_image(truncated, "row 2")
    image = Image.new("L", (3, 3), 9)
    assert row_problem("image_classification", {"image": image, "label": 1}) is None
    assert decode_image(image, "row 1") is image
    assert "give the image's bytes, its path, a PIL image" in row_problem("image_classification",
                                                                          {"image": 3, "label": 1})


def test_fedpeft_data_decodes_every_image_and_lists_the_ones_a_run_would_refuse(tmp_path, capsys):
    from fedpeft.cli import main

    for cls, n in (("cat", 3), ("dog", 2)):
        (tmp_path / "pets" / "train" / cls).mkdir(parents=True)
        for i in range(n):
            (tmp_path / "pets" / "train" / cls / f"{i}.png").write_bytes(png("RGB", (5, 4), (1, 2, 3)))
    assert main(["data", str(tmp_path / "pets")]) == 0
    out = capsys.readouterr().out
    assert "train: 5 rows; fields: image, label" in out and "labels: 'cat': 3, 'dog': 2" in out
    assert "images (width x height mode): 5 x 4 RGB: 5" in out
    (tmp_path / "pets" / "train" / "dog" / "1.png").write_bytes(png("RGB")[:30])
    (tmp_path / "pets" / "train" / "cat" / "2.png").write_bytes(png("RGBA", (2, 2), (1, 2, 3, 4)))
    assert main(["data", str(tmp_path / "pets")]) == 2
    out = capsys.readouterr().out
    assert "images (width x height mode): 5 x 4 RGB: 3" in out
    assert f"problem: {tmp_path / 'pets' / 'train'}: split 'train' row 3 ({tmp_path}/pets/train/cat/2.png): image " \
           "mode RGBA (colour with alpha)" in out
    assert "split 'train' row 5 (" in out and "dog/1.png): the image cannot be decoded" in out


def vision_model_dir(path: Path, model_type: str) -> Path:
    """A Hugging Face model directory of a small vision model of ``model_type`` (random weights) and its image
    processor, as a Hub download or save_pretrained leaves it: the path a user passes as model.name."""
    import transformers as T

    small = {"image_size": 32, "num_labels": 10}
    classes = {
        "deit": (T.DeiTConfig, T.DeiTForImageClassification,
                 {"patch_size": 8, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 64}),
        "beit": (T.BeitConfig, T.BeitForImageClassification,
                 {"patch_size": 8, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 64}),
        "convnext": (T.ConvNextConfig, T.ConvNextForImageClassification,
                     {"patch_size": 4, "hidden_sizes": [16, 32], "depths": [1, 1], "num_stages": 2}),
        "swin": (T.SwinConfig, T.SwinForImageClassification,
                 {"patch_size": 4, "embed_dim": 16, "depths": [1, 1], "num_heads": [2, 4], "window_size": 4}),
    }
    config_class, model_class, shape = classes[model_type]
    torch.manual_seed(0)
    model_class(config_class(**shape, **small)).save_pretrained(path)
    T.ViTImageProcessorPil(size={"height": 32, "width": 32}, image_mean=[0.5] * 3,
                           image_std=[0.5] * 3).save_pretrained(path)
    return path


@pytest.mark.needs_data
def test_swin_trains_with_adapters_and_lora_and_head_level_algorithms_are_refused_by_reason(tmp_path, capsys):
    """Swin's stages differ in width and heads: its adapters follow each stage's width; head pruning, which needs
    one head count, is refused in one line."""
    from fedpeft.heads.layout import LayoutError
    from fedpeft.rundir import read_metrics
    from fedpeft.runtime.embedded import EmbeddedRuntime, run

    model = vision_model_dir(tmp_path / "swin", "swin")
    rt = EmbeddedRuntime(mnist_config(f"model.name={model}", "peft={method: houlsby, reduction_factor: 4}"),
                         tmp_path / "houlsby")
    widths = {n: tuple(p.shape) for n, p in rt.exp.tuned.params.items() if n.endswith("down.weight")}
    assert sorted(set(widths.values())) == [(4, 16), (8, 32)]  # stage 1 is 16 wide, stage 2 32: 16/4 and 32/4
    assert rt.exp.data.train.tokens == 64  # (32 / 4)^2 patches, no class token
    rt.run()
    rt.close()
    run(mnist_config(f"model.name={model}", "peft.method=lora"), tmp_path / "lora")
    assert np.isfinite(read_metrics(tmp_path / "lora")[1]["train_loss"])
    assert reloads_to_its_score(tmp_path / "houlsby", capsys) and reloads_to_its_score(tmp_path / "lora", capsys)
    with pytest.raises(LayoutError, match=r"model type 'swin' has stages of different widths and head counts "
                                          r"\(heads \[2, 4\]\).*use a model with one head count"):
        run(mnist_config(f"model.name={model}", "peft.method=lora", "algorithm={name: headprune, sparsity: 0.5}"),
            tmp_path / "heads")


@pytest.mark.needs_data
@pytest.mark.parametrize("model_type", ["deit", "beit"])
def test_vit_family_models_from_a_model_directory_train_with_adapters_lora_and_head_pruning(model_type, tmp_path):
    from fedpeft.rundir import read_metrics
    from fedpeft.runtime.embedded import EmbeddedRuntime, run

    model = vision_model_dir(tmp_path / model_type, model_type)
    rt = EmbeddedRuntime(mnist_config(f"model.name={model}", "peft.method=houlsby"), tmp_path / "houlsby")
    adapters = [n for n in rt.exp.tuned.params if "classifier" not in n]
    assert len(adapters) == 2 * 2 * 4  # two adapters (after attention and MLP) in each of 2 layers: down/up weight/bias
    from fedpeft.data.batching import collate

    batch = collate(rt.exp.data.train, np.arange(2), None)
    with torch.no_grad():
        hidden = rt.exp.tuned.module(pixel_values=batch["pixel_values"], output_hidden_states=True).hidden_states
    assert rt.exp.data.train.tokens == hidden[0].shape[1] == 16 + {"deit": 2, "beit": 1}[model_type]
    rt.run()
    rt.close()
    assert np.isfinite(read_metrics(tmp_path / "houlsby")[1]["train_loss"])
    run(mnist_config(f"model.name={model}", "peft.method=lora", "algorithm={name: headprune, sparsity: 0.5}"),
        tmp_path / "heads")
    row = read_metrics(tmp_path / "heads")[1]
    assert np.isfinite(row["train_loss"]) and row["agg_importance_s_mean"] > 0


@pytest.mark.needs_data
def reloads_to_its_score(run_dir: Path, capsys) -> bool:
    """``fedpeft eval`` of a run's last adapter scores as the run's last evaluation did (peft's plain wrapper
    for a vision model, fedpeft's adapters, BitFit's tensors: each saved and reloaded)."""
    import json

    from fedpeft.cli import main
    from fedpeft.rundir import read_metrics

    last = read_metrics(run_dir)[-1]
    capsys.readouterr()
    assert main(["eval", str(run_dir), "--adapter", "last", "--max-examples", "32", "--json"]) == 0
    scored = json.loads(capsys.readouterr().out)
    return scored["eval_accuracy"] == last["eval_accuracy"] and math.isclose(scored["eval_loss"], last["eval_loss"],
                                                                            rel_tol=1e-5)


def test_convnext_takes_the_methods_that_need_no_attention_and_refuses_the_others_by_reason(tmp_path, capsys):
    from fedpeft.heads.layout import LayoutError
    from fedpeft.rundir import read_metrics
    from fedpeft.runtime.embedded import EmbeddedRuntime, run

    model = vision_model_dir(tmp_path / "convnext", "convnext")
    for method, trained in (("lora", ("pwconv1.lora_", "pwconv2.lora_")), ("pfeiffer", ("pwconv2.adapter",)),
                            ("ia3", ("pwconv2.ia3_l",)), ("bitfit", ("bias",))):
        rt = EmbeddedRuntime(mnist_config(f"model.name={model}", f"peft.method={method}"), tmp_path / method)
        names = [n for n in rt.exp.tuned.params if "classifier" not in n]
        assert names and all(any(t in n for t in trained) for n in names), (method, names)
        rt.run()
        rt.close()
        assert np.isfinite(read_metrics(tmp_path / method)[1]["train_loss"])
        assert reloads_to_its_score(tmp_path / method, capsys), method
    with pytest.raises(ValueError, match="houlsby puts an adapter after each attention .* use pfeiffer"):
        run(mnist_config(f"model.name={model}", "peft.method=houlsby"), tmp_path / "houlsby")
    with pytest.raises(LayoutError, match="model type 'convnext' has no attention heads"):
        run(mnist_config(f"model.name={model}", "algorithm={name: headprune, sparsity: 0.5}"), tmp_path / "heads")


@pytest.mark.parametrize("model_type", ["swin", "convnext", "beit"])
def test_fedpeft_model_accounts_for_each_vision_model_and_leaves_out_what_does_not_apply(model_type, tmp_path, capsys):
    """Swin and ConvNeXt have no one shape for the analytic OPs: unknown, not made up. BEiT carries a vocabulary
    (of visual tokens) yet takes no prompts."""
    import json

    from fedpeft.cli import main

    model = vision_model_dir(tmp_path / model_type, model_type)
    capsys.readouterr()
    assert main(["model", str(model), "--num-labels", "10", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    rows = {r["method"]: r for r in out["methods"]}
    assert rows["full"]["reduction_vs_full"] == 0 and 0 < rows["lora"]["reduction_vs_full"] < 1
    assert {"prompt_tuning", "p_tuning", "prefix_tuning"} <= set(out["not_available"]) and "prompt_tuning" not in rows
    if model_type == "beit":
        built_in = ("full", "lora", "ia3", "houlsby", "pfeiffer", "bitfit")  # (a plugin's method may count no OPs)
        assert out["tokens"] == 17 and out["heads"] == 4 and all(rows[m]["ops"]["appendix_a"] > 0 for m in built_in)
        return
    assert out["tokens"] == 64 and "heads" not in out  # (32 / 4)^2 positions; no one head count to report
    assert all(v is None for r in rows.values() for v in r["ops"].values())  # OPs not counted, not made up
    if model_type == "convnext":
        assert "houlsby" not in rows and "has no attention" in out["not_available"]["houlsby"]


@pytest.mark.needs_data
def test_the_mnist_vit_quickstart_config_runs_on_the_pretrained_encoder_its_benchmark_writes(tmp_path, monkeypatch):
    """configs/mnist_vit_adapters.yaml on what ``python benchmarks/mnist_vit.py prepare`` writes (here pretrained
    for one epoch): the encoder loads without its digits-0-4 head, a new head learns 5-9, only the adapters and
    the head travel."""
    import sys

    from conftest import REPO

    from fedpeft.config import load_config
    from fedpeft.rundir import read_metrics
    from fedpeft.runtime.embedded import EmbeddedRuntime

    sys.path.insert(0, str(REPO / "benchmarks"))
    import mnist_vit

    monkeypatch.chdir(tmp_path)
    mnist_vit.prepare(tmp_path / "runs" / "mnist_vit", DATA_DIR / "mnist" / "test.parquet", epochs=1)
    cfg = load_config(REPO / "configs" / "mnist_vit_adapters.yaml",
                      ["federation.rounds=1", "task.max_train_examples=200", "eval.max_examples=100",
                       "runtime.progress=false"])
    rt = EmbeddedRuntime(cfg, tmp_path / "run")
    assert rt.exp.data.label_names == ["5", "6", "7", "8", "9"] and rt.exp.data.train.pixels.shape[1:] == (1, 28, 28)
    from safetensors.torch import load_file

    saved = load_file(tmp_path / "runs" / "mnist_vit" / "vit-mnist-0to4" / "model.safetensors")
    assert not any(k.startswith("classifier") for k in saved)  # the 0-4 head stays behind
    params = dict(rt.exp.tuned.module.named_parameters())
    # (transformers 5 writes ViT checkpoints under the names of its earlier versions, and renames them on loading)
    for name, key in (("embeddings.patch_embeddings.projection.weight",) * 2,
                      ("layers.3.attention.q_proj.weight", "encoder.layer.3.attention.attention.query.weight")):
        loaded = next(p for n, p in params.items() if n.endswith(name))
        assert torch.equal(loaded.detach(), saved[key]), key  # the pretrained encoder, not fresh weights
    assert {n.split(".")[-3] for n in rt.exp.tuned.params if "classifier" not in n} == {"adapter"}
    rt.run()
    rt.close()
    assert 0 <= read_metrics(tmp_path / "run")[1]["eval_accuracy"] <= 1


def test_an_image_row_without_a_label_is_refused_naming_the_field_and_the_fix():
    from fedpeft.data.validate import row_problem

    image = png()
    assert row_problem("image_classification", {"image": image}) == (
        "has no field 'label' (fields: image); map yours with task.columns, e.g. --set task.columns.label=<your column>")
    assert row_problem("image_classification", {"image": image, "label": None}).startswith("label is null; give every "
                                                                                          "row its class")
    assert row_problem("image_classification", {"label": 1}).startswith("has no field 'image'")



@pytest.mark.needs_data
@pytest.mark.parametrize("partition", ["{scheme: dirichlet_label, alpha: 0.5}",
                                       "{scheme: dirichlet_quantity, alpha: 0.5}", "{scheme: column, column: label}"])
def test_fedpeft_partition_splits_an_image_dataset_like_a_text_one(partition, capsys):
    from conftest import REPO

    from fedpeft.cli import main

    sets = [x for s in (*IMAGES, f"task.dataset={DATA_DIR / 'mnist'}", "task.max_train_examples=400",
                        "federation.num_clients=10", f"federation.partition={partition}")
            for x in ("--set", s)]
    assert main(["partition", str(REPO / "configs" / "quickstart.yaml"), *sets]) == 0
    out = capsys.readouterr().out
    assert "clients: 10  examples: 400" in out and "classes: 10" in out
    if "column" in partition:  # a client per digit
        assert "classes per client (mean): 1.00" in out


@pytest.mark.needs_data
@pytest.mark.parametrize("algorithm", [
    ["algorithm.name=ffa_lora"], ["algorithm.name=fedsa_lora", "eval.personalized=true"], ["algorithm.name=flora"],
    ["algorithm.name=fedex_lora"],
    ["algorithm.name=hetlora", "algorithm.rank_groups=[{rank: 2, share: 0.5}, {rank: 4, share: 0.5}]"],
    ["algorithm.name=flexlora", "algorithm.rank_groups=[{rank: 2, share: 0.5}, {rank: 4, share: 0.5}]"],
], ids=lambda a: a[0].split("=")[1])
def test_the_federated_lora_methods_train_a_vit(algorithm, tmp_path, capsys):
    from fedpeft.rundir import read_metrics
    from fedpeft.runtime.embedded import run

    run(mnist_config("peft={method: lora, r: 4, alpha: 8}", *algorithm, "federation.rounds=2"), tmp_path / "run")
    rows = read_metrics(tmp_path / "run")
    assert all(np.isfinite(r["train_loss"]) and r["rejected"] == {} for r in rows[1:] if "train_loss" in r)
    if algorithm[0] not in ("algorithm.name=flora", "algorithm.name=fedex_lora"):  # (these merge into the
        assert reloads_to_its_score(tmp_path / "run", capsys)  # backbone: their adapter is refused by reason)


def test_split_folders_without_class_folders_and_text_split_folders_are_not_read_as_classes(tmp_path):
    """Unlabelled split folders (<dataset>/train/0.png) are refused, not read as two classes 'train' and 'test';
    split folders of data files keep the errors of a text dataset."""
    from fedpeft.data.sources import _available_splits, load_rows

    for split in ("train", "test"):
        (tmp_path / "unlabelled" / split).mkdir(parents=True)
        (tmp_path / "unlabelled" / split / "0.png").write_bytes(png())
    with pytest.raises(DataError, match=r"split folder 'train' holds images but no class folders, so they have no "
                                        r"labels; put each class's images in a folder of its own"):
        load_rows(str(tmp_path / "unlabelled"), "train")
    for split in ("train", "validation"):
        (tmp_path / "text" / split).mkdir(parents=True)
        (tmp_path / "text" / split / "part.jsonl").write_text('{"text": "a", "label": 0}\n')
    assert _available_splits(tmp_path / "text") == []
    with pytest.raises(DataError, match="has no split 'train'"):
        load_rows(str(tmp_path / "text"), "train")


# --- bounded image inputs (issue 50): a pixel cap read from the header, one frame, no way out of the dataset ---

def big_png(width: int, height: int) -> bytes:
    """A valid bilevel PNG of ``width`` x ``height``, written row by row: a few KB on disk (its rows are zeros) and
    never held decoded here."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    row, packer = b"\0" * (1 + (width + 7) // 8), zlib.compressobj(9)
    idat = b"".join(packer.compress(row) for _ in range(height)) + packer.flush()
    header = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)  # 1 bit, grayscale
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


def refusal(call, *args) -> str:
    """The one-line message of the DataError that ``call(*args)`` raises."""
    with pytest.raises(DataError) as caught:
        call(*args)
    message = str(caught.value)
    assert "\n" not in message and "\r" not in message, message
    return message


@pytest.fixture
def no_decoding(monkeypatch):
    """Fails a test that decodes an image file's pixels (ImageFile.load), so a refusal is seen to come first."""
    from PIL import ImageFile

    def load(self):
        raise AssertionError(f"decoded a {self.size} image")

    monkeypatch.setattr(ImageFile.ImageFile, "load", load)


def test_an_image_over_the_pixel_cap_is_refused_from_its_header_whatever_its_source(tmp_path, no_decoding):
    import warnings

    from fedpeft.data.images import MAX_IMAGE_PIXELS

    data = big_png(12_000, 12_000)  # just under twice Pillow's limit: Pillow would decode it (576 MB as mode 1)
    assert len(data) < 100_000 and MAX_IMAGE_PIXELS == 4096 * 4096
    path = tmp_path / "huge.png"
    path.write_bytes(data)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        loaders = Image.open(path)  # as a loader hands it over: opened lazily, not decoded
    sources = [data, str(path), path, {"bytes": data, "path": None}, {"bytes": None, "path": str(path)}, loaders]
    with warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)  # Pillow's warning is not shown: refused
        for source in sources:
            assert refusal(decode_image, source, "row 4") == (
                "row 4: the image is 12000 x 12000, 144,000,000 pixels, over the cap of 16,777,216 "
                "(task.max_image_pixels); shrink the image (the model takes a few hundred pixels a side), or raise "
                "task.max_image_pixels")
    beyond_pillow = big_png(14_000, 14_000)  # over twice Pillow's limit: Pillow refuses it on opening
    assert refusal(decode_image, beyond_pillow, "row 5").startswith(
        "row 5: the image is over the cap of 16,777,216 pixels (task.max_image_pixels) and over Pillow's own limit")


def test_the_cap_is_the_images_pixel_count_and_a_task_option(tmp_path):
    from fedpeft.config import ConfigError
    from fedpeft.config.load import apply_overrides, validate_config
    from fedpeft.config.schema import TaskConfig
    from fedpeft.data.images import MAX_IMAGE_PIXELS

    assert decode_image(png(size=(6, 4)), "row 1", 24).size == (6, 4)  # at the cap: taken
    assert refusal(decode_image, png(size=(6, 4)), "row 1", 23).startswith(
        "row 1: the image is 6 x 4, 24 pixels, over the cap of 23 (task.max_image_pixels)")
    assert refusal(decode_image, Image.new("L", (6, 4)), "row 2", 23).startswith("row 2: the image is 6 x 4")
    assert TaskConfig().max_image_pixels == MAX_IMAGE_PIXELS == 16_777_216
    raw = apply_overrides({}, ["task.max_image_pixels=1000000"])
    assert validate_config(raw).task.max_image_pixels == 1_000_000
    for bad in ("0", "89478486", "big"):
        with pytest.raises(ConfigError, match="max_image_pixels"):
            validate_config(apply_overrides({}, [f"task.max_image_pixels={bad}"]))


def test_a_runs_images_are_capped_by_its_task_option(tmp_path):
    from fedpeft.config.schema import TaskConfig
    from fedpeft.data.prepare import prepare_task

    for split in ("train", "validation"):
        image_dataset(tmp_path / "pets", split=split)
    task = TaskConfig(type="image_classification", dataset=str(tmp_path / "pets"), max_image_pixels=23)
    with pytest.raises(DataError, match=r"row \d+ \(.*\.png\): the image is 6 x 4, 24 pixels, over the cap of 23 "):
        prepare_task(task, None, encoder_decoder=False, seed=0, eval_max_examples=None)  # refused before the model


def test_fedpeft_data_lists_an_oversized_image_as_a_problem_and_takes_the_cap_from_set(tmp_path, capsys):
    from fedpeft.cli import main

    folder = tmp_path / "pets" / "train"
    for cls in ("cat", "dog"):
        (folder / cls).mkdir(parents=True)
        (folder / cls / "0.png").write_bytes(png("RGB", (5, 4), (1, 2, 3)))
    (folder / "cat" / "huge.png").write_bytes(big_png(12_000, 12_000))
    assert main(["data", str(tmp_path / "pets")]) == 2
    out = capsys.readouterr().out
    assert f"problem: {folder}: split 'train' row 2 ({folder}/cat/huge.png): the image is 12000 x 12000, " \
           "144,000,000 pixels, over the cap of 16,777,216 (task.max_image_pixels); shrink the image" in out
    assert "Traceback" not in out and "images (width x height mode): 5 x 4 RGB: 2" in out
    (folder / "cat" / "huge.png").write_bytes(big_png(4100, 4100))  # just over the default
    assert main(["data", str(tmp_path / "pets")]) == 2
    assert "the image is 4100 x 4100, 16,810,000 pixels" in capsys.readouterr().out
    assert main(["data", str(tmp_path / "pets"), "--set", "task.max_image_pixels=17000000"]) == 0
    assert "4100 x 4100 1: 1" in capsys.readouterr().out  # (bilevel: mode 1)
    assert main(["data", str(tmp_path / "pets"), "--set", "task.max_image_pixels=19"]) == 2
    assert "row 1 (" in capsys.readouterr().out  # 5 x 4 = 20 pixels: over a cap of 19


def frames_file(fmt: str, frames: int = 3) -> bytes:
    images = [Image.new("RGB", (4, 4), (v, v, v)) for v in range(0, 60 * frames, 60)]
    out = io.BytesIO()
    images[0].save(out, format=fmt, save_all=True, append_images=images[1:])
    return out.getvalue()


@pytest.mark.parametrize("fmt", ["GIF", "TIFF", "PNG", "WEBP"])
def test_an_image_of_several_frames_is_refused_naming_the_count(fmt, tmp_path, no_decoding):
    from PIL import features

    if fmt == "WEBP" and not features.check("webp"):
        pytest.skip("Pillow built without WebP")
    data = frames_file(fmt)
    path = tmp_path / f"moving.{fmt.lower()}"
    path.write_bytes(data)
    for source in (data, {"bytes": None, "path": str(path)}, Image.open(path)):
        assert refusal(decode_image, source, f"row 2 ({path})") == (
            f"row 2 ({path}): the image has 3 frames (an animation or a multi-page file), and which one to learn "
            "from is not fedpeft's guess; save the frame you mean as a single-frame PNG")


def image_dataset(root: Path, classes=("cat", "dog"), split: str = "train") -> Path:
    """An ImageFolder dataset ``root/<split>/<class>/0.png`` of 6 x 4 grayscale images."""
    for cls in classes:
        (root / split / cls).mkdir(parents=True)
        (root / split / cls / "0.png").write_bytes(png())
    return root


def test_a_symlink_out_of_the_dataset_directory_is_refused_and_one_within_it_is_followed(tmp_path):
    from fedpeft.data.sources import load_rows

    outside = image_dataset(tmp_path / "elsewhere", ("bird",)) / "train"
    dataset = image_dataset(tmp_path / "pets")
    (dataset / "train" / "bird").symlink_to(outside / "bird")  # a class folder leading out
    assert refusal(load_rows, str(dataset), "train") == (
        f"{dataset}/train/bird: points to {outside}/bird, outside the dataset directory {dataset}; put the class "
        "folders and images inside the dataset directory (copy them in, or link only within it)")
    (dataset / "train" / "bird").unlink()
    (dataset / "train" / "cat" / "1.png").symlink_to(outside / "bird" / "0.png")  # an image leading out
    assert refusal(load_rows, str(dataset), "train").startswith(
        f"{dataset}/train/cat/1.png: points to {outside}/bird/0.png, outside the dataset directory {dataset};")
    (dataset / "train" / "cat" / "1.png").unlink()
    image_dataset(dataset / "pool", ("bird",))  # symlinks within the dataset's directory: followed
    (dataset / "train" / "bird").symlink_to(dataset / "pool" / "train" / "bird")
    (dataset / "train" / "cat" / "1.png").symlink_to(Path("..") / "dog" / "0.png")
    rows = load_rows(str(dataset), "train")
    assert [r["label"] for r in rows] == ["bird", "cat", "cat", "dog"]
    assert [decode_image(r["image"], "x").size for r in rows] == [(6, 4)] * 4
    link = tmp_path / "link-to-pets"  # the dataset directory itself may be a symlink
    link.symlink_to(dataset)
    assert len(load_rows(str(link), "train")) == 4
    split = tmp_path / "split-out"  # a split folder leading out: its classes leave with it
    split.mkdir()
    (split / "train").symlink_to(outside)
    assert refusal(load_rows, str(split), "train").startswith(f"{split}/train: points to {outside}, outside the "
                                                              f"dataset directory {split};")
    flat = tmp_path / "flat"  # class folders directly in the dataset directory: it is the dataset's directory
    (flat / "cat").mkdir(parents=True)
    (flat / "cat" / "0.png").write_bytes(png())
    (flat / "bird").symlink_to(outside / "bird")
    assert refusal(load_rows, str(flat), "train").startswith(f"{flat}/bird: points to {outside}/bird, outside")


@pytest.mark.parametrize("name", ["ca\nt", "ca\tt", "ca\rt", "ca\u200bt", "ca\x7ft", "ca\u2028t", "ca\u2029t"])
def test_a_class_folder_name_with_a_control_character_is_refused_on_one_line(name, tmp_path):
    folder = tmp_path / "train" / name
    folder.mkdir(parents=True)
    (folder / "0.png").write_bytes(png())
    message = refusal(read_image_folder, tmp_path / "train")
    assert message.startswith(f"{str(folder)!r}: class folder name {name!r} holds the unprintable character "
                              f"{name[2]!r} (a control or format character); rename the folder (its name is the class label)"), message


def test_a_class_folder_name_over_128_characters_is_refused_and_128_is_taken(tmp_path):
    for n in (128, 250):
        folder = tmp_path / str(n) / ("a" * n)
        folder.mkdir(parents=True)
        (folder / "0.png").write_bytes(png())
    assert read_image_folder(tmp_path / "128")[0]["label"] == "a" * 128
    assert refusal(read_image_folder, tmp_path / "250") == (
        f"{tmp_path / '250' / ('a' * 250)}: class folder name of 250 characters, over 128; rename the folder to a "
        "shorter name (its name is the class label)")


def test_a_camera_jpeg_with_a_preview_is_read_as_its_primary_image_and_said_once(tmp_path, caplog, monkeypatch):
    """MPO (a JPEG with an MPF preview or second view, as phones and cameras write): frame 0 is the photo."""
    from fedpeft.data import images

    primary, preview = Image.new("RGB", (8, 6), (200, 10, 10)), Image.new("RGB", (4, 3), (10, 10, 200))
    out = io.BytesIO()
    primary.save(out, format="MPO", save_all=True, append_images=[preview])
    assert Image.open(io.BytesIO(out.getvalue())).n_frames == 2
    monkeypatch.setattr(images, "_primary_frame_logged", False)
    with caplog.at_level("WARNING", logger="fedpeft"):
        for row in (1, 2):
            image = decode_image(out.getvalue(), f"row {row}")
            assert image.size == (8, 6) and image.getpixel((4, 3))[0] > 150  # the primary image, decoded
    assert caplog.text.count("its primary image (frame 0) is read") == 1 and "row 1" in caplog.text


def test_a_run_resizes_large_images_in_groups_within_twice_the_pixel_cap(monkeypatch):
    """The cap bounds one decode; a run holds at most twice its pixels decoded before the processor resizes them
    (a batch of 256 images at the cap would hold over 4 G pixels)."""
    from fedpeft.data import images
    from fedpeft.models.images import ImageProcessing

    held = []

    def counted(batch, processor):
        held.append(sum(i.width * i.height for i in batch))
        return np.zeros((len(batch), 3, 2, 2), np.uint8)

    monkeypatch.setattr(images, "pixel_values", counted)
    processor = type("P", (), {"do_rescale": False, "do_normalize": False})()
    processing = ImageProcessing(processor, 3, 4)
    rows = [{"image": png("RGB", (10, 10), (1, 2, 3))} for _ in range(9)]
    encoded = images.encode_images(rows, [0] * 9, [f"row {i}" for i in range(9)], processing, max_pixels=150)
    assert len(encoded.pixels) == 9 and held == [300, 300, 300]  # 100-pixel images, 300 pixels at most
    held.clear()
    images.encode_images(rows, [0] * 9, [f"row {i}" for i in range(9)], processing, batch=2)
    assert held == [200, 200, 200, 200, 100]  # small images: the batch size decides
