"""An export's folder never costs the user a file: `--overwrite` replaces only a folder whose manifest
(minigpt_export.json) lists every entry in it, unchanged, never one judged by file names (transformers writes the
same ones); a full disk, a file-size limit or Ctrl-C while writing is one line, leaves the old export as it was and
no temporary folder.  Every folder is built here; the full disk is a real write failing under `ulimit -f`."""

import errno
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import SafetensorError
from safetensors.torch import save_file as save_tensors

from minigpt.core.checkpoint import model_checkpoint, save_file
from minigpt.core.config import GPTConfig
from minigpt.core.errors import UserError
from minigpt.core.model import GPT
from minigpt.core.tokenizers import ByteTokenizer
from minigpt.export.folder import MANIFEST
from minigpt.export.hf import EXPORT_FILES, check_out_dir, export_hf

REPO = Path(__file__).resolve().parents[2]
TINY = dict(n_layer=1, n_head=2, n_embd=32, block_size=16, vocab_size=256)  # model.safetensors is ~100 KB


def tiny_model(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig(**TINY)).eval()


def contents(folder: Path) -> dict[str, bytes | str | dict]:
    """Every entry under folder, recursively: a file's bytes, a link's target, a folder's contents."""
    return {
        p.name: os.readlink(p) if p.is_symlink() else contents(p) if p.is_dir() else p.read_bytes()
        for p in sorted(folder.iterdir())
    }


def hidden_leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name.startswith("."))


@pytest.fixture
def previous(tmp_path):
    """A folder export_hf wrote, and its contents."""
    out = export_hf(tiny_model(), ByteTokenizer(), tmp_path / "out")
    return out, contents(out)


def refused(out: Path, match: str, model_seed: int = 1) -> None:
    before = contents(out)
    with pytest.raises(UserError, match=match) as e:
        export_hf(tiny_model(model_seed), ByteTokenizer(), out, overwrite=True)
    assert "\n" not in str(e.value) and "choose another output folder" in str(e.value)
    assert contents(out) == before and hidden_leftovers(out.parent) == []


# ------------------------------------------------------------------------------------------------- the manifest


def test_an_export_lists_every_file_it_wrote_and_overwrite_replaces_it(previous):
    out, before = previous
    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest["format"] == "minigpt-hf-export" and manifest["version"] == 1
    listed = {f["name"]: (f["size"], f["sha256"]) for f in manifest["files"]}
    assert set(listed) | {MANIFEST} == {p.name for p in out.iterdir()} == EXPORT_FILES
    for name, (size, sha256) in listed.items():
        data = (out / name).read_bytes()
        assert (len(data), hashlib.sha256(data).hexdigest()) == (size, sha256)
    export_hf(tiny_model(1), ByteTokenizer(), out, overwrite=True)
    assert contents(out)["model.safetensors"] != before["model.safetensors"]
    assert hidden_leftovers(out.parent) == []
    export_hf(tiny_model(2), ByteTokenizer(), out, overwrite=True)  # the new export is replaceable in turn


