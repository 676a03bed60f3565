"""Local tables (.jsonl, .json, .csv, .parquet, a `datasets` save_to_disk folder) read through `datasets`, and its
failures in a few words: what minigpt.data.sources (text rows) and minigpt.data.conversations (chat, preference and
prompt rows) share."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from minigpt.core.errors import first_line

__all__ = ["dataset_failure", "is_saved_dataset", "load_local_dataset"]

# the files `datasets`' save_to_disk writes beside the rows' .arrow files: a Dataset's, or a DatasetDict's
SAVED_DATASET_MARKERS = ("state.json", "dataset_dict.json")


def is_saved_dataset(folder: Path) -> bool:
    """Whether `folder` is a `datasets` save_to_disk folder: rows to read, not text files (its .json metadata)."""
    return any((folder / name).is_file() for name in SAVED_DATASET_MARKERS)


def load_local_dataset(builder: str, path: str) -> Any:
    """A local file read by `datasets`' builder (json, csv, parquet; "disk": a save_to_disk folder) as a Dataset
    (split "train"), read from the file again: `datasets` finds its cached copy by the file's modification time
    alone, so a file edited and given its old time back (cp -p, rsync -a, tar x) read as the old rows.  Called only
    where the rows are read for a preparation, which reads the whole file anyway."""
    import datasets

    if builder == "disk":  # a save_to_disk folder (no cache to bypass): a DatasetDict gives its "train" split
        ds = datasets.load_from_disk(path)
        if isinstance(ds, datasets.DatasetDict):
            if "train" not in ds:
                raise ValueError(f"its splits are {', '.join(ds)}, none is 'train'; save the split to read alone")
            ds = ds["train"]
        return ds
    return datasets.load_dataset(builder, data_files=[path], split="train", download_mode="force_redownload")


def dataset_failure(e: BaseException) -> str:
    """Why `datasets` could not read a source, in a few words: the error it wraps (its DatasetGenerationError says
    only "An error occurred while generating the dataset"; the parser's own, e.g. "JSON parse error ... in row 1",
    is its cause), or that a file holds no rows (an empty file: a bare StopIteration; a CSV of its header alone:
    "Instruction "train" corresponds to no data!")."""
    if isinstance(e, StopIteration) or "corresponds to no data" in str(e):
        return "it holds no rows"
    while e.__cause__ is not None:
        e = e.__cause__
    return f"{type(e).__name__}: {first_line(e)}"
