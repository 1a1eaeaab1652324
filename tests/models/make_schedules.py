"""Writes tests/data/schedules.json: the learning rate of each PyTorch and Hugging Face scheduler
that `--schedule` follows, at each of 1000 optimizer steps, with the mpc settings that name it.

    python tests/models/make_schedules.py    (needs torch and transformers)

Step k's rate is the one the k-th `optimizer.step()` uses: read from the optimizer before it,
then `scheduler.step()` after it, as a training loop calls them.
"""
import json
import pathlib

import torch
import transformers

PEAK = 3e-4
STEPS = 1000


def rates(make):
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.AdamW([p], lr=PEAK)
    sched = make(opt)
    out = []
    for _ in range(STEPS):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


t = transformers
CASES = [
    ("hf constant_with_warmup(100)", {"schedule": "constant", "warmup": 100},
     lambda o: t.get_constant_schedule_with_warmup(o, 100)),
    ("hf linear_with_warmup(100, 1000)", {"schedule": "linear", "warmup": 100},
     lambda o: t.get_linear_schedule_with_warmup(o, 100, STEPS)),
    ("hf linear_with_warmup(ceil(0.06 * 1000), 1000)", {"schedule": "linear", "warmup": 0.06},
     lambda o: t.get_linear_schedule_with_warmup(o, 60, STEPS)),
    ("hf cosine_with_warmup(100, 1000)", {"schedule": "cosine", "warmup": 100},
     lambda o: t.get_cosine_schedule_with_warmup(o, 100, STEPS)),
    ("hf cosine_with_min_lr(50, 1000, min_lr_rate=0.1)", {"schedule": "cosine", "warmup": 50, "lr_min": PEAK * 0.1},
     lambda o: t.get_cosine_with_min_lr_schedule_with_warmup(o, 50, STEPS, min_lr_rate=0.1)),
    ("torch CosineAnnealingLR(T_max=1000, eta_min=1e-5)", {"schedule": "cosine", "lr_min": 1e-5},
     lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=STEPS, eta_min=1e-5)),
    ("torch StepLR(step_size=100, gamma=0.5)", {"schedule": "step:size=100,gamma=0.5"},
     lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=100, gamma=0.5)),
    ("torch OneCycleLR(total_steps=1000, cycle_momentum=False)", {"schedule": "one-cycle"},
     lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=PEAK, total_steps=STEPS, cycle_momentum=False)),
    ("torch OneCycleLR(total_steps=1000, pct_start=0.25, div_factor=10, cycle_momentum=False)",
     {"schedule": "one-cycle:div=10", "warmup": 250},
     lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=PEAK, total_steps=STEPS, pct_start=0.25,
                                                   div_factor=10, cycle_momentum=False)),
]

out = {
    "made_by": "tests/models/make_schedules.py",
    "torch": torch.__version__,
    "transformers": transformers.__version__,
    "lr": PEAK,
    "steps": STEPS,
    "cases": [{"name": n, "settings": s, "rates": rates(m)} for n, s, m in CASES],
}
path = pathlib.Path(__file__).resolve().parent.parent / "data" / "schedules.json"
path.write_text(json.dumps(out, indent=1) + "\n")
print(f"wrote {path}: {len(CASES)} schedules of {STEPS} steps")
