"""Training on PyTorch Lightning: the LightningModule, the DataModule, callbacks, optimizers, the run directory."""
