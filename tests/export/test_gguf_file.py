"""The .gguf file written whole or not at all (minigpt.export.gguf_file): an existing file is replaced only with
--overwrite and only when it is a GGUF file minigpt wrote and nobody changed; a full disk or Ctrl-C leaves the old
file as it was and no temporary file; a killed export's leftover is removed by the next."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from minigpt.core.errors import UserError
from minigpt.core.tokenizers import ByteTokenizer
from minigpt.export.gguf import export_gguf

sys.path.insert(0, str(Path(__file__).parent))
from gguf_models import random_model  # noqa: E402

gguf = pytest.importorskip("gguf")
pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one thread is as fast


def test_an_existing_out_is_replaced_only_with_overwrite_and_only_an_unchanged_export(tmp_path):
    out = tmp_path / "model.gguf"
    out.write_text("my notes")
    first, second = random_model(seed=1), random_model(seed=2)
    with pytest.raises(UserError, match="model.gguf already exists; choose another output file, or pass --overwrite"):
        export_gguf(first, ByteTokenizer(), out)
    with pytest.raises(UserError, match="is not a GGUF file export.py wrote .* so --overwrite would replace it"):
        export_gguf(first, ByteTokenizer(), out, overwrite=True)
    assert out.read_text() == "my notes"

    out.unlink()
    export_gguf(first, ByteTokenizer(), out)
    written = out.read_bytes()
    with pytest.raises(UserError, match="already exists"):
        export_gguf(second, ByteTokenizer(), out)
    export_gguf(second, ByteTokenizer(), out, overwrite=True)  # an unchanged export: replaced
    assert out.read_bytes() != written and [p.name for p in tmp_path.iterdir()] == ["model.gguf"]

    data = bytearray(out.read_bytes())
    data[-1] ^= 1  # one bit of one weight
    out.write_bytes(bytes(data))
    with pytest.raises(UserError, match=r"was changed after export.py wrote it \(its SHA-256 differs"):
        export_gguf(first, ByteTokenizer(), out, overwrite=True)
    assert out.read_bytes() == bytes(data)
    (tmp_path / "link.gguf").symlink_to(out)
    with pytest.raises(UserError, match="link.gguf is a symbolic link, not a GGUF file export.py wrote"):
        export_gguf(first, ByteTokenizer(), tmp_path / "link.gguf", overwrite=True)


@pytest.mark.parametrize(
    "failure, error", [(OSError(28, "No space left on device"), UserError), (KeyboardInterrupt(), KeyboardInterrupt)]
)
def test_a_failed_write_leaves_the_old_file_and_no_temporary_one(failure, error, tmp_path, monkeypatch):
    out = tmp_path / "model.gguf"
    export_gguf(random_model(seed=1), ByteTokenizer(), out)
    before = out.read_bytes()

    def fail_midway(self, *args, **kwargs):
        Path(self.fout[0].name).write_bytes(b"half a file")
        raise failure

    monkeypatch.setattr(gguf.GGUFWriter, "write_tensors_to_file", fail_midway)
    with pytest.raises(error) as e:
        export_gguf(random_model(seed=2), ByteTokenizer(), out, overwrite=True)
    if error is UserError:
        assert str(e.value).startswith(f"cannot write {out} (No space left on device); free space there")
    assert out.read_bytes() == before and [p.name for p in tmp_path.iterdir()] == ["model.gguf"]
    with pytest.raises(error):
        export_gguf(random_model(seed=2), ByteTokenizer(), tmp_path / "new" / "model.gguf")
    assert [p.name for p in tmp_path.iterdir()] == ["model.gguf"]  # nor the folder it created


def test_a_killed_exports_leftover_is_removed_by_the_next(tmp_path):
    leftover = tmp_path / ".model.gguf.tmp-999999999"  # a process id that is not running
    leftover.write_bytes(b"half a file")
    export_gguf(random_model(), ByteTokenizer(), tmp_path / "model.gguf")
    assert [p.name for p in tmp_path.iterdir()] == ["model.gguf"]
