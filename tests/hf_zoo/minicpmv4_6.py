"""MiniCPM-V 4.6: MiniCPM-OCR's modeling with other config defaults and batches."""

from hf_zoo import minicpm_ocr

batch = minicpm_ocr.batch


def build():
    return minicpm_ocr.build("MiniCPMV4_6Config", "MiniCPMV4_6ForConditionalGeneration")
