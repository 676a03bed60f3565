"""Reading a torch.save file a user names (a minigpt checkpoint, a Hugging Face pytorch_model.bin): one ladder.

torch.load(weights_only=True) refuses code, but it still builds what its allowed globals build: bytearray(8e9), a
storage of 10**9 floats asked of a record holding 64 bytes, sparse or meta tensors.  So before torch.load runs,
the archive is checked with zipfile (stored records only, adding up to no more than the file) and its pickle is run
once by the standard library's pickle.Unpickler with every global a recorder: nothing is imported, allocated or
built, and what torch.load will then allocate is bounded by the file's size.  torch has no public hook for either
check (torch.load takes no persistent_load and weights_only no deny-list), which is why this part is hand-written.
"""

from __future__ import annotations

import io
import pickle
import re
import struct
import warnings
import zipfile
from pathlib import Path
from typing import Any

import torch

from minigpt.core.errors import CheckpointError, first_line

# globals torch's weights_only allows that rebuild a tensor other than a dense one with storage, which no weights are
NOT_DENSE = {
    "torch._utils._rebuild_sparse_tensor": "a sparse tensor",
    "torch._utils._rebuild_meta_tensor_no_storage": "a meta-device tensor (no data)",
    "torch._utils._rebuild_wrapper_subclass": "a tensor subclass without storage",
    "torch._utils._rebuild_device_tensor_from_cpu_tensor": "a tensor moved to another device as it loads",
    "torch._utils._rebuild_device_tensor_from_numpy": "a tensor moved to another device as it loads",
    "torch._utils._rebuild_nested_tensor": "a nested tensor",
    "torch.nested._internal.nested_tensor._rebuild_njt": "a nested tensor",
    "torch._utils._rebuild_qtensor": "a quantized tensor",
}
ALLOCATING = {"bytearray", "bytes"}  # weights_only allows them; a number argument allocates that much
# what torch.load and pickle raise on a stream that is malformed rather than malicious (PROTO+STOP: IndexError; an
# unset memo slot: KeyError; a cut: EOFError), caught where a user's file is read, and only there
STREAM_ERRORS = (
    zipfile.BadZipFile,
    OSError,
    pickle.UnpicklingError,
    EOFError,
    LookupError,
    TypeError,
    AttributeError,
    ValueError,
    RuntimeError,
    OverflowError,
    struct.error,
)


def load_torch_file(path: Path, fix: str, damaged_fix: str, map_location: Any = "cpu") -> Any:
    """torch.load(path, weights_only=True), after check_archive; every refusal is one CheckpointError
    line ending in `fix` (a crafted file) or `damaged_fix` (a file cut short or damaged)."""
    loading = False
    try:
        problem = check_archive(path)
        if loading := problem is None:
            with warnings.catch_warnings():  # a foreign pickle protocol only matters if the load fails (below)
                warnings.filterwarnings("ignore", message="Detected pickle protocol")
                return torch.load(path, map_location=map_location, weights_only=True)
    except STREAM_ERRORS as e:
        if not (loading and isinstance(e, pickle.UnpicklingError)):  # a malformed archive or stream: damage
            raise CheckpointError(
                f"cannot read {path}: it is truncated or damaged ({type(e).__name__}: "
                f"{first_line(e, 100)}); {damaged_fix}"
            ) from None
        # weights_only refused what the dry run let through: torch's paragraph; the global it refused is what helps
        found = re.search(r"GLOBAL [\w.]+", str(e))
        problem = f"it holds objects other than tensors and plain data ({found[0] if found else first_line(e, 120)})"
    raise CheckpointError(f"refusing to load {path}: {problem}; {fix}")


def check_archive(path: Path) -> str | None:
    """What the torch.save archive at `path` holds that torch.save never writes, or None.  Refused: a file that
    is no zip archive (torch's legacy format, or damage); compressed records (a few MB that inflate to GBs); records
    adding up to more than the file; a pickle that calls a global allocating from a number (bytearray(8e9),
    torch.FloatTensor(8e9)), asks a storage for other than the bytes its record holds, or rebuilds a tensor other
    than a dense one with storage; and, as torch.load(weights_only=True) would, a global it does not allow.  A
    record whose bytes do not match its CRC-32 (damage) raises zipfile.BadZipFile."""
    with open(path, "rb") as f:
        if f.read(4) != b"PK\x03\x04":
            return "it is not a zip archive as torch.save writes it (a legacy-format or damaged file)"
    with zipfile.ZipFile(path) as archive:
        records = {r.filename: r for r in archive.infolist()}
        if len(records) != len(archive.infolist()):
            return "it holds two records of one name, which torch.save never writes"
        if any(r.compress_type != zipfile.ZIP_STORED for r in records.values()):
            return "it holds compressed records, which torch.save never writes"
        if sum(r.file_size for r in records.values()) > path.stat().st_size:
            return "its records add up to more bytes than the file holds"
        pickles = [name for name in records if name.endswith("data.pkl")]
        if len(pickles) != 1:
            return "it has no data.pkl (or several), so torch.save did not write it"
        prefix = pickles[0][: -len("data.pkl")]
        if unsafe := torch.serialization.get_unsafe_globals_in_checkpoint(path):  # a static scan: runs nothing
            return f"it holds objects other than tensors and plain data (GLOBAL {unsafe[0][:100]})"
        calls, storages = _dry_run(archive.read(pickles[0]))
        sizes = {name[len(prefix) :]: r.file_size for name, r in records.items() if name.startswith(prefix)}
        if problem := _call_problem(calls) or _storage_problem(storages, sizes):
            return problem
        check_crcs(archive)
    return None


