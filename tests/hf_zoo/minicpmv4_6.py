"""MiniCPM-V 4.6: MiniCPM-OCR's modeling with other config defaults, refused like it."""

from hf_zoo import minicpm_ocr


def build():
    return minicpm_ocr.build("MiniCPMV4_6Config", "MiniCPMV4_6ForConditionalGeneration")
