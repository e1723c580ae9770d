"""A model directory's transformers processor, images only where its video processor cannot load.

transformers 5's video processors need torchvision (their classes are import-time dummies
without it), and the processors of several vision-language models (LLaVA-OneVision, SmolVLM,
Qwen2.5-VL, Qwen3-VL) take one as a constructor argument, so ``AutoProcessor`` fails for them on
a server without torchvision even though the engine sends them images only. For those, the
same processor class is built from the same files with no video processor: its tokenizer
(``AutoTokenizer``), its image processor (``AutoImageProcessor``) and its
``processor_config.json`` arguments, through transformers' own ``from_args_and_dict``. Every
image and text path of the processor is its own; only a video would fail (the engine accepts
none).

One processor cannot even be imported without torchvision: Pixtral's (Mistral 3's), whose
module imports a size helper from the torchvision image processor's module although the PIL
image processor's module defines the same helper. :func:`processor_class` imports it with the
PIL module standing in for the torchvision one, for that import only.
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)


def load_auto_processor(model_dir: str) -> Any:
    """The directory's processor (see the module docstring).

    Raises:
        OSError, ValueError, KeyError: the directory has no usable processor (as
            ``AutoProcessor.from_pretrained`` raises them).
    """
    from transformers import AutoProcessor
    from transformers.utils import is_torchvision_available

    cls = _processor_class(model_dir)
    if cls is None or is_torchvision_available():
        return AutoProcessor.from_pretrained(model_dir)
    if "video_processor" in cls.get_attributes():
        logger.info("%s: building %s without its video processor (no torchvision)",
                    model_dir, cls.__name__)  # fmt: skip
        return image_only_processor(cls, model_dir)
    return cls.from_pretrained(model_dir)  # the class itself: AutoProcessor may map a dummy


def _processor_class(model_dir: str) -> type | None:
    """The processor class ``processor_config.json`` (or the model type) names, if any."""
    from transformers import AutoConfig
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES
    from transformers.processing_utils import ProcessorMixin

    try:
        processor_dict, _ = ProcessorMixin.get_processor_dict(model_dir)
    except (OSError, ValueError):
        processor_dict = {}
    name = processor_dict.get("processor_class")
    if not name:
        try:
            config = AutoConfig.from_pretrained(model_dir)
        except (OSError, ValueError, KeyError):
            return None
        name = PROCESSOR_MAPPING_NAMES.get(getattr(config, "model_type", None))
    return processor_class(name) if name else None


def processor_class(name: str) -> type | None:
    """The processor class ``name`` of transformers; Pixtral's imported without torchvision.

    Returns:
        The class, or None when transformers has none of that name.
    """
    import importlib
    import sys

    from transformers.models.auto.processing_auto import processor_class_from_name
    from transformers.utils.import_utils import DummyObject

    cls = processor_class_from_name(name)
    if cls is None or not isinstance(cls, DummyObject) or name != "PixtralProcessor":
        return cls
    package = "transformers.models.pixtral"
    stand_in = importlib.import_module(f"{package}.image_processing_pil_pixtral")
    blocked = f"{package}.image_processing_pixtral"
    saved = sys.modules.get(blocked)
    sys.modules[blocked] = stand_in  # only get_resize_output_image_size is imported from it
    try:
        module = importlib.import_module(f"{package}.processing_pixtral")
    finally:
        if saved is None:
            del sys.modules[blocked]
        else:
            sys.modules[blocked] = saved
    return module.PixtralProcessor


def image_only_processor(cls: type, model_dir: str) -> Any:
    """``cls`` (a ``ProcessorMixin`` with a ``video_processor``) built with no video processor.

    The tokenizer and image processor load through their Auto classes; every other argument
    comes from the directory's processor config, as ``ProcessorMixin.from_pretrained`` does.

    Raises:
        ValueError: ``cls`` takes a sub-processor other than a tokenizer, an image processor
            and a video processor.
    """
    from transformers import AutoImageProcessor, AutoTokenizer

    image_only = image_only_class(cls)
    args = []
    for attribute in cls.get_attributes():
        if attribute == "tokenizer":
            args.append(AutoTokenizer.from_pretrained(model_dir))
        elif attribute == "image_processor":
            args.append(AutoImageProcessor.from_pretrained(model_dir))
        elif attribute == "video_processor":
            args.append(None)
        else:
            raise ValueError(f"{cls.__name__} needs a {attribute}; only images are supported")
    processor_dict, kwargs = image_only.get_processor_dict(model_dir)
    return image_only.from_args_and_dict(args, processor_dict, **kwargs)


def image_only_class(cls: type) -> type:
    """A subclass of processor class ``cls`` that takes ``video_processor=None``.

    transformers checks each sub-processor's class, and without torchvision there is no video
    processor class to check against; the subclass skips that check for a None video processor
    only, and puts :class:`NoVideoProcessor` in its place (SmolVLM's ``apply_chat_template``
    reads the video processor's frame sampling whatever the content). It keeps ``cls``'s name
    (transformers reads some processors' behaviour from it) and saves as ``cls`` does.
    """

    class ImageOnly(cls):
        def __setattr__(self, name, value):  # ProcessorMixin.__init__ sets each sub-processor
            if name == "video_processor" and value is None:
                value = NoVideoProcessor()
            super().__setattr__(name, value)

        def check_argument_for_proper_class(self, argument_name, argument):
            if argument_name == "video_processor" and argument is None:
                return None
            return super().check_argument_for_proper_class(argument_name, argument)

        def to_dict(self):
            out = super().to_dict()
            out.pop("video_processor", None)
            return out

    ImageOnly.__name__ = ImageOnly.__qualname__ = cls.__name__
    ImageOnly.__doc__ = cls.__doc__
    return ImageOnly


class NoVideoProcessor:
    """The video processor of a processor built images-only: no frame sampling, no videos.

    Raises (when called):
        ValueError: always; the engine takes no video.
    """

    num_frames = None
    fps = None
    _auto_class = None

    def __call__(self, *args, **kwargs):
        """Refuse a video."""
        raise ValueError("this processor was built without a video processor; it takes no video")
