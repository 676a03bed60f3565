"""What a resume trains with: the schedule of the resumed run's config from its first step, and Muon's ns_steps
refused where the optimizer's saved state would keep the checkpoint's."""

import pytest

from minigpt.cli.train import main
from minigpt.core.errors import UserError
from minigpt.training.lightning_module import GPTLightningModule
from minigpt.training.optim import OptimConfig, lr_multiplier

pytestmark = pytest.mark.usefixtures("one_thread")


def test_a_resume_that_extends_the_run_trains_its_first_step_at_the_new_schedules_rate(
    tiny_run_args, corpus, data_root, tmp_path, monkeypatch
):
    main(tiny_run_args(corpus, data_root, tmp_path / "run", steps=10))  # cosine, decayed to its floor at step 10
    used = []
    real = GPTLightningModule.on_before_optimizer_step

    def on_before_optimizer_step(self, optimizer):
        used.append((self.global_step, optimizer.param_groups[0]["lr"]))
        real(self, optimizer)

    monkeypatch.setattr(GPTLightningModule, "on_before_optimizer_step", on_before_optimizer_step)
    main(tiny_run_args(corpus, data_root, tmp_path / "run", steps=20) + ["--resume", "true"])
    cfg = OptimConfig(learning_rate=0.01, warmup_steps=5)
    expected = [(s, pytest.approx(0.01 * lr_multiplier(s, cfg, 20))) for s in range(10, 20)]
    assert used == expected, "step 10 trained at the old schedule's rate (its floor, 0.001)"


def test_a_resume_cannot_change_muons_ns_steps(tiny_run_args, corpus, data_root, tmp_path):
    def args(steps, *more):
        return tiny_run_args(corpus, data_root, tmp_path / "run", steps=steps, optim__optimizer="muon") + list(more)

    main(args(5))
    with pytest.raises(UserError, match=r"was trained with optim.muon_ns_steps=5 \(this run's config gives 2\)"):
        main(args(10, "--resume", "true", "--optim.muon_ns_steps", "2"))
    assert main(args(10, "--resume", "true")).global_step == 10  # unchanged, it resumes


def test_an_adamw_run_resumes_whatever_muon_ns_steps_says(tiny_run_args, corpus, data_root, tmp_path):
    main(tiny_run_args(corpus, data_root, tmp_path / "run", steps=5))
    trainer = main(
        tiny_run_args(corpus, data_root, tmp_path / "run", steps=10, optim__muon_ns_steps=2) + ["--resume", "true"]
    )
    assert trainer.global_step == 10
