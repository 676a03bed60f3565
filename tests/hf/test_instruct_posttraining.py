"""Post-training that starts from a Hugging Face Instruct folder (Phi-3-shaped: EOS <|endoftext|>, turns ending with
<|end|>, generation_config.json listing [<|endoftext|>, <|assistant|>, <|end|>]): every chat objective (SFT, DPO,
GRPO's prompts) renders with the folder's own template and tokens, and a run and its export stop where the folder
stops."""

from __future__ import annotations

import json

import pytest

from minigpt.cli.export import run as export_run
from minigpt.cli.train import main as train_main
from minigpt.loading import load_chat_model
from support import flags

transformers = pytest.importorskip("transformers")
from test_chat_ends import PHI3_TEMPLATE, phi3_instruct_folder

ROWS = {
    "chat": [
        {"messages": [{"role": "user", "content": "hello"}, {"role": "assistant", "content": f"hello {k}"}]}
        for k in range(8)
    ],
    "preference": [{"prompt": "hello", "chosen": f"hello {k}", "rejected": f"world {k}"} for k in range(8)],
    "prompts": [{"prompt": f"hello {k}", "answer": "hello"} for k in range(8)],
}


def train(tmp_path, folder, fmt):
    (tmp_path / f"{fmt}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS[fmt]))
    args = {
        "init_from": folder,
        "data.format": fmt,
        "data.source": tmp_path / f"{fmt}.jsonl",
        "data.data_root": tmp_path / "data",
        "out_dir": tmp_path / fmt,
        "data.batch_size": 2,
        "trainer.max_steps": 1,
        "trainer.enable_progress_bar": False,
        "sample_tokens": 0,
        "optim.warmup_steps": 0,
        "eval_full": False,
        **({"grpo.group_size": 2, "grpo.max_new_tokens": 2} if fmt == "prompts" else {}),
    }
    train_main(flags(args))
    return tmp_path / fmt


@pytest.mark.parametrize("fmt", ["chat", "preference", "prompts"])
def test_every_chat_objective_from_a_folder_keeps_its_template_tokens_and_ends(tmp_path, fmt):
    folder, ids = phi3_instruct_folder(tmp_path / "phi3")
    source_model, source = load_chat_model(folder)
    run = train(tmp_path, folder, fmt)
    model, chat = load_chat_model(run)
    # DPO and GRPO rendered ChatML with two new rows (<|im_start|>, <|im_end|>) instead of the folder's template
    assert (chat.template, chat.added, chat.token(chat.eot_id)) == (PHI3_TEMPLATE, [], "<|end|>")
    assert model.config.vocab_size == source_model.config.vocab_size
    # the run stopped only at <|end|> and <|endoftext|>: the folder's <|assistant|> end was lost in the checkpoint
    assert chat.stop_ids == source.stop_ids == {ids["<|endoftext|>"], ids["<|assistant|>"], ids["<|end|>"]}


def test_the_export_lists_every_end_the_folder_lists(tmp_path):
    folder, ids = phi3_instruct_folder(tmp_path / "phi3")
    export_run(["--ckpt", str(train(tmp_path, folder, "chat")), "--out", str(tmp_path / "export")])
    generation = json.loads((tmp_path / "export" / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [ids["<|end|>"], ids["<|endoftext|>"], ids["<|assistant|>"]]
    _, exported = load_chat_model(tmp_path / "export")
    assert exported.stop_ids == load_chat_model(folder)[1].stop_ids
    # the template writes eos_token after the last turn: the export's is the folder's <|endoftext|>, as minigpt
    # rendered it in training (it was the end of turn <|end|>)
    conversation = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hello 1"}]
    fast = transformers.AutoTokenizer.from_pretrained(tmp_path / "export")
    rendered = fast.apply_chat_template(conversation, tokenize=True, return_dict=True)["input_ids"]
    assert rendered == exported.encode_chat(conversation)[0] and rendered[-1] == ids["<|endoftext|>"]