def check_crcs(archive: zipfile.ZipFile) -> None:
    """Read every record to its end, which checks its CRC-32 (zipfile raises BadZipFile on a mismatch): torch.load
    never does, so flipped bytes in a tensor would load as other weights.  Records written without one (torch.save
    with serialization.config.save.compute_crc32 off stores 0) are not checked."""
    for record in archive.infolist():
        if record.CRC != 0:
            with archive.open(record) as f:
                while f.read(1 << 24):
                    pass


def _dry_run(data: bytes) -> tuple[list[tuple[str, tuple]], list[Any]]:
    """Run a torch.save pickle with every global a recorder: (the calls it makes as (global, args), the persistent
    ids it asks for).  Nothing is imported, allocated from a number or built."""
    calls: list[tuple[str, tuple]] = []
    storages: list[Any] = []
    recorders: dict[str, type] = {}

    class Recorder(dict):  # a dict, so that an OrderedDict() call takes its SETITEMS
        global_name = ""
        __hash__ = object.__hash__

        def __new__(cls, *args, **kwargs):  # REDUCE calls the class; NEWOBJ its __new__
            calls.append((cls.global_name, args))
            return super().__new__(cls)

        def __init__(self, *args, **kwargs):
            super().__init__()

        def __setstate__(self, state):  # BUILD
            pass

        def append(self, item):  # APPEND(S) on a call's result
            pass

    class DryRun(pickle.Unpickler):
        def find_class(self, module, name):
            full = f"{module}.{name}"
            calls.append((full, ()))  # named counts as called: a rebuild function may call its argument
            return recorders.setdefault(full, type(name, (Recorder,), {"global_name": full}))

        def persistent_load(self, pid):
            storages.append(pid)
            return pid

    DryRun(io.BytesIO(data), encoding="utf-8").load()  # the encoding torch.load reads protocol-2 strings with
    return calls, storages


def _call_problem(calls: list[tuple[str, tuple]]) -> str | None:
    for name, args in calls:
        last = name.rsplit(".", 1)[-1]
        if name in NOT_DENSE:
            return f"it holds {NOT_DENSE[name]} ({name}), where minigpt reads dense tensors only"
        if last in ALLOCATING:
            return f"its pickle calls {last}, which torch.save never writes"
        if args and last.endswith(("Tensor", "Storage")):  # a constructor called: torch.FloatTensor(8e9)
            return f"its pickle calls {name}, which allocates from a number and which torch.save never writes"
        if (
            name == "torch._tensor._rebuild_from_type_v2"
            and args
            and isinstance(args[0], type)
            and args[0].global_name.endswith(("Tensor", "Storage"))
        ):  # it calls its first argument
            return (
                f"its pickle calls {args[0].global_name}, which allocates from a number and which torch.save "
                "never writes"
            )
    return None


def _storage_dtype(storage_type: Any) -> torch.dtype | None:
    """torch.FloatStorage -> torch.float32 (the legacy storage classes torch.save names), torch.storage.UntypedStorage
    -> uint8; None for anything else."""
    module, _, name = getattr(storage_type, "global_name", "").rpartition(".")
    if module == "torch.storage" and name == "UntypedStorage":  # other dtypes (float8) name theirs apart
        return torch.uint8
    if module not in ("torch", "torch.cuda") or not name.endswith("Storage"):
        return None
    with warnings.catch_warnings():  # the legacy classes warn that TypedStorage is deprecated when asked
        warnings.simplefilter("ignore", UserWarning)
        dtype = getattr(getattr(torch if module == "torch" else torch.cuda, name, None), "dtype", None)
    return dtype if isinstance(dtype, torch.dtype) else None


def _storage_problem(storages: list[Any], record_sizes: dict[str, int]) -> str | None:
    for pid in storages:
        if not (
            isinstance(pid, tuple)
            and len(pid) == 5
            and pid[0] == "storage"
            and isinstance(pid[2], str)
            and isinstance(pid[4], int)
            and not isinstance(pid[4], bool)
            and pid[4] >= 0
        ):
            return f"its pickle asks for a storage as {str(pid)[:80]}, which torch.save never writes"
        dtype = _storage_dtype(pid[1])
        if dtype is None:
            return f"its pickle asks for a storage of type {str(pid[1])[:80]}, which torch.save never writes"
        record, wanted = f"data/{pid[2]}", pid[4] * dtype.itemsize
        if record_sizes.get(record) != wanted:
            held = f"{record_sizes[record]} bytes" if record in record_sizes else "no such record"
            return (
                f"its pickle asks for {wanted} bytes of {dtype} from the record {record[:40]}, which holds "
                f"{held}; the file is damaged or crafted"
            )
    return None
