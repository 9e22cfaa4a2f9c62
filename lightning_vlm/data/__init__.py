"""Data: the synthetic task, sources, row normalisation/validation and the DataModules."""

from lightning_vlm.data.datamodule import (
    PreferenceDataModule,
    PromptDataModule,
    RowDataset,
    SFTDataModule,
    UnpairedDataModule,
    VLMDataModule,
    collate_rows,
)
from lightning_vlm.data.files import SourceError
from lightning_vlm.data.images import load_row, open_image, to_rgb
from lightning_vlm.data.loaded import Source
from lightning_vlm.data.row_error import RowError
from lightning_vlm.data.rows import normalize_row
from lightning_vlm.data.skips import NoRowsError
from lightning_vlm.data.sources import load_source, synthetic_source
from lightning_vlm.data.synthetic import VOCABULARY, make_sample, synthetic_rows

__all__ = [
    "VOCABULARY",
    "NoRowsError",
    "PreferenceDataModule",
    "PromptDataModule",
    "RowDataset",
    "RowError",
    "SFTDataModule",
    "Source",
    "SourceError",
    "UnpairedDataModule",
    "VLMDataModule",
    "collate_rows",
    "load_row",
    "load_source",
    "make_sample",
    "normalize_row",
    "open_image",
    "synthetic_rows",
    "synthetic_source",
    "to_rgb",
]