def test_overwrite_refuses_a_transformers_folder_with_the_same_file_names(tmp_path):
    transformers = pytest.importorskip("transformers")
    import tokenizers

    out = tmp_path / "out"
    config = transformers.GPT2Config(n_layer=1, n_head=2, n_embd=16, n_positions=16, vocab_size=256)
    transformers.GPT2LMHeadModel(config).save_pretrained(out)
    vocab = tokenizers.Tokenizer(tokenizers.models.WordLevel({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    transformers.PreTrainedTokenizerFast(tokenizer_object=vocab).save_pretrained(out)
    assert {p.name for p in out.iterdir()} <= EXPORT_FILES  # the names alone would pass for an export
    refused(
        out,
        r"holds no minigpt_export.json .* --overwrite would delete config.json, generation_config.json, "
        r"model.safetensors, \.\.\.; choose another output folder, or move them away",
    )
    (tmp_path / "only_config").mkdir()
    (tmp_path / "only_config" / "config.json").write_text('{"my": "settings"}')
    refused(tmp_path / "only_config", r"holds no minigpt_export.json")


def test_a_manifest_copied_from_another_export_does_not_pass_for_this_folder(tmp_path, previous):
    out, _ = previous
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text((out / "config.json").read_text())  # same bytes: passes
    save_tensors({"w": torch.randn(8)}, str(other / "model.safetensors"))  # the user's weights
    (other / MANIFEST).write_bytes((out / MANIFEST).read_bytes())
    refused(other, rf"{other / 'model.safetensors'} was changed after export.py wrote it \(its size differs")


def test_a_user_folder_or_file_inside_an_export_is_never_deleted(previous):
    out, _ = previous
    (out / "tokenizer.json").unlink()
    (out / "tokenizer.json").mkdir()  # the case: a user's tokenizer.json/ subfolder
    (out / "tokenizer.json" / "vocab.txt").write_text("my vocabulary")
    refused(out, rf"{out / 'tokenizer.json'} is a folder, not a file export.py wrote, so --overwrite would delete it")
    (out / "tokenizer.json" / "vocab.txt").unlink()
    (out / "tokenizer.json").rmdir()
    (out / "notes.txt").write_text("mine")
    refused(out, rf"{out / 'notes.txt'} is not a file export.py wrote \(its minigpt_export.json does not list it\)")
    (out / "notes.txt").unlink()
    (out.parent / "my_tokenizer.json").write_text("{}")
    (out / "tokenizer.json").symlink_to(out.parent / "my_tokenizer.json")
    refused(out, r"tokenizer.json is a symbolic link, not a file export.py wrote")


@pytest.mark.parametrize(
    "edit, why",
    [
        (lambda data: data.replace(b'"n_layer": 1', b'"n_layer": 2'), "SHA-256"),  # same size: only the hash sees it
        (lambda data: data + b"\n", "size"),
    ],
    ids=["same-size", "longer"],
)
def test_an_export_the_user_edited_is_refused(previous, edit, why):
    out, _ = previous
    config = out / "config.json"
    edited = edit(config.read_bytes())
    assert edited != config.read_bytes()
    config.write_bytes(edited)
    refused(
        out,
        rf"{config} was changed after export.py wrote it \(its {why} differs from minigpt_export.json\), so "
        "--overwrite would delete it; choose another output folder, or move it away",
    )


@pytest.mark.parametrize(
    "manifest, why",
    [
        (b"not json", "Expecting value"),
        (b"[" * 100_000 + b"]" * 100_000, "nested more than 100 levels deep"),
        (b'{"format": "something-else", "files": []}', "no format 'minigpt-hf-export'"),
        (
            b'{"format": "minigpt-hf-export", "files": [{"name": "../config.json", "size": 1, "sha256": "00"}]}',
            "a file entry is not a unique plain name",
        ),
        (
            b'{"format": "minigpt-hf-export", "files": [{"name": "config.json", "size": true, "sha256": "00"}]}',
            "a file entry is not a unique plain name",
        ),
        (None, "not a regular file"),  # a folder named like the manifest
    ],
    ids=["not-json", "deep", "other-format", "path-name", "bool-size", "folder"],
)
def test_a_damaged_or_foreign_manifest_is_one_line(previous, manifest, why):
    out, _ = previous
    (out / MANIFEST).unlink()
    (out / MANIFEST).mkdir() if manifest is None else (out / MANIFEST).write_bytes(manifest)
    refused(
        out,
        rf"{out / MANIFEST} is not a manifest export.py wrote \({why}.*\), so --overwrite cannot tell an "
        "export's files from yours",
    )


# ------------------------------------------------------------------------------------------------- races and kills


def test_a_file_added_while_the_export_is_written_is_kept(previous, monkeypatch):
    out, before = previous
    import minigpt.export.hf as export

    def write_files_while_user_adds_a_file(folder, *args):
        real_write_files(folder, *args)
        (out / "added_meanwhile.txt").write_text("mine")

    real_write_files = export.write_files
    monkeypatch.setattr(export, "write_files", write_files_while_user_adds_a_file)
    with pytest.raises(UserError, match=r"out changed while the export was written, so it was left as it is"):
        export_hf(tiny_model(1), ByteTokenizer(), out, overwrite=True)
    assert contents(out) == {**before, "added_meanwhile.txt": b"mine"} and hidden_leftovers(out.parent) == []


@pytest.mark.parametrize("where", ["write_files", "between the renames"])
def test_ctrl_c_during_an_export_keeps_the_old_one(previous, monkeypatch, where):
    out, before = previous
    import minigpt.export.folder as export_folder
    import minigpt.export.hf as export

    def interrupt(*args):
        raise KeyboardInterrupt

    if where == "write_files":
        monkeypatch.setattr(export, "write_files", interrupt)
    else:  # the old folder is already renamed aside when its state is checked
        monkeypatch.setattr(export_folder, "folder_state", interrupt)
    with pytest.raises(KeyboardInterrupt):
        export_hf(tiny_model(1), ByteTokenizer(), out, overwrite=True, checked=check_out_dir(out, True))
    assert contents(out) == before and hidden_leftovers(out.parent) == []


def test_an_export_killed_between_its_renames_is_put_back_by_the_next_one(previous):
    out, before = previous
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    pid = int(dead.stdout)  # a process that has exited: its leftovers are stale
    os.rename(out, out.parent / f".out.old-{pid}")
    (out.parent / f".out.tmp-{pid}").mkdir()  # the half-installed new export
    with pytest.raises(UserError, match="already holds files"):  # the old export is back, and protected
        export_hf(tiny_model(1), ByteTokenizer(), out)
    assert contents(out) == before
    export_hf(tiny_model(1), ByteTokenizer(), out, overwrite=True)
    assert contents(out)["model.safetensors"] != before["model.safetensors"] and hidden_leftovers(out.parent) == []


# ------------------------------------------------------------------------------------------------- a full disk


@pytest.mark.parametrize(
    "failure, reason",
    [
        (
            SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)"),
            "No space left on device",
        ),
        (
            Exception('Error while saving: Os { code: 122, kind: QuotaExceeded, message: "Disk quota exceeded" }'),
            "Disk quota exceeded",
        ),  # the form of older safetensors and of tokenizers
    ],
    ids=["safetensors-enospc", "rust-edquot"],
)
def test_a_library_write_error_of_a_full_disk_is_one_line_and_keeps_the_old_export(
    previous, monkeypatch, failure, reason
):
    out, before = previous

    def full_disk(tensors, path):
        path.write_bytes(b"half a file")
        raise failure

    monkeypatch.setattr("minigpt.export.hf.save_safetensors", full_disk)
    for target, overwrite in [(out, True), (out.parent / "new" / "deeper" / "hf", False)]:
        with pytest.raises(UserError) as e:
            export_hf(tiny_model(1), ByteTokenizer(), target, overwrite=overwrite)
        assert str(e.value) == f"cannot write {target} ({reason}); free space there or choose another output folder"
    assert contents(out) == before and sorted(p.name for p in out.parent.iterdir()) == ["out"]


@pytest.mark.parametrize(
    "code, fix",
    [
        (errno.EROFS, "the folder is read-only; choose another output folder"),
        (errno.EACCES, "the folder is read-only to this user; choose another output folder, or make it writable"),
    ],
)
def test_a_read_only_folder_is_named_read_only_not_full(previous, monkeypatch, code, fix):
    """As root a chmod stops nothing: the file system's answer is injected (a real read-only mount:
    test_gguf_file.py::test_a_full_and_a_read_only_file_system_are_one_line)."""
    out, before = previous

    def read_only(*args):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr("minigpt.export.hf.write_files", read_only)
    with pytest.raises(UserError) as e:
        export_hf(tiny_model(1), ByteTokenizer(), out, overwrite=True)
    assert str(e.value) == f"cannot write {out} ({os.strerror(code)}); {fix}"
    assert contents(out) == before and hidden_leftovers(out.parent) == []


def test_a_library_error_that_is_no_write_failure_keeps_its_traceback(previous, monkeypatch):
    out, before = previous

    def bug(tensors, path):
        raise SafetensorError("Error while serializing: a tensor is not contiguous")

    monkeypatch.setattr("minigpt.export.hf.save_safetensors", bug)
    with pytest.raises(SafetensorError):
        export_hf(tiny_model(1), ByteTokenizer(), out, overwrite=True)
    assert contents(out) == before and hidden_leftovers(out.parent) == []


# what runs in the child: real writes under a file-size limit (EFBIG, SIGXFSZ ignored as a shell's `ulimit -f` with
# `trap '' XFSZ`), then a real SIGINT in the middle of writing the weights; each run of export.py as from a shell
CHILD = r"""
import contextlib, io, json, os, resource, runpy, signal, sys, time
import minigpt.export.hf as export
results = []

def export_py(*argv):
    signal.signal(signal.SIGINT, signal.default_int_handler)  # as a new process starts (export.py ignores it at exit)
    sys.argv, err = ["export.py", *argv], io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            runpy.run_path("export.py", run_name="__main__"); code = 0
        except SystemExit as e:
            code = e.code
    results.append([code, err.getvalue()])

ckpt, out, new = sys.argv[1:4]
soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (40_000, hard))  # model.safetensors is ~100 KB
export_py("--ckpt", ckpt, "--out", out, "--overwrite")
export_py("--ckpt", ckpt, "--out", new)
resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))

def ctrl_c(tensors, path):
    path.write_bytes(b"half a file")
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(30)

export.save_safetensors = ctrl_c
export_py("--ckpt", ckpt, "--out", out, "--overwrite")
print(json.dumps(results))
"""


def test_export_py_on_a_full_disk_and_on_ctrl_c_is_one_line_and_keeps_the_old_export(previous, tmp_path):
    out, before = previous
    tokenizer = ByteTokenizer()
    save_file(model_checkpoint(tiny_model(1), tokenizer), tmp_path / "model.ckpt")
    new = tmp_path / "new" / "hf"
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, str(tmp_path / "model.ckpt"), str(out), str(new)],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    (full_code, full_err), (new_code, new_err), (int_code, int_err) = json.loads(proc.stdout.splitlines()[-1])
    assert (full_code, full_err) == (
        2,
        f"error: cannot write {out} (File too large); free space there or choose another output folder\n",
    )
    assert (new_code, new_err) == (
        2,
        f"error: cannot write {new} (File too large); free space there or choose another output folder\n",
    )
    assert (int_code, int_err) == (130, f"error: interrupted before the export was complete; {out} as it was\n")
    assert contents(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.ckpt", "out"]  # no temporary folder, no new/
