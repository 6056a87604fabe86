"""Images for image classification, read strictly: decoded in full, in a mode the model can take, from the Hugging
Face image schema (a parquet ``image`` column of ``{bytes, path}``, and a Hub dataset's image column, read
undecoded), a file path, a PIL image, or an ImageFolder directory (``<root>/<class>/<file>``). A problem is one line naming the row or file, what is wrong and the fix; nothing is
skipped or silently reinterpreted.

Modes: 8-bit grayscale (``L``) and ``RGB`` are taken as they are; bilevel (``1``) and palette (``P``, without
transparency) images are expanded losslessly. Grayscale becomes three equal channels for a model that expects
three (MNIST into an ImageNet ViT). Anything that would lose information (an alpha channel, 16-bit or float
pixels, CMYK, colour into a one-channel model) is refused with the conversion to make.
"""

from __future__ import annotations

import io
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from fedpeft.data.batching import ImageEncoded
from fedpeft.data.catalog import Row
from fedpeft.data.files import DataError

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff", ".webp")
_LOSSLESS = {"1": "L"}  # modes expanded without loss (palette images: see to_mode)
_CONVERT_FIX = "convert the images to RGB or 8-bit grayscale first (PIL: image.convert('RGB'))"


def decode_image(value: Any, where: str) -> Any:
    """A fully decoded PIL image from a Hugging Face image value (``{"bytes": ..., "path": ...}``), raw bytes, a
    path or a PIL image (a dataset loader's); ``where`` names the row or file in the error."""
    from PIL import Image, UnidentifiedImageError

    if isinstance(value, Image.Image):  # a loader's, perhaps opened lazily: decoded here like a file
        try:
            value.load()
        except (OSError, SyntaxError, ValueError) as exc:
            why = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise DataError(f"{where}: the image cannot be decoded ({why}); replace the file with an intact PNG or "
                            "JPEG") from None
        return value
    if isinstance(value, Mapping):
        data, path = value.get("bytes"), value.get("path")
        if data is None and not path:
            raise DataError(f"{where}: the image has neither bytes nor a path; give each row its image")
        value = data if data is not None else path
    if value is None:
        raise DataError(f"{where}: no image; give each row its image")
    try:
        source = io.BytesIO(value) if isinstance(value, (bytes, bytearray)) else Path(value)
        image = Image.open(source)
        image.load()  # decode every pixel now: a truncated file fails here, not in the middle of a round
    except FileNotFoundError:
        raise DataError(f"{where}: image file {value!s} does not exist; check the path") from None
    except (PermissionError, IsADirectoryError) as exc:
        raise DataError(f"{where}: image file {value!s} cannot be read ({exc.strerror}); check the path and its "
                        "permissions") from None
    except Image.DecompressionBombError as exc:
        raise DataError(f"{where}: {exc}; shrink the image, or raise PIL.Image.MAX_IMAGE_PIXELS if it is "
                        "trusted") from None
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as exc:
        why = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise DataError(f"{where}: the image cannot be decoded ({why}); replace the file with an intact PNG or "
                        "JPEG") from None
    return image


def to_mode(image: Any, channels: int, where: str) -> Any:
    """``image`` in the mode a model of ``channels`` input channels takes (``L`` for 1, ``RGB`` for 3)."""
    mode = image.mode
    if mode in _LOSSLESS:
        image, mode = image.convert(_LOSSLESS[mode]), _LOSSLESS[mode]
    elif mode == "P":
        if "transparency" in image.info:
            raise DataError(f"{where}: a palette image with transparency; {_CONVERT_FIX}")
        image, mode = image.convert("RGB"), "RGB"
    if mode not in ("L", "RGB"):
        raise DataError(f"{where}: image mode {mode} ({_describe(mode)}): fedpeft reads 8-bit grayscale (L) and RGB "
                        f"images and converts nothing that would lose information; {_CONVERT_FIX}")
    if channels == 3:
        return image if mode == "RGB" else image.convert("RGB")  # gray: the same value in all three channels
    if channels == 1:
        if mode == "RGB":
            raise DataError(f"{where}: a colour image for a model of one input channel; convert the images to "
                            "grayscale (PIL: .convert('L')) or use a model with num_channels 3")
        return image
    raise DataError(f"{where}: the model takes {channels} input channels; fedpeft reads images of 1 or 3")


def _describe(mode: str) -> str:
    return {"RGBA": "colour with alpha", "LA": "grayscale with alpha", "CMYK": "print colours",
            "I;16": "16-bit grayscale", "I": "32-bit integer", "F": "32-bit float"}.get(mode, "not 8-bit L or RGB")


