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
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from fedpeft.data.batching import ImageEncoded
from fedpeft.data.catalog import Row
from fedpeft.data.files import DataError
from fedpeft.errors import unprintable

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff", ".webp")
_LOSSLESS = {"1": "L"}  # modes expanded without loss (palette images: see to_mode)
# A class folder's name is its label: a few words (long species names included), not a file name or a caption
# moved into a folder name; longer is refused, and keeps labels readable in logs, reports and prediction files.
MAX_CLASS_NAME = 128
# The default of task.max_image_pixels (config/schema.py, where its reason is given)
MAX_IMAGE_PIXELS = 4096 * 4096
log = logging.getLogger("fedpeft")
_CONVERT_FIX = "convert the images to RGB or 8-bit grayscale first (PIL: image.convert('RGB'))"


def decode_image(value: Any, where: str, max_pixels: int = MAX_IMAGE_PIXELS) -> Any:
    """A fully decoded PIL image from a Hugging Face image value (``{"bytes": ..., "path": ...}``), raw bytes, a
    path or a PIL image (a dataset loader's); ``where`` names the row or file in the error. An image of more than
    ``max_pixels`` pixels, or of several frames, is refused from its header, before it is decoded."""
    from PIL import Image

    image = value if isinstance(value, Image.Image) else _open(value, where, max_pixels)
    try:
        _check_header(image, where, max_pixels)
        image.load()  # decode every pixel now: a truncated file fails here, not in the middle of a round
    except DataError:
        if image is not value:
            image.close()
        raise
    except (OSError, SyntaxError, ValueError) as exc:
        raise DataError(f"{where}: the image cannot be decoded ({_why(exc)}); replace the file with an intact PNG "
                        "or JPEG") from None
    return image


def _check_header(image: Any, where: str, max_pixels: int) -> None:
    """Refuse an opened, not yet decoded ``image`` of more than ``max_pixels`` pixels or of several frames: what
    its header says, read before a pixel is decoded."""
    width, height = image.size
    if width * height > max_pixels:
        raise DataError(f"{where}: the image is {width} x {height}, {width * height:,} pixels, over the cap of "
                        f"{max_pixels:,} (task.max_image_pixels); shrink the image (the model takes a few hundred "
                        "pixels a side), or raise task.max_image_pixels")
    frames = getattr(image, "n_frames", 1)
    if frames > 1 and image.format == "MPO":  # a camera JPEG with an MPF preview: frame 0 is its primary image
        _log_primary_frame(where, frames)
    elif frames > 1:
        raise DataError(f"{where}: the image has {frames} frames (an animation or a multi-page file), and which one "
                        "to learn from is not fedpeft's guess; save the frame you mean as a single-frame PNG")


_primary_frame_logged = False


def _log_primary_frame(where: str, frames: int) -> None:
    """Say (once per process) that a JPEG of several images (MPO: phone and camera photos with a preview or a
    second view, CIPA DC-007) is read as its primary image, frame 0, as any JPEG reader shows it."""
    global _primary_frame_logged
    if not _primary_frame_logged:
        _primary_frame_logged = True
        log.warning("%s: a JPEG holding %d images (MPO, e.g. a camera's photo with its preview): its primary image "
                    "(frame 0) is read, as for every such JPEG of the dataset (logged once)", where, frames)


def _open(value: Any, where: str, max_pixels: int) -> Any:
    """``value`` (a Hugging Face image value, bytes or a path) opened lazily: its header read, no pixel decoded."""
    import warnings

    from PIL import Image, UnidentifiedImageError

    if isinstance(value, Mapping):
        data, path = value.get("bytes"), value.get("path")
        if data is None and not path:
            raise DataError(f"{where}: the image has neither bytes nor a path; give each row its image")
        value = data if data is not None else path
    if value is None:
        raise DataError(f"{where}: no image; give each row its image")
    try:
        source = io.BytesIO(value) if isinstance(value, (bytes, bytearray)) else Path(value)
        with warnings.catch_warnings():  # Pillow's huge-image warning: _check_header refuses the image
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            return Image.open(source)
    except FileNotFoundError:
        raise DataError(f"{where}: image file {value!s} does not exist; check the path") from None
    except (PermissionError, IsADirectoryError) as exc:
        raise DataError(f"{where}: image file {value!s} cannot be read ({exc.strerror}); check the path and its "
                        "permissions") from None
    except Image.DecompressionBombError as exc:  # over twice Pillow's own limit: over any cap fedpeft allows
        raise DataError(f"{where}: the image is over the cap of {max_pixels:,} pixels (task.max_image_pixels) and "
                        f"over Pillow's own limit ({_why(exc).rstrip('.')}); shrink the image") from None
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as exc:
        raise DataError(f"{where}: the image cannot be decoded ({_why(exc)}); replace the file with an intact PNG or "
                        "JPEG") from None


def _why(exc: BaseException) -> str:
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__


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


