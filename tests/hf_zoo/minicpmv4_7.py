"""MiniCPM-V 4.7: MiniCPM-OCR's tower with canvas M-RoPE (its marker ids in the config), and
batches."""

from hf_zoo import minicpm_ocr
from hf_zoo._common import VEND, VSTART


def batch(model, images, videos, seed):
    return minicpm_ocr.batch(model, images, videos, seed, markers=True)


def build():
    return minicpm_ocr.build(
        "MiniCPMV4_7Config",
        "MiniCPMV4_7ForConditionalGeneration",
        image_start_id=VSTART,
        image_end_id=VEND,
        slice_start_id=124,
        slice_end_id=125,
        newline_id=126,
    )