def read_image_folder(root: Path, label_column: str = "label") -> list[Row]:
    """The rows of an ImageFolder directory: ``root/<class>/<image>``, one row per image, ``{"image": path,
    label_column: class name}``, classes and files in name order."""
    if not root.is_dir():
        raise DataError(f"{root}: not a directory; give an ImageFolder directory (<root>/<class>/<image>)")
    stray = sorted(p.name for p in root.iterdir() if not p.is_dir() or p.name.startswith("."))
    if stray:
        raise DataError(f"{root}: {stray[0]!r} is not a class folder; an ImageFolder directory holds only "
                        "<class>/<image> folders: move or remove it")
    classes = sorted(p for p in root.iterdir() if p.is_dir())
    if not classes:
        raise DataError(f"{root}: no class folders; an ImageFolder directory holds <class>/<image> folders")
    rows: list[Row] = []
    for folder in classes:
        files = sorted(folder.iterdir())
        if not files:
            raise DataError(f"{folder}: class {folder.name!r} has no images; add its images or remove the folder")
        for f in files:
            if f.name.startswith("."):
                raise DataError(f"{f}: a hidden file in class folder {folder.name!r}; remove it (fedpeft skips "
                                "nothing in a class folder)")
            if f.is_dir() or not f.name.lower().endswith(IMAGE_SUFFIXES):
                raise DataError(f"{f}: not an image file ({', '.join(IMAGE_SUFFIXES)}); move or remove it "
                                "(nothing in a class folder is skipped)")
            rows.append({"image": str(f), label_column: folder.name})
    return rows


def image_report(rows: list[Row], where: list[str], listed: int = 3) -> tuple[str, list[str]]:
    """What ``fedpeft data`` says of a split's images: every image decoded (strictly), a line of the most common
    sizes and modes, and one problem line for each image a run would refuse whatever its model (``where`` names
    each row); a colour image for a one-channel model is told by the run, which knows the model."""
    from collections import Counter

    kinds: Counter[str] = Counter()
    problems = []
    for row, w in zip(rows, where):
        w = f"{w} ({row['image']})" if isinstance(row.get("image"), str) else w
        try:
            image = decode_image(row.get("image"), w)
            to_mode(image, 3, w)  # a lossy mode is refused whatever the model (colour into one channel is not)
        except DataError as exc:
            problems.append(str(exc))
            continue
        kinds[f"{image.size[0]} x {image.size[1]} {image.mode}"] += 1
    shown = ", ".join(f"{kind}: {n}" for kind, n in kinds.most_common(listed))
    more = f", and {len(kinds) - listed} other sizes and modes" if len(kinds) > listed else ""
    return f"images (width x height mode): {shown or 'none decoded'}{more}", problems


def pixel_values(images: list[Any], processor: Any) -> np.ndarray:
    """(N, channels, height, width) uint8: ``images`` resized by a transformers image processor (e.g.
    ``AutoImageProcessor.from_pretrained(model)``), not yet rescaled or normalised (:func:`normalisation`)."""
    values = processor(images=images, return_tensors="np", do_rescale=False, do_normalize=False)["pixel_values"]
    return np.clip(np.rint(np.asarray(values)), 0, 255).astype(np.uint8)


def normalisation(processor: Any, channels: int) -> tuple[float, tuple[float, ...], tuple[float, ...]]:
    """(scale, mean, std) by which the processor turns 8-bit pixels into the model's input."""
    scale = float(processor.rescale_factor) if getattr(processor, "do_rescale", True) else 1.0
    if not getattr(processor, "do_normalize", True):
        return scale, (0.0,) * channels, (1.0,) * channels
    mean, std = processor.image_mean, processor.image_std
    mean = [float(mean)] * channels if isinstance(mean, (int, float)) else [float(m) for m in mean]
    std = [float(std)] * channels if isinstance(std, (int, float)) else [float(s) for s in std]
    return scale, tuple(mean[:channels]), tuple(std[:channels])


def encode_images(rows: list[Row], labels: list[int], where: list[str], processing: Any,
                  batch: int = 256) -> ImageEncoded:
    """The rows' images decoded (strictly, ``where`` naming each row, and the file of an image given by path), in
    the mode of the model's channels, resized by its processor (``processing``:
    :class:`fedpeft.models.images.ImageProcessing`) and kept as 8-bit pixels."""
    blocks = []
    for start in range(0, len(rows), batch):
        images = []
        for r, w in zip(rows[start:start + batch], where[start:start + batch]):
            w = f"{w} ({r['image']})" if isinstance(r["image"], str) else w
            images.append(to_mode(decode_image(r["image"], w), processing.channels, w))
        blocks.append(pixel_values(images, processing.processor))
    pixels = np.concatenate(blocks) if blocks else np.zeros((0, processing.channels, 1, 1), np.uint8)
    return ImageEncoded(pixels, list(labels), processing.tokens, *normalisation(processing.processor,
                                                                               processing.channels))
