"""The LightningModule built by hand (a notebook's own Trainer): what it trains is what load_model reads back."""

import lightning as L
import pytest
import torch

from minigpt import ConfigError, GPTConfig, load_model
from minigpt.core.tokenizers import CharTokenizer, TiktokenTokenizer
from minigpt.training.lightning_module import GPTLightningModule
from support import byte_bpe

CONFIG = dict(n_layer=1, n_head=2, n_embd=16, block_size=8)


@pytest.mark.parametrize("vocab_size", [4, 64])  # fewer than the characters, or padded past them
def test_a_vocabulary_that_does_not_fit_the_tokenizer_is_refused_before_training(vocab_size):
    with pytest.raises(ConfigError, match="model.vocab_size: .* set it to exactly 6$"):
        GPTLightningModule(GPTConfig(**CONFIG, vocab_size=vocab_size), tokenizer=CharTokenizer("abcdef"))


def test_a_hand_built_module_trains_under_its_own_trainer_and_loads_back(tmp_path):
    tokenizer = CharTokenizer("abcdef")
    module = GPTLightningModule(GPTConfig(**CONFIG, vocab_size=6), tokenizer=tokenizer)
    batches = [torch.randint(0, 6, (2, 9)) for _ in range(2)]
    trainer = L.Trainer(max_steps=2, accelerator="cpu", logger=False, enable_checkpointing=False, barebones=True)
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(batches, batch_size=None))
    trainer.save_checkpoint(tmp_path / "run.ckpt")
    model, loaded = load_model(tmp_path / "run.ckpt")
    assert loaded.to_dict() == tokenizer.to_dict()
    assert torch.equal(model.lm_head.weight, module.model.lm_head.weight)
    # a BPE model's vocabulary may be padded past its tokenizer's (GPT-2's 50304 > 50257): accepted
    GPTLightningModule(GPTConfig(**CONFIG, vocab_size=320), tokenizer=TiktokenTokenizer(byte_bpe()))