def read_image_folder(root: Path, label_column: str = "label", dataset: Path | None = None) -> list[Row]:
    """The rows of an ImageFolder directory: ``root/<class>/<image>``, one row per image, ``{"image": path,
    label_column: class name}``, classes and files in name order. ``dataset`` is the dataset's directory (the
    parent of a split folder ``root``; ``root`` itself when not given): a class folder or image that leads out of it
    through a symlink is refused; symlinks within it are followed."""
    if not root.is_dir():
        raise DataError(f"{root}: not a directory; give an ImageFolder directory (<root>/<class>/<image>)")
    top = _resolved(dataset or root)
    _stays_inside(root, top)
    stray = sorted(p.name for p in root.iterdir() if not p.is_dir() or p.name.startswith("."))
    if stray:
        raise DataError(f"{root}: {stray[0]!r} is not a class folder; an ImageFolder directory holds only "
                        "<class>/<image> folders: move or remove it")
    classes = sorted(p for p in root.iterdir() if p.is_dir())
    if not classes:
        raise DataError(f"{root}: no class folders; an ImageFolder directory holds <class>/<image> folders")
    rows: list[Row] = []
    for folder in classes:
        _check_class_name(folder)
        if folder.is_symlink():  # (one that is not lies in root, inside)
            _stays_inside(folder, top)
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
            if f.is_symlink():
                _stays_inside(f, top)
            rows.append({"image": str(f), label_column: folder.name})
    return rows


def _check_class_name(folder: Path) -> None:
    """A class folder's name is its class label, printed in logs, reports and prediction files: one printable line
    of at most :data:`MAX_CLASS_NAME` characters."""
    name = folder.name
    bad = unprintable(name)
    if bad is not None:
        raise DataError(f"{_shown(folder)}: class folder name {name!r} holds the unprintable character {bad!r} (a control or format character); rename "
                        "the folder (its name is the class label)")
    if len(name) > MAX_CLASS_NAME:
        raise DataError(f"{folder}: class folder name of {len(name)} characters, over {MAX_CLASS_NAME}; rename the "
                        "folder to a shorter name (its name is the class label)")


def _resolved(path: Path) -> Path:
    try:
        return path.resolve()
    except (OSError, RuntimeError) as exc:  # a symlink loop
        raise DataError(f"{_shown(path)}: cannot be followed ({_why(exc)}); replace the symlink with the folder or "
                        "file it means") from None


def _stays_inside(path: Path, top: Path) -> None:
    target = _resolved(path)
    if not target.is_relative_to(top):
        raise DataError(f"{_shown(path)}: points to {_shown(target)}, outside the dataset directory {_shown(top)}; "
                        "put the class folders and images inside the dataset directory (copy them in, or link "
                        "only within it)")


def _shown(path: Path) -> str:
    """``path`` as it can stand in a one-line message: quoted and escaped when it holds a newline or the like."""
    text = str(path)
    return text if unprintable(text) is None else repr(text)


def image_report(rows: list[Row], where: list[str], listed: int = 3,
                 max_pixels: int = MAX_IMAGE_PIXELS) -> tuple[str, list[str]]:
    """What ``fedpeft data`` says of a split's images: every image decoded (strictly, none of more than
    ``max_pixels`` pixels), a line of the most common sizes and modes, and one problem line for each image a run
    would refuse whatever its model (``where`` names each row); a colour image for a one-channel model is told by
    the run, which knows the model."""
    from collections import Counter

    kinds: Counter[str] = Counter()
    problems = []
    for row, w in zip(rows, where):
        w = f"{w} ({row['image']})" if isinstance(row.get("image"), str) else w
        try:
            image = decode_image(row.get("image"), w, max_pixels)
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


def encode_images(rows: list[Row], labels: list[int], where: list[str], processing: Any, batch: int = 256,
                  max_pixels: int = MAX_IMAGE_PIXELS) -> ImageEncoded:
    """The rows' images decoded (strictly, none of more than ``max_pixels`` pixels, ``where`` naming each row, and
    the file of an image given by path), in the mode of the model's channels, resized by its processor in groups of
    at most ``batch`` images and twice ``max_pixels`` decoded pixels (``processing``:
    :class:`fedpeft.models.images.ImageProcessing`) and kept as 8-bit pixels."""
    blocks, images, held = [], [], 0
    budget = 2 * max_pixels  # decoded pixels held at once: a batch of large images is resized in smaller groups
    for r, w in zip(rows, where):
        w = f"{w} ({r['image']})" if isinstance(r["image"], str) else w
        image = to_mode(decode_image(r["image"], w, max_pixels), processing.channels, w)
        if images and (len(images) == batch or held + image.width * image.height > budget):
            blocks.append(pixel_values(images, processing.processor))
            images, held = [], 0  # (the decoded images go with the list)
        images.append(image)
        held += image.width * image.height
    if images:
        blocks.append(pixel_values(images, processing.processor))
    pixels = np.concatenate(blocks) if blocks else np.zeros((0, processing.channels, 1, 1), np.uint8)
    return ImageEncoded(pixels, list(labels), processing.tokens, *normalisation(processing.processor,
                                                                               processing.channels))
